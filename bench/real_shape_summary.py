"""A short table of bench/real_shape.py results (the last lines of a GPU call's output):
output tokens/s per concurrency and, per profiled concurrency, where a decode step's time
goes. `python bench/real_shape_summary.py RESULT.json ...`"""

from __future__ import annotations

import json
import sys


def rows(path: str):
    d = json.load(open(path))
    tag = f"{d.get('model')} {d.get('label') or ''} @{str(d.get('code_commit', d.get('commit')))[:8]}"
    engines = {f"bf16 {m}": v for m, v in (d.get("engine_bf16_dense") or {}).items()}
    for name, row in (d.get("runtime_static") or {}).items():
        for mode, loads in (row.get("modes") or {}).items():
            engines[f"{name} {mode}"] = {"loads": loads, "profile": row.get("profile")}
    for name, row in engines.items():
        loads = " ".join(f"c{x['concurrency']}={x['output_tokens_per_s']}" for x in row.get("loads", []))
        yield f"{tag} | {name} | tok/s {loads}"
        for c, p in (row.get("profile") or {}).items():
            if not isinstance(p, dict) or "step_ms" not in p:
                continue
            fields = ["step_ms", "replay_device_ms", "kernels_per_step", "kernel_ms_per_step",
                      "host_ms_excluding_wait", "first_prefill_step_ms", "host_syncs_per_step"]
            yield f"    c{c}: " + " ".join(f"{f}={p.get(f)}" for f in fields if f in p)
            if "host_phase_ms" in p:
                yield "      host ms: " + " ".join(f"{k}={v}" for k, v in p["host_phase_ms"].items())


def main() -> None:
    for path in sys.argv[1:]:
        try:
            for line in rows(path):
                print(line)
        except (OSError, ValueError) as err:
            print(f"{path}: {err}")


if __name__ == "__main__":
    main()
