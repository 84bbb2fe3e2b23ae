"""The text side of serving, torch-free so the gateway can import it without the worker.

- `tokenizer.Tokenizer`: tokenizer.json / tokenizer_config.json of a model directory.
- `chat_template.render_chat_template`: chat templates in jinja2's immutable sandbox.
- `detokenizer.RequestDetokenizer`: token ids -> streaming text deltas, stop strings.

The engine below takes and returns token ids only (EOS, stop token ids, max/min tokens);
everything about text happens here.
"""
