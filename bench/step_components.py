"""Where an engine step's time goes: per component of the model (`component_profile`) and per
phase of a step as the engine runs it (`decode_profile`: host phases, kernels by name).

A replayed CUDA graph is one launch to the profiler, so the component profile runs the steps
eagerly with a `record_function` range around each component's call and gives every operator
to the innermost range it ran in: on CUDA its kernels (count, device time), on the CPU (which
checks the instrumentation) its own CPU time, one "kernel" per leaf. "host" is the step's wall
time less the summed device time: what a replay removes. What a range leaves over goes to its
enclosing component: the MoE block's to gating, the layer's to norms, the model's to "embed +
lm head".
"""

from __future__ import annotations

import collections
import time

import torch
from torch.autograd.profiler import record_function
from torch.profiler import ProfilerActivity, profile

from bench.bench_meta import STEP_COMPONENTS as COMPONENTS
from pagedweight.engine.sampler import SamplingParams
from pagedweight.model.layers import RMSNorm

PREFIX = "component:"


def _ranged(original, component: str):
    """`original` inside a record_function range of the component."""
    def ranged(*args, **kwargs):
        with record_function(PREFIX + component):
            return original(*args, **kwargs)
    return ranged


def instrument(model, runner) -> list:
    """Ranges around the components' calls, each an instance attribute over the method (deleted
    again after the profile); returns the (object, method) pairs wrapped."""
    wrapped: list = []

    def wrap(obj, component: str, *methods: str) -> None:  # (an object None or without the method: none)
        for method in methods:
            if (original := getattr(obj, method, None)) is not None:
                setattr(obj, method, _ranged(original, component))
                wrapped.append((obj, method))

    wrap(model, "embed + lm head", "forward_paged")
    for layer in model.layers:
        moe, shared = layer.moe, getattr(layer.moe, "shared_expert", None)
        wrap(layer, "norms", "forward_paged", "forward_paged_fused")
        wrap(layer.self_attn, "attention", "forward_paged")
        wrap(moe, "gating", "forward", "forward_parts")
        wrap(moe.experts, "routed experts", "forward")
        for name in ("gate", "router", "shared_expert_gate"):
            wrap(getattr(moe, name, None), "gating", "forward")
        wrap(shared, "shared expert", "forward")
        wrap(getattr(shared, "down_proj", None), "shared expert", "forward")
        wrap(getattr(layer, "mlp", None), "shared expert", "forward")  # Gemma-4's dense MLP beside the experts
    for module in model.modules():
        if isinstance(module, RMSNorm):
            wrap(module, "norms", "forward")
    wrap(runner, "sampling", "sample")
    return wrapped


def _component_of(event) -> str:
    """The innermost component range an operator ran in ("other": none)."""
    while event is not None and not event.name.startswith(PREFIX):
        event = event.cpu_parent
    return "other" if event is None else event.name[len(PREFIX):]


def attribute(events, on_cuda: bool) -> dict:
    """component -> {"ms": device ms (CUDA) or own CPU ms, "kernels": count} over `events`."""
    out = {c: {"ms": 0.0, "kernels": 0} for c in COMPONENTS}
    for e in events:
        if e.device_type != torch.autograd.DeviceType.CPU:
            continue
        slot = out[_component_of(e)]  # (a range is its own component)
        if on_cuda:
            # An operator's kernels; a range's own are those launched outside torch's operators
            # (the cupy-launched expert, norm and attention kernels), correlated with the
            # innermost range open at their launch.
            for k in e.kernels:
                slot["ms"] += k.duration / 1000
                slot["kernels"] += 1
        elif not e.name.startswith(PREFIX):
            slot["ms"] += e.self_cpu_time_total / 1000
            slot["kernels"] += not e.cpu_children
    return out


def component_profile(engine, concurrency: int, prompt_len: int, device: torch.device, steps: int = 3,
                      prefill: bool = False) -> dict:
    """Per decode step at `concurrency` sequences, run eagerly: ms and kernels per
    component, the step's wall ms, and host ms (see the module's docstring). prefill: the
    step that prefills `concurrency` new prompts instead (one step, after a prefill of the
    same shape has warmed it up)."""
    runner = engine.runner
    graphs, runner.graphs = runner.graphs, None
    wrapped = instrument(engine.model, runner)
    on_cuda, steps = device.type == "cuda", 1 if prefill else steps
    try:
        if prefill:  # the same prefill once first (kernels compiled, memory cached)
            add_requests(engine, concurrency, prompt_len, 1, seed=29)
            while engine.has_work:
                engine.step()
        add_requests(engine, concurrency, prompt_len, steps + 8, seed=23)
        for _ in range(0 if prefill else 3):  # prefill, then decode steps (warm)
            engine.step()
        activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if on_cuda else [])
        with profile(activities=activities) as prof:
            sync(device)
            t0 = time.perf_counter()
            for _ in range(steps):
                engine.step()
            sync(device)
            wall_ms = 1000 * (time.perf_counter() - t0) / steps
    finally:
        for obj, method in wrapped:
            delattr(obj, method)
        runner.graphs = graphs
        while engine.has_work:
            engine.step()
    parts = attribute(prof.events(), on_cuda)
    per_step = {c: {"ms": round(v["ms"] / steps, 3), "kernels": round(v["kernels"] / steps, 1)}
                for c, v in parts.items()}
    counted = sum(v["ms"] for v in per_step.values())
    return {"concurrency": concurrency, "mode": "eager", "steps": steps, "step_ms": round(wall_ms, 3),
            **({"prefill_tokens": concurrency * prompt_len} if prefill else {}),
            "components": per_step, "kernels_per_step": round(sum(v["kernels"] for v in per_step.values()), 1),
            "host_ms": round(max(0.0, wall_ms - counted), 3),
            "time": "device" if on_cuda else "cpu"}


def decode_profile(engine, concurrency: int, prompt_len: int, device: torch.device, steps: int = 8) -> dict:
    """Where a decode step's time goes at `concurrency` sequences, the engine as it runs
    (graphs and all): wall ms per step; the host's ms per phase of the step (`Engine.phases`:
    schedule, prepare, signature, launch, wait = reading the sampled tokens back, update,
    boundary); and over two more steps (torch.profiler, CUDA) the kernels per step, their summed
    device ms and their count by name."""
    add_requests(engine, concurrency, prompt_len, 2 * steps + 16, seed=11)
    for _ in range(4):  # the prefill and a few decodes (captures this bucket's graph)
        engine.step()
    sync(device)
    engine.phases.reset()
    t0 = time.perf_counter()
    for _ in range(steps):
        engine.step()
    sync(device)
    out = {"concurrency": concurrency, "step_ms": round(1000 * (time.perf_counter() - t0) / steps, 3),
           "host_phase_ms": engine.phases.per_step_ms()}
    if device.type == "cuda":
        with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
            for _ in range(2):
                engine.step()
            sync(device)
        kernels = [e for e in prof.events() if e.device_type == torch.autograd.DeviceType.CUDA]
        out["kernels_per_step"] = round(len(kernels) / 2, 1)
        out["kernel_ms_per_step"] = round(sum(e.time_range.elapsed_us() for e in kernels) / 2000, 3)
        out["kernels_by_name"] = {name[:96]: n / 2 for name, n in collections.Counter(
            e.name for e in kernels).most_common()}
    while engine.has_work:
        engine.step()
    return out


def add_requests(engine, num: int, prompt_len: int, max_tokens: int, seed: int) -> None:
    """`num` random prompts of `prompt_len` tokens, each generating `max_tokens` (EOS ignored)."""
    gen, vocab = torch.Generator().manual_seed(seed), engine.model.config.vocab_size
    for i in range(num):
        engine.add_request(f"profile{seed}-{i}", torch.randint(1, vocab, (prompt_len,), generator=gen).tolist(),
                           SamplingParams(max_tokens=max_tokens, ignore_eos=True))


def sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)
