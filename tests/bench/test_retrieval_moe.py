"""The retrieval task's invariants and the trainer end to end at toy size (CPU)."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from bench.retrieval_task import (
    EVAL_SEED_BASE, ID, KEY_IDS, NUM_KEYS, NUM_VALUES, QUERY, RECORD_LEN, TRAIN_SEED_BASE, VALUE_IDS, build_tokenizer,
    eval_examples, make_example, to_text)

REPO = Path(__file__).resolve().parents[2]


@pytest.mark.parametrize("length,records,queries", [(256, 4, 4), (2048, 16, 1), (1024, 32, 32)])
def test_the_answer_is_the_value_of_the_queried_key_in_the_context(length, records, queries):
    for seed in range(5):
        ex = make_example(np.random.default_rng(seed), length, records, queries)
        ids = ex.ids.tolist()
        assert len(ids) == length
        assert len(set(ex.keys)) == records  # distinct keys: one right answer
        assert ids[ex.prompt_len - 2] == ID[QUERY] and ids[ex.prompt_len - 1] in KEY_IDS
        asked = ids[ex.prompt_len - 1]
        value = ex.values[ex.keys.index(asked)]
        assert ex.answer == [value]
        context = ids[:len(ids) - 1 - queries * RECORD_LEN]
        assert [j for j in range(len(context) - 1) if context[j] == asked] != []
        at = [j for j in range(len(context)) if context[j] == asked]
        assert len(at) == 1 and context[at[0] + 1] == value  # the key once, its value right after
        keys_in_context = [t for t in context if t in set(KEY_IDS.tolist())]
        assert sorted(keys_in_context) == sorted(ex.keys)  # no key outside a record
        assert sum(t in set(VALUE_IDS.tolist()) for t in context) == records
        # every query is answered by its own record
        assert ex.answer_mask.sum() == queries
        for j in np.flatnonzero(ex.answer_mask):
            assert ids[j] == ex.values[ex.keys.index(ids[j - 1])]


def test_every_answer_follows_its_key_once_in_the_context_across_lengths_and_seeds():
    """The property training relies on, over the shapes the curriculum draws: each supervised
    answer is the token after the one occurrence of its key before the query section."""
    rng = np.random.default_rng(7)
    for _ in range(300):
        length = int(rng.integers(32, 600))
        records = int(rng.integers(1, min(16, (length - 1) // 6) + 1))
        queries = int(rng.integers(1, records + 1))
        ex = make_example(np.random.default_rng(int(rng.integers(1 << 30))), length, records, queries)
        ids = ex.ids.tolist()
        query_at = len(ids) - 1 - queries * RECORD_LEN
        assert ids[query_at] == ID[QUERY]
        for j in np.flatnonzero(ex.answer_mask):
            at = [i for i in range(query_at) if ids[i] == ids[j - 1]]
            assert len(at) == 1 and ids[at[0] + 1] == ids[j]
        assert ex.answer == [ids[ex.prompt_len]] and ex.answer_mask[ex.prompt_len]


def test_examples_are_a_function_of_the_seed_and_text_round_trips_through_the_tokenizer():
    a, b = eval_examples(0, 512, 3, 8), eval_examples(0, 512, 3, 8)
    assert all((x.ids == y.ids).all() and x.answer == y.answer for x, y in zip(a, b))
    assert not (eval_examples(1, 512, 1, 8)[0].ids[:100] == a[0].ids[:100]).all()
    tok = build_tokenizer()
    for ex in a:
        assert tok.encode(to_text(ex.ids), add_special_tokens=False).ids == ex.ids.tolist()


def test_training_batches_never_draw_a_held_out_seed():
    """Training rows come from rng((TRAIN_SEED_BASE + seed, step, row)) and held-out examples
    from rng((EVAL_SEED_BASE + seed, length, index)): disjoint as long as no training seed
    reaches the evaluation's base."""
    from tools.train_retrieval_moe import Curriculum, batch_spec, make_batch

    assert TRAIN_SEED_BASE + 10 ** 5 < EVAL_SEED_BASE
    spec = batch_spec(Curriculum(), 0, 0, 128)
    ids, mask, length = make_batch(spec)
    again = make_batch(batch_spec(Curriculum(), 0, 0, 128))
    assert (ids == again[0]).all() and (mask == again[1]).all()  # seeded: the same batch
    held_out = {tuple(e.ids.tolist()) for e in eval_examples(0, length, 64, 4)}
    assert not held_out & {tuple(r) for r in ids.tolist()}


def test_too_short_a_context_is_refused():
    with pytest.raises(ValueError):
        make_example(np.random.default_rng(0), 24, 8, 1)  # 16 record tokens, 3 of query: no room
    make_example(np.random.default_rng(0), 32, 8, 1)  # 13 filler tokens are room enough
    with pytest.raises(ValueError):
        make_example(np.random.default_rng(0), 4096, NUM_KEYS + 1, 1)  # keys must be distinct


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
    assert result["steps"] == 6 and set(result["eval"]["accuracy"]) == {"64"}

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



def test_a_tiny_trained_model_beats_chance(tmp_path, one_torch_thread):
    """120 seeded steps of the toy model on recall rows alone (about 7 s of one thread) answer
    a two-record context far above a uniform guess over the values: the supervision reaches
    the answers and the model reads them from the context. (Key matching takes about a
    thousand steps even at this size, with the copy rows: copying either value of the context
    scores one half.)"""
    import json

    from tools.train_retrieval_moe import main

    out = tmp_path / "toy"
    assert main(["--device", "cpu", "--tiny", "--max-steps", "120", "--copy-share", "0", "--out", str(out)]) == 0
    result = json.loads((tmp_path / "train_retrieval_moe.json").read_text())
    chance = 1 / NUM_VALUES
    assert result["steps"] == 120
    assert result["eval"]["accuracy"]["64"] >= 8 * chance, result["eval"]
