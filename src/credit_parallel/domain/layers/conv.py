"""Domain-parallel convolutions and transposed convolutions (any kernel, stride, padding,
dilation, groups, output_padding, padding_mode), and the periodic (lat-reflect / lon-circular)
convolution of the reference models.

Each rank computes exactly the output rows the balanced layout assigns to it from the input rows
those outputs read (own rows, rows of other ranks, and rows beyond the poles mapped by the
layer's padding rule), fetched with one exchange.  Non-transposed convolutions convolve straight
from the shard and only the boundary rows from small halo strips (``split_conv.SplitConv``, no copy
of the shard); transposed, fused-pad and shared-input convolutions, shards too thin for an
interior row and the option ``split_halo=False`` assemble the window and run the plain op with
no padding along the sharded dim.  Nothing is padded inside the globe and nothing is trimmed
approximately.  The pure geometry lives in ``conv_geometry.py``, the split conv and halo
overlap in ``layers/split_conv.py`` and the exchange shared by sibling convolutions in
``exchange/shared_input.py``.

A layer's options (``options.py``: overlap, split halo, side stream, fused pad, shared input,
fused norm, module path) are given at construction (``options=``; ``overlap=`` alone as a keyword) and
changed only through ``configure(...)``; ``_path`` picks the forward's path from them.
"""

from __future__ import annotations

from dataclasses import dataclass, replace

import torch
import torch.nn.functional as F
from torch import nn

from ..exchange.halo import exchange_planned
from ..exchange.shared_input import SharedInputExchange
from ..exchange.windows import assemble_window, reads_only_fill
from ..manager import resolve_manager
from ..options import LayerOptions, check_overlap
from ..rows import FILL, RankExchangePlan, compose_windows, plan_exchange, shard_range
from ..wrap import DomainWrapper, run_forward_pre_hooks
from .conv_geometry import (
    ConvGeometry,
    ConvOp,
    OverlapSplit,
    conv_needs_domain_wrapper,
    conv_transpose_windows,
    conv_windows,
    overlap_split,
)
from .conv_tiles import tile_conv_forward, tile_conv_windows
from .padding import DomainParallelPad
from .split_conv import SplitConv, overlap_enabled

__all__ = [
    "ConvGeometry",
    "DomainParallelConv2d",
    "DomainParallelConv3d",
    "DomainParallelConvTranspose2d",
    "DomainParallelConvTranspose3d",
    "DomainParallelPeriodicConv2d",
    "conv_needs_domain_wrapper",
]

_CONVT = {1: F.conv_transpose1d, 2: F.conv_transpose2d, 3: F.conv_transpose3d}


@dataclass(frozen=True)
class _ConvCall:
    """This rank's part of one conv call: its exchange plan, its overlap split (None: no
    interior output row) and whether it owns no output row."""

    plan: RankExchangePlan
    split: OverlapSplit | None
    owns_no_output: bool
    out_rows: tuple[int, int]  # [o0, o1) of the output rows this rank owns
    first_input_row: int | None  # the first global row of its window (None: an empty window)
    # (op, window positions of the shard) when one zero-padded call covers every owned row
    full: tuple | None = None


def _without_fill_strips(split: OverlapSplit, plan, skip: tuple) -> OverlapSplit:
    """``split`` without the boundary strips that read, outside the shard's positions
    ``skip``, only fill rows beyond the globe (zeros): with the full call (the conv with its own
    zero padding over the shard) those output rows are already what the strip would give.
    Traceable (a new ``OverlapSplit`` built field by field; ``reads_only_fill`` runs for real
    under Dynamo), so that a compiled layer takes the eager layer's path."""
    top, bottom = split.top_rows, split.bottom_rows
    if top and reads_only_fill(plan, 0, split.top_stop, skip):
        top = 0
    if bottom and reads_only_fill(plan, split.bottom_start, plan.window_rows, skip):
        bottom = 0
    return OverlapSplit(
        top,
        split.top_stop,
        split.interior_rows,
        split.interior_start,
        split.interior_stop,
        bottom,
        split.bottom_start,
    )


def fused_pad_windows(pad, conv, length: int, n: int) -> tuple:
    """Windows, over the pad's input of ``length`` rows, of the padding layer ``pad`` followed by
    the (non-transposed) domain conv ``conv``: the two row maps composed into one."""
    padded = pad.output_height(length)
    return compose_windows(pad.input_windows(length, n), padded, conv.input_windows(padded, n))


class _DomainParallelConvNd(DomainWrapper):
    """Shared implementation; ``shard_dim`` is the tensor dim holding latitude."""

    domain_form = "halo"
    domain_kind = "conv"
    tile_exact = True  # exact on lat x lon tiles too (conv_tiles.py)
    _expected: tuple = ()

    def __init__(
        self,
        conv: nn.Module,
        shard_dim: int,
        *,
        manager=None,
        geometry: ConvGeometry | None = None,
        overlap: bool | None = None,
        options: LayerOptions | None = None,
    ):
        if self._expected and not isinstance(conv, self._expected):
            raise TypeError(
                f"{type(self).__name__} wraps {self._expected[0].__name__}, got {type(conv).__name__}"
            )
        super().__init__(conv)
        self.nd = len(conv.kernel_size)
        rank = self.nd + 2
        if not -rank <= shard_dim < rank or shard_dim % rank < 2:
            raise ValueError(f"shard_dim {shard_dim} is not a spatial dim of a {rank}-D input")
        self.shard_dim = shard_dim
        self.spatial_index = shard_dim % rank - 2
        self.geometry = geometry if geometry is not None else ConvGeometry.of(conv)
        self.manager = manager
        # overlap, split_halo, side_stream, fused_pad, shared_input, module_path (options.py);
        # ``overlap=`` is the seed's keyword for the one option most callers set
        options = options if options is not None else LayerOptions()
        if overlap is not None:
            options = replace(options, overlap=check_overlap(overlap))
        self._options = options
        # the local op along the other dims, fixed by the geometry
        self.op = ConvOp.of(self.geometry, self.spatial_index)
        # per (global input height, domain size, rank, fused): this rank's geometry of one call
        self._calls: dict[tuple[int, int, int, bool], _ConvCall] = {}
        if self.geometry.transposed and self.geometry.edge_mode != "zeros":
            raise ValueError(f"{type(conv).__name__} only supports padding_mode='zeros'")

    # ---- options (read-only views of ``self.options``; change them with ``configure``)
    @property
    def overlap(self) -> bool | None:
        """Wait for the halo rows after the shard's own computation (None: the default rule)."""
        return self._options.overlap

    @property
    def split_halo(self) -> bool | None:
        """Convolve around the halo (``split_conv.SplitConv``); False: assemble the window."""
        return self._options.split_halo

    @property
    def side_stream(self) -> bool:
        """Pack and post the exchange on the device's exchange stream (``exchange/streams.py``)."""
        return self._options.side_stream

    @property
    def fused_pad(self) -> DomainParallelPad | None:
        """The padding layer whose exchange this conv does (``fusion.py``), or None."""
        return self._options.fused_pad

    @property
    def shared_input(self) -> SharedInputExchange | None:
        """The exchange this conv shares with its siblings (``exchange/shared_input.py``), or None."""
        return self._options.shared_input

    @property
    def conv(self):
        return self.wrapped

    @property
    def _splits(self) -> bool:
        """Whether this call takes the split conv: ``split_halo`` True / False, or None (the
        default): yes unless the other dims are padded explicitly (periodic / reflect: the
        split backward pads the whole shard again, one shard-sized buffer more at the peak than
        the window path, measured on the bundled U-Net) and ``overlap`` is left at None (an
        explicit overlap choice is a choice of the split form, whose wait it places).  Never
        with the side stream."""
        options = self._options
        if options.side_stream:
            return False
        if options.split_halo is not None:
            return options.split_halo
        return self.op.pad_flat is None or options.overlap is not None

    # ---- geometry (domain/geometry.py)
    def output_height(self, input_height: int) -> int:
        return self.geometry.output_length(input_height, self.spatial_index)

    def input_windows(self, input_height: int, n: int) -> tuple:
        windows_of = conv_transpose_windows if self.geometry.transposed else conv_windows
        return windows_of(self.geometry, self.spatial_index, input_height, n)[0]

    def tile_windows(self, height: int, width: int, shape, *, double: bool = False) -> tuple:
        """(row windows over the P latitude ranks, column windows over the Q longitude ranks)
        of a ``height`` x ``width`` input on a ``shape`` = (P, Q) domain (``conv_tiles.py``)."""
        return tile_conv_windows(self, height, width, shape)

    def _weight_and_bias(self, x):
        conv = self.wrapped_weights(x)
        return conv.weight, conv.bias

    def _path(self, call: _ConvCall) -> str:
        """The one place this conv's forward path is picked, from its options and this call's
        geometry: "transposed", "fused_pad" (exchange the pad's input once for both), "shared"
        (take the rows from the siblings' shared exchange), "split" (``split_conv.SplitConv``: no
        window assembled) or "window" (assemble the window, run the plain op)."""
        options = self._options
        if self.geometry.transposed:
            return "transposed"
        if options.fused_pad is not None:
            return "fused_pad"
        # compiled: each conv exchanges alone and assembles its window (the shared window's
        # bookkeeping and SplitConv's own backward are not traceable)
        compiling = torch.compiler.is_compiling()
        if options.shared_input is not None and options.shared_input.active and not compiling:
            return "shared"
        plan = call.plan
        if call.split is not None and self._splits and (plan.sends or plan.recvs) and not compiling:
            return "split"
        # every rank takes part in the exchange, also one that owns no output row
        return "window"

    # ---- the seed's read-only views (credit.domain_parallel: layer.halo_width / halo_exchange)
    @property
    def halo_width(self):
        """Rows of OTHER ranks' shards this rank reads above and below its own shard: an int
        when the two are equal, else ``(before, after)``.

        Exact per rank (uneven shards and poles included) for the last global input height the
        layer ran on: rows beyond the globe are padding, not halo, so the first rank reads
        nothing above unless ``padding_mode="circular"`` wraps it to the far edge.  Before any
        forward: the value ``credit.domain_parallel`` assigns the layer (:func:`seed_halo_width`:
        ``(kernel - 1) // 2`` at stride 1, ``(kernel - stride) // 2`` when strided, a transposed
        conv's padding when kernel > stride, else 0), from the kernel and stride alone."""
        before, after = _halo_of(self)
        return before if before == after else (before, after)

    @property
    def halo_exchange(self):
        """A :class:`HaloExchange` with this layer's :attr:`halo_width`, dim, boundary mode and
        manager.  The layer itself exchanges exactly the rows of its per-rank window (one
        planned exchange, ``exchange.exchange_planned``); this object is that exchange's
        fixed-width equivalent, for inspection and for code written against the seed."""
        from ..exchange.halo import HaloExchange

        before, after = _halo_of(self)
        mode = self.geometry.edge_mode
        mode = mode if mode in ("zeros", "reflect", "replicate", "circular") else "zeros"
        return HaloExchange((before, after), dim=self.shard_dim, manager=self.manager, mode=mode)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if x.dim() != self.nd + 2:
            raise ValueError(
                f"{type(self).__name__} expects a {self.nd + 2}-D input, got shape {tuple(x.shape)}"
            )
        mgr = resolve_manager(self.manager, type(self).__name__)
        weight, bias = self._weight_and_bias(x)
        if getattr(mgr, "is_tiled", False):  # a lat x lon tile (SPEC §3b)
            return tile_conv_forward(self, x, weight, bias, mgr)
        dim = self.spatial_index + 2
        n = mgr.domain_world_size
        length = mgr.global_length(self, x.shape[dim])
        fused = self._options.fused_pad is not None
        call = self._call_geometry(length, n, mgr.domain_rank, fused=fused)
        link = self._options.fused_norm
        if link is not None and not torch.compiler.is_compiling():
            halos = link.take_halos(x)  # the norm before it exchanged for it (norm_halo.py)
            if halos is not None:
                window = assemble_window(x, halos, call.plan, dim, 0.0)
                if call.owns_no_output:
                    return self._bias_only(x, window, weight, bias, 0)
                return self.op(window, weight, bias)
        path = self._path(call)
        if path == "transposed":
            return self._forward_transposed(x, weight, bias, call, mgr, dim)
        if path == "fused_pad":
            return self._forward_fused_pad(x, weight, bias, call, mgr, dim)
        if path == "split":
            late = overlap_enabled(self._options.overlap, x.device)
            peers, group = mgr.domain_ranks, mgr.domain_group
            return SplitConv.apply(
                x, weight, bias, self.op, call.plan, dim, call.split, peers, group, late, call.full
            )
        if path == "shared":
            window = self._options.shared_input.window_for(self, x, length, n, dim, mgr)
        else:
            spec = (call.plan, dim, 0.0)
            (window,) = exchange_planned([x], [spec], mgr, side_stream=self.side_stream)
        if call.owns_no_output:
            return self._bias_only(x, window, weight, bias, 0)
        return self.op(window, weight, bias)

    def _call_geometry(self, length: int, n: int, rank: int, fused: bool = False) -> _ConvCall:
        """This rank's plan, overlap split and output rows for an input of ``length`` rows over
        ``n`` ranks: computed once per (length, n, rank), then a dict lookup per call.
        ``fused``: ``length`` is the input height of the fused pad (no overlap split)."""
        key = (length, n, rank, fused)
        call = self._calls.get(key)
        if call is None:
            if fused:
                windows = fused_pad_windows(self.fused_pad, self, length, n)
                out_h = self.output_height(self.fused_pad.output_height(length))
                split = None
            else:
                windows = self.input_windows(length, n)
                out_h = self.output_height(length)
                split = overlap_split(self.geometry, self.spatial_index, length, n, rank)
            o0, o1 = shard_range(out_h, n, rank)
            first = windows[rank][0] if windows[rank] else None
            plan = plan_exchange(length, n, windows)[rank]
            full = None if split is None else self._full_call(length, n, rank, plan)
            if full is not None:
                split = _without_fill_strips(split, plan, full[1])
            call = _ConvCall(plan, split, o0 == o1, (o0, o1), first, full)
            if len(self._calls) > 64:
                self._calls.clear()
            self._calls[key] = call
        return call

    def _full_call(self, length: int, n: int, rank: int, plan) -> tuple | None:
        """``(op, shard positions)`` when the conv with its own zero padding along the sharded
        dim, run on the shard alone (the other dims padded as the op pads them), gives exactly
        this rank's output rows (stride 1, symmetric padding, output rows = shard rows): then
        only the boundary rows need the halo (``split_conv.SplitConv``).  Else None."""
        geo, i = self.geometry, self.spatial_index
        pb, pa = geo.pads[i]
        s, e = shard_range(length, n, rank)
        if (
            geo.stride[i] != 1
            or pb != pa
            or geo.output_length(length, i) != length
            or plan.window_rows != e - s + pb + pa
        ):
            return None
        return self.op.with_row_padding(i, pb), (pb, pb + e - s)

    def _forward_fused_pad(self, x, weight, bias, call, mgr, dim):
        """The padding layer ``fused_pad`` then this conv, with ONE exchange of the pad's input
        (``call`` made over its rows): the two row maps composed (``rows.compose_windows``)."""
        pad = self.fused_pad
        spec = (call.plan, dim, pad.value)
        (window,) = exchange_planned([x], [spec], mgr, side_stream=self.side_stream)
        window = pad.pad_width(window)
        if call.owns_no_output:
            return self._bias_only(window, window, weight, bias, 0)
        return self.op(window, weight, bias)

    def _bias_only(self, x, window, weight, bias, rows: int) -> torch.Tensor:
        """Output rows no input row reaches (an empty shard, or kernel*dilation gaps < stride of a
        transposed conv): exactly the bias, attached to the graph of the window and the weight
        so that the exchange's backward runs on this rank too."""
        geo, i = self.geometry, self.spatial_index
        channels = weight.shape[1] * geo.groups if geo.transposed else weight.shape[0]
        shape = [x.shape[0], channels]
        for j in range(self.nd):
            shape.append(rows if j == i else geo.output_length(x.shape[j + 2], j))
        y = (window.sum() + weight.sum()) * 0.0 + x.new_zeros(shape)
        if bias is not None:
            y = y + bias.view(1, -1, *([1] * self.nd))
        return y

    def _forward_transposed(self, x, weight, bias, call, mgr, dim):
        geo, i = self.geometry, self.spatial_index
        # every rank takes part in the exchange, also one whose own window is empty
        (window,) = exchange_planned(
            [x], [(call.plan, dim, 0.0)], mgr, side_stream=self.side_stream
        )
        o0, o1 = call.out_rows
        if call.first_input_row is None:
            return self._bias_only(x, window, weight, bias, o1 - o0)
        pads = tuple(p[0] if j != i else 0 for j, p in enumerate(geo.pads))
        out_pad = tuple(p if j != i else 0 for j, p in enumerate(geo.output_padding))
        y = _CONVT[self.nd](
            window, weight, None, geo.stride, pads, out_pad, geo.groups, geo.dilation
        )
        # y's rows along dim are the un-cropped positions lo*s + t; keep our output rows
        first = o0 + geo.pads[i][0] - call.first_input_row * geo.stride[i]
        last = o1 + geo.pads[i][0] - call.first_input_row * geo.stride[i]
        before, after = max(0, -first), max(0, last - y.shape[dim])
        if before or after:  # rows no input reaches (output_padding, kernel*dilation < stride)
            flat = [0, 0] * (self.nd - 1 - i) + [before, after]
            y = F.pad(y, flat)
            first += before
            last += before
        y = y.narrow(dim, first, last - first)
        if bias is not None:
            y = y + bias.view(1, -1, *([1] * self.nd))
        return y

    def extra_repr(self) -> str:
        return f"{self.wrapped!r}, shard_dim={self.shard_dim}"


def seed_halo_width(geo: ConvGeometry, i: int) -> int:
    """The halo ``credit.domain_parallel.layers`` assigns a conv along its sharded dim ``i``,
    from the kernel and stride alone: ``(kernel - 1) // 2`` at stride 1, ``max(0, (kernel -
    stride) // 2)`` when strided; for a transposed conv its padding when kernel > stride, else 0.
    (The value a layer reports before its first forward.)"""
    k, s = geo.kernel[i], geo.stride[i]
    if geo.transposed:
        return geo.pads[i][0] if k > s else 0
    return (k - 1) // 2 if s == 1 else max(0, (k - s) // 2)


def _halo_of(layer: _DomainParallelConvNd) -> tuple[int, int]:
    """(rows above, rows below) of other ranks' shards in ``layer``'s window on this rank, for
    the last (global height, domain size, rank) it ran on; miles-credit's value
    (:func:`seed_halo_width`) before any call.  Pure: reads the layer's geometry only."""
    calls = [key for key in layer._calls if not key[3]]
    if not calls:
        if isinstance(layer, DomainParallelPeriodicConv2d):  # the seed's: its padding
            return layer.padding, layer.padding
        width = seed_halo_width(layer.geometry, layer.spatial_index)
        return width, width
    length, n, rank, _ = calls[-1]
    window = layer.input_windows(length, n)[rank]
    s, e = shard_range(length, n, rank)
    own = [j for j, row in enumerate(window) if s <= row < e]
    before = after = 0
    for j, row in enumerate(window):
        if row == FILL or s <= row < e:
            continue
        if (j < own[0]) if own else (row < s):
            before += 1
        else:
            after += 1
    return before, after


class DomainParallelConv2d(_DomainParallelConvNd):
    """Domain-parallel ``nn.Conv2d``; shares the conv's parameters and state_dict keys."""

    _expected = (nn.Conv2d,)

    def __init__(
        self,
        conv: nn.Conv2d,
        shard_dim: int = -2,
        *,
        manager=None,
        overlap: bool | None = None,
        options: LayerOptions | None = None,
    ):
        super().__init__(conv, shard_dim, manager=manager, overlap=overlap, options=options)


class DomainParallelConv3d(_DomainParallelConvNd):
    """Domain-parallel ``nn.Conv3d`` (latitude is dim 3 of B,C,T,H,W by default)."""

    _expected = (nn.Conv3d,)

    def __init__(
        self,
        conv: nn.Conv3d,
        shard_dim: int = 3,
        *,
        manager=None,
        overlap: bool | None = None,
        options: LayerOptions | None = None,
    ):
        super().__init__(conv, shard_dim, manager=manager, overlap=overlap, options=options)


class DomainParallelConvTranspose2d(_DomainParallelConvNd):
    """Domain-parallel ``nn.ConvTranspose2d`` (any kernel, stride, padding, output_padding)."""

    domain_kind = "conv_transpose"
    _expected = (nn.ConvTranspose2d,)

    def __init__(
        self,
        conv: nn.ConvTranspose2d,
        shard_dim: int = -2,
        *,
        manager=None,
        options: LayerOptions | None = None,
    ):
        super().__init__(conv, shard_dim, manager=manager, options=options)


class DomainParallelConvTranspose3d(_DomainParallelConvNd):
    """Domain-parallel ``nn.ConvTranspose3d`` (latitude is dim 3 of B,C,Z,H,W by default)."""

    domain_kind = "conv_transpose"
    _expected = (nn.ConvTranspose3d,)

    def __init__(
        self,
        conv: nn.ConvTranspose3d,
        shard_dim: int = 3,
        *,
        manager=None,
        options: LayerOptions | None = None,
    ):
        super().__init__(conv, shard_dim, manager=manager, options=options)


class DomainParallelPeriodicConv2d(_DomainParallelConvNd):
    """Domain-parallel periodic conv: reflect at the poles (H), circular in longitude (W).

    Wraps any module with ``.conv`` (an ``nn.Conv2d`` with padding 0) and ``.padding`` (int)
    that pads W circularly and H by reflection before the conv, e.g.
    ``credit_parallel.models.PeriodicConv2d``.  State dict keys stay ``conv.weight``/``conv.bias``.
    """

    domain_kind = "periodic_conv"

    def __init__(
        self,
        periodic_conv: nn.Module,
        shard_dim: int = -2,
        *,
        manager=None,
        overlap: bool | None = None,
        options: LayerOptions | None = None,
    ):
        inner = getattr(periodic_conv, "conv", None)
        p = getattr(periodic_conv, "padding", None)
        if not isinstance(inner, nn.Conv2d) or not isinstance(p, int):
            raise TypeError(
                "DomainParallelPeriodicConv2d wraps a module with .conv (nn.Conv2d) and .padding (int); "
                f"got {type(periodic_conv).__name__}"
            )
        if any(v != 0 for v in (inner.padding if not isinstance(inner.padding, str) else (1,))):
            raise ValueError("the inner .conv of a periodic conv must have padding 0")
        if shard_dim % 4 != 2:
            raise ValueError("DomainParallelPeriodicConv2d shards latitude (dim -2 of B,C,H,W)")
        base = ConvGeometry.of(inner)
        geo = ConvGeometry(
            False,
            base.kernel,
            base.stride,
            base.dilation,
            ((p, p), (p, p)),
            (0, 0),
            base.groups,
            "reflect",
            "circular",
        )
        super().__init__(
            inner, shard_dim, manager=manager, geometry=geo, overlap=overlap, options=options
        )
        # share the periodic module's own dicts (keys "conv.weight"), not the inner conv's
        self._parameters = periodic_conv._parameters
        self._buffers = periodic_conv._buffers
        self._modules = periodic_conv._modules
        self._non_persistent_buffers_set = periodic_conv._non_persistent_buffers_set
        self.__dict__["periodic"] = periodic_conv  # not a child: its dicts are shared above
        self.padding = p

    def _weight_and_bias(self, x):
        run_forward_pre_hooks(self.periodic, (x,))
        conv = self._modules["conv"]
        run_forward_pre_hooks(conv, (x,))
        return conv.weight, conv.bias

    @property
    def conv(self):
        return self._modules["conv"]

    @property
    def weight(self):
        return self.conv.weight

    @property
    def bias(self):
        return self.conv.bias
