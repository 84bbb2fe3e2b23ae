"""One host-to-device copy for a step's index tensors, with no host synchronisation.

`torch.tensor(list, device="cuda")` and `cpu_tensor.to("cuda")` copy from pageable memory,
which blocks the host until the GPU has finished everything queued before it: a decode step
that builds six index tensors that way waits on the GPU six times before it can queue its
first kernel. Here every int64 tensor of the step goes into one pinned host buffer and
crosses in one non-blocking copy; the device-side views come back in the same order. The
pinned buffer's caching allocator keeps it alive until the copy has run. On the CPU the
tensors are returned as they are.
"""

from __future__ import annotations

from typing import Sequence

import torch


def upload_int64(parts: Sequence[torch.Tensor | list[int]], device: torch.device) -> list[torch.Tensor]:
    """Host int64 tensors (or lists of ints), any shapes -> the same on `device`."""
    host = [p if isinstance(p, torch.Tensor) else torch.tensor(p, dtype=torch.int64) for p in parts]
    if device.type != "cuda":
        return [t.to(device) for t in host]
    sizes = [t.numel() for t in host]
    staging = torch.empty(sum(sizes), dtype=torch.int64, pin_memory=True)
    if staging.numel():
        torch.cat([t.reshape(-1).to(torch.int64) for t in host], out=staging)
    flat = staging.to(device, non_blocking=True)
    return [view.view(t.shape) for view, t in zip(torch.split(flat, sizes), host)]
