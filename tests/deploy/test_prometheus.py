"""Prometheus config and rules under the real promtool; the dashboards' JSON is the
generator's current output."""

from __future__ import annotations

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


def test_config_check_clean(tmp_path):
    # the config names the rules where the Compose stack mounts them; point it here
    config = (ROOT / "deploy/prometheus/prometheus.yml").read_text().replace("/etc/prometheus/rules", str(RULES))
    (tmp_path / "prometheus.yml").write_text(config)
    result = run(tool("promtool"), "check", "config", tmp_path / "prometheus.yml")
    assert "SUCCESS" in result.stdout + result.stderr and "12 rules found" in result.stdout + result.stderr


def test_dashboards_are_generated():
    run("python3", ROOT / "deploy/grafana/build_dashboards.py", "--check")
