"""The cost model of a planned run: per-layer-call rows and halos, memory and collectives.

:class:`DomainLayerPlan` is one call of a domain layer as it will run, built by
:func:`layer_call_plan` from the layer's own geometry (``domain/geometry.py``: its form, output
height and input windows) and ``rows.plan_exchange``; :func:`predicted_halo_bytes` and
:func:`predicted_collectives` are public so the benchmarks can compare them with what a run
measures (``credit_parallel.domain.exchange.halo.record_exchange_stats``).  The memory helpers read
the tensor-parallel and FSDP2 declarations of a (meta) model.  Pure: no processes.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

from torch import nn

from ..domain.attention.cost import form_cost
from ..domain.geometry import FILL, domain_form_of, domain_kind_of, input_windows_of
from ..domain.rows import plan_exchange, shard_range, shard_sizes
from ..layout.config import DataMode
from ..parallel.fsdp import FSDP2_MIN_UNIT_PARAMS, fsdp2_units
from ..parallel.tensor_parallel import (
    COLUMN,
    _check_layer,
    _resolve,
    collect_tensor_parallel_targets,
)

__all__ = [
    "DEFAULT_BUCKET_CAP_MB",
    "DomainLayerPlan",
    "MemoryEstimate",
    "PLAN_DEVICES",
    "activation_parts",
    "conv_workspace_bytes",
    "fsdp_units",
    "layer_call_plan",
    "local_numel",
    "predicted_collectives",
    "predicted_halo_bytes",
    "tp_split_dims",
]

SHARD_DIM = -2  # latitude, as convert_to_domain_parallel shards it by default
_MIB = 2**20
DDP_FIRST_BUCKET_BYTES = 1 * _MIB  # torch's DDP: a small first bucket, then bucket_cap_mb
DEFAULT_BUCKET_CAP_MB = 25.0  # DDP's default and credit_parallel.collectives' default


@dataclass(frozen=True)
class DomainLayerPlan:
    """One call of a module that ``convert_to_domain_parallel`` replaces, as the layer will run.

    ``out_rows[r]``: output rows domain rank r owns (balanced layout of ``out_height``).
    ``halo_before[r]`` / ``halo_after[r]``: distinct rows rank r receives from other ranks that
    sit before / after its own rows (north / south; rows of a rank with no own row in the window
    count by global index).  ``rows_received[r]`` / ``rows_sent[r]``: rows rank r receives /
    sends in the forward exchange (``RankExchangePlan.rows_received`` / ``.rows_sent``; the
    backward moves the same rows the other way).  ``row_elements``: elements of one input row at
    batch 1 (channels x every other non-sharded dim).  ``peers[r]``: domain ranks rank r receives
    from.  ``error``: why the layer cannot run at this layout (None when it can).
    """

    path: str
    kind: str
    in_height: int
    out_height: int
    out_rows: tuple[int, ...]
    halo_before: tuple[int, ...]
    halo_after: tuple[int, ...]
    rows_received: tuple[int, ...]
    rows_sent: tuple[int, ...]
    row_elements: int
    peers: tuple[tuple[int, ...], ...] = ()
    error: str | None = None
    form: str = ""  # the layer's domain_form (domain/geometry.py FORMS)
    # attention and gathered modules (``domain.attention.form_cost``), at batch 1: extra bytes
    # sent over all ranks per forward (the backward sends as much again) and the module input
    # the busiest rank holds while it runs; 0 for layers that do not report them
    communication_bytes: int = 0
    activation_bytes: int = 0
    # a GroupNorm whose statistics travel with the next conv's halo exchange
    # (``domain/layers/norm_halo.py``): no statistics collective of its own
    stats_with_exchange: bool = False
    # the rows go back to their owners after the module by the same plan inverted (row-group
    # attention, ``returns_rows``): twice the bytes and the calls of the windows' exchange
    returns: bool = False
    # the layer's input needs a gradient; False for a model input (a training step's batch):
    # autograd then skips the exchange's backward, and no gradient rows go back
    input_grad: bool = True

    @property
    def exchanges(self) -> bool:
        """Whether any rank sends or receives rows in this layer."""
        return any(self.rows_received) or any(self.rows_sent)

    def rank_calls(self, domain_rank: int) -> int:
        """Batched P2P calls of one direction ``domain_rank`` makes in this layer (0 or 1; 0 or
        2 for a layer whose rows go back, ``returns``)."""
        return int(self.rank_exchanges(domain_rank)) * (2 if self.returns else 1)

    def rank_step_calls(self, domain_rank: int) -> int:
        """Batched P2P calls ``domain_rank`` makes in this layer in one step, forward and
        backward: the backward of the input's exchange is left out where the input needs no
        gradient (``input_grad``); a ``returns`` layer's return still has one."""
        calls = self.rank_calls(domain_rank)
        skipped = 0 if self.input_grad else int(self.rank_exchanges(domain_rank))
        return 2 * calls - skipped

    def rank_exchanges(self, domain_rank: int) -> bool:
        """Whether ``domain_rank`` takes part in a P2P call (it skips it with nothing to move)."""
        if not self.rows_received:
            return False
        return bool(self.rows_received[domain_rank] or self.rows_sent[domain_rank])


@dataclass(frozen=True)
class MemoryEstimate:
    """Bytes per rank (the largest rank where ranks differ) at the peak of a training step, by
    part; an estimate, see ``format_plan``.  Not counted: the framework's own per-process memory
    (CPU: torch's kernels and caches, tens of MiB; GPU: the CUDA context) and the data loader's
    prefetched batches."""

    param_bytes: int
    grad_bytes: int
    optimizer_bytes: int
    activation_bytes: int  # what autograd saves for backward (traced on meta)
    param_bytes_unsharded: int  # the whole model, fp32, on one rank
    fsdp_largest_unit_bytes: int  # unsharded (all-gathered) size of the largest FSDP2 unit
    activation_dtype_bytes: int
    # activation gradients alive at once in backward: the largest layer's output and input grads
    backward_transient_bytes: int = 0
    # the convolution workspace counted for ``workspace_device`` (conv_workspace_bytes): the
    # largest convolution's im2col columns on the CPU, 0 on CUDA (cuDNN's bounded workspace)
    workspace_bytes: int = 0
    batch_bytes: int = 0  # this rank's inputs and targets
    input_bytes: int = 0  # the inputs' part of batch_bytes (autograd saves them too)
    exchange_bytes: int = 0  # halo-extended inputs saved by domain layers, gathered globes
    workspace_device: str = "cpu"  # the device type workspace_bytes is counted for
    im2col_bytes: int = 0  # the largest convolution's im2col columns (what the CPU allocates)

    def total_on(self, device: str) -> int:
        """:attr:`total_bytes` with the convolution workspace counted for ``device``."""
        return (
            self.total_bytes
            - self.workspace_bytes
            + conv_workspace_bytes(self.im2col_bytes, device)
        )

    @property
    def state_bytes(self) -> int:
        """Parameters, gradients and optimizer state."""
        return self.param_bytes + self.grad_bytes + self.optimizer_bytes

    @property
    def total_bytes(self) -> int:
        return (
            self.state_bytes
            + self.activation_bytes
            + self.exchange_bytes
            + self.backward_transient_bytes
            + self.workspace_bytes
            + self.batch_bytes
        )


# --------------------------------------------------------------------------- conv workspace
PLAN_DEVICES = ("cpu", "cuda")


# What a convolution allocates besides its input, output and weights, by device type.
#
# CPU: PyTorch's slow_conv2d (float64 always; float32 where oneDNN does not take the call)
# materialises the im2col columns of the WHOLE batch, (batch, C_in/groups x kh x kw,
# out_h x out_w), in forward and again for the weight gradient
# (aten/src/ATen/native/ConvolutionMM2d.cpp, compute_columns2d); a 1x1 stride-1 unpadded kernel
# uses a view.  oneDNN's float32 kernels need at most that.  Counted: the largest call's columns.
#
# CUDA: cuDNN takes a workspace the size its chosen engine asks for, but PyTorch bounds it by the
# memory that is free at the call: with cudnn.benchmark it only considers engines whose
# workspace fits the caching allocator's largest free block and halves the allocation on OOM
# (aten/src/ATen/native/cudnn/Conv_v8.cpp, get_available_workspace / generate_and_filter_plans;
# Conv_v7.cpp getMaxWorkspaceSize likewise), and without benchmark it tries the heuristic's
# engines in order, moving to the next one when the workspace allocation runs out of memory
# (Conv_v8.cpp try_configs, Conv_v7.cpp), down to implicit-GEMM engines that need no workspace
# ("expresses the convolution as a matrix product without forming the matrix that holds the
# input", cuDNN's CUDNN_CONVOLUTION_FWD_ALGO_IMPLICIT_GEMM).  torch.backends.cudnn.benchmark_limit
# (default 10) bounds how many engines the v8 benchmark times, not their memory.  The workspace
# therefore only uses memory left free and never decides whether a step fits: counted 0.
# (Deterministic dilated convolutions, as verify runs them, skip cuDNN for PyTorch's CUDA
# slow_conv_dilated2d, whose columns are one sample's: not modelled.)
def conv_workspace_bytes(im2col_bytes: int, device: str) -> int:
    """Bytes of convolution workspace a step needs on ``device`` ("cpu" or "cuda") given the
    largest convolution's im2col columns (see the comment above for the sources)."""
    if device not in PLAN_DEVICES:
        raise ValueError(f"device must be one of {PLAN_DEVICES}, got {device!r}")
    return im2col_bytes if device == "cpu" else 0


# --------------------------------------------------------------------------- cost functions
def predicted_halo_bytes(
    layers: Sequence[DomainLayerPlan],
    *,
    batch_size: int,
    dtype_bytes: int,
    domain_rank: int | None = None,
) -> int:
    """Halo bytes of one training step (forward + backward) of one domain group.

    Inputs: ``layers`` from :func:`make_plan` (``plan.layers``), the per-rank ``batch_size``
    (``trainer.batch_size``) and the activation element size (4 for fp32, 2 for bf16 under amp).

    With ``domain_rank`` r: the bytes rank r SENDS — its halo rows to peers in forward plus the
    gradients of the rows it received in backward, ``(rows_sent + rows_received) x row size`` —
    which is what ``exchange_stats.bytes_sent`` counts on that rank.  A layer whose input needs
    no gradient (``input_grad``: the model's input) returns none.  With ``domain_rank=None``:
    the total over the group, ``2 x rows exchanged x other dims x dtype bytes``.
    """
    total = 0
    for layer in layers:
        if not layer.rows_received:
            continue
        unit = layer.row_elements * batch_size * dtype_bytes
        row_bytes = unit * (2 if layer.returns else 1)
        if domain_rank is None:
            received = sum(layer.rows_received)
            total += 2 * received * row_bytes
        else:
            received = layer.rows_received[domain_rank]
            total += (layer.rows_sent[domain_rank] + received) * row_bytes
        if not layer.input_grad:  # no gradient of the received rows goes back
            total -= received * unit
    return total


def _greedy_buckets(sizes: Sequence[int], cap: int, first_cap: int | None = None) -> int:
    """Number of buckets when ``sizes`` (bytes) are packed in order, a new bucket when the next
    tensor would overflow the cap (a larger tensor travels alone), as ``collectives._buckets``."""
    count, current, limit = 0, 0, first_cap if first_cap is not None else cap
    open_bucket = False
    for nbytes in sizes:
        if open_bucket and current + nbytes > limit:
            count += 1
            current, open_bucket, limit = 0, False, cap
        current += nbytes
        open_bucket = True
    return count + (1 if open_bucket else 0)


def predicted_collectives(
    layers: Sequence[DomainLayerPlan],
    *,
    data: str,
    dp: int,
    tp: int,
    domain: int,
    tp_row_layers: int = 0,
    tp_col_layers: int = 0,
    tp_fused_layers: int = 0,
    fsdp_units: int = 0,
    grad_sizes_bytes: Sequence[int] = (),
    bucket_cap_mb: float = DEFAULT_BUCKET_CAP_MB,
    domain_rank: int | None = None,
) -> dict[str, int]:
    """Collective calls ONE rank issues per training step (forward, backward, gradient sync), by kind.

    Inputs: ``layers`` (``plan.layers``); the degrees ``data``/``dp``/``tp``/``domain``; the
    number of row- and column-parallel tensor-parallel layers (``tp_fused_layers``: column layers
    with ``_tp_fused`` parts > 1, counted in ``tp_col_layers`` too); ``fsdp_units``: FSDP2 units
    that own parameters (opted-in blocks plus the root); ``grad_sizes_bytes``: this rank's local
    gradient sizes in parameter order (after TP/FSDP sharding) for the bucketed reductions.
    ``domain_rank``: count for that domain rank; None = the busiest rank.

    Keys (all present, 0 when not applicable):

    * ``domain_p2p``: ``batch_isend_irecv`` calls, 2 per domain layer this rank exchanges in
      (forward rows + backward gradients; 1 where the layer's input needs no gradient,
      ``DomainLayerPlan.input_grad``); on lat x lon tiles (``tiles.TileLayerPlan``) 2 per
      pass (rows, columns) it takes part in;
    * ``domain_all_gather`` / ``domain_all_reduce_norm``: per GroupNorm call one all-gather of the
      statistics in forward and its adjoint all-reduce in backward (none for a norm whose
      statistics travel with the next conv's exchange, ``stats_with_exchange``); per gathered module
      (``nonlocal_policy="gather"``) one all-gather of its input rows;
    * ``domain_all_reduce_bottleneck``: per ``SpectralGNNBottleneck`` call one all-reduce of its
      (B, C, K) spectral sums in forward and one of their gradient in backward;
    * ``domain_grad_all_reduce``: buckets of ``sync_domain_gradients`` (domain > 1);
    * ``tp_all_reduce``: one per row-parallel layer (forward) plus one per column layer (backward);
    * ``tp_weight_regroup``: fused column layers regroup their weight (forward and backward);
    * ``fsdp_all_gather``: one per unit in forward plus one per non-root unit in backward (the
      root is not resharded after forward); ``fsdp_reduce_scatter``: one per unit;
    * ``ddp_all_reduce``: DDP buckets (1 MiB first bucket, then ``bucket_cap_mb``; approximate).

    Steady state: the global heights are cached per input shape, so the one all-gather of local
    heights per domain layer of the first step is not counted.
    """
    counts = dict.fromkeys(
        (
            "domain_p2p",
            "domain_all_gather",
            "domain_all_reduce_norm",
            "domain_all_reduce_bottleneck",
            "domain_grad_all_reduce",
            "tp_all_reduce",
            "tp_weight_regroup",
            "fsdp_all_gather",
            "fsdp_reduce_scatter",
            "ddp_all_reduce",
        ),
        0,
    )
    cap = max(1, int(bucket_cap_mb * _MIB))
    if domain > 1:
        ranks = range(domain) if domain_rank is None else (domain_rank,)
        counts["domain_p2p"] = max(sum(lay.rank_step_calls(r) for lay in layers) for r in ranks)
        norms = sum(
            1 for layer in layers if layer.kind == "group_norm" and not layer.stats_with_exchange
        )
        gathers = sum(1 for layer in layers if layer.form == "gather")
        counts["domain_all_gather"] = norms + gathers
        counts["domain_all_reduce_norm"] = norms
        # CREDIT's SpectralGNNBottleneck (domain/adapters/nextgen.py): forward and backward
        bottlenecks = sum(1 for layer in layers if layer.kind == "spectral_bottleneck")
        counts["domain_all_reduce_bottleneck"] = 2 * bottlenecks
        counts["domain_grad_all_reduce"] = _greedy_buckets(grad_sizes_bytes, cap)
    if tp > 1:
        counts["tp_all_reduce"] = tp_row_layers + tp_col_layers
        counts["tp_weight_regroup"] = 2 * tp_fused_layers
    if data == DataMode.FSDP2:
        counts["fsdp_all_gather"] = fsdp_units + max(0, fsdp_units - 1)
        counts["fsdp_reduce_scatter"] = fsdp_units
    elif data == DataMode.DDP and dp > 1:
        counts["ddp_all_reduce"] = _greedy_buckets(
            list(reversed(grad_sizes_bytes)), cap, DDP_FIRST_BUCKET_BYTES
        )
    return counts


# --------------------------------------------------------------------------- memory
def tp_split_dims(model: nn.Module, tp: int, violations: list[str]):
    """``{parameter name: dim split over tp}`` from the ``_tp_col``/``_tp_row`` declarations,
    checking every target (all problems collected into ``violations``)."""
    try:
        targets = collect_tensor_parallel_targets(model)
    except (ValueError, TypeError) as err:
        violations.append(f"tensor parallelism declarations: {err}")
        return {}, []
    split, listed = {}, []
    for target in targets:
        try:
            layer = _resolve(model, target)
        except ValueError as err:
            if tp > 1:
                violations.append(f"trainer.parallelism.tensor={tp}: {err}")
            continue
        listed.append(target)
        if tp > 1:
            try:
                _check_layer(layer, target, tp)
            except (ValueError, TypeError) as err:
                violations.append(f"trainer.parallelism.tensor={tp}: {err}")
        for pname, _ in layer.named_parameters(recurse=False):
            full = f"{target.path}.{pname}"
            if target.role == COLUMN:
                split[full] = 0  # weight and bias: output features/channels
            elif pname == "weight":
                split[full] = 1  # input features/channels; the row bias stays replicated
    return split, listed


def fsdp_units(
    model: nn.Module, min_params: int = FSDP2_MIN_UNIT_PARAMS
) -> list[tuple[str, set[str]]]:
    """FSDP2 units in ``apply_fsdp2`` order and the parameter names each one manages: the
    opted-in blocks with at least ``min_params`` parameters of their own
    (:func:`credit_parallel.parallel.fsdp.fsdp2_units`), then the root with the rest."""
    blocks = [name for name, _ in fsdp2_units(model, min_params)]
    owned: dict[str, set[str]] = {name: set() for name in [*blocks, ""]}
    for pname, _ in model.named_parameters():
        owner = ""
        for block in blocks:  # the deepest opted-in block containing the parameter
            if pname.startswith(block + ".") and len(block) > len(owner):
                owner = block
        owned[owner].add(pname)
    return [(name, names) for name, names in owned.items() if names]


def _rank_share(numel: int, shape, heights, n: int, q: int = 1) -> int:
    """Elements the busiest domain rank holds of a tensor of ``shape``: its rows of a latitude
    field (a 4-D/5-D tensor whose dim -2 is one of the model's heights; on a lat x lon domain,
    ``q`` > 1, its tile: its columns of the last dim too, padded widths included), else a
    1/(n q) share (the attention layouts spread reshaped tensors over the ranks)."""
    if n * q <= 1:
        return numel
    if len(shape) in (4, 5) and shape[SHARD_DIM] in heights:
        h = shape[SHARD_DIM]
        share = numel // max(h, 1) * max(1, -(-h // n))
        w = shape[-1]
        if q > 1:
            share = share // max(w, 1) * max(1, -(-w // q))
        return share
    return -(-numel // (n * q))


def activation_parts(
    trace,
    layers,
    input_shapes,
    heights,
    n: int,
    *,
    batch_size: int,
    act_bytes: int,
    data_bytes: int,
    device: str = "cpu",
    q: int = 1,
    tile_layers=None,
) -> dict:
    """Per-rank activation memory at the peak of a step, by part (``MemoryEstimate`` fields).

    ``trace``: the meta trace (``trace.saved``: what autograd saves, ``leaf_outputs``,
    ``conv_columns``, ``model_outputs``) at batch 1 in the model's dtype; ``heights``: the
    model's global heights (the levels); ``act_bytes``: activation element bytes (2 under amp);
    ``data_bytes``: element bytes of inputs and targets; ``device``: the device type the
    convolution workspace is counted for (:func:`conv_workspace_bytes`).  On a lat x lon
    domain: ``q`` longitude ranks and ``tile_layers``
    (``tiles.TileLayerPlan``: the halo-extended window of the busiest tile); every 4-D/5-D field
    scales with the tile."""

    def share(numel, shape):
        return _rank_share(numel, shape, heights, n, q)

    saved = 0
    for shape, nbytes in trace.saved:
        itemsize = max(1, nbytes // max(1, math.prod(shape)))
        numel = nbytes // itemsize
        saved += share(numel, shape) * act_bytes
    largest = max((share(math.prod(s), s) for _, s in trace.leaf_outputs), default=0)
    columns = max((-(-c // (n * q)) for c in trace.conv_columns), default=0)
    inputs = sum(share(math.prod((1, *s)), (1, *s)) for s in input_shapes)
    batch = inputs + sum(share(math.prod(s), s) for s in trace.model_outputs if len(s) >= 3)
    exchange = 0
    for layer in tile_layers or ():
        p = layer.shape[0]
        received = max(layer.received_elements(a, b) for a in range(p) for b in range(q))
        exchange += received * act_bytes
    for layer in layers if tile_layers is None else ():
        if layer.form == "gather":
            exchange += layer.activation_bytes  # the whole globe's input on every rank
        elif layer.rows_received:
            exchange += max(layer.rows_received) * layer.row_elements * act_bytes
    return {
        "activation_bytes": saved * batch_size,
        "backward_transient_bytes": 2 * largest * act_bytes * batch_size,
        "workspace_bytes": conv_workspace_bytes(columns * act_bytes * batch_size, device),
        "workspace_device": device,
        "im2col_bytes": columns * act_bytes * batch_size,
        "batch_bytes": batch * data_bytes * batch_size,
        "input_bytes": inputs * data_bytes * batch_size,
        "exchange_bytes": exchange * batch_size,
    }


def local_numel(shape, split_dim, tp: int, fsdp_dp: int) -> int:
    shape = list(shape)
    if split_dim is not None and tp > 1 and len(shape) > split_dim:
        shape[split_dim] = -(-shape[split_dim] // tp)
    if fsdp_dp > 1 and shape:
        shape[0] = -(-shape[0] // fsdp_dp)  # FSDP2 shards dim 0, padded to a multiple of dp
    return math.prod(shape)


# --------------------------------------------------------------------------- one layer call
def _halo_sides(windows, in_h: int, n: int) -> tuple[tuple[int, ...], tuple[int, ...]]:
    """Distinct rows each rank receives that sit before / after its own rows in its window
    (rows of a rank with no own row in the window count by global index)."""
    before, after = [], []
    for r, window in enumerate(windows):
        start, stop = shard_range(in_h, n, r)
        own_positions = [p for p, g in enumerate(window) if start <= g < stop]
        first_own = own_positions[0] if own_positions else None
        rows_before, rows_after = set(), set()
        for p, g in enumerate(window):
            if g == FILL or start <= g < stop:
                continue
            north = p < first_own if first_own is not None else g < start
            (rows_before if north else rows_after).add(g)
        before.append(len(rows_before))
        after.append(len(rows_after))
    return tuple(before), tuple(after)


def layer_call_plan(
    path: str, layer, in_shape, out_shape, n: int, double: bool, exchange=None, itemsize: int = 4
):
    """The :class:`DomainLayerPlan` of one call of the domain layer ``layer`` (the converter's
    replacement) on an input of ``in_shape`` giving ``out_shape`` (batch 1), over ``n`` ranks,
    from the layer's own geometry.  ``double``: float64 activations (interpolation indices).
    ``exchange``: None (the layer's own windows), False (another layer exchanges for it: a
    fused pad), or ``(windows, exchanged_shape)`` when it exchanges another tensor (a conv
    fused with its pad, a shared sibling exchange).  ``itemsize``: activation element bytes,
    for the communication and memory that attention and gathered modules report."""
    # a layer that shards another dim says so (Swin blocks on (B, H, W, C): dim -3)
    dim = getattr(layer, "shard_dim", SHARD_DIM)
    in_h = in_shape[dim % len(in_shape)]
    out_h = out_shape[dim % len(out_shape)]
    row_elements = math.prod(in_shape) // max(in_h, 1)
    kind = domain_kind_of(layer)
    zeros = (0,) * n
    form = domain_form_of(layer) or ""
    cost = form_cost(layer, tuple(in_shape), n, itemsize) if n > 1 else None
    extra = (cost["communication_bytes"], cost["activation_bytes"]) if cost else (0, 0)

    def without_exchange(error: str | None = None) -> DomainLayerPlan:
        peers = ((),) * n if error is None else ()
        return DomainLayerPlan(
            path, kind, in_h, out_h, shard_sizes(out_h, n), zeros, zeros, zeros, zeros,
            row_elements, peers, error, form, *extra,
        )  # fmt: skip

    # a gathered module all-gathers (a collective, counted in its communication_bytes), it
    # does not exchange halo rows point to point
    if not form or exchange is False or form == "gather":
        return without_exchange()  # not a layer this planner can ask, or fused: no halo
    try:
        ex_h = in_h
        if exchange is not None:
            windows, ex_shape = exchange
            ex_h = ex_shape[dim % len(ex_shape)]
            row_elements = math.prod(ex_shape) // max(ex_h, 1)
        else:
            windows = input_windows_of(layer, in_h, n, double=double)
        if windows is None:
            return without_exchange()
        plans = plan_exchange(ex_h, n, tuple(windows))
    except ValueError as err:
        return without_exchange(str(err))
    before, after = _halo_sides(windows, ex_h, n)
    return DomainLayerPlan(
        path,
        kind,
        in_h,
        out_h,
        shard_sizes(out_h, n),
        before,
        after,
        tuple(p.rows_received for p in plans),
        tuple(p.rows_sent for p in plans),
        row_elements,
        tuple(tuple(q for q, _ in p.recvs) for p in plans),
        None,
        form,
        *extra,
        returns=bool(getattr(layer, "returns_rows", False)),
    )
