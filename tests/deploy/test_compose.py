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


def flag(command: list[str], name: str) -> str:
    return command[command.index(name) + 1]


def test_gpu_override_is_valid_and_reserves_a_gpu():
    base = compose_config("docker-compose.yml")["services"]["worker"]
    worker = compose_config("docker-compose.yml", "docker-compose.gpu.yml")["services"]["worker"]
    assert worker["build"]["dockerfile"] == "docker/Dockerfile.worker"
    (device,) = worker["deploy"]["resources"]["reservations"]["devices"]
    assert device["capabilities"] == ["gpu"] and device["device_ids"] == ["0"]  # its own GPU, as cuda:0
    assert flag(worker["command"], "--device") == "cuda"
    # the override replaces the command whole: it keeps every flag but the device and budget
    differ = {"--device", "--memory-budget"}
    assert {f: flag(base["command"], f) for f in base["command"] if f.startswith("--") and f not in differ} == \
        {f: flag(worker["command"], f) for f in worker["command"] if f.startswith("--") and f not in differ}


SECOND_GPU = ("docker-compose.yml", "docker-compose.gpu.yml", "docker-compose.second-gpu.yml")


def test_second_gpu_adds_a_worker_on_its_own_gpu_behind_the_one_gateway():
    services = compose_config(*SECOND_GPU)["services"]
    assert set(services) == SERVICES | {"worker-1"}
    worker, second = services["worker"], services["worker-1"]
    # the same worker in every respect but its GPU
    assert {k for k in worker.keys() | second.keys() if worker.get(k) != second.get(k)} == {"deploy"}
    gpus = [s["deploy"]["resources"]["reservations"]["devices"][0]["device_ids"] for s in (worker, second)]
    assert gpus == [["0"], ["1"]]
    port = flag(worker["command"], "--port")
    assert flag(services["gateway"]["command"], "--workers").split(",") == [f"worker:{port}", f"worker-1:{port}"]
    single = compose_config("docker-compose.yml")["services"]["gateway"]["command"]
    assert [a for a in services["gateway"]["command"] if "worker-1" not in a] == \
        [a for a in single if a != flag(single, "--workers")]


def test_second_gpu_prometheus_scrapes_both_workers_and_the_rest_as_before():
    services = compose_config(*SECOND_GPU)["services"]
    mounts = {v["target"]: v["source"] for v in services["prometheus"]["volumes"]}
    config = yaml.safe_load(open(mounts["/etc/prometheus/prometheus.yml"]))
    expected = yaml.safe_load((ROOT / "deploy/prometheus/prometheus.yml").read_text())
    metrics = flag(services["worker-1"]["command"], "--metrics-port")
    workers = next(j for j in expected["scrape_configs"] if j["job_name"] == "pagedweight-worker")
    workers["static_configs"][0]["targets"] = [f"worker:{metrics}", f"worker-1:{metrics}"]
    assert config == expected  # the single-worker config with the second target, nothing else


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
