"""Writes the Grafana dashboards (deploy/grafana/dashboards/*.json) from one description.

    python3 deploy/grafana/build_dashboards.py          # rewrite the JSON files
    python3 deploy/grafana/build_dashboards.py --check  # exit 1 when a file is stale

The JSON is generated so that every panel follows the same conventions, which the tests
check against a real Prometheus (tests/deploy/test_dashboards.py):
- metric names exactly as services/pagedweight/common/metrics.py defines them (vLLM's
  families, our `pagedweight:` ones; README.md, "Metrics");
- counters and histograms only through `rate()`/`increase()` over `$__rate_interval`
  (vLLM's production-stack dashboard plots lifetime averages: we do not);
- every query filtered by the `model_name` variable, worker-side ones by `worker`
  (the scrape `instance` of a worker), client-side ones (latency, throughput, finish
  reasons) to the gateway's series; the planner service's own panel has no model (it
  serves every worker); the datasource is a variable, so the same JSON works
  with the Compose stack's Prometheus and with any Prometheus in a cluster.
Standard library only, so it runs anywhere the repository does.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

OUT_DIR = Path(__file__).resolve().parent / "dashboards"
DATASOURCE = {"type": "prometheus", "uid": "${datasource}"}
MODEL = 'model_name=~"$model_name"'
WORKER = f'{MODEL}, instance=~"$worker"'  # series a worker exports
# The gateway exports vLLM's request families too, with engine="gateway": the latency a
# client sees (queueing, routing, detokenisation included). Client-side panels read those
# and so never add a request twice (once at the gateway, once at its worker).
CLIENT = f'{MODEL}, engine="gateway"'
RATE = "$__rate_interval"
QUANTILES = (0.5, 0.9, 0.99)


def target(expr: str, legend: str, ref: str, **extra) -> dict:
    return {"datasource": DATASOURCE, "expr": expr, "legendFormat": legend, "refId": ref, **extra}


def targets(*pairs, **extra) -> list[dict]:
    """(expr, legend) pairs -> targets with refIds A, B, C, ..."""
    return [target(expr, legend, chr(ord("A") + i), **extra) for i, (expr, legend) in enumerate(pairs)]


def panel(kind: str, title: str, description: str, tgts: list[dict], grid: tuple, unit: str = "short",
          stack: bool = False, **options) -> dict:
    x, y, w, h = grid
    defaults = {"unit": unit}
    custom = {}
    if kind == "timeseries":
        custom = {"fillOpacity": 70 if stack else 10, "lineWidth": 1 if stack else 2,
                  "stacking": {"mode": "normal" if stack else "none", "group": "A"}}
    defaults["custom"] = custom
    defaults.update(options.pop("defaults", {}))
    return {
        "type": kind, "title": title, "description": description, "datasource": DATASOURCE,
        "gridPos": {"x": x, "y": y, "w": w, "h": h}, "targets": tgts,
        "fieldConfig": {"defaults": defaults, "overrides": options.pop("overrides", [])},
        "options": options.pop("panel_options", {"legend": {"displayMode": "list", "placement": "bottom"},
                                                 "tooltip": {"mode": "multi", "sort": "desc"}}),
        **options,
    }


def latency_panel(metric: str, title: str, description: str, grid: tuple, where: str = CLIENT) -> dict:
    """p50/p90/p99 and the mean of a vLLM latency histogram over the rate window."""
    pairs = [(f"histogram_quantile({q}, sum by (le) (rate({metric}_bucket{{{where}}}[{RATE}])))", f"p{round(q * 100)}")
             for q in QUANTILES]
    pairs.append((f"sum(rate({metric}_sum{{{where}}}[{RATE}])) / sum(rate({metric}_count{{{where}}}[{RATE}]))", "mean"))
    return panel("timeseries", title, description, targets(*pairs), grid, unit="s")


def variables() -> dict:
    def query_var(name: str, label: str, query: str) -> dict:
        return {
            "name": name, "label": label, "type": "query", "datasource": DATASOURCE,
            "query": {"query": query, "refId": f"{name}-var"}, "definition": query,
            "refresh": 2, "includeAll": True, "multi": True, "sort": 1,
            "current": {"selected": True, "text": ["All"], "value": ["$__all"]},
        }

    return {"list": [
        {"name": "datasource", "label": "Prometheus", "type": "datasource", "query": "prometheus",
         "current": {}, "hide": 0},
        query_var("model_name", "Model", "label_values(vllm:num_requests_running, model_name)"),
        query_var("worker", "Worker", 'label_values(pagedweight:mean_expert_bits{model_name=~"$model_name"}, instance)'),
    ]}


def dashboard(uid: str, title: str, description: str, panels: list[dict]) -> dict:
    for i, p in enumerate(panels, start=1):
        p["id"] = i
    return {
        "uid": uid, "title": title, "description": description, "tags": ["pagedweight"],
        "editable": True, "schemaVersion": 39, "version": 1, "refresh": "10s",
        "time": {"from": "now-30m", "to": "now"}, "timezone": "browser",
        "templating": variables(), "annotations": {"list": []}, "panels": panels,
    }


def memory_dashboard() -> dict:
    split = targets(
        (f'sum by (bits) (pagedweight:gpu_memory_bytes{{component="expert_weights", {WORKER}}})', "experts {{bits}}-bit"),
        (f'sum by (component) (pagedweight:gpu_memory_bytes{{component=~"dense_weights|workspace|in_transit|kv_used|kv_free|free", {WORKER}}})',
         "{{component}}"),
        (f"sum(pagedweight:budget_bytes{{{WORKER}}})", "budget"),
    )
    budget_line = {"matcher": {"id": "byName", "options": "budget"}, "properties": [
        {"id": "custom.stacking", "value": {"mode": "none", "group": "A"}},
        {"id": "custom.fillOpacity", "value": 0}, {"id": "custom.lineStyle", "value": {"fill": "dash", "dash": [10, 10]}},
        {"id": "color", "value": {"mode": "fixed", "fixedColor": "red"}}]}
    panels = [
        panel("timeseries", "Memory split",
              "Device bytes by use, stacked up to the budget: expert weights by committed bit-width, dense "
              "weights, workspace, copies in transit, KV blocks holding tokens, KV blocks kept free, and free "
              "space. Under KV pressure the expert bands shift to fewer bits and KV grows into their bytes.",
              split, (0, 0, 24, 10), unit="bytes", stack=True, overrides=[budget_line]),
        panel("timeseries", "Mean expert bits",
              "Committed bits per expert weight (blocks weighted by size), per worker: 8 when memory is "
              "plentiful, falling toward 3 as KV needs the bytes.",
              targets((f"avg by (instance) (pagedweight:mean_expert_bits{{{WORKER}}})", "{{instance}}")),
              (0, 10, 8, 8), unit="none", defaults={"min": 3, "max": 8, "decimals": 2}),
        panel("heatmap", "Expert bits: layers x experts",
              "One row per (layer, expert) block, averaged over its modules and the selected workers; colour "
              "is the committed bit-width. Hot experts keep more bits than cold ones.",
              targets((f"avg by (layer, expert) (pagedweight:expert_bits{{{WORKER}}})", "L{{layer}} E{{expert}}")),
              (8, 10, 16, 8), unit="none",
              calculate=False,
              panel_options={"calculate": False, "yAxis": {"axisPlacement": "left", "reverse": True},
                             "rowsFrame": {"layout": "auto"},
                             "color": {"mode": "scheme", "scheme": "RdYlGn", "steps": 6, "min": 3, "max": 8},
                             "cellValues": {"unit": "none", "decimals": 0},
                             "tooltip": {"mode": "single", "yHistogram": False}, "legend": {"show": True}}),
        panel("timeseries", "Page moves and plans",
              "Committed bit changes per second by direction (raise: planes copied in; lower: bytes given "
              "back to KV) and plans per second by source (the planner service, or the worker's local "
              "planner when the service is slow or down).",
              targets((f"sum by (direction) (rate(pagedweight:page_moves_total{{{WORKER}}}[{RATE}]))", "moves {{direction}}"),
                      (f"sum by (source) (rate(pagedweight:plans_total{{{WORKER}}}[{RATE}]))", "plans {{source}}")),
              (0, 18, 12, 8), unit="ops"),
        panel("timeseries", "Planner latency",
              "Time from asking for a plan to having it, as the workers see it, by who answered (the "
              "planner service, or the local planner when the service is slow or down): p50 and p99.",
              targets(*[(f"histogram_quantile({q}, sum by (source, le) (rate(pagedweight:plan_latency_seconds_bucket{{{WORKER}}}[{RATE}])))",
                         f"p{round(q * 100)} {{{{source}}}}") for q in (0.5, 0.99)]),
              (12, 18, 6, 8), unit="s"),
        panel("state-timeline", "Planner connection",
              "1 while the worker is connected to the planner service; 0 while it plans locally and "
              "reconnects with backoff.",
              targets((f"max by (instance) (pagedweight:planner_connected{{{WORKER}}})", "{{instance}}")),
              (18, 18, 6, 8), unit="none",
              defaults={"mappings": [{"type": "value", "options": {
                  "0": {"text": "disconnected", "color": "red"}, "1": {"text": "connected", "color": "green"}}}]},
              panel_options={"showValue": "never", "legend": {"displayMode": "list", "placement": "bottom"}}),
        panel("timeseries", "KV cache usage",
              "Share of the KV blocks allocated now that hold tokens (vLLM's definition, 0-1), and KV blocks "
              "that exist: capacity grows when bits fall.",
              targets((f"max by (instance) (vllm:kv_cache_usage_perc{{{WORKER}}})", "usage {{instance}}"),
                      (f"max by (instance) (pagedweight:kv_capacity_blocks{{{WORKER}}})", "blocks {{instance}}")),
              (0, 26, 12, 8), unit="percentunit",
              overrides=[{"matcher": {"id": "byRegexp", "options": "blocks.*"},
                          "properties": [{"id": "unit", "value": "short"}, {"id": "custom.axisPlacement", "value": "right"}]}]),
        panel("timeseries", "KV reclaimable by lowering bits",
              "Bytes that lowering expert bits to their floor could still free for KV: the headroom no other "
              "server has. At 0 with KV full, the worker must preempt.",
              targets((f"sum by (instance) (pagedweight:kv_reclaimable_bytes{{{WORKER}}})", "{{instance}}")),
              (12, 26, 6, 8), unit="bytes"),
        panel("timeseries", "Preemptions",
              "Requests preempted per second for KV space. PagedWeight lowers bits first; preemptions "
              "mean the bits were already at their floor.",
              targets((f"sum by (instance) (rate(vllm:num_preemptions_total{{{WORKER}}}[{RATE}]))", "{{instance}}")),
              (18, 26, 6, 8), unit="reqps"),
        panel("timeseries", "Planner service",
              "The planner service itself (it serves every worker, so no model filter): workers registered, "
              "plans answered per second by direction, and its p99 time to compute a plan (right axis).",
              targets(("sum(pagedweight:planner_workers_registered)", "workers registered"),
                      (f"sum by (direction) (rate(pagedweight:planner_plans_total[{RATE}]))", "plans/s {{direction}}"),
                      (f"histogram_quantile(0.99, sum by (le) (rate(pagedweight:planner_plan_latency_seconds_bucket[{RATE}])))",
                       "p99 compute")),
              (0, 34, 24, 7),
              overrides=[{"matcher": {"id": "byName", "options": "p99 compute"},
                          "properties": [{"id": "unit", "value": "s"}, {"id": "custom.axisPlacement", "value": "right"}]}]),
    ]
    return dashboard("pagedweight-memory", "PagedWeight / memory",
                     "How each worker splits its device memory between expert weights (by bit-width) and KV cache.",
                     panels)


def serving_dashboard() -> dict:
    panels = [
        panel("timeseries", "Requests running and waiting",
              "Requests in the running batch and in the queue, per worker.",
              targets((f"sum by (instance) (vllm:num_requests_running{{{WORKER}}})", "running {{instance}}"),
                      (f"sum by (instance) (vllm:num_requests_waiting{{{WORKER}}})", "waiting {{instance}}")),
              (0, 0, 12, 8)),
        panel("timeseries", "Token throughput",
              "Prompt and generated tokens per second over the rate window.",
              targets((f"sum(rate(vllm:prompt_tokens_total{{{CLIENT}}}[{RATE}]))", "prompt"),
                      (f"sum(rate(vllm:generation_tokens_total{{{CLIENT}}}[{RATE}]))", "generation")),
              (12, 0, 12, 8), unit="suffix: tok/s"),
        latency_panel("vllm:time_to_first_token_seconds", "Time to first token",
                      "TTFT as clients see it at the gateway: quantiles and mean over the rate window "
                      "(not lifetime averages).", (0, 8, 8, 8)),
        latency_panel("vllm:inter_token_latency_seconds", "Inter-token latency",
                      "ITL at the gateway: time between consecutive output tokens of a request (vLLM's "
                      "inter_token_latency, not TPOT).", (8, 8, 8, 8)),
        latency_panel("vllm:e2e_request_latency_seconds", "End-to-end request latency",
                      "From arrival at the gateway to the last token, quantiles and mean over the rate window.",
                      (16, 8, 8, 8)),
        latency_panel("vllm:request_queue_time_seconds", "Queue time",
                      "Time requests wait in a worker's queue before their first scheduling.", (0, 16, 8, 8),
                      where=WORKER),
        panel("timeseries", "Finish reasons",
              "Finished requests per second by reason: stop (EOS or a stop string), length (max_tokens), "
              "abort (client gone, or drained at shutdown), error.",
              targets((f"sum by (finished_reason) (rate(vllm:request_success_total{{{CLIENT}}}[{RATE}]))", "{{finished_reason}}")),
              (8, 16, 8, 8), unit="reqps"),
        panel("heatmap", "Prompt length",
              "Distribution of prompt lengths in tokens, per rate window.",
              targets((f"sum by (le) (increase(vllm:request_prompt_tokens_bucket{{{CLIENT}}}[{RATE}]))", "{{le}}"),
                      format="heatmap"),
              (16, 16, 4, 8), calculate=False,
              panel_options={"calculate": False, "yAxis": {"unit": "short"}, "legend": {"show": False},
                             "color": {"mode": "scheme", "scheme": "Blues"}}),
        panel("heatmap", "Generation length",
              "Distribution of generated lengths in tokens, per rate window.",
              targets((f"sum by (le) (increase(vllm:request_generation_tokens_bucket{{{CLIENT}}}[{RATE}]))", "{{le}}"),
                      format="heatmap"),
              (20, 16, 4, 8), calculate=False,
              panel_options={"calculate": False, "yAxis": {"unit": "short"}, "legend": {"show": False},
                             "color": {"mode": "scheme", "scheme": "Blues"}}),
    ]
    return dashboard("pagedweight-serving", "PagedWeight / serving",
                     "Load and latency as vLLM's dashboards show them, on the same metric names.", panels)


DASHBOARDS = {"pagedweight-memory.json": memory_dashboard, "pagedweight-serving.json": serving_dashboard}


def render(build) -> str:
    return json.dumps(build(), indent=2, sort_keys=True) + "\n"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--check", action="store_true", help="fail when a committed dashboard is stale")
    args = parser.parse_args(argv)
    stale = []
    for name, build in DASHBOARDS.items():
        path, text = OUT_DIR / name, render(build)
        if args.check:
            if not path.exists() or path.read_text() != text:
                stale.append(str(path))
        else:
            path.write_text(text)
    if stale:
        print("stale dashboards (run python3 deploy/grafana/build_dashboards.py): " + ", ".join(stale), file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
