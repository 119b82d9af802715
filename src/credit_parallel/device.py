"""Where a process keeps its tensors: one decision for the trainer, verify and the benchmark.

An NCCL process group communicates CUDA tensors, so its ranks compute on ``cuda:LOCAL_RANK``;
gloo (and a run without a process group) computes on the CPU.  Every other place follows the
device this module decides, or the device of the tensor it was given, never a literal.
"""

from __future__ import annotations

import contextlib
import os

import torch
import torch.distributed as dist

__all__ = ["autocast_for", "batch_to_device", "device_for_process_group", "synchronize"]


def device_for_process_group(group=None) -> torch.device:
    """``cuda:LOCAL_RANK`` when ``group`` (default: the world) uses NCCL, else the CPU."""
    if dist.is_available() and dist.is_initialized():
        backend = str(dist.get_backend(group)).lower()
        if "nccl" in backend:
            return torch.device("cuda", int(os.environ.get("LOCAL_RANK", "0")))
    return torch.device("cpu")


def batch_to_device(batch: dict, device: torch.device, dtype: torch.dtype | None = None) -> dict:
    """A new dict with every tensor of ``batch`` on ``device`` (floating ones cast to ``dtype``).

    Host tensors bound for a CUDA device are pinned first and copied without blocking, so the
    copy overlaps with whatever the stream still runs; the same stream then orders the copy
    before the first kernel that reads it.
    """
    device = torch.device(device)
    out = {}
    for key, value in batch.items():
        if not isinstance(value, torch.Tensor):
            out[key] = value
            continue
        if device.type == "cuda" and value.device.type == "cpu":
            # pin_memory returns a tensor the DataLoader pinned already as it is
            value = value.pin_memory().to(device, non_blocking=True)
        else:
            value = value.to(device)
        if dtype is not None and value.is_floating_point():
            value = value.to(dtype)  # after the copy: the smaller dtype crosses the bus
        out[key] = value
    return out


def autocast_for(device: torch.device, enabled: bool, dtype: torch.dtype = torch.bfloat16):
    """``torch.autocast`` for ``device``'s type; a no-op context when not ``enabled``."""
    device = torch.device(device)
    if not enabled or device.type not in ("cpu", "cuda"):
        return contextlib.nullcontext()
    return torch.autocast(device.type, dtype=dtype, enabled=True)


def synchronize(device: torch.device) -> None:
    """Wait for the work queued on ``device`` (CUDA kernels run asynchronously; the CPU does not)."""
    device = torch.device(device)
    if device.type == "cuda":
        torch.cuda.synchronize(device)
