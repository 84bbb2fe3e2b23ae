"""The gateway: OpenAI-compatible REST in front of the gRPC workers (torch-free).

Laid out as vLLM's entrypoints/openai: `protocol` (request and response bodies),
`serving*` (the logic per endpoint), `api_server` (thin routes, wiring in one lifespan).
Beside them: `text` (tokenizer, detokeniser, stop strings), `workers` + `routing` +
`hashring` (which worker serves a request), `generation` (one request's worker streams),
`sessions` (Redis, or in-process when Redis does not answer), `middleware` (request id,
API key, body limit), `metrics`, `config`.
"""
