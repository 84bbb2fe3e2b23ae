"""Prometheus config and rules under the real promtool; the dashboards' JSON is the
generator's current output."""

from __future__ import annotations

import json
import re

import pytest

from deploy_helpers import ROOT, run, tool

pytestmark = pytest.mark.deploy

RULES = ROOT / "deploy/prometheus/rules"


def test_rules_check_clean():
    result = run(tool("promtool"), "check", "rules", RULES / "pagedweight.rules.yml")
    assert "SUCCESS" in result.stdout


def test_alert_rules_unit_tests():
    """Each alert fires on the series it is for and stays silent on its near miss."""
    run(tool("promtool"), "test", "rules", "pagedweight.rules.test.yml", cwd=RULES)


def test_rule_unit_tests_can_fail(tmp_path):
    broken = (RULES / "pagedweight.rules.yml").read_text().replace("vllm:kv_cache_usage_perc > 0.9", "vllm:kv_cache_usage_perc > 0.99")
    (tmp_path / "pagedweight.rules.yml").write_text(broken)
    (tmp_path / "pagedweight.rules.test.yml").write_text((RULES / "pagedweight.rules.test.yml").read_text())
    result = run(tool("promtool"), "test", "rules", "pagedweight.rules.test.yml", cwd=tmp_path, check=False)
    assert result.returncode != 0 and "PagedWeightKVFullAtBitFloor" in result.stdout + result.stderr


@pytest.mark.parametrize("name", ["prometheus.yml", "prometheus.second-gpu.yml"])
def test_config_check_clean(name, tmp_path):
    # the config names the rules where the Compose stack mounts them; point it here
    config = (ROOT / "deploy/prometheus" / name).read_text().replace("/etc/prometheus/rules", str(RULES))
    (tmp_path / "prometheus.yml").write_text(config)
    result = run(tool("promtool"), "check", "config", tmp_path / "prometheus.yml")
    assert "SUCCESS" in result.stdout + result.stderr and "12 rules found" in result.stdout + result.stderr


def test_dashboards_are_generated():
    run("python3", ROOT / "deploy/grafana/build_dashboards.py", "--check")


GONE_IN_VLLM_0_33 = ("vllm:gpu_cache_usage_perc", "vllm:gpu_prefix_cache", "vllm:time_per_output_token_seconds",
                     "vllm:num_requests_swapped")


def dashboard_exprs() -> list[tuple[str, str, str]]:
    out = []
    for path in sorted((ROOT / "deploy/grafana/dashboards").glob("*.json")):
        for panel in json.loads(path.read_text())["panels"]:
            out += [(path.name, panel["title"], t["expr"]) for t in panel["targets"]]
    return out


def test_dashboard_queries_follow_the_conventions():
    exprs = dashboard_exprs()
    assert len(exprs) > 30
    for name, title, expr in exprs:
        where = f"{name} / {title}: {expr}"
        # counters and histograms only as rates over Grafana's rate interval, never lifetime totals
        for window in re.findall(r"(?:rate|increase)\([^\[]+\[([^\]]+)\]", expr):
            assert window == "$__rate_interval", where
        for metric in re.findall(r"([a-z0-9_:]+(?:_total|_bucket|_sum|_count))\{", expr):
            assert re.search(rf"(rate|increase)\({re.escape(metric)}\{{", expr), f"raw counter in {where}"
        assert not any(gone in expr for gone in GONE_IN_VLLM_0_33), where
        if "planner_" not in expr or "planner_connected" in expr:
            assert 'model_name=~"$model_name"' in expr, f"no model filter: {where}"


def test_dashboards_have_the_model_and_worker_variables():
    for path in sorted((ROOT / "deploy/grafana/dashboards").glob("*.json")):
        names = {v["name"] for v in json.loads(path.read_text())["templating"]["list"]}
        assert {"model_name", "worker", "datasource"} <= names, path.name
