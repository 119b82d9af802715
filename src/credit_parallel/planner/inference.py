"""Memory of a forecast step (inference) per rank, and the smallest layout that fits a GPU.

A forecast runs the model under ``torch.no_grad``: no gradients, no optimizer state, and only the
activations alive at once (a U-Net's skip connections while its decoder runs, the current
layer's input and output) instead of everything autograd saves.  :func:`inference_live_elements`
runs ONE forward on meta tensors (no memory, no arithmetic) and follows every tensor storage an
operation creates until its last tensor is gone, counting each at the busiest domain rank's share
(``cost._rank_share``: its rows, or its tile), and returns the peak.

:func:`forecast_bytes` adds the rest of a forecast rank: the parameters as the layout holds them
(the training layout's, FSDP2's all-gathered largest unit while in use), the model input and the
step's output (the rollout feeds one back as the next input), the halo-extended inputs of the
domain layers and the CPU convolution's column buffer (``MemoryEstimate`` parts).

:func:`smallest_fitting` is the arithmetic ``plan`` uses for "the smallest layout that fits":
the first candidate whose bytes are within the budget.
"""

from __future__ import annotations

import math
import weakref
from collections.abc import Callable, Iterable

import torch
from torch import nn
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten

from .cost import MemoryEstimate, _rank_share

__all__ = [
    "GPU_80GB_BYTES",
    "forecast_bytes",
    "format_layout_fits",
    "inference_live_elements",
    "layout_fits",
    "smallest_fitting",
]

# an "80 GB" GPU (H100 / A100 80GB): 80 x 10^9 bytes, less 2 GiB for the CUDA context, NCCL's
# buffers and the caching allocator's fragmentation (the plan's totals leave them out)
GPU_80GB_BYTES = 80 * 10**9 - 2 * 2**30


class _LiveStorages(TorchDispatchMode):
    """Counts the elements of the storages alive at once (each at ``share(shape)``), from the
    outputs of every operation run under it; a storage is freed when its last tensor is."""

    def __init__(self, share: Callable[[tuple], int]):
        super().__init__()
        self.share = share
        self.refs: dict[int, int] = {}  # storage key -> live tensors on it
        self.sizes: dict[int, int] = {}
        self.live = 0
        self.peak = 0

    def _release(self, key: int) -> None:
        self.refs[key] -= 1
        if self.refs[key] == 0:
            del self.refs[key]
            self.live -= self.sizes.pop(key)

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        for t in tree_flatten(out)[0]:
            if not isinstance(t, torch.Tensor):
                continue
            key = t.untyped_storage()._cdata
            if key not in self.refs:  # a new storage (a view adds a tensor to an old one)
                storage = t.untyped_storage().nbytes() // max(1, t.element_size())
                numel = max(1, math.prod(t.shape))
                # the storage's elements at this rank's share of a field of t's shape
                size = self.share(tuple(t.shape)) * storage // numel
                self.refs[key], self.sizes[key] = 0, size
                self.live += size
                self.peak = max(self.peak, self.live)
            self.refs[key] += 1
            weakref.finalize(t, self._release, key)
        return out


def inference_live_elements(
    model: nn.Module, input_shapes: Iterable, heights: set, n: int, q: int = 1
) -> int:
    """Peak elements of the activations alive at once during one forward of ``model`` (on the
    meta device) under ``torch.no_grad`` at batch 1, at the busiest of ``n`` latitude ranks (x
    ``q`` longitude ranks) rank's share; parameters and the inputs are not counted."""
    dtype = next((p.dtype for p in model.parameters()), torch.get_default_dtype())
    inputs = [torch.empty((1, *s), device="meta", dtype=dtype) for s in input_shapes]
    mode = _LiveStorages(lambda shape: _rank_share(math.prod(shape), shape, heights, n, q))
    with torch.no_grad(), mode:
        out = model(*inputs)
    del out
    return mode.peak


def forecast_bytes(memory: MemoryEstimate, live_elements: int, *, batch_size: int = 1) -> int:
    """Bytes of a forecast rank: parameters (the layout's share; FSDP2's largest unit gathered
    while in use), the activations alive at once (``live_elements`` at the activation element
    size, per batch entry), the input and the step's output (``memory.batch_bytes``: inputs and
    targets of the training step, the same fields), the halo-extended inputs and the
    convolution workspace."""
    return (
        memory.param_bytes
        + memory.fsdp_largest_unit_bytes
        + live_elements * memory.activation_dtype_bytes * batch_size
        + memory.batch_bytes
        + memory.exchange_bytes
        + memory.workspace_bytes
    )


def smallest_fitting(candidates: Iterable[tuple], budget: int):
    """The first ``(layout, bytes)`` of ``candidates`` (smallest first) with ``bytes <= budget``,
    or None when none fits."""
    for layout, nbytes in candidates:
        if nbytes <= budget:
            return layout, nbytes
    return None


def layout_fits(conf: dict, world_size: int, *, device: str = "cuda", budget: int = GPU_80GB_BYTES):
    """The smallest latitude domain (with the config's data mode and tensor degree, ``world_size``
    ranks) whose training step and whose forecast step fit ``budget`` bytes per rank on
    ``device``: ``{"training": (domain, bytes) | None, "forecast": ...}`` and every candidate's
    ``(domain, training bytes, forecast bytes)`` (``"candidates"``).  Candidates: the domain
    sizes dividing ``world_size / tensor``, smallest first, planned until both fit."""
    from ..layout.config import parse_parallelism_conf
    from .make import make_plan
    from .trace import build_meta_model, model_input_shapes

    block = parse_parallelism_conf(conf)
    tp = block["tensor"]
    model, _ = build_meta_model(conf)
    shapes = model_input_shapes(model)
    rows = []
    found: dict = {"training": None, "forecast": None}
    for d in (d for d in range(1, world_size // tp + 1) if (world_size // tp) % d == 0):
        if tp * d > world_size or world_size % (tp * d):
            continue
        plan = make_plan(conf, world_size, parallelism={**block, "domain": d}, device=device)
        if plan.violations:  # a domain size the model cannot take (rows per rank, windows)
            continue
        heights = {h for h, _ in plan.levels}
        live = inference_live_elements(model, shapes, heights, d)
        training = plan.memory.total_on(device)
        forecast = forecast_bytes(plan.memory, live, batch_size=plan.batch_size)
        rows.append((d, training, forecast))
        for key, nbytes in (("training", training), ("forecast", forecast)):
            if found[key] is None:
                found[key] = smallest_fitting([(d, nbytes)], budget)
        if all(found.values()):
            break
    return {**found, "candidates": rows, "budget": budget, "device": device}


def format_layout_fits(fits: dict, world_size: int) -> str:
    """The ``plan`` section of :func:`layout_fits`."""
    gib = 2**30
    budget = fits["budget"] / gib
    lines = [
        f"== Smallest layout that fits an 80 GB GPU ({budget:.1f} GiB per rank counted, "
        f"{fits['device']}, {world_size} ranks) =="
    ]
    for key, what in (("training", "training step"), ("forecast", "forecast step")):
        found = fits[key]
        lines.append(
            f"{what:14s} domain {found[0]} ({found[1] / gib:.1f} GiB per rank)"
            if found is not None
            else f"{what:14s} no domain size up to {world_size} fits"
        )
    lines.append("domain | training GiB/rank | forecast GiB/rank")
    for d, training, forecast in fits["candidates"]:
        lines.append(f"{d:6d} | {training / gib:17.2f} | {forecast / gib:17.2f}")
    lines.append(
        "(the config's data mode and tensor degree; the forecast counts parameters, the "
        "activations alive at once under no_grad (traced on meta), input, output, halos)"
    )
    return "\n".join(lines)
