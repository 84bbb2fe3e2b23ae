"""docker-compose.yml under the real Compose CLI (`docker compose config`, the compose-go
validator of the Compose specification), and its wiring to deploy/."""

from __future__ import annotations

import json

import pytest
import yaml

from deploy_helpers import ROOT, run, tool

pytestmark = pytest.mark.deploy

SERVICES = {"rpc-token", "redis", "planner", "worker", "gateway", "prometheus", "grafana"}


def compose_config(*files) -> dict:
    args = [tool("docker-compose")]
    for f in files:
        args += ["-f", ROOT / f]
    result = run(*args, "config", "--format", "json", env={"PATH": "/usr/bin:/bin", "HOME": str(ROOT)})
    return json.loads(result.stdout)


def test_compose_file_is_valid_and_has_every_service():
    config = compose_config("docker-compose.yml")
    assert set(config["services"]) == SERVICES


def test_gpu_override_is_valid_and_reserves_a_gpu():
    worker = compose_config("docker-compose.yml", "docker-compose.gpu.yml")["services"]["worker"]
    assert worker["build"]["dockerfile"] == "docker/Dockerfile.worker"
    devices = worker["deploy"]["resources"]["reservations"]["devices"]
    assert devices[0]["capabilities"] == ["gpu"] and "--device" in worker["command"]
    assert worker["command"][worker["command"].index("--device") + 1] == "cuda"


def test_validator_rejects_a_broken_file(tmp_path):
    """The validator is not a YAML parser: a schema error (an unknown key) fails."""
    broken = yaml.safe_load((ROOT / "docker-compose.yml").read_text())
    broken["services"]["worker"]["restart_policy"] = "always"
    (tmp_path / "docker-compose.yml").write_text(yaml.safe_dump(broken))
    result = run(tool("docker-compose"), "-f", tmp_path / "docker-compose.yml", "config", "--quiet", check=False)
    assert result.returncode != 0 and "restart_policy" in result.stderr


def test_monitoring_is_provisioned_from_deploy():
    services = compose_config("docker-compose.yml")["services"]
    mounts = {v["target"]: v["source"] for v in services["grafana"]["volumes"]}
    assert mounts["/etc/grafana/provisioning"] == str(ROOT / "deploy/grafana/provisioning")
    assert mounts["/var/lib/grafana/dashboards"] == str(ROOT / "deploy/grafana/dashboards")
    assert list((ROOT / "deploy/grafana/dashboards").glob("*.json"))
    datasource = yaml.safe_load((ROOT / "deploy/grafana/provisioning/datasources/prometheus.yml").read_text())
    assert datasource["datasources"][0]["url"] == "http://prometheus:9090"
    prom_mounts = {v["target"]: v["source"] for v in services["prometheus"]["volumes"]}
    assert prom_mounts["/etc/prometheus/prometheus.yml"] == str(ROOT / "deploy/prometheus/prometheus.yml")


def test_prometheus_scrapes_the_ports_the_services_serve_metrics_on():
    services = compose_config("docker-compose.yml")["services"]
    prom = yaml.safe_load((ROOT / "deploy/prometheus/prometheus.yml").read_text())
    targets = {job["job_name"]: job["static_configs"][0]["targets"] for job in prom["scrape_configs"]}
    assert set(targets) == {"pagedweight-gateway", "pagedweight-worker", "pagedweight-planner"}
    for job, (target,) in targets.items():
        host, port = target.split(":")
        command = services[host]["command"]
        flag = "--port" if host == "gateway" else "--metrics-port"
        assert command[command.index(flag) + 1] == port, f"{job} scrapes {target}, {host} serves {flag} elsewhere"
