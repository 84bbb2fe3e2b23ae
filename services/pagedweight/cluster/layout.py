"""Where `pagedweight serve`'s workers listen and which GPU each one gets.

N workers take consecutive ports from the first worker's gRPC and metrics ports; the
planner, unless its ports are given, takes the next ones after the workers' (so a single
worker keeps 50051 / 9091 and the planner 50052 / 9092). On CUDA each worker sees one GPU
through its own CUDA_VISIBLE_DEVICES: worker i gets the i-th GPU this process sees (an
inherited CUDA_VISIBLE_DEVICES is honoured, entry by entry), so N may not exceed the GPUs
visible. On the CPU the workers are plain processes side by side.
"""

from __future__ import annotations

from dataclasses import dataclass

from pagedweight.common.errors import UserError

MAX_PORT = 65535


@dataclass(frozen=True)
class WorkerSlot:
    name: str  # "worker" when it is the only one, else "worker-<i>" (its log prefix)
    port: int  # gRPC
    metrics_port: int  # /metrics, /health
    cuda_visible_devices: str | None  # this worker's CUDA_VISIBLE_DEVICES; None: inherit (CPU)


def worker_env(slot: WorkerSlot) -> dict[str, str]:
    """What a worker's process gets on top of the inherited environment."""
    if slot.cuda_visible_devices is None:
        return {}
    return {"CUDA_VISIBLE_DEVICES": slot.cuda_visible_devices}


def visible_gpus(num_devices: int, cuda_visible_devices: str | None) -> list[str]:
    """The GPUs this process sees, as CUDA_VISIBLE_DEVICES entries (ids or UUIDs).

    num_devices: what CUDA counts (it already honours CUDA_VISIBLE_DEVICES, stopping at
    the first entry it cannot use); cuda_visible_devices: the variable as inherited."""
    if cuda_visible_devices is None:
        return [str(i) for i in range(num_devices)]
    entries = [e.strip() for e in cuda_visible_devices.split(",") if e.strip()]
    return entries[:num_devices]


def worker_gpus(num_workers: int, device: str, gpus: list[str] | None) -> list[str | None]:
    """Each worker's CUDA_VISIBLE_DEVICES (None: the CPU, or one named GPU as given).

    gpus: visible_gpus() on a CUDA device, None otherwise."""
    if num_workers < 1:
        raise UserError(f"--workers must be >= 1, got {num_workers}")
    if not device.startswith("cuda"):
        return [None] * num_workers
    gpus = gpus or []
    where = "no GPU is visible" if not gpus else f"{len(gpus)} GPU{'s' if len(gpus) > 1 else ''} visible"
    if device != "cuda":  # cuda:K names one GPU: one worker on it, as given
        if num_workers > 1:
            raise UserError(f"--device {device} names one GPU; --workers {num_workers} puts one worker "
                            f"on each GPU: use --device cuda")
        index = device.partition(":")[2]
        if not index.isdigit() or int(index) >= len(gpus):
            raise UserError(f"--device {device}: {where}")
        return [None]
    if num_workers > len(gpus):
        raise UserError(f"--workers {num_workers}: one worker per GPU, and {where}")
    return gpus[:num_workers]


def worker_slots(num_workers: int, port: int, metrics_port: int, gpus: list[str | None]) -> list[WorkerSlot]:
    """gpus: worker_gpus() (one entry per worker)."""
    for flag, first in (("--worker-port", port), ("--worker-metrics-port", metrics_port)):
        if first + num_workers - 1 > MAX_PORT:
            raise UserError(f"{flag} {first}: {num_workers} workers need ports up to {first + num_workers - 1}, "
                            f"past {MAX_PORT}")
    return [WorkerSlot("worker" if num_workers == 1 else f"worker-{i}", port + i, metrics_port + i, gpus[i])
            for i in range(num_workers)]


def check_ports_apart(ports: dict[str, int]) -> None:
    """ports: what each listens on ("--planner-port", "worker-1's gRPC port") -> port.
    Two services on one port is one error line naming both."""
    seen: dict[int, str] = {}  # port -> its first owner
    for owner, port in ports.items():
        if port in seen:
            raise UserError(f"{owner} {port} is also {seen[port]}: give each service its own port")
        seen[port] = owner
