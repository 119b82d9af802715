"""Projected step time and efficiency of a domain x dp layout on a cluster (alpha-beta model).

Pure arithmetic, no processes and no torch: the inputs are the planner's per-layer-call plans
(:class:`~credit_parallel.planner.cost.DomainLayerPlan`: rows each rank owns, halo rows sent and
received, row size, form, the bytes attention / gathered modules move), a measured single-device
compute profile (:class:`ComputeProfile`: seconds of forward + backward per layer path for ONE
sample on the WHOLE grid) and the links of the cluster (:class:`Link`: a message of ``n`` bytes
costs ``alpha + n * beta``; :class:`Cluster`: one link inside a node, one across nodes).

The model of one training step on one rank (domain ranks innermost, so a domain group stays in
one node while ``domain <= gpus_per_node``; the dp group crosses nodes once ``domain x dp`` does):

* compute: each profiled layer call costs its whole-grid time x (the busiest rank's output rows
  / the output height); the rest of the step (activations, additions, the loss: row-local) costs
  ``rest_s / domain`` (or the busiest rank's share of ``rest_rows``), as do profiled paths that
  no planned layer call names;
* halo exchange: per exchanging layer call, 2 messages (forward rows, backward gradients) of the
  busiest rank's ``max(rows sent, rows received) x row bytes``, neighbours served concurrently;
* GroupNorm statistics: one small all-gather (forward) and one small all-reduce (backward) per
  norm call, each ``ceil(log2 d)`` (all-gather) / ``2 ceil(log2 d)`` (all-reduce) latencies;
* attention / gathered modules: ``communication_bytes`` per forward over the group (the same
  again in backward), each rank moving its ``1/d`` share, ``ceil(log2 d)`` latencies each way;
* gradient all-reduces (domain group: the parameters FSDP does not reduce; dp group: DDP):
  ring all-reduce, ``2 (g-1)/g x bytes x beta + 2 ceil(log2 g) x alpha`` per bucket; a fraction
  ``overlap`` of them hides behind the backward compute (``backward_fraction`` of the compute).

Efficiency ``E = T(1 device, 1 sample) / (domain x T(step))``: every GPU of a dp replica does
``1/domain`` of a sample, so dp adds no work and E compares the step with a perfect split of the
sample over the domain group.  Not modelled: kernel-launch overheads, boundary rows some layers
recompute, contention of several ranks on one NIC, stragglers.  See docs/performance.md
("Projection to GPU clusters") for the assumed alpha/beta and their sources.
"""

from __future__ import annotations

import math
from collections import Counter
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field

from .cost import DomainLayerPlan

__all__ = [
    "DEFAULT_CLUSTER",
    "Cluster",
    "ComputeProfile",
    "Link",
    "Projection",
    "allreduce_time",
    "gather_time",
    "project_step",
    "project_tiles",
]


@dataclass(frozen=True)
class Link:
    """A link of the alpha-beta model: one message of ``n`` bytes costs ``alpha_s + n * beta_s``.

    ``beta_s`` is seconds per byte in ONE direction (1 / unidirectional bandwidth)."""

    name: str
    alpha_s: float
    beta_s: float

    def __post_init__(self) -> None:
        if not (self.alpha_s >= 0 and self.beta_s >= 0):
            raise ValueError(
                f"Link {self.name!r}: alpha_s and beta_s must be >= 0, got "
                f"alpha_s={self.alpha_s!r}, beta_s={self.beta_s!r}"
            )

    def message(self, nbytes: float) -> float:
        """Seconds of one message of ``nbytes`` (0 bytes: no message, 0 s)."""
        return 0.0 if nbytes <= 0 else self.alpha_s + nbytes * self.beta_s


@dataclass(frozen=True)
class Cluster:
    """Nodes of ``gpus_per_node`` devices: ``intra`` links inside a node, ``inter`` across."""

    gpus_per_node: int
    intra: Link
    inter: Link

    def __post_init__(self) -> None:
        if self.gpus_per_node < 1:
            raise ValueError(f"Cluster: gpus_per_node must be >= 1, got {self.gpus_per_node!r}")

    def link(self, span: int) -> Link:
        """The slowest link a group of ``span`` consecutive ranks uses."""
        return self.intra if span <= self.gpus_per_node else self.inter


@dataclass(frozen=True)
class ComputeProfile:
    """Seconds of forward + backward of ONE sample on the WHOLE grid on one device.

    ``layers``: per layer path (summed over the path's calls: a module called twice counts
    both calls; :func:`project_step` splits it evenly over the calls); ``rest_s``: everything
    else in the step (element-wise layers, additions, the loss); ``source``: where the figures
    come from (shown in the table)."""

    layers: Mapping[str, float]
    rest_s: float = 0.0
    source: str = ""

    @property
    def total_s(self) -> float:
        return float(sum(self.layers.values())) + self.rest_s


@dataclass(frozen=True)
class Projection:
    """One layout's projected step on the busiest rank; times in seconds."""

    domain: int
    dp: int
    compute_s: float
    halo_s: float
    norm_s: float
    attention_s: float
    domain_grad_s: float
    dp_grad_s: float
    exposed_grad_s: float
    single_device_s: float
    sync_points: int
    parts: dict = field(default_factory=dict)

    @property
    def world(self) -> int:
        return self.domain * self.dp

    @property
    def step_s(self) -> float:
        return self.compute_s + self.halo_s + self.norm_s + self.attention_s + self.exposed_grad_s

    @property
    def efficiency(self) -> float:
        """``T(1 device) / (domain x T(step))``; dp replicas add samples, not shares."""
        return self.single_device_s / (self.domain * self.step_s) if self.step_s > 0 else 0.0


# the links benchmarks/projection.py assumes by default (docs/performance.md gives the sources):
# NVLink 4 inside a node of 8 GPUs, NDR InfiniBand across
DEFAULT_CLUSTER = Cluster(
    8, Link("NVLink 4", 3e-6, 1 / 360e9), Link("NDR InfiniBand", 10e-6, 1 / 45e9)
)


def _log_steps(group: int) -> int:
    return math.ceil(math.log2(group)) if group > 1 else 0


def allreduce_time(nbytes: float, group: int, link: Link, buckets: int = 1) -> float:
    """Ring all-reduce of ``nbytes`` over ``group`` ranks in ``buckets`` calls: bandwidth term
    ``2 (g-1)/g x bytes x beta``, latency ``2 ceil(log2 g) x alpha`` per call (NCCL's tree /
    ring choice for small messages); 0 for a group of 1 or no bytes."""
    if group <= 1 or nbytes <= 0:
        return 0.0
    return (
        2 * (group - 1) / group * nbytes * link.beta_s
        + max(1, buckets) * 2 * _log_steps(group) * link.alpha_s
    )


def gather_time(total_bytes: float, group: int, link: Link) -> float:
    """All-gather whose result holds ``total_bytes``: each rank receives ``(g-1)/g`` of it,
    ``ceil(log2 g)`` latencies; 0 for a group of 1."""
    if group <= 1:
        return 0.0
    return (group - 1) / group * max(total_bytes, 0) * link.beta_s + _log_steps(
        group
    ) * link.alpha_s


def _share(rows: Sequence[int], height: int) -> float:
    """The busiest rank's fraction of a level of ``height`` rows."""
    return max(rows) / height if rows and height > 0 else 1.0


def project_step(
    layers: Sequence[DomainLayerPlan],
    profile: ComputeProfile,
    *,
    domain: int,
    dp: int,
    cluster: Cluster,
    batch_size: int = 1,
    dtype_bytes: int = 4,
    domain_grad_bytes: int = 0,
    dp_grad_bytes: int = 0,
    domain_grad_buckets: int = 1,
    dp_grad_buckets: int = 1,
    norm_stat_bytes: int = 64,
    overlap: float = 0.0,
    domain_overlap: float | None = None,
    backward_fraction: float = 2 / 3,
    rest_rows: Sequence[int] = (),
    rest_height: int = 0,
    sync_points: int = 0,
) -> Projection:
    """The projected step of one rank of a ``domain`` x ``dp`` layout (see the module docstring).

    ``layers``: ``plan.layers`` of the plan at this domain size; ``profile``: single-device
    compute at batch 1 (scaled here by ``batch_size``); ``dtype_bytes``: activation element size
    (2 under bf16 amp); ``*_grad_bytes``: gradient bytes each rank all-reduces over the domain /
    dp group per step, in ``*_grad_buckets`` calls; ``norm_stat_bytes``: one GroupNorm statistics
    message; ``overlap`` in [0, 1]: fraction of the dp gradient all-reduce (DDP) hidden behind
    the backward, ``domain_overlap`` the same for the domain group's (None: ``overlap``); ``rest_rows`` / ``rest_height``: the rows per rank of the level the rest of the
    step runs on (default: a ``1/domain`` share); ``sync_points``: reported as given (the
    planner's collective count).
    """
    if domain < 1 or dp < 1:
        raise ValueError(f"project_step: domain and dp must be >= 1, got {domain=}, {dp=}")
    domain_overlap = overlap if domain_overlap is None else domain_overlap
    for name, value in (("overlap", overlap), ("domain_overlap", domain_overlap)):
        if not 0.0 <= value <= 1.0:
            raise ValueError(f"project_step: {name} must be in [0, 1], got {value!r}")
    if not 0.0 <= backward_fraction <= 1.0:
        raise ValueError(
            f"project_step: backward_fraction must be in [0, 1], got {backward_fraction!r}"
        )
    calls = Counter(layer.path for layer in layers)
    link = cluster.link(domain)
    compute = halo = norm = attention = 0.0
    parts: dict[str, float] = {}
    for layer in layers:
        seconds = profile.layers.get(layer.path, 0.0) / calls[layer.path] * batch_size
        share = 1.0 if domain == 1 else _share(layer.out_rows, layer.out_height)
        compute += seconds * share
        parts[layer.kind] = parts.get(layer.kind, 0.0) + seconds * share
        if domain == 1:
            continue
        if layer.rows_received:
            rows = max(max(s, r) for s, r in zip(layer.rows_sent, layer.rows_received))
            halo += 2 * link.message(rows * layer.row_elements * batch_size * dtype_bytes)
        if layer.kind == "group_norm" and not layer.stats_with_exchange:
            norm += gather_time(norm_stat_bytes * domain, domain, link)
            norm += allreduce_time(norm_stat_bytes, domain, link)
        if layer.communication_bytes:
            per_rank = layer.communication_bytes * batch_size / domain
            attention += 2 * (per_rank * link.beta_s + _log_steps(domain) * link.alpha_s)
    rest_share = _share(rest_rows, rest_height) if rest_rows and domain > 1 else 1 / domain
    # profiled paths no layer call names (layers the converter leaves alone) are row-local
    unplanned = sum(t for path, t in profile.layers.items() if path not in calls)
    rest = (profile.rest_s + unplanned) * batch_size * rest_share
    compute += rest
    parts["rest"] = rest
    grads = dict(
        domain_grad_bytes=domain_grad_bytes, dp_grad_bytes=dp_grad_bytes,
        domain_grad_buckets=domain_grad_buckets, dp_grad_buckets=dp_grad_buckets,
        overlap=overlap, domain_overlap=domain_overlap, backward_fraction=backward_fraction,
    )  # fmt: skip
    times = dict(compute_s=compute, halo_s=halo, norm_s=norm, attention_s=attention)
    return _with_gradients(
        domain, dp, cluster, times, grads, profile.total_s * batch_size, sync_points, parts
    )


def _with_gradients(domain, dp, cluster, times, grads, single_s, sync_points, parts):
    """The :class:`Projection` of ``times`` plus the gradient all-reduces of ``grads`` (the
    domain group's and the dp group's; the overlapped parts share the backward compute, the
    rest waits after it)."""
    domain_grad = allreduce_time(
        grads["domain_grad_bytes"], domain, cluster.link(domain), grads["domain_grad_buckets"]
    )
    dp_grad = allreduce_time(
        grads["dp_grad_bytes"], dp, cluster.link(domain * dp), grads["dp_grad_buckets"]
    )
    overlap, domain_overlap = grads["overlap"], grads["domain_overlap"]
    overlapped = domain_grad * domain_overlap + dp_grad * overlap
    blocking = domain_grad * (1 - domain_overlap) + dp_grad * (1 - overlap)
    backward = grads["backward_fraction"] * times["compute_s"]
    exposed = max(0.0, overlapped - backward) + blocking
    return Projection(
        domain=domain, dp=dp, **times, domain_grad_s=domain_grad, dp_grad_s=dp_grad,
        exposed_grad_s=exposed, single_device_s=single_s, sync_points=sync_points, parts=parts,
    )  # fmt: skip


def _tile_halo_time(layer, link: Link, batch_size: int, dtype_bytes: int) -> float:
    """Seconds of one tile layer's exchanges (forward + backward) on its busiest rank: per
    pass (rows, then columns of the row-extended tile: sequential), one message time of the
    larger of what the rank sends and receives, its peers served concurrently.  A call run on
    latitude strips: its two all-to-alls (each one message time of the larger of what the rank
    sends and receives, in forward and again in backward) and its 1-D exchange on the strips
    (forward and backward; twice when the rows go back, ``strip_returns``)."""
    p, q = layer.shape
    item = batch_size * dtype_bytes
    worst = 0.0
    for a in range(p):
        for b in range(q):
            (rows_f, cols_f), (rows_b, cols_b) = layer.pass_elements(a, b)
            seconds = 2 * (
                link.message(max(rows_f, rows_b) * item) + link.message(max(cols_f, cols_b) * item)
            )
            worst = max(worst, seconds + _strips_time(layer, a * q + b, link, item))
    return worst


def _strips_time(layer, rank: int, link: Link, item: int) -> float:
    """Seconds (forward + backward) of what ``rank`` moves for a call run on strips."""
    seconds = 0.0
    if getattr(layer, "strips_moves", ()):
        in_s, in_r, out_s, out_r = layer.strips_moves[rank]
        seconds += 2 * (
            link.message(max(in_s, in_r) * item) + link.message(max(out_s, out_r) * item)
        )
    if getattr(layer, "strip_rows_sent", ()):
        rows = max(layer.strip_rows_sent[rank], layer.strip_rows_received[rank])
        ways = 2 if layer.strip_returns else 1
        seconds += 2 * ways * link.message(rows * layer.strip_row_elements * item)
    return seconds


def project_tiles(
    layers,
    profile: ComputeProfile,
    *,
    shape: tuple[int, int],
    dp: int,
    cluster: Cluster,
    batch_size: int = 1,
    dtype_bytes: int = 4,
    norm_stat_bytes: int = 64,
    **grads,
) -> Projection:
    """:func:`project_step` of a ``shape`` = (P, Q) lat x lon domain from its tile plans
    (``tiles.TileLayerPlan``; Q = 1 is the latitude split without exchange fusion): each
    layer call's compute x the busiest tile's share (rows x columns) of its output, the rest
    x the busiest tile's share of the first layer's input; halo: per exchanging call, the row
    pass and the column pass of the busiest rank (:func:`_tile_halo_time`); GroupNorm
    statistics over the P x Q group; layers with an ``error`` (not exact on tiles) add no
    communication.  ``grads``: the gradient keywords of :func:`project_step`."""
    p, q = shape
    domain = p * q
    if domain < 1 or dp < 1:
        raise ValueError(f"project_tiles: shape and dp must be >= 1, got {shape=}, {dp=}")
    link = cluster.link(domain)
    compute = halo = norm = 0.0
    parts: dict[str, float] = {}
    for layer in layers:
        (h, w), rows, cols = layer.out_hw, layer.out_rows, layer.out_cols
        share = 1.0 if domain == 1 else max(rows) / max(h, 1) * max(cols) / max(w, 1)
        if domain > 1 and getattr(layer, "strip_compute_rows", 0):  # run on strips
            share = layer.strip_compute_rows / max(h, 1)
        seconds = profile.layers.get(layer.path, 0.0) * batch_size * share
        compute += seconds
        parts[layer.kind] = parts.get(layer.kind, 0.0) + seconds
        if domain == 1 or layer.error:
            continue
        if layer.exchanges:
            halo += _tile_halo_time(layer, link, batch_size, dtype_bytes)
        if layer.kind == "group_norm":
            norm += gather_time(norm_stat_bytes * domain, domain, link)
            norm += allreduce_time(norm_stat_bytes, domain, link)
    named = {layer.path for layer in layers}
    unplanned = sum(t for path, t in profile.layers.items() if path not in named)
    first = layers[0] if layers else None
    rest_share = 1 / domain
    if first is not None and domain > 1:
        (h, w) = first.in_hw
        rest_share = max(first.in_rows) / max(h, 1) * max(first.in_cols) / max(w, 1)
    rest = (profile.rest_s + unplanned) * batch_size * rest_share
    compute += rest
    parts["rest"] = rest
    grads = {
        "domain_grad_bytes": 0, "dp_grad_bytes": 0, "domain_grad_buckets": 1,
        "dp_grad_buckets": 1, "overlap": 0.0, "domain_overlap": None,
        "backward_fraction": 2 / 3, **grads,
    }  # fmt: skip
    if grads["domain_overlap"] is None:
        grads["domain_overlap"] = grads["overlap"]
    times = dict(compute_s=compute, halo_s=halo, norm_s=norm, attention_s=0.0)
    return _with_gradients(
        domain, dp, cluster, times, grads, profile.total_s * batch_size, 0, parts
    )
