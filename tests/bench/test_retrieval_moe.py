"""The retrieval task's invariants and the trainer end to end at toy size (CPU)."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from bench.retrieval_task import (
    DIGIT_IDS, ID, QUERY, VALUE, VOCAB, TaskShape, build_tokenizer, eval_examples, make_example, record_len, to_text)

REPO = Path(__file__).resolve().parents[2]


@pytest.mark.parametrize("length,records,queries", [(256, 4, 4), (2048, 16, 1), (1024, 32, 8)])
def test_the_answer_is_the_value_of_the_queried_key_in_the_context(length, records, queries):
    for seed in range(5):
        ex = make_example(np.random.default_rng(seed), length, records, queries)
        ids = ex.ids.tolist()
        assert abs(len(ids) - length) < record_len(TaskShape())
        assert len(set(ex.keys)) == records  # distinct keys: one right answer
        query_at = ex.prompt_len - TaskShape().key_digits - 2
        assert ids[query_at] == ID[QUERY] and ids[ex.prompt_len - 1] == ID[VALUE]
        asked = tuple(int(VOCAB[t]) for t in ids[query_at + 1:ex.prompt_len - 1])
        i = ex.keys.index(asked)
        assert ex.answer == [int(DIGIT_IDS[d]) for d in ex.values[i]]
        record = [ID["key"], *DIGIT_IDS[list(asked)], ID[VALUE], *ex.answer]
        context = ids[:query_at]
        assert any(context[j:j + len(record)] == record for j in range(len(context)))  # in the context, once
        assert sum(ex.answer_mask) == queries * TaskShape().value_digits
        digits = set(DIGIT_IDS.tolist())
        assert sum(t in digits for t in context) == records * (TaskShape().key_digits + TaskShape().value_digits)


def test_examples_are_a_function_of_the_seed_and_text_round_trips_through_the_tokenizer():
    a, b = eval_examples(0, 512, 3, 8), eval_examples(0, 512, 3, 8)
    assert all((x.ids == y.ids).all() and x.answer == y.answer for x, y in zip(a, b))
    assert not (eval_examples(1, 512, 1, 8)[0].ids[:100] == a[0].ids[:100]).all()
    tok = build_tokenizer()
    for ex in a:
        assert tok.encode(to_text(ex.ids), add_special_tokens=False).ids == ex.ids.tolist()


def test_too_short_a_context_is_refused():
    with pytest.raises(ValueError):
        make_example(np.random.default_rng(0), 60, 8, 1)


@pytest.mark.slow
def test_trainer_writes_a_checkpoint_that_transformers_and_quantize_load(tmp_path, one_torch_thread):
    import json

    import torch
    from transformers import AutoModelForCausalLM

    from pagedweight.cli.main import build_parser
    from pagedweight.frontend.tokenizer import Tokenizer
    from pagedweight.model import load_model
    from pagedweight.model.contiguous_kv import ContiguousKVCache

    out = tmp_path / "retrieval-moe"
    env = {"PYTHONPATH": f"{REPO / 'services'}:{REPO}", "PATH": "/usr/bin:/bin"}
    done = subprocess.run([sys.executable, str(REPO / "tools" / "train_retrieval_moe.py"), "--device", "cpu",
                           "--tiny", "--threads", "1", "--max-steps", "6", "--out", str(out)],
                          env=env, capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr[-2000:]
    result = json.loads((tmp_path / "train_retrieval_moe.json").read_text())
    assert result["steps"] == 6 and set(result["eval"]["accuracy"]) == {"256"}

    hf = AutoModelForCausalLM.from_pretrained(out, dtype=torch.float32)
    ours = load_model(out, dtype=torch.float32)
    ex = eval_examples(0, 256, 1, 4)[0]
    ids = torch.from_numpy(ex.ids[:ex.prompt_len])[None]
    with torch.no_grad():
        ref = hf(input_ids=ids).logits[0, -1]
        cache = ContiguousKVCache(ours.config, 1, ids.shape[1], ours.dtype, ours.device)
        got = ours(ids, 0, cache)[0, -1]
    torch.testing.assert_close(got, ref, atol=2e-4, rtol=1e-3)  # the project's model is transformers' model
    assert ours.config.max_position_embeddings >= 8192 + 16
    assert Tokenizer(out).encode(to_text(ex.ids)) == ex.ids.tolist()

    calib = tmp_path / "calib.txt"
    calib.write_text("\n".join(to_text(e.ids) for e in eval_examples(1, 256, 4, 4)))
    cli = build_parser().parse_args(["quantize", "--model", str(out), "--out", str(tmp_path / "paged"), "--calib",
                                     str(calib), "--calib-tokens", "512", "--seq-len", "256", "--quiet"])
    cli.handler(cli)
    assert (tmp_path / "paged" / "config.json").is_file()
