"""The retrieval budget benchmark (bench/retrieval_budget.py) end to end at toy size on the CPU:
the trained checkpoint quantised on a little task text, two short context lengths, two
budgets; every row present, its interval around its estimate and its paired counts
consistent, the budgets in order, bf16 refused where its experts leave less KV than one
request needs, and the docs section rendered from the result."""

from __future__ import annotations

import json

import pytest

from bench import bench_meta, tables
from bench import retrieval_budget as rb
from pagedweight.memory.kv_cache import blocks_for

# lengths: at 256 tokens the bf16 experts take more than the KV of the three requests a budget
# holds (refused), at 1024 they leave the KV of one request; both above the task's minimum
TOY = ["--lengths", "256", "1024", "--count", "6", "--concurrency", "3", "--records", "4",
       "--expert-bits", "3.5", "4.5", "--max-batched-tokens", "512", "--calib-examples", "4",
       "--calib-length", "256", "--calib-tokens", "1024", "--calib-seq-len", "256", "--threads", "1"]


def test_wilson_interval_is_the_published_one():
    # Newcombe (1998), table I: 8 of 10 -> [0.4902, 0.9433]; 0 of 10 -> [0, 0.2775]
    lo, hi = rb.wilson(8, 10)
    assert lo == pytest.approx(0.4902, abs=1e-4) and hi == pytest.approx(0.9433, abs=1e-4)
    assert rb.wilson(0, 10) == [0.0, pytest.approx(0.2775, abs=1e-4)]
    assert rb.wilson(10, 10) == [pytest.approx(1 - 0.2775, abs=1e-4), 1.0]  # symmetric, and 1 stays in
    narrow = rb.wilson(800, 1000)
    assert lo < narrow[0] < 0.8 < narrow[1] < hi  # more examples, a narrower interval


@pytest.fixture(scope="module")
def result(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("retrieval-budget")
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(bench_meta, "RESULTS_DIR", tmp / "results")
        rb.main([*TOY, "--work", str(tmp / "work"), "--out-name", "toy"])
    path = next((tmp / "results").glob("toy_*.json"))
    return json.loads(path.read_text()), tmp


def test_every_row_is_scored_with_an_interval_around_it(result):
    payload, _ = result
    assert [r["length"] for r in payload["lengths"]] == [256, 1024]
    for r in payload["lengths"]:
        reference = r["bf16_unlimited"]["right"]
        assert len(reference) == r["examples"] == 6
        assert [p["expert_bits"] for p in r["budgets"]] == [3.5, 4.5]
        for point in r["budgets"]:
            rows = point["results"]
            assert set(rows) == {"bf16", "pagedweight", f"static-{point['fitting_uniform_bits']}"}
            for name, row in [("unlimited", r["bf16_unlimited"]), *rows.items()]:
                if "refused" in row:
                    continue
                assert row["correct"] == sum(row["right"]) and row["accuracy"] == row["correct"] / r["examples"]
                lo, hi = row["ci95"]
                assert 0 <= lo <= row["accuracy"] <= hi <= 1, name
                if name != "unlimited":
                    assert row["lost"] == sum(a and not b for a, b in zip(reference, row["right"]))
                    assert row["gained"] == sum(b and not a for a, b in zip(reference, row["right"]))
            for name in ("pagedweight", f"static-{point['fitting_uniform_bits']}"):
                bits = rows[name]["bits"]
                assert 3 <= bits["mean_min"] <= 8 and 3 <= bits["mean"] <= 8
                assert min(bits["per_block"].values()) <= bits["mean"] <= max(bits["per_block"].values())
            assert set(rows[f"static-{point['fitting_uniform_bits']}"]["bits"]["per_block"].values()) == {
                point["fitting_uniform_bits"]}


def test_budgets_are_ordered_and_bf16_experts_do_not_fit_beside_the_kv(result):
    payload, _ = result
    block_size = payload["args"]["block_size"]
    for r in payload["lengths"]:
        tight, loose = r["budgets"]
        assert tight["budget_bytes"] < loose["budget_bytes"] < loose["bf16_needs_bytes"]
        assert (tight["fitting_uniform_bits"], loose["fitting_uniform_bits"]) == (3, 4)
        one_request = blocks_for(r["request_tokens"], block_size)
        for point in r["budgets"]:
            assert point["bf16_kv_blocks"] < 3 * one_request  # fewer than --concurrency requests
            bf16 = point["results"]["bf16"]
            assert ("refused" in bf16) == (point["bf16_kv_blocks"] < one_request)
            if "refused" not in bf16:
                assert bf16["max_running"] <= point["bf16_kv_blocks"] // one_request
    assert "refused" in payload["lengths"][0]["budgets"][0]["results"]["bf16"]
    assert "refused" not in payload["lengths"][1]["budgets"][1]["results"]["bf16"]


def test_the_docs_section_comes_from_the_result(result, monkeypatch):
    payload, tmp = result
    text = rb.markdown(payload)
    accuracy = text[text.index("| budget | row |"):].split("\n\n")[0].splitlines()
    assert len(accuracy) == 2 + 1 + 2 * 3  # header, unlimited bf16, three rows at each budget
    assert accuracy[2].startswith("| unlimited | bf16 | ") and "refused" in accuracy[3]
    assert "### Targets" in text and "`pagedweight` 10 points above `static-3`" in text
    # docs/quality.md: the quality benchmark's page, then this section once its result exists
    results = tmp / "page-results"
    results.mkdir()
    quality = "quality_budget_cpu.json"
    (results / quality).write_text((tables.RESULTS / quality).read_text())
    monkeypatch.setattr(tables, "RESULTS", results)
    page = tables.DOCS / "quality.md"
    alone = tables.page_text(page)
    (results / "retrieval_budget_retrieval-moe_cpu.json").write_text(json.dumps(payload))
    assert tables.page_text(page) == alone + text
    assert text not in alone
