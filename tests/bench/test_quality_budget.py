"""The quality table's statistics: chunk-paired differences, their confidence intervals, the
mean over models and the targets' checks, on synthetic per-chunk scores."""

from __future__ import annotations

import math

import numpy as np
import pytest

from bench.calibration_quality import summarise as calibration_summary
from bench.calibration_quality import variant_domains
from bench.quality_budget import DOMAINS, PLANNER, as_ppl_change, combine, domain_mean, summarise

POLICIES = (PLANNER, "uniform", "no-residual")


def domain_row(kl: dict, nll: dict, bf16_nll: list[float], bits=("3.5", "4.0", "5.0")) -> dict:
    cell = {p: {"kl": kl[p], "nll": nll[p], "mean_bits": float(b), "bytes_fraction": 0.3}
            for b in bits for p in kl}
    return {"bf16_nll": bf16_nll, "bits": {b: cell for b in bits}}


def model_result(rng, planner_gap: float, residual_gap: float = 0.0) -> dict:
    """Four domains of eight chunks; uniform's KL is the planner's + planner_gap (noisy)."""
    domains = {}
    for _ in DOMAINS:
        base = rng.uniform(0.01, 0.02, 8)
        kl = {PLANNER: base, "uniform": base + planner_gap + rng.normal(0, 1e-4, 8),
              "no-residual": base + residual_gap}
        bf16 = rng.uniform(2.0, 3.0, 8)
        nll = {p: bf16 + v for p, v in kl.items()}  # NLL rises by the KL
        domains[_] = domain_row({p: v.tolist() for p, v in kl.items()}, {p: v.tolist() for p, v in nll.items()},
                                bf16.tolist())
    return {"domains": domains}


def test_domain_mean_weights_domains_equally_and_its_error_comes_from_the_chunks():
    mean, se = domain_mean([np.array([1.0, 3.0]), np.array([10.0, 10.0, 10.0, 10.0])])
    assert mean == pytest.approx(6.0)  # (2 + 10) / 2, not the pooled 7.33
    assert se == pytest.approx(math.sqrt(2.0 / 2) / 2)  # var 2 over 2 chunks; the flat domain adds 0


def test_combine_is_the_mean_of_models_with_independent_errors():
    out = combine([(1.0, 0.3), (3.0, 0.4)])
    assert out["mean"] == pytest.approx(2.0) and out["se"] == pytest.approx(0.25)
    assert out["low"] == pytest.approx(2.0 - 1.96 * 0.25) and out["high"] == pytest.approx(2.0 + 1.96 * 0.25)
    assert as_ppl_change(out)["mean"] == pytest.approx(math.exp(2.0) - 1)


def test_summary_finds_a_real_gap_and_not_a_tie():
    rng = np.random.default_rng(0)
    results = {"a": model_result(rng, 0.005), "b": model_result(rng, 0.003)}
    s = summarise(results, bits_list=(4.0, 5.0), policies=POLICIES)
    vs = s["versus"]["4.0"]
    assert vs["uniform"]["kl"]["mean"] == pytest.approx(-0.004, abs=2e-4)
    assert vs["uniform"]["kl"]["high"] < 0  # the planner is better, CI excludes zero
    assert vs["no-residual"]["kl"]["mean"] == 0 and vs["no-residual"]["kl"]["high"] == 0  # a tie
    checks = {(c["check"].split(" than ")[-1].split(" ")[0], c["bits"]): c["met"] for c in s["checks"]
              if "than" in c["check"]}
    assert checks[("uniform", 4.0)] and not checks[("no-residual", 4.0)]
    # the planner's perplexity change: NLL over bf16 is its KL, so exp(mean KL) - 1
    ppl = s["mean"]["4.0"][PLANNER]["ppl_change"]["mean"]
    assert ppl == pytest.approx(math.expm1(s["mean"]["4.0"][PLANNER]["kl"]["mean"]))
    target = [c for c in s["checks"] if c["check"].startswith("perplexity") and c["bits"] == 4.0][0]
    assert target["met"] == (ppl <= 0.01)


def test_summary_reports_a_planner_that_loses():
    rng = np.random.default_rng(1)
    results = {"a": model_result(rng, -0.002), "b": model_result(rng, -0.002)}
    s = summarise(results, bits_list=(4.0,), policies=POLICIES)
    assert s["versus"]["4.0"]["uniform"]["kl"]["low"] > 0
    assert not [c for c in s["checks"] if "uniform" in c["check"]][0]["met"]


def test_calibration_variants_and_the_shift_uses_only_the_other_domains():
    assert variant_domains("all-16384") == DOMAINS and variant_domains("kjv-2048") == ("kjv",)
    with pytest.raises(ValueError):
        variant_domains("legal-16384")
    rng = np.random.default_rng(2)
    helped = model_result(rng, 0.0, residual_gap=0.001)  # no-residual worse on every domain
    # ... except on kjv, where the artifact was calibrated: residuals hurt there, and it must not count
    for b in ("3.5", "4.0", "5.0"):
        helped["domains"]["kjv"]["bits"][b]["no-residual"] = {
            **helped["domains"]["kjv"]["bits"][b]["no-residual"],
            "kl": (np.asarray(helped["domains"]["kjv"]["bits"][b][PLANNER]["kl"]) - 0.05).tolist()}
    s = calibration_summary({"m": {"kjv-16384": helped, "all-16384": model_result(rng, 0.0)}})
    assert s["shift"]["4.0"]["kl"]["mean"] == pytest.approx(-0.001)
    assert s["shift"]["4.0"]["kl"]["high"] < 0
    assert set(s["defaults"]["4.0"]) == {"all-16384", "one-domain-16384"}
