"""Every Grafana panel query returns data from a real Prometheus scraping real services.

No Grafana here: the test does what Grafana would. It starts the planner service, a worker
on a small memory budget (so bits move and requests get preempted) and the gateway as real
processes on loopback (sessions in the real Redis), and the Debian `prometheus` binary
scraping them every second with the repository's rule files. A short load of completions
goes through the gateway. Then, for each dashboard in deploy/grafana/dashboards, it
resolves the template variables with their own queries (`label_values`, "All" selected:
Grafana's regex of every value), substitutes them and `$__rate_interval`, and runs every
panel target as a range query over the load; each must parse and return at least one
series with a finite value.
"""

from __future__ import annotations

import itertools
import json
import math
import os
import re
import signal
import subprocess
import sys
import threading
import time
import urllib.error
import urllib.parse
import urllib.request
from pathlib import Path

import pytest

from deploy_helpers import ROOT, tool
from service_procs import free_port

pytestmark = pytest.mark.deploy

DASHBOARDS = sorted((ROOT / "deploy/grafana/dashboards").glob("*.json"))
MODEL_NAME = "micro-mixtral"
SCRAPE_S = 1
# Grafana's $__rate_interval: max($__interval + scrape interval, 4 x scrape interval); the
# panel's $__interval is the range query's step here.
STEP_S = 2
RATE_INTERVAL = f"{max(STEP_S + SCRAPE_S, 4 * SCRAPE_S)}s"
LOAD_REQUESTS = 48
LOAD_CONCURRENCY = 12
MIN_LOAD_S = 4 * (STEP_S + SCRAPE_S)  # a few rate windows of traffic
REDIS_URL = "redis://127.0.0.1:6379/13"


def http_get(url: str, timeout: float = 5.0) -> tuple[int, bytes]:
    try:
        with urllib.request.urlopen(url, timeout=timeout) as response:
            return response.status, response.read()
    except urllib.error.HTTPError as err:
        return err.code, err.read()
    except OSError:
        return 0, b""


def wait_for(url: str, what: str, procs: list, timeout_s: float = 180) -> None:
    deadline = time.time() + timeout_s
    while time.time() < deadline:
        if http_get(url)[0] == 200:
            return
        for name, proc, log in procs:
            if proc.poll() is not None:
                raise AssertionError(f"{name} exited {proc.returncode} while waiting for {what}:\n{log.read_text()[-3000:]}")
        time.sleep(0.5)
    raise AssertionError(f"{what} not ready at {url} after {timeout_s}s")


class Cluster:
    """The real processes, each logging to a file; stopped with SIGTERM, then SIGKILL."""

    def __init__(self, tmp: Path):
        self.tmp = tmp
        self.procs: list[tuple[str, subprocess.Popen, Path]] = []

    def start(self, name: str, *cmd) -> None:
        log = self.tmp / f"{name}.log"
        # this checkout's code, whatever the virtual environment has installed
        path = os.pathsep.join([str(ROOT / "services"), str(ROOT / "kernels"), os.environ.get("PYTHONPATH", "")])
        env = {**os.environ, "PYTHONUNBUFFERED": "1", "PYTHONPATH": path}
        proc = subprocess.Popen([str(c) for c in cmd], stdout=log.open("w"), stderr=subprocess.STDOUT,
                                cwd=self.tmp, env=env, start_new_session=True)
        self.procs.append((name, proc, log))

    def stop(self) -> None:
        for _, proc, _ in reversed(self.procs):
            if proc.poll() is None:
                proc.send_signal(signal.SIGTERM)
        for _, proc, _ in reversed(self.procs):
            try:
                proc.wait(timeout=20)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()


def pagedweight(*args) -> list:
    return [sys.executable, "-m", "pagedweight.cli.main", *args]


def prometheus_config(targets: dict[str, str]) -> str:
    """The repository's scrape jobs and rule files, pointed at the loopback processes."""
    rules = ROOT / "deploy/prometheus/rules/pagedweight.rules.yml"
    jobs = "".join(f"  - job_name: {job}\n    static_configs:\n      - targets: [\"{target}\"]\n"
                   for job, target in targets.items())
    return (f"global:\n  scrape_interval: {SCRAPE_S}s\n  evaluation_interval: {SCRAPE_S}s\n"
            f"rule_files:\n  - {rules}\nscrape_configs:\n{jobs}")


def completion(gateway: str, i: int) -> int:
    # greedy: what is measured here is the metrics, not the text
    body = {"model": MODEL_NAME, "prompt": f"Request {i}: in the beginning", "max_tokens": 24 + (i % 3) * 8,
            "temperature": 0.0, "ignore_eos": True, "stream": i % 2 == 0,
            "stream_options": {"include_usage": True} if i % 2 == 0 else None}
    if i % 2:
        body.pop("stream_options")
    request = urllib.request.Request(f"{gateway}/v1/completions", data=json.dumps(body).encode(),
                                     headers={"Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(request, timeout=120) as response:
            response.read()
            return response.status
    except urllib.error.HTTPError as err:
        return err.code


def drive_load(gateway: str) -> list[int]:
    """At least LOAD_REQUESTS requests, and for at least MIN_LOAD_S: a rate() needs two
    scrapes inside its window that saw the counters move, however fast the machine is."""
    statuses: list[int] = []
    lock = threading.Lock()
    ids = itertools.count()
    until = time.monotonic() + MIN_LOAD_S

    def client():
        while (i := next(ids)) < LOAD_REQUESTS or time.monotonic() < until:
            status = completion(gateway, i)
            with lock:
                statuses.append(status)

    threads = [threading.Thread(target=client) for _ in range(LOAD_CONCURRENCY)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=300)
    return statuses


@pytest.fixture(scope="module")
def prometheus(paged_micro_dir, tmp_path_factory):
    tmp = tmp_path_factory.mktemp("cluster")
    ports = {name: free_port() for name in ("planner", "planner_http", "worker", "worker_http", "gateway", "prometheus")}
    cluster = Cluster(tmp)
    try:
        cluster.start("planner", *pagedweight("planner", "--port", ports["planner"], "--http-port", ports["planner_http"]))
        cluster.start("worker", *pagedweight(
            "worker", "--model", paged_micro_dir, "--served-model-name", MODEL_NAME, "--port", ports["worker"],
            "--http-port", ports["worker_http"], "--planner", f"127.0.0.1:{ports['planner']}",
            "--memory-budget", "20MiB", "--max-num-seqs", "16", "--max-num-batched-tokens", "128"))
        cluster.start("gateway", *pagedweight(
            "gateway", "--model", paged_micro_dir, "--served-model-name", MODEL_NAME, "--port", ports["gateway"],
            "--workers", f"127.0.0.1:{ports['worker']}", "--redis-url", REDIS_URL))
        config = tmp / "prometheus.yml"
        config.write_text(prometheus_config({
            "pagedweight-gateway": f"127.0.0.1:{ports['gateway']}",
            "pagedweight-worker": f"127.0.0.1:{ports['worker_http']}",
            "pagedweight-planner": f"127.0.0.1:{ports['planner_http']}",
        }))
        cluster.start("prometheus", tool("prometheus"), f"--config.file={config}", f"--storage.tsdb.path={tmp / 'tsdb'}",
                      f"--web.listen-address=127.0.0.1:{ports['prometheus']}")
        prom = f"http://127.0.0.1:{ports['prometheus']}"
        gateway = f"http://127.0.0.1:{ports['gateway']}"
        wait_for(f"http://127.0.0.1:{ports['worker_http']}/ready", "the worker", cluster.procs)
        wait_for(f"{gateway}/health", "the gateway", cluster.procs)
        wait_for(f"{prom}/-/ready", "prometheus", cluster.procs)
        start = time.time()
        statuses = drive_load(gateway)
        assert statuses.count(200) >= len(statuses) * 0.9, f"load failed: {statuses}"
        time.sleep(4 * SCRAPE_S + 1)  # the last samples scraped and the rules evaluated
        yield {"url": prom, "start": start - 5, "end": time.time(), "logs": tmp}
    finally:
        cluster.stop()


def prom_api(prom: dict, path: str, **params) -> dict:
    status, body = http_get(f"{prom['url']}/api/v1/{path}?{urllib.parse.urlencode(params, doseq=True)}", timeout=30)
    reply = json.loads(body or b"{}")
    assert status == 200 and reply.get("status") == "success", f"{path} {params}: {status} {reply}"
    return reply["data"]


def resolve_variables(prom: dict, dashboard: dict) -> dict[str, str]:
    """name -> the regex Grafana substitutes with "All" selected: every value of the
    variable's `label_values(selector, label)` query, alternated."""
    values = {}
    for var in dashboard["templating"]["list"]:
        if var["type"] != "query":
            continue
        query = substitute(var["query"]["query"], values)
        match = re.fullmatch(r"label_values\((.+),\s*(\w+)\)", query)
        assert match, f"variable {var['name']}: unsupported query {query}"
        found = prom_api(prom, f"label/{match.group(2)}/values", **{"match[]": match.group(1),
                         "start": prom["start"], "end": prom["end"]})
        assert found, f"variable {var['name']} ({query}) has no values"
        values[var["name"]] = "(" + "|".join(promql_regex_escape(v) for v in found) + ")"
    return values


def promql_regex_escape(value: str) -> str:
    """A label value as Grafana puts it into a PromQL regex: regex metacharacters escaped
    with a backslash that is itself escaped inside the PromQL string."""
    return re.sub(r"([\\^$*+?.()|\[\]{}])", r"\\\\\1", value)


def substitute(expr: str, values: dict[str, str]) -> str:
    expr = expr.replace("$__rate_interval", RATE_INTERVAL)
    for name, value in values.items():
        expr = expr.replace(f"${{{name}}}", value).replace(f"${name}", value)
    return expr


# (dashboard, panel) -> why its queries return no data yet; strict: the test fails once they do,
# so the mark is removed the day the gap closes.
KNOWN_GAPS: dict[tuple[str, str], str] = {}


def panel_targets():
    for path in DASHBOARDS:
        dashboard = json.loads(path.read_text())
        for panel in dashboard["panels"]:
            gap = KNOWN_GAPS.get((path.name, panel["title"]))
            marks = [pytest.mark.xfail(strict=True, reason=gap)] if gap else []
            for target in panel.get("targets", []):
                yield pytest.param(path.name, panel["title"], target["expr"], marks=marks,
                                   id=f"{path.stem}/{panel['title']}/{target['refId']}")


def test_the_test_covers_every_panel():
    panels = [(p.name, panel["title"]) for p in DASHBOARDS for panel in json.loads(p.read_text())["panels"]]
    assert len(panels) >= 15 and all(t for t in panel_targets())
    covered = {(name, title) for name, title, _ in (t.values for t in panel_targets())}
    assert covered == set(panels)


@pytest.mark.parametrize("dashboard_name, panel_title, expr", list(panel_targets()))
def test_panel_query_returns_data(prometheus, dashboard_name, panel_title, expr):
    dashboard = json.loads((ROOT / "deploy/grafana/dashboards" / dashboard_name).read_text())
    query = substitute(expr, resolve_variables(prometheus, dashboard))
    assert "$" not in query, f"unsubstituted variable in {query}"
    data = prom_api(prometheus, "query_range", query=query, start=prometheus["start"], end=prometheus["end"], step=f"{STEP_S}s")
    finite = [s for s in data["result"] if any(math.isfinite(float(v)) for _, v in s["values"])]
    assert finite, f"{panel_title}: no data for {query}"


def test_recording_rules_evaluate(prometheus):
    """The recording rules produce series from the live metrics (the alert rules are unit
    tested in test_prometheus.py; here their inputs are shown to exist)."""
    groups = prom_api(prometheus, "rules")["groups"]
    rules = {r["name"]: r for g in groups for r in g["rules"]}
    for name in ("instance:pagedweight_gpu_memory_reserved_bytes:sum", "instance:pagedweight_budget_used:ratio",
                 "instance:vllm_num_preemptions:rate5m"):
        assert rules[name]["health"] == "ok", rules[name]
        result = prom_api(prometheus, "query", query=name)["result"]
        assert result, f"{name}: no series"
    used = float(prom_api(prometheus, "query", query="max(instance:pagedweight_budget_used:ratio)")["result"][0]["value"][1])
    assert 0 < used <= 1  # the worker never holds more than its budget
    for rule in rules.values():
        assert rule["health"] == "ok", rule
