"""Where the time of a training step goes, per layer kind (``credit-parallel bench --profile``).

:func:`profile_step` runs a step function under ``torch.profiler`` and splits its time by layer
kind (conv, transposed conv, group norm, interpolation, padding, pixel shuffle, attention, other)
and, within a kind, into

* **compute** — the top-level aten operators the layers run (convolutions, norms, ...);
* **window** — copy-like operators (cat, pad, copy, fill, ...) inside a domain-parallel layer:
  the cost of assembling halo windows and splitting their gradients;
* **comm** — time blocked in ``torch.distributed`` (halo exchanges, statistics collectives,
  gradient reductions): every collective and every ``Work.wait`` runs inside a marked range while
  profiling, so a rank waiting for a slower neighbour shows up here;
* **overhead** — the rest of the layer's wall time: Python, hooks, autograd bookkeeping.

Forward time is attributed through a range per leaf module (a domain-parallel wrapper counts as
a leaf); backward time through the autograd nodes, linked to the module that created them by the
profiler's sequence numbers.  Whatever no layer claims (the loss, gradient accumulation and
synchronisation, code between layers) is "other".  Times are per step, on this rank, with the
profiler's own small per-operator cost included.
"""

from __future__ import annotations

import contextlib
import time
from dataclasses import dataclass, field

import torch.distributed as dist
from torch import nn
from torch.profiler import ProfilerActivity, profile, record_function

__all__ = [
    "LAYER_KINDS",
    "KindTimes",
    "StepProfile",
    "format_profile",
    "layer_kind",
    "mean_profile",
    "profile_step",
]

LAYER_KINDS = (
    "conv",
    "transposed conv",
    "group norm",
    "interpolation",
    "padding",
    "pixel shuffle",
    "attention",
    "other",
)
_PARTS = ("compute", "window", "comm", "overhead")
_MODULE_RANGE = "cp.module|"
_COMM_RANGE = "cp.comm"
_BACKWARD_PREFIX = "autograd::engine::evaluate_function: "
# operators that move rows rather than compute on them: window assembly in a domain layer
_COPY_OPS = frozenset(
    f"aten::{name}"
    for name in (
        "cat",
        "stack",
        "copy_",
        "clone",
        "contiguous",
        "constant_pad_nd",
        "pad",
        "reflection_pad2d",
        "replication_pad2d",
        "zeros",
        "zeros_like",
        "new_zeros",
        "zero_",
        "fill_",
        "narrow_copy",
        "slice_scatter",
        "index_add_",
        "index_select",
        "flip",
        "roll",
        "split_with_sizes_copy",
    )
)
_COLLECTIVES = (
    "all_reduce",
    "all_gather",
    "all_gather_single",
    "all_gather_into_tensor",
    "reduce_scatter_tensor",
    "broadcast",
    "all_to_all_single",
    "batch_isend_irecv",
    "barrier",
)


def layer_kind(module: nn.Module) -> str:
    """The kind a module's time is filed under (a domain wrapper by the module it wraps)."""
    name = type(getattr(module, "wrapped", module)).__name__
    for marker, kind in (
        ("ConvTranspose", "transposed conv"),
        ("Conv", "conv"),
        ("GroupNorm", "group norm"),
        ("Upsample", "interpolation"),
        ("Interpolate", "interpolation"),
        ("PixelShuffle", "pixel shuffle"),
        ("PixelUnshuffle", "pixel shuffle"),
        ("Pad", "padding"),
        ("Attention", "attention"),
    ):
        if marker in name:
            return kind
    return "other"


@dataclass
class KindTimes:
    """Seconds per step of one layer kind, by part; ``calls``: module calls per step."""

    calls: float = 0.0
    compute: float = 0.0
    window: float = 0.0
    comm: float = 0.0
    overhead: float = 0.0

    @property
    def total(self) -> float:
        return self.compute + self.window + self.comm + self.overhead


@dataclass
class StepProfile:
    """Per-kind times of one rank (per step) and the step's own wall time."""

    step_s: float
    kinds: dict = field(default_factory=lambda: {k: KindTimes() for k in LAYER_KINDS})


def _timed(fn):
    def call(*args, **kwargs):
        with record_function(_COMM_RANGE):
            return fn(*args, **kwargs)

    return call


@contextlib.contextmanager
def _marked_communication():
    """Run every ``torch.distributed`` collective (looked up through the module, as the library
    and FSDP do) and every ``Work.wait`` inside the communication range.  The works themselves
    are not wrapped: FSDP2 tells async works apart by their type."""
    originals = {n: getattr(dist, n) for n in _COLLECTIVES if hasattr(dist, n)}
    work_type = dist.distributed_c10d.Work
    original_wait = work_type.wait
    try:
        for name, fn in originals.items():
            setattr(dist, name, _timed(fn))
        work_type.wait = _timed(original_wait)
        yield
    finally:
        work_type.wait = original_wait
        for name, fn in originals.items():
            setattr(dist, name, fn)


def _profiled_leaves(model: nn.Module):
    """(path, module) of the modules timed as one unit: domain wrappers and childless modules."""
    skip = set()
    for path, module in model.named_modules():
        if any(path.startswith(p + ".") for p in skip):
            continue
        if getattr(module, "_domain_parallel", False):
            skip.add(path)
            yield path, module
        elif not any(True for _ in module.children()):
            yield path, module


@contextlib.contextmanager
def _module_ranges(model: nn.Module):
    """A profiler range around each leaf module's forward, named by kind and domain-ness."""
    handles, open_ranges = [], {}

    def pre(module, args):
        tag = "1" if getattr(module, "_domain_parallel", False) else "0"
        rf = record_function(f"{_MODULE_RANGE}{layer_kind(module)}|{tag}")
        rf.__enter__()
        open_ranges.setdefault(id(module), []).append(rf)

    def post(module, args, output):
        open_ranges[id(module)].pop().__exit__(None, None, None)

    for _, module in _profiled_leaves(model):
        handles.append(module.register_forward_pre_hook(pre))
        handles.append(module.register_forward_hook(post))
    try:
        yield
    finally:
        for h in handles:
            h.remove()


def _duration(event) -> float:
    return (event.time_range.end - event.time_range.start) * 1e-6


def _split(event, domain: bool, parts: dict) -> None:
    """Add the compute/window/comm seconds under ``event`` (not counting nested ops twice)."""
    for child in event.cpu_children:
        if child.name == _COMM_RANGE:
            parts["comm"] += _duration(child)
        elif child.name.startswith("aten::"):
            part = "window" if domain and child.name in _COPY_OPS else "compute"
            parts[part] += _duration(child)
        else:
            _split(child, domain, parts)


def _sequence_numbers(event, out: set) -> None:
    for child in event.cpu_children:
        if child.sequence_nr >= 0:
            out.add(child.sequence_nr)
        _sequence_numbers(child, out)


def _module_tag(event):
    """(kind, is domain layer) of a module range, else None."""
    if not event.name.startswith(_MODULE_RANGE):
        return None
    kind, tag = event.name[len(_MODULE_RANGE) :].split("|")
    return kind, tag == "1"


def _map_sequence_numbers(event, seq_kind: dict) -> None:
    """Sequence number of every autograd node created inside a module range -> its kind."""
    tag = _module_tag(event)
    if tag is not None:
        numbers: set = set()
        _sequence_numbers(event, numbers)
        seq_kind.update(dict.fromkeys(numbers, tag))
        return
    for child in event.cpu_children:
        _map_sequence_numbers(child, seq_kind)


def _claim(event, seq_kind: dict, result: StepProfile, unclaimed: dict) -> float:
    """Attribute ``event`` (a module range, a backward node of a module, or something that may
    contain them); returns the seconds claimed by layers."""
    tag = _module_tag(event)
    if tag is None and event.name.startswith(_BACKWARD_PREFIX):
        tag = seq_kind.get(event.sequence_nr)
    if tag is not None:
        kind, domain = tag
        if event.name.startswith(_MODULE_RANGE):
            result.kinds[kind].calls += 1
        parts = dict.fromkeys(_PARTS, 0.0)
        _split(event, domain, parts)
        busy = parts["compute"] + parts["window"] + parts["comm"]
        parts["overhead"] = max(_duration(event) - busy, 0.0)
        times = result.kinds[kind]
        for part, value in parts.items():
            setattr(times, part, getattr(times, part) + value)
        return _duration(event)
    if event.name == _COMM_RANGE:
        unclaimed["comm"] += _duration(event)
        return 0.0
    if event.name.startswith("aten::"):
        unclaimed["compute"] += _duration(event)
        return 0.0
    return sum(_claim(child, seq_kind, result, unclaimed) for child in event.cpu_children)


def _attribute(events, steps: int, step_s: float) -> StepProfile:
    result = StepProfile(step_s=step_s)
    roots = [e for e in events if e.cpu_parent is None]
    seq_kind: dict = {}
    for event in roots:
        _map_sequence_numbers(event, seq_kind)
    unclaimed = dict.fromkeys(_PARTS, 0.0)
    claimed = sum(_claim(event, seq_kind, result, unclaimed) for event in roots)
    # the rest of the step (loss, gradient sync, code between layers) is "other"
    busy = unclaimed["compute"] + unclaimed["comm"]
    unclaimed["overhead"] = max(step_s * steps - claimed - busy, 0.0)
    other = result.kinds["other"]
    for part, value in unclaimed.items():
        setattr(other, part, getattr(other, part) + value)
    for times in result.kinds.values():
        for part in ("calls", *_PARTS):
            setattr(times, part, getattr(times, part) / steps)
    return result


def profile_step(step_fn, model: nn.Module, *, steps: int = 3, warmup: int = 1) -> StepProfile:
    """Profile ``steps`` calls of ``step_fn()`` (after ``warmup`` unprofiled ones) on this rank
    and return the per-kind times per step.  ``model``: the module whose leaves are timed (the
    domain-converted model; DDP/FSDP wrappers are fine, their children are walked)."""
    for _ in range(warmup):
        step_fn()
    with _marked_communication(), _module_ranges(model):
        with profile(activities=[ProfilerActivity.CPU]) as prof:
            t0 = time.perf_counter()
            for _ in range(steps):
                step_fn()
            wall = time.perf_counter() - t0
    return _attribute(prof.events(), steps, wall / steps)


def mean_profile(profiles: list) -> StepProfile:
    """The mean over ranks of several :class:`StepProfile` (step time included)."""
    result = StepProfile(step_s=sum(p.step_s for p in profiles) / len(profiles))
    for kind in LAYER_KINDS:
        for part in ("calls", *_PARTS):
            value = sum(getattr(p.kinds[kind], part) for p in profiles) / len(profiles)
            setattr(result.kinds[kind], part, value)
    return result


def format_profile(profile_result: StepProfile, title: str = "") -> str:
    """A table in milliseconds per step: one row per layer kind that ran, and the total."""
    head = f"{'layer kind':<16}| {'calls':>5} | " + " | ".join(f"{p + ' ms':>11}" for p in _PARTS)
    head += f" | {'total ms':>9} | {'share':>5}"
    lines = ([title] if title else []) + [head, "-" * len(head)]
    step = profile_result.step_s
    sums = dict.fromkeys(_PARTS, 0.0)
    for kind in LAYER_KINDS:
        t = profile_result.kinds[kind]
        if t.total == 0 and t.calls == 0:
            continue
        cells = " | ".join(f"{getattr(t, p) * 1e3:11.2f}" for p in _PARTS)
        share = t.total / step if step else 0.0
        lines.append(f"{kind:<16}| {t.calls:5.0f} | {cells} | {t.total * 1e3:9.2f} | {share:5.2f}")
        for p in _PARTS:
            sums[p] += getattr(t, p)
    cells = " | ".join(f"{sums[p] * 1e3:11.2f}" for p in _PARTS)
    total = sum(sums.values())
    lines.append(f"{'all':<16}| {'':>5} | {cells} | {total * 1e3:9.2f} | {total / step:5.2f}")
    lines.append(f"step wall time {step * 1e3:.2f} ms (under the profiler)")
    return "\n".join(lines)
