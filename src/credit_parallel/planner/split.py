"""When a two-dimensional domain pays: the (P, Q) split of the domain ranks with the least
projected time per step (issue 26 item 5, ``plan --world-size N``).

Pure arithmetic on the planner's meta trace: for every split P x Q of the domain size D, the
tile plans of every layer call (``tiles.py``: halo bytes and messages per rank) and the
alpha-beta projection of one step (``projection.project_tiles``: the busiest tile's compute,
the row pass and the column pass of every exchange, the two all-to-alls and the 1-D exchange of
every call run on latitude strips, GroupNorm statistics over the P x Q group).
The compute of a layer call is a roofline on one device (:func:`trace_profile`: its
convolution FLOPs at ``flops_s``, or the bytes it reads and writes at ``hbm_bytes_s``,
whichever is slower); what only the split changes is the busiest tile's share of it.  The
gradient reductions are the same for every split of one D and are left out.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from torch import nn

from .projection import DEFAULT_CLUSTER, Cluster, ComputeProfile, project_tiles
from .tiles import tile_layer_plans, tile_messages

__all__ = [
    "SplitProjection",
    "domain_splits",
    "project_splits",
    "refusal_reason",
    "split_note",
    "trace_profile",
]

# H100 SXM5 (NVIDIA data sheet): 989 TFLOP/s dense bf16 at 40% sustained, 3.35 TB/s HBM3
ROOFLINE_FLOPS_S = 0.4 * 989e12
ROOFLINE_HBM_BYTES_S = 3.35e12
_CONVS = (nn.Conv1d, nn.Conv2d, nn.Conv3d)
_TRANSPOSED = (nn.ConvTranspose1d, nn.ConvTranspose2d, nn.ConvTranspose3d)


@dataclass(frozen=True)
class SplitProjection:
    """One split's projected step: ``shape`` (P, Q), seconds of the step and of its parts,
    the busiest rank's messages per step, and why it cannot run (``refused``, else None)."""

    shape: tuple[int, int]
    step_s: float = 0.0
    compute_s: float = 0.0
    halo_s: float = 0.0
    norm_s: float = 0.0
    halo_bytes: int = 0  # the busiest rank's, per step
    messages: int = 0  # the busiest rank's, per step
    refused: str | None = None


def domain_splits(size: int) -> list[tuple[int, int]]:
    """Every (P, Q) with P x Q = ``size``, latitude only first."""
    return [(size // q, q) for q in range(1, size + 1) if size % q == 0]


def _flops(module, in_shape, out_shape) -> int:
    """Forward + backward FLOPs of one convolution call at batch 1 (3 x the forward); 0 for
    other modules."""
    if isinstance(module, _CONVS):
        k = math.prod(module.kernel_size) * module.in_channels // module.groups
        return 3 * 2 * math.prod(out_shape) * k
    if isinstance(module, _TRANSPOSED):
        k = math.prod(module.kernel_size) * module.out_channels // module.groups
        return 3 * 2 * math.prod(in_shape) * k
    return 0


def trace_profile(
    trace,
    dtype_bytes: int,
    *,
    flops_s: float = ROOFLINE_FLOPS_S,
    hbm_bytes_s: float = ROOFLINE_HBM_BYTES_S,
) -> ComputeProfile:
    """A roofline :class:`~credit_parallel.planner.projection.ComputeProfile` of a meta trace
    (``trace.trace_model``): per domain-layer call (labelled as the plans label it) ``max(FLOPs
    / flops_s, 3 x (input + output) x dtype_bytes / hbm_bytes_s)``; the other leaf modules'
    outputs, read and written 3 times, as ``rest_s``."""
    layers, seen, paths = {}, {}, set()
    for path, module, _, in_shape, out_shape, _ in trace.calls:
        seen[path] = seen.get(path, 0) + 1
        paths.add(path)
        label = path if seen[path] == 1 else f"{path} (call {seen[path]})"
        moved = 3 * (math.prod(in_shape) + math.prod(out_shape)) * dtype_bytes
        layers[label] = max(_flops(module, in_shape, out_shape) / flops_s, moved / hbm_bytes_s)
    rest = sum(
        3 * 2 * math.prod(shape) * dtype_bytes / hbm_bytes_s
        for path, shape in trace.leaf_outputs
        if path not in paths
    )
    source = f"roofline {flops_s / 1e12:.0f} TFLOP/s, {hbm_bytes_s / 1e12:.2f} TB/s"
    return ComputeProfile(layers, rest, source)


def project_splits(
    trace,
    size: int,
    *,
    batch_size: int,
    dtype_bytes: int,
    double: bool = False,
    dp: int = 1,
    cluster: Cluster = DEFAULT_CLUSTER,
    profile: ComputeProfile | None = None,
    refused: str | None = None,
    exclude_refused_layers: bool = False,
) -> list[SplitProjection]:
    """The :class:`SplitProjection` of every split of ``size`` domain ranks (``refused``: why
    the model cannot run on tiles, which rules out every Q > 1).  ``exclude_refused_layers``:
    project the layers that cannot run on tiles as a perfect split of their compute with no
    communication, at every split (the tables that project a model's convolutions only)."""
    profile = profile if profile is not None else trace_profile(trace, dtype_bytes)
    out = []
    for shape in domain_splits(size):
        if shape[1] > 1 and refused:
            out.append(SplitProjection(shape, refused=refused))
            continue
        layers = tile_layer_plans(trace, shape, double)
        errors = [f"{lay.path}: {lay.error}" for lay in layers if lay.error]
        if errors and shape[1] > 1 and not exclude_refused_layers:
            out.append(SplitProjection(shape, refused=errors[0]))
            continue
        proj = project_tiles(
            layers, profile, shape=shape, dp=dp, cluster=cluster, batch_size=batch_size,
            dtype_bytes=dtype_bytes,
        )  # fmt: skip
        ranks = [divmod(r, shape[1]) for r in range(size)]
        sent = max(sum(lay.sent_elements(a, b) for lay in layers) for a, b in ranks)
        messages = max(tile_messages(layers, r) for r in range(size))
        out.append(
            SplitProjection(
                shape,
                proj.step_s,
                proj.compute_s,
                proj.halo_s,
                proj.norm_s,
                sent * batch_size * dtype_bytes,
                messages,
            )  # fmt: skip
        )
    return out


def refusal_reason(refusals) -> str | None:
    """Why a model cannot run on tiles, from ``(path, reason)`` refusals (None: it can)."""
    if not refusals:
        return None
    path, reason = refusals[0]
    more = f" and {len(refusals) - 1} more" if len(refusals) > 1 else ""
    return f"{path}{more} not exact on tiles: {reason[:100]}"


def split_note(splits: list[SplitProjection], configured: tuple[int, int]) -> str | None:
    """The plan's note naming the split with the least projected step, against the
    configured one; None when there is nothing to choose (one split)."""
    runnable = [s for s in splits if s.refused is None]
    if len(runnable) < 2:
        refused = [s for s in splits if s.refused]
        if not refused:
            return None
        return (
            f"lat x lon splits of the {configured[0] * configured[1]} domain "
            f"ranks: only latitude runs; {', '.join(f'{s.shape[0]}x{s.shape[1]}' for s in refused)} "
            f"not possible ({refused[0].refused})"
        )
    best = min(runnable, key=lambda s: (s.step_s, s.shape[1]))
    mine = next((s for s in splits if s.shape == tuple(configured)), None)

    def ms(s: SplitProjection) -> str:
        return (
            f"{s.step_s * 1e3:.3f} ms (compute {s.compute_s * 1e3:.3f}, halo "
            f"{s.halo_s * 1e3:.3f}, {s.messages} messages and "
            f"{s.halo_bytes / 2**20:.2f} MiB per step on the busiest rank)"
        )

    p, q = best.shape
    size = p * q
    text = f"split of the {size} domain ranks with the least projected step: lat x lon = {p} x {q}, {ms(best)}"
    if mine is not None and mine.shape != best.shape:
        if mine.refused:
            text += f"; the configured {mine.shape[0]} x {mine.shape[1]} cannot run on tiles"
        else:
            ratio = mine.step_s / best.step_s if best.step_s > 0 else float("inf")
            text += (
                f"; the configured {mine.shape[0]} x {mine.shape[1]}: {ms(mine)}, "
                f"{ratio:.2f}x the best"
            )
    elif mine is not None:
        text += " (the configured split)"
    others = ", ".join(
        f"{s.shape[0]}x{s.shape[1]} {s.step_s * 1e3:.3f} ms"
        for s in runnable
        if s is not best and s is not mine
    )
    refused = [s for s in splits if s.refused]
    if others:
        text += f"; others: {others}"
    if refused:
        text += (
            f"; {', '.join(f'{s.shape[0]}x{s.shape[1]}' for s in refused)} not possible "
            f"({refused[0].refused})"
        )
    return (
        text + " (alpha-beta projection, planner/split.py: NVLink 4 / NDR InfiniBand links, "
        "convolution roofline of an H100; the gradient reductions, equal for every split, "
        "left out)"
    )
