"""The Helm chart under a real Helm 4: lint --strict, template over the default values and
three value sets, the rendered manifests validated offline against the Kubernetes schemas
(kubernetes-validate --strict), values.schema.json rejecting bad values, and what each
value set must render."""

from __future__ import annotations

import copy
import json
import re
import sys
from pathlib import Path

import pytest
import yaml

from deploy_helpers import CHART, ROOT, VALUE_SETS, by_kind, helm_template, manifests, run, tool

sys.path.insert(0, str(ROOT / "services"))
from pagedweight.memory.pool import MemoryBudgetError, parse_memory_budget  # noqa: E402

pytestmark = pytest.mark.deploy
CRD_KINDS = {"ServiceMonitor", "ScaledObject"}  # validated against their CRD models (validate_crds.mjs)


@pytest.fixture(scope="module")
def rendered() -> dict[str, list[dict]]:
    return {name: manifests(helm_template(*files).stdout) for name, files in VALUE_SETS.items()}


@pytest.mark.parametrize("value_set", VALUE_SETS)
def test_lint_strict(value_set):
    args = []
    for f in VALUE_SETS[value_set]:
        args += ["-f", f]
    result = run(tool("helm"), "lint", "--strict", CHART, *args)
    assert "0 chart(s) failed" in result.stdout


@pytest.mark.parametrize("value_set", VALUE_SETS)
def test_manifests_validate_against_kubernetes_schemas(value_set, rendered, tmp_path):
    docs = [d for d in rendered[value_set] if d["kind"] not in CRD_KINDS]
    path = tmp_path / "manifests.yaml"
    path.write_text(yaml.safe_dump_all(docs))
    result = run(tool("kubernetes-validate"), "--strict", "--quiet", path, check=False)
    assert result.returncode == 0, result.stdout + result.stderr


def validate_crds(docs):
    validator = ROOT / ".tools" / "validate_crds.mjs"  # linked there so node finds .tools/node_modules
    if not validator.exists():
        pytest.fail(f"{validator} is missing: run `make tools` first")
    return run("node", "--preserve-symlinks", "--preserve-symlinks-main", validator, input=json.dumps(docs), check=False)


@pytest.mark.parametrize("value_set", VALUE_SETS)
def test_custom_resources_validate_against_their_crds(value_set, rendered):
    docs = [d for d in rendered[value_set] if d["kind"] in CRD_KINDS]
    result = validate_crds(docs)
    assert result.returncode == 0, result.stdout + result.stderr
    assert result.stdout.count(": valid") == len(docs)


def test_crd_validation_can_fail(rendered):
    docs = copy.deepcopy([d for d in rendered["multi-worker"] if d["kind"] in CRD_KINDS])
    docs[0]["spec"].pop("scaleTargetRef" if docs[0]["kind"] == "ScaledObject" else "selector")
    result = validate_crds(docs)
    assert result.returncode == 1 and "must have required property" in result.stdout


def test_validation_can_fail(rendered, tmp_path):
    docs = copy.deepcopy([d for d in rendered["default"] if d["kind"] == "Deployment"])
    docs[0]["spec"]["template"]["spec"]["containers"][0]["livenessProbe"]["grpcc"] = {}
    path = tmp_path / "bad.yaml"
    path.write_text(yaml.safe_dump_all(docs))
    result = run(tool("kubernetes-validate"), "--strict", "--quiet", path, check=False)
    assert result.returncode != 0 and "grpcc" in result.stdout + result.stderr


def containers(docs):
    """name -> pod spec of every Deployment and StatefulSet."""
    return {d["metadata"]["name"]: d["spec"]["template"]["spec"] for d in docs
            if d["kind"] in ("Deployment", "StatefulSet")}


GATEWAY, WORKER = "rel-pagedweight-gateway-micro-mixtral", "rel-pagedweight-worker-micro-mixtral"


@pytest.mark.parametrize("value_set", VALUE_SETS)
def test_every_service_drains_before_it_is_killed(value_set, rendered):
    for name, pod in containers(rendered[value_set]).items():
        if name.endswith("-redis"):
            continue
        (container,) = pod["containers"]
        sleep = int(container["lifecycle"]["preStop"]["exec"]["command"][1])
        drain = next((int(a.split("=")[1]) for a in container["args"] if a.startswith("--shutdown-timeout=")), 0)
        assert pod["terminationGracePeriodSeconds"] > sleep + drain, name
        assert pod["securityContext"]["runAsNonRoot"] is True
        for probe in ("startupProbe", "livenessProbe", "readinessProbe"):
            assert probe in container, f"{name}: no {probe}"


def test_probes_use_health_endpoints(rendered):
    pods = containers(rendered["default"])
    gateway = pods[GATEWAY]["containers"][0]
    assert gateway["readinessProbe"]["httpGet"]["path"] == "/health"
    worker = pods[WORKER]["containers"][0]
    # the worker's grpc.health.v1 names: "" live from the start, its service once loaded
    assert worker["readinessProbe"]["grpc"] == {"port": 50051, "service": "pagedweight.v1.Worker"}
    assert worker["livenessProbe"]["grpc"] == {"port": 50051}
    planner = pods["rel-pagedweight-planner"]["containers"][0]
    assert planner["readinessProbe"]["grpc"] == {"port": 50061, "service": "pagedweight.v1.Planner"}
    # the startup probe covers the first start's quantisation
    startup = worker["startupProbe"]
    assert startup["periodSeconds"] * startup["failureThreshold"] >= 1800


def test_gpu_requests_follow_the_values(rendered):
    default = containers(rendered["default"])[WORKER]["containers"][0]
    assert default["resources"]["limits"]["nvidia.com/gpu"] == "1"
    assert "--memory-budget=0.9" in default["args"] and "--device=cuda" in default["args"]
    cpu = containers(rendered["no-gpu"])[WORKER]["containers"][0]
    assert not any("gpu" in k for k in cpu["resources"]["limits"]) and "--device=cpu" in cpu["args"]
    multi = containers(rendered["multi-worker"])
    mixtral = multi["rel-pagedweight-worker-mixtral-8x7b"]
    assert mixtral["runtimeClassName"] == "nvidia" and mixtral["tolerations"][0]["key"] == "nvidia.com/gpu"
    terms = mixtral["affinity"]["nodeAffinity"]["requiredDuringSchedulingIgnoredDuringExecution"]["nodeSelectorTerms"]
    assert terms[0]["matchExpressions"][0]["values"] == ["NVIDIA-H100-80GB-HBM3"]
    assert "--max-num-seqs" in mixtral["containers"][0]["args"]
    qwen = multi["rel-pagedweight-worker-qwen3-30b-a3b"]["containers"][0]
    assert qwen["resources"]["limits"]["nvidia.com/mig-3g.40gb"] == 1  # resources replace requestGPU


def test_each_gateway_lists_every_worker_its_model_can_scale_to(rendered):
    """Workers are StatefulSets with a governing headless Service, so worker i of a model is
    <sts>-<i>.<headless>; a model's gateway lists all of them up to KEDA's maximum."""
    docs = rendered["multi-worker"]
    sets = {d["metadata"]["name"]: d for d in by_kind(docs, "StatefulSet")}
    headless = {d["metadata"]["name"] for d in by_kind(docs, "Service") if d["spec"].get("clusterIP") == "None"}
    pods = containers(docs)
    for model, replicas in (("mixtral-8x7b", 4), ("qwen3-30b-a3b", 2)):
        sts = sets[f"rel-pagedweight-worker-{model}"]
        assert sts["spec"]["replicas"] == replicas and sts["spec"]["serviceName"] in headless
        args = pods[f"rel-pagedweight-gateway-{model}"]["containers"][0]["args"]
        assert f"--served-model-name={model}" in args
        workers = next(a for a in args if a.startswith("--workers=")).removeprefix("--workers=").split(",")
        assert workers == [f"{sts['metadata']['name']}-{i}.{sts['spec']['serviceName']}:50051" for i in range(8)]
        worker_args = pods[f"rel-pagedweight-worker-{model}"]["containers"][0]["args"]
        assert f"--served-model-name={model}" in worker_args  # the model_name label the dashboards filter on
    default_args = containers(rendered["default"])[GATEWAY]["containers"][0]["args"]
    assert f"--workers={WORKER}-0.{WORKER}-headless:50051" in default_args
    gateways = {d["metadata"]["name"]: d["spec"]["replicas"] for d in by_kind(docs, "Deployment") if "gateway" in d["metadata"]["name"]}
    assert gateways == {"rel-pagedweight-gateway-mixtral-8x7b": 3, "rel-pagedweight-gateway-qwen3-30b-a3b": 3}


def test_redis_bundled_or_external(rendered):
    bundled = rendered["default"]
    assert [s["metadata"]["name"] for s in by_kind(bundled, "StatefulSet") if "redis" in s["metadata"]["name"]] == ["rel-pagedweight-redis"]
    env = {e["name"]: e for e in containers(bundled)[GATEWAY]["containers"][0]["env"]}
    assert env["REDIS_URL"]["value"] == "redis://rel-pagedweight-redis:6379/0"
    external = rendered["external-redis"]
    assert not [s for s in by_kind(external, "StatefulSet") if "redis" in s["metadata"]["name"]]
    env = {e["name"]: e for e in containers(external)[GATEWAY]["containers"][0]["env"]}
    assert env["REDIS_URL"]["value"] == "redis://sessions-redis.cache.svc.cluster.local:6379/2"
    # the API key from the user's Secret; the chart makes none (only the RPC token's)
    assert env["PAGEDWEIGHT_API_KEY"]["valueFrom"]["secretKeyRef"] == {"name": "pagedweight-api-key", "key": "token"}
    assert [s["metadata"]["name"] for s in by_kind(external, "Secret")] == ["rel-pagedweight-rpc-token"]
    assert not any("planner" in n for n in containers(external))
    worker_args = containers(external)[WORKER]["containers"][0]["args"]
    assert not any(a.startswith("--planner") for a in worker_args)


def test_api_key_secret_made_by_the_chart(rendered):
    docs = rendered["multi-worker"]
    (secret,) = [s for s in by_kind(docs, "Secret") if "api-key" in s["metadata"]["name"]]
    for name, pod in containers(docs).items():
        if "gateway" in name:
            env = {e["name"]: e for e in pod["containers"][0]["env"]}
            ref = env["PAGEDWEIGHT_API_KEY"]["valueFrom"]["secretKeyRef"]
            assert ref["name"] == secret["metadata"]["name"] and ref["key"] in secret["data"]
    assert "PAGEDWEIGHT_API_KEY" not in {e["name"] for e in containers(rendered["default"])[GATEWAY]["containers"][0]["env"]}


def test_optional_monitoring_objects(rendered):
    assert not any(by_kind(rendered["default"], k) for k in ("ServiceMonitor", "ScaledObject", "ConfigMap"))
    docs = rendered["multi-worker"]
    services = by_kind(docs, "Service")
    for monitor in by_kind(docs, "ServiceMonitor"):
        assert monitor["apiVersion"] == "monitoring.coreos.com/v1"
        assert monitor["metadata"]["labels"]["release"] == "kube-prometheus-stack"
        assert monitor["spec"]["jobLabel"] == "pagedweight.io/job"
        selector = monitor["spec"]["selector"]["matchLabels"]
        matched = [s for s in services if selector.items() <= s["metadata"]["labels"].items()]
        assert matched, f"{monitor['metadata']['name']} selects no Service"
        ports = {p["name"] for s in matched for p in s["spec"]["ports"]}
        assert monitor["spec"]["endpoints"][0]["port"] in ports
    jobs = {m["spec"]["selector"]["matchLabels"]["pagedweight.io/job"] for m in by_kind(docs, "ServiceMonitor")}
    prom_jobs = {j["job_name"] for j in yaml.safe_load((ROOT / "deploy/prometheus/prometheus.yml").read_text())["scrape_configs"]}
    assert jobs == prom_jobs  # the rules' job names hold on Kubernetes too
    scaled = by_kind(docs, "ScaledObject")
    workers = {d["metadata"]["name"] for d in by_kind(docs, "StatefulSet") if "worker" in d["metadata"]["name"]}
    assert {s["spec"]["scaleTargetRef"]["name"] for s in scaled} == workers
    assert {s["spec"]["scaleTargetRef"]["kind"] for s in scaled} == {"StatefulSet"}
    for s in scaled:
        (trigger,) = s["spec"]["triggers"]
        assert trigger["type"] == "prometheus" and "vllm:num_requests_waiting" in trigger["metadata"]["query"]


def test_dashboards_as_configmaps(rendered):
    maps = by_kind(rendered["multi-worker"], "ConfigMap")
    files = {p.name: p.read_text() for p in (ROOT / "deploy/grafana/dashboards").glob("*.json")}
    got = {}
    for cm in maps:
        assert cm["metadata"]["labels"]["grafana_dashboard"] == "1"
        got.update(cm["data"])
    assert got.keys() == files.keys()
    for name, text in files.items():
        assert json.loads(got[name]) == json.loads(text)


BAD_VALUES = {
    "memory budget not a size": {"servingEngineSpec": {"modelSpec": [{"memoryBudget": "lots"}]}},
    "cuda worker without a GPU": {"servingEngineSpec": {"modelSpec": [{"requestGPU": 0}]}},
    "unknown top-level key": {"gatway": {"replicaCount": 1}},
    "negative replicas": {"gateway": {"replicaCount": -1}},
    "two planners": {"planner": {"replicaCount": 2}},
    "redis url scheme": {"redis": {"url": "http://redis:6379"}},
    "no models": {"servingEngineSpec": {"modelSpec": []}},
    "model name not a DNS label": {"servingEngineSpec": {"modelSpec": [{"name": "Mixtral 8x7B!"}]}},
    # a worker drives one GPU: a second one in its pod would sit idle
    "two GPUs for one worker": {"servingEngineSpec": {"modelSpec": [{"requestGPU": 2}]}},
    "two GPUs for every worker": {"servingEngineSpec": {"modelDefaults": {"requestGPU": 2}}},
    "a GPU its pod does not see": {"servingEngineSpec": {"modelSpec": [{"device": "cuda:1"}]}},
}


def _merged_model(override: dict) -> dict:
    """The default model with the override's fields (a list in values replaces the default list)."""
    default = yaml.safe_load((CHART / "values.yaml").read_text())["servingEngineSpec"]["modelSpec"][0]
    return {**default, **override}


@pytest.mark.parametrize("case", BAD_VALUES)
def test_schema_rejects_bad_values(case, tmp_path):
    values = BAD_VALUES[case]
    models = values.get("servingEngineSpec", {}).get("modelSpec")
    if models:
        values = {"servingEngineSpec": {"modelSpec": [_merged_model(m) for m in models]}}
    path = tmp_path / "values.yaml"
    path.write_text(yaml.safe_dump(values))
    result = helm_template(path, check=False)
    assert result.returncode != 0 and "values don't meet the specifications" in result.stderr, result.stderr


@pytest.mark.parametrize("budget", ["60GiB", "512M", "1000000", "8gib", "0.9", ".5", "1.0", "90%",
                                    "lots", "0", "0GiB", "0%", "100%", "0.5%", "1.5", "2T", "3PiB", "0.0", "8TiB", "60 GiB", "-1GiB", "150%", "GiB"])
def test_memory_budget_schema_agrees_with_the_worker(budget):
    """values.schema.json accepts a memoryBudget exactly when the worker's parser does."""
    pattern = json.loads((CHART / "values.schema.json").read_text())["properties"]["servingEngineSpec"][
        "properties"]["modelSpec"]["items"]["properties"]["memoryBudget"]["pattern"]
    try:
        parse_memory_budget(budget, device_total_bytes=1 << 50)
        parses = True
    except MemoryBudgetError:
        parses = False
    assert (re.search(pattern, budget) is not None) == parses


def test_readme_values_example_installs(tmp_path):
    """The README's `my-values.yaml` passes the schema, lints and renders valid manifests."""
    readme = (ROOT / "README.md").read_text()
    block = re.search(r"<!-- helm-values-example -->\n```yaml\n(.*?)```", readme, re.S)
    assert block, "README lost its Helm values example"
    values = tmp_path / "my-values.yaml"
    values.write_text(block.group(1))
    run(tool("helm"), "lint", "--strict", CHART, "-f", values)
    docs = [d for d in manifests(helm_template(values).stdout) if d["kind"] not in CRD_KINDS]
    path = tmp_path / "manifests.yaml"
    path.write_text(yaml.safe_dump_all(docs))
    result = run(tool("kubernetes-validate"), "--strict", "--quiet", path, check=False)
    assert result.returncode == 0, result.stdout + result.stderr
    assert any(d["kind"] == "StatefulSet" and d["metadata"]["name"] == "rel-pagedweight-worker-mixtral-8x7b" for d in docs)


@pytest.mark.parametrize("value_set", VALUE_SETS)
def test_internal_rpc_carries_the_token_and_listens_on_the_pod_only(value_set, rendered):
    docs = rendered[value_set]
    (secret,) = [s for s in by_kind(docs, "Secret") if s["metadata"]["name"].endswith("rpc-token")]
    assert len(secret["data"]["rpc-token"]) >= 48  # base64 of 48 random characters
    for name, pod in containers(docs).items():
        if "redis" in name:
            continue
        (container,) = pod["containers"]
        env = {e["name"]: e for e in container["env"]}
        assert env["PAGEDWEIGHT_RPC_TOKEN"]["valueFrom"]["secretKeyRef"] == {
            "name": secret["metadata"]["name"], "key": "rpc-token"}, name
        if "gateway" not in name:  # the gRPC servers: the pod's own address, never 0.0.0.0
            assert "--host=$(POD_IP)" in container["args"], name
            assert env["POD_IP"]["valueFrom"]["fieldRef"]["fieldPath"] == "status.podIP"


def test_network_policies_admit_only_the_callers(rendered):
    docs = rendered["default"]
    policies = {p["metadata"]["name"]: p["spec"] for p in by_kind(docs, "NetworkPolicy")}
    assert set(policies) == {"rel-pagedweight-workers", "rel-pagedweight-planner", "rel-pagedweight-redis"}
    workers = policies["rel-pagedweight-workers"]
    assert workers["podSelector"]["matchLabels"]["pagedweight.io/role"] == "worker"
    grpc_rule = workers["ingress"][0]
    assert grpc_rule["from"][0]["podSelector"]["matchLabels"]["pagedweight.io/role"] == "gateway"
    planner = policies["rel-pagedweight-planner"]
    assert planner["ingress"][0]["from"][0]["podSelector"]["matchLabels"]["pagedweight.io/role"] == "worker"
    redis_from = policies["rel-pagedweight-redis"]["ingress"][0]["from"][0]["podSelector"]["matchLabels"]
    assert redis_from["pagedweight.io/role"] == "gateway"
    # the selectors match the pods they are meant for
    labels = {name: pod_labels for name, pod_labels in pod_label_sets(docs)}
    assert any(l.get("pagedweight.io/role") == "worker" for l in labels.values())
    assert any(l.get("pagedweight.io/role") == "gateway" for l in labels.values())


def pod_label_sets(docs):
    for doc in docs:
        if doc["kind"] in ("Deployment", "StatefulSet"):
            yield doc["metadata"]["name"], doc["spec"]["template"]["metadata"]["labels"]


def _pod(docs: list[dict], kind: str, part: str) -> dict:
    (doc,) = [d for d in by_kind(docs, kind) if part in d["metadata"]["name"]]
    return doc["spec"]["template"]


def test_a_model_override_needs_one_value_and_the_timings_derive(tmp_path):
    """Helm replaces a list value whole: a model given as its name and modelURL alone gets
    modelDefaults, and every timing derives from the model's drain."""
    values = tmp_path / "one-model.yaml"
    values.write_text(yaml.safe_dump({"servingEngineSpec": {"modelSpec": [
        {"name": "qwen", "modelURL": "/models/qwen-paged", "shutdownTimeoutSeconds": 100}]}}))
    docs = manifests(helm_template(values).stdout)
    worker = _pod(docs, "StatefulSet", "worker-qwen")["spec"]
    (container,) = worker["containers"]
    assert "--shutdown-timeout=100" in container["args"] and "--memory-budget=0.9" in container["args"]
    assert worker["terminationGracePeriodSeconds"] == 5 + 100 + 15  # preStop + drain + margin
    assert container["startupProbe"]["failureThreshold"] == 1800 // 10
    gateway = _pod(docs, "Deployment", "gateway-qwen")["spec"]
    (gw,) = gateway["containers"]
    assert "--shutdown-timeout=100" in gw["args"]  # the gateway outlasts its workers' drain
    assert gateway["terminationGracePeriodSeconds"] == 5 + 100 + 15


def test_pods_carry_scrape_annotations_by_default_and_the_servicemonitor_is_optional(rendered):
    docs = rendered["default"]
    assert not by_kind(docs, "ServiceMonitor")
    ports = {}
    for kind, part in (("StatefulSet", "worker"), ("Deployment", "gateway"), ("Deployment", "planner")):
        annotations = _pod(docs, kind, part)["metadata"]["annotations"]
        assert annotations["prometheus.io/scrape"] == "true" and annotations["prometheus.io/path"] == "/metrics"
        ports[part] = int(annotations["prometheus.io/port"])
    assert ports == {"worker": 9100, "gateway": 8000, "planner": 9101}
    off = manifests(helm_template(set_values=("metrics.scrapeAnnotations=false",)).stdout)
    for kind, part in (("StatefulSet", "worker"), ("Deployment", "planner")):
        assert "prometheus.io/scrape" not in (_pod(off, kind, part)["metadata"].get("annotations") or {})


def test_one_worker_per_gpu_and_replica_count_says_how_many(tmp_path):
    """N workers of a model are N pods of its StatefulSet, each with one GPU (seen as cuda),
    its own address and metrics port, all in its gateway's worker list: a node with N GPUs
    runs one worker on each."""
    path = tmp_path / "values.yaml"
    path.write_text(yaml.safe_dump({"servingEngineSpec": {"modelSpec": [_merged_model({"replicaCount": 3})]}}))
    docs = manifests(helm_template(path).stdout)
    (sts,) = [d for d in by_kind(docs, "StatefulSet") if d["metadata"]["name"] == WORKER]
    assert sts["spec"]["replicas"] == 3
    pod = sts["spec"]["template"]
    (worker,) = pod["spec"]["containers"]
    assert worker["resources"]["requests"]["nvidia.com/gpu"] == worker["resources"]["limits"]["nvidia.com/gpu"] == "1"
    assert "--device=cuda" in worker["args"] and "--host=$(POD_IP)" in worker["args"]
    assert pod["metadata"]["annotations"]["prometheus.io/port"] == "9100"  # each pod scraped on its own
    args = containers(docs)[GATEWAY]["containers"][0]["args"]
    workers = next(a for a in args if a.startswith("--workers=")).removeprefix("--workers=").split(",")
    assert workers == [f"{WORKER}-{i}.{WORKER}-headless:50051" for i in range(3)]
