"""Domain-parallel convolutions and transposed convolutions (any kernel, stride, padding,
dilation, groups, output_padding, padding_mode), and the periodic (lat-reflect / lon-circular)
convolution of the reference models.

Each rank computes exactly the output rows the balanced layout assigns to it: it assembles the
input rows those outputs read (own rows, rows of other ranks, and rows beyond the poles mapped by
the layer's padding rule) with one exchange, then runs the plain op with no padding along the
sharded dim.  Nothing is padded inside the globe and nothing is trimmed approximately.

Halo/compute overlap (convolutions, not transposed ones; switched by
:func:`set_halo_overlap` / :func:`halo_overlap` or per layer with ``overlap=``).  Only the
boundary output rows read halo rows, so the forward posts the exchange, convolves the INTERIOR
output rows (those whose input rows all lie in the local shard) straight from the shard while
the rows are in flight, waits, then convolves the boundary rows from the assembled window
(:func:`overlap_split` says which rows are which).  The backward computes the window's input
gradient in one call, posts the return of the halo gradients, computes the weight and bias
gradients while they are in flight, then waits.  The backward calls see exactly the plain
path's operands (input and weight gradients are separate kernels either way) and accumulate the
gradient rows in the same order; the forward pieces compute every output row from the same
input rows, and the CPU convolution kernels give an output row the same bits whichever other
rows a call computes.  So on CPU the results are bitwise those of the plain path
(``tests/test_overlap.py`` checks forward and every gradient with ``torch.equal``, float64 and
float32).  It is nevertheless OFF by default (``set_halo_overlap(None)``): on the 2-core
benchmark machine the split convolution costs more than the halo time it hides (946 vs 848 ms
per step, docs/performance.md), and on CUDA cuDNN may pick another algorithm for a few boundary
rows than for the whole window (last bits could differ, well inside the parity tolerances).
``set_halo_overlap(True)`` or ``overlap=True`` per layer turns it on.  A shard too thin to have an
interior output row uses the plain path; both paths send the same messages, so ranks may mix.
The overlapped backward is once-differentiable: a double backward (gradient penalties) needs
``set_halo_overlap(False)``.

Convolutions called one after the other on the SAME tensor (the branches of a cross-scale
embedding) can share one exchange of the union of their windows: :func:`share_input_exchange`.
"""

from __future__ import annotations

import contextlib
import weakref
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn
from torch.autograd.function import once_differentiable

from .exchange import (
    assemble_window,
    exchange_rows,
    post_gradient_return,
    post_rows,
)
from .manager import resolve_manager
from .rows import (
    ceil_div,
    check_min_rows,
    conv_output_length,
    conv_transpose_input_range,
    conv_transpose_output_length,
    conv_window,
    edge_source_row,
    plan_exchange,
    same_padding,
    shard_range,
)
from .wrap import DomainWrapper

__all__ = [
    "ConvGeometry",
    "DomainParallelConv2d",
    "DomainParallelConv3d",
    "DomainParallelConvTranspose2d",
    "DomainParallelConvTranspose3d",
    "DomainParallelPeriodicConv2d",
    "OverlapSplit",
    "conv_needs_domain_wrapper",
    "halo_overlap",
    "halo_overlap_enabled",
    "overlap_split",
    "set_halo_overlap",
    "share_input_exchange",
]


@dataclass(frozen=True)
class ConvGeometry:
    """Everything about a conv along all spatial dims, with padding resolved to (before, after)."""

    transposed: bool
    kernel: tuple
    stride: tuple
    dilation: tuple
    pads: tuple  # ((before, after), ...) per spatial dim
    output_padding: tuple
    groups: int
    edge_mode: str  # boundary rule along the sharded dim
    other_mode: str  # padding mode of the other spatial dims

    @classmethod
    def of(cls, conv: nn.Module) -> ConvGeometry:
        nd = len(conv.kernel_size)
        transposed = isinstance(conv, nn.modules.conv._ConvTransposeNd)
        if isinstance(conv.padding, str):
            if conv.padding == "valid":
                pads = tuple((0, 0) for _ in range(nd))
            else:  # "same"
                pads = tuple(same_padding(k, d) for k, d in zip(conv.kernel_size, conv.dilation))
        else:
            pads = tuple((p, p) for p in conv.padding)
        mode = conv.padding_mode
        return cls(
            transposed,
            tuple(conv.kernel_size),
            tuple(conv.stride),
            tuple(conv.dilation),
            pads,
            tuple(getattr(conv, "output_padding", (0,) * nd)),
            conv.groups,
            mode,
            mode,
        )

    def output_length(self, length: int, i: int) -> int:
        if self.transposed:
            return conv_transpose_output_length(
                length,
                self.kernel[i],
                self.stride[i],
                self.pads[i][0],
                self.output_padding[i],
                self.dilation[i],
            )
        return conv_output_length(
            length, self.kernel[i], self.stride[i], *self.pads[i], self.dilation[i]
        )

    def is_row_local(self, i: int) -> bool:
        """True when output row r is computed from input row r alone (no exchange needed)."""
        return (
            self.kernel[i] == 1
            and self.stride[i] == 1
            and self.pads[i] == (0, 0)
            and self.output_padding[i] == 0
        )


def conv_needs_domain_wrapper(conv: nn.Module, spatial_index: int) -> bool:
    return not ConvGeometry.of(conv).is_row_local(spatial_index)


def _conv_windows(geo: ConvGeometry, i: int, length: int, n: int, what: str = "output") -> tuple:
    out_len = geo.output_length(length, i)
    check_min_rows(out_len, n, what)
    windows = []
    for r in range(n):
        o0, o1 = shard_range(out_len, n, r)
        lo, hi = conv_window(
            o0,
            o1,
            kernel=geo.kernel[i],
            stride=geo.stride[i],
            dilation=geo.dilation[i],
            pad_before=geo.pads[i][0],
        )
        windows.append(tuple(edge_source_row(p, length, geo.edge_mode) for p in range(lo, hi)))
    return tuple(windows), out_len


def _convt_windows(geo: ConvGeometry, i: int, length: int, n: int, what: str = "output") -> tuple:
    out_len = geo.output_length(length, i)
    check_min_rows(out_len, n, what)
    windows = []
    for r in range(n):
        o0, o1 = shard_range(out_len, n, r)
        lo, hi = conv_transpose_input_range(
            o0,
            o1,
            length,
            kernel=geo.kernel[i],
            stride=geo.stride[i],
            padding=geo.pads[i][0],
            dilation=geo.dilation[i],
        )
        windows.append(tuple(range(lo, hi)))
    return tuple(windows), out_len


# --------------------------------------------------------------------------- overlap
# None: the default, off. Overlap is verified bitwise equal to the plain path on CPU, but on the
# 2-core benchmark machine the split convolution costs more than the hidden halo time (see
# docs/performance.md: 946 vs 848 ms per step at domain 2), and on CUDA cuDNN may pick other
# algorithms for the boundary rows; enable it with set_halo_overlap(True) where it pays.
_OVERLAP: dict = {"enabled": None}


def _check_switch(enabled):
    if enabled is not None and not isinstance(enabled, bool):
        raise TypeError(f"halo overlap must be True, False or None (default), got {enabled!r}")
    return enabled


def set_halo_overlap(enabled: bool | None) -> None:
    """Process-wide default of halo/compute overlap for domain-parallel convolutions (layers
    built with ``overlap=None``): True, False, or None = the default (off; see ``_OVERLAP``)."""
    _OVERLAP["enabled"] = _check_switch(enabled)


def halo_overlap_enabled(device: torch.device | str = "cpu") -> bool:
    """Whether a layer with ``overlap=None`` overlaps for tensors on ``device``."""
    enabled = _OVERLAP["enabled"]
    torch.device(device)  # validates the argument
    return False if enabled is None else enabled


@contextlib.contextmanager
def halo_overlap(enabled: bool | None):
    """Context manager: the process-wide overlap default inside the block (then restored).
    It is read at forward time; the backward follows the path its forward took."""
    before = _OVERLAP["enabled"]
    _OVERLAP["enabled"] = _check_switch(enabled)
    try:
        yield
    finally:
        _OVERLAP["enabled"] = before


@dataclass(frozen=True)
class OverlapSplit:
    """How one rank's output rows of a convolution split around its shard (sharded dim only).

    Output rows ``[0, top_rows)`` (of this rank's outputs) read window positions
    ``[0, top_stop)``; the next ``interior_rows`` read only own rows, local rows
    ``[interior_start, interior_stop)`` of the shard; the last ``bottom_rows`` read window
    positions ``[bottom_start, window_rows)``.
    """

    top_rows: int
    top_stop: int
    interior_rows: int
    interior_start: int
    interior_stop: int
    bottom_rows: int
    bottom_start: int


def overlap_split(geo: ConvGeometry, i: int, length: int, n: int, rank: int):
    """The :class:`OverlapSplit` of ``rank`` for a (non-transposed) conv ``geo`` along spatial
    dim ``i`` of a global ``length``, or None when the rank has no interior output row (its
    shard is thinner than the kernel's reach, or it owns no output)."""
    if geo.transposed:
        return None
    k, st, d, pb = geo.kernel[i], geo.stride[i], geo.dilation[i], geo.pads[i][0]
    span = d * (k - 1) + 1
    out_len = geo.output_length(length, i)
    o0, o1 = shard_range(out_len, n, rank)
    s, e = shard_range(length, n, rank)
    # output row o reads padded rows [o*st - pb, o*st - pb + span): interior when inside [s, e)
    i0 = max(o0, ceil_div(s + pb, st))
    i1 = min(o1, (e + pb - span) // st + 1)
    if i1 <= i0:
        return None
    top_stop = (i0 - 1 - o0) * st + span if i0 > o0 else 0
    return OverlapSplit(
        top_rows=i0 - o0,
        top_stop=top_stop,
        interior_rows=i1 - i0,
        interior_start=i0 * st - pb - s,
        interior_stop=(i1 - 1) * st - pb + span - s,
        bottom_rows=o1 - i1,
        bottom_start=(i1 - o0) * st,
    )


@dataclass(frozen=True)
class _ConvOp:
    """The local op of a conv along the non-sharded dims: optional ``F.pad`` then the conv."""

    nd: int
    stride: tuple
    padding: tuple  # the conv's own padding (zeros, symmetric) of every dim, 0 on the sharded
    dilation: tuple
    groups: int
    pad_flat: tuple | None  # F.pad argument when the other dims are padded explicitly
    pad_mode: str

    def input_of(self, window):
        if self.pad_flat is None:
            return window
        return F.pad(window, list(self.pad_flat), mode=self.pad_mode)

    def __call__(self, window, weight, bias):
        inp = self.input_of(window)
        return _CONV[self.nd](
            inp, weight, bias, self.stride, self.padding, self.dilation, self.groups
        )


class _OverlappedConv(torch.autograd.Function):
    """A conv over this rank's window with the exchange hidden behind computation (see module
    docstring).  Inputs: the local shard ``x``, weight, bias; saves ``x``, the received halo
    rows, weight and bias (no copy of the assembled window)."""

    @staticmethod
    def forward(ctx, x, weight, bias, op, plan, dim, split, peers, group):
        pending = post_rows(x, plan, dim, peers, group)
        interior = op(
            x.narrow(dim, split.interior_start, split.interior_stop - split.interior_start),
            weight,
            bias,
        )
        recv_bufs = pending.wait()
        parts = []
        if split.top_rows:
            parts.append(
                op(assemble_window(x, recv_bufs, plan, dim, 0.0, 0, split.top_stop), weight, bias)
            )
        parts.append(interior)
        if split.bottom_rows:
            bottom = assemble_window(x, recv_bufs, plan, dim, 0.0, split.bottom_start)
            parts.append(op(bottom, weight, bias))
        ctx.op, ctx.plan, ctx.dim, ctx.peers, ctx.group = op, plan, dim, peers, group
        ctx.save_for_backward(x, weight, bias, *recv_bufs)
        return parts[0] if len(parts) == 1 else torch.cat(parts, dim)

    @staticmethod
    @once_differentiable
    def backward(ctx, grad_y):
        x, weight, bias, *recv_bufs = ctx.saved_tensors
        op, plan, dim = ctx.op, ctx.plan, ctx.dim
        need_x, need_w, need_b = ctx.needs_input_grad[:3]
        window = assemble_window(x, recv_bufs, plan, dim, 0.0)
        del recv_bufs
        args = (
            None if bias is None else [bias.shape[0]],
            list(op.stride),
            list(op.padding),
            list(op.dilation),
            False,
            [0] * op.nd,
            op.groups,
        )
        with torch.enable_grad():
            leaf = window.detach().requires_grad_(need_x and op.pad_flat is not None)
            inp = op.input_of(leaf)
        pending = None
        if need_x:
            grad_inp, _, _ = torch.ops.aten.convolution_backward(
                grad_y, inp.detach(), weight, *args, [True, False, False]
            )
            if op.pad_flat is not None:
                # the padding's own backward, exactly as autograd runs it on the plain path
                (grad_inp,) = torch.autograd.grad(inp, leaf, grad_inp)
            pending = post_gradient_return(grad_inp, plan, dim, ctx.peers, ctx.group, x.shape)
            del grad_inp
        grad_w = grad_b = None
        if need_w or need_b:
            # computed while the halo gradients travel
            _, grad_w, grad_b = torch.ops.aten.convolution_backward(
                grad_y, inp.detach(), weight, *args, [False, need_w, need_b]
            )
        del inp, leaf, window
        grad_x = pending.wait() if pending is not None else None
        return grad_x, grad_w, grad_b, None, None, None, None, None, None


# --------------------------------------------------------------------------- shared input
class _SharedInputExchange:
    """One exchange for several convolutions called on the same tensor (see
    :func:`share_input_exchange`)."""

    def __init__(self, layers):
        self.layers = tuple(layers)
        self._entry = None  # (weakref to the input, its version, length, window, served ids)
        self._union: dict = {}

    # a copied or pickled model must not carry (or fail on) the window of a forward in flight
    def __deepcopy__(self, memo):
        import copy

        new = _SharedInputExchange(())
        memo[id(self)] = new  # the layers refer back to this group
        new.layers = copy.deepcopy(self.layers, memo)
        return new

    def __getstate__(self):
        return {"layers": self.layers, "_entry": None, "_union": {}}

    def _union_windows(self, length: int, n: int, rank: int):
        key = (length, n, rank)
        if key not in self._union:
            lo = [[0] * len(self.layers) for _ in range(n)]
            hi = [[0] * len(self.layers) for _ in range(n)]
            for m, layer in enumerate(self.layers):
                geo, i = layer.geometry, layer.spatial_index
                out_len = geo.output_length(length, i)
                check_min_rows(out_len, n, layer._describe(length))
                for r in range(n):
                    o0, o1 = shard_range(out_len, n, r)
                    lo[r][m], hi[r][m] = conv_window(
                        o0,
                        o1,
                        kernel=geo.kernel[i],
                        stride=geo.stride[i],
                        dilation=geo.dilation[i],
                        pad_before=geo.pads[i][0],
                    )
            mode = self.layers[0].geometry.edge_mode
            windows = tuple(
                tuple(edge_source_row(p, length, mode) for p in range(min(lo[r]), max(hi[r])))
                for r in range(n)
            )
            # where each layer's own window sits inside this rank's union window
            offsets = tuple(
                (lo[rank][m] - min(lo[rank]), hi[rank][m] - lo[rank][m])
                for m in range(len(self.layers))
            )
            self._union[key] = (windows, offsets)
        return self._union[key]

    def window_for(self, layer, x, length: int, n: int, dim: int, mgr):
        windows, offsets = self._union_windows(length, n, mgr.domain_rank)
        index = self.layers.index(layer)
        entry = self._entry
        fresh = (
            entry is None
            or entry[0]() is not x
            or entry[1] != x._version
            or entry[2] != length
            or index in entry[4]
        )
        if fresh:
            # every rank sees the same sequence of calls, so all ranks exchange together
            window = exchange_rows(x, windows, length, dim, mgr)
            entry = self._entry = (weakref.ref(x), x._version, length, window, set())
        entry[4].add(index)
        window = entry[3]
        if len(entry[4]) == len(self.layers):
            self._entry = None  # all served: do not keep the window alive
        start, count = offsets[index]
        return window.narrow(dim, start, count)


def share_input_exchange(*layers) -> None:
    """Let domain-parallel convolutions that are called on the SAME tensor one after the other
    (the branches of a cross-scale embedding, an inception block) fetch their halo rows in ONE
    exchange instead of one each: the first of them called on a tensor exchanges the union of
    their windows, the others take their rows from it.  A layer called on another tensor (or
    twice on the same one) simply exchanges again, so the results never depend on the pairing;
    they equal the unshared layers' to rounding (gradient rows are summed before they travel).
    Every layer must be a non-transposed :class:`DomainParallelConv2d`/``Conv3d``/periodic conv
    with the same shard dim, boundary rule and manager.  These layers do not overlap (the
    exchange is shared, not hidden).
    """
    if len(layers) < 2:
        raise ValueError("share_input_exchange needs at least two layers")
    first = layers[0]
    for layer in layers:
        if not isinstance(layer, _DomainParallelConvNd) or layer.geometry.transposed:
            raise TypeError(
                "share_input_exchange takes domain-parallel (non-transposed) convolutions, got "
                f"{type(layer).__name__}"
            )
        same = (
            layer.shard_dim % (layer.nd + 2) == first.shard_dim % (first.nd + 2)
            and layer.nd == first.nd
            and layer.geometry.edge_mode == first.geometry.edge_mode
            and layer.manager is first.manager
        )
        if not same:
            raise ValueError(
                "share_input_exchange: all layers need the same shard dim, dimensionality, "
                f"boundary rule and manager; {layer!r} differs from {first!r}"
            )
    group = _SharedInputExchange(layers)
    for layer in layers:
        layer.__dict__["_cp_shared_input"] = group


_CONV = {1: F.conv1d, 2: F.conv2d, 3: F.conv3d}
_CONVT = {1: F.conv_transpose1d, 2: F.conv_transpose2d, 3: F.conv_transpose3d}


class _DomainParallelConvNd(DomainWrapper):
    """Shared implementation; ``shard_dim`` is the tensor dim holding latitude."""

    _expected: tuple = ()

    def __init__(
        self,
        conv: nn.Module,
        shard_dim: int,
        *,
        manager=None,
        geometry: ConvGeometry | None = None,
        overlap: bool | None = None,
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
        self.overlap = _check_switch(overlap)  # None: the process-wide default
        if self.geometry.transposed and self.geometry.edge_mode != "zeros":
            raise ValueError(f"{type(conv).__name__} only supports padding_mode='zeros'")

    @property
    def conv(self):
        return self.wrapped

    def _describe(self, length: int) -> str:
        # the module path is known when the layer came from convert_to_domain_parallel
        path = self.__dict__.get("_cp_path")
        where = f"{path} ({type(self.wrapped).__name__})" if path else repr(self.wrapped)
        return f"{type(self).__name__} {where}, output of an input of {length} rows"

    def _weight_and_bias(self, x):
        conv = self.wrapped_weights(x)
        return conv.weight, conv.bias

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if x.dim() != self.nd + 2:
            raise ValueError(
                f"{type(self).__name__} expects a {self.nd + 2}-D input, got shape {tuple(x.shape)}"
            )
        mgr = resolve_manager(self.manager, type(self).__name__)
        weight, bias = self._weight_and_bias(x)
        geo, i = self.geometry, self.spatial_index
        dim = i + 2
        n = mgr.domain_world_size
        length = mgr.global_length(self, x.shape[dim])
        if geo.transposed:
            return self._forward_transposed(x, weight, bias, mgr, length, n, dim)
        cache = self.__dict__.setdefault("_cp_windows", {})
        key = (length, n)
        if key not in cache:
            cache[key] = _conv_windows(geo, i, length, n, self._describe(length))
        windows, _ = cache[key]
        shared = self.__dict__.get("_cp_shared_input")
        if shared is not None:
            window = shared.window_for(self, x, length, n, dim, mgr)
            return self._conv_window(window, weight, bias)
        overlap = self.overlap if self.overlap is not None else halo_overlap_enabled(x.device)
        if overlap:
            plan = plan_exchange(length, n, windows)[mgr.domain_rank]
            split = self._split(length, n, mgr.domain_rank)
            if split is not None and (plan.sends or plan.recvs):
                return _OverlappedConv.apply(
                    x,
                    weight,
                    bias,
                    self._op(),
                    plan,
                    dim,
                    split,
                    mgr.domain_ranks,
                    mgr.domain_group,
                )
        window = exchange_rows(x, windows, length, dim, mgr)
        return self._conv_window(window, weight, bias)

    def _split(self, length: int, n: int, rank: int):
        cache = self.__dict__.setdefault("_cp_splits", {})
        key = (length, n, rank)
        if key not in cache:
            cache[key] = overlap_split(self.geometry, self.spatial_index, length, n, rank)
        return cache[key]

    def _op(self) -> _ConvOp:
        op = self.__dict__.get("_cp_op")
        if op is None:
            geo, i = self.geometry, self.spatial_index
            # padding of the other spatial dims exactly as the wrapped conv would do it
            pads = [p if j != i else (0, 0) for j, p in enumerate(geo.pads)]
            symmetric = all(a == b for a, b in pads)
            if geo.other_mode == "zeros" and symmetric:
                padding, flat, mode = tuple(a for a, _ in pads), None, "constant"
            else:
                flat = []
                for a, b in reversed(pads):
                    flat += [a, b]
                padding, flat = (0,) * self.nd, tuple(flat)
                mode = "constant" if geo.other_mode == "zeros" else geo.other_mode
            op = _ConvOp(self.nd, geo.stride, padding, geo.dilation, geo.groups, flat, mode)
            self.__dict__["_cp_op"] = op
        return op

    def _conv_window(self, window, weight, bias):
        return self._op()(window, weight, bias)

    def _forward_transposed(self, x, weight, bias, mgr, length, n, dim):
        geo, i = self.geometry, self.spatial_index
        cache = self.__dict__.setdefault("_cp_windows", {})
        key = (length, n)
        if key not in cache:
            cache[key] = _convt_windows(geo, i, length, n, self._describe(length))
        windows, out_len = cache[key]
        lo_hi = windows[mgr.domain_rank]
        # every rank takes part in the exchange, also one whose own window is empty
        window = exchange_rows(x, windows, length, dim, mgr)
        o0, o1 = shard_range(out_len, n, mgr.domain_rank)
        if not lo_hi:
            # no input row reaches this rank's outputs (kernel*dilation gaps < stride): they are
            # exactly the bias; keep the result attached to the graph of x and the weight
            shape = [x.shape[0], weight.shape[1] * geo.groups]
            for j in range(self.nd):
                shape.append(o1 - o0 if j == i else geo.output_length(x.shape[j + 2], j))
            y = (window.sum() + weight.sum()) * 0.0 + x.new_zeros(shape)
            if bias is not None:
                y = y + bias.view(1, -1, *([1] * self.nd))
            return y
        pads = tuple(p[0] if j != i else 0 for j, p in enumerate(geo.pads))
        out_pad = tuple(p if j != i else 0 for j, p in enumerate(geo.output_padding))
        y = _CONVT[self.nd](
            window, weight, None, geo.stride, pads, out_pad, geo.groups, geo.dilation
        )
        # y's rows along dim are the un-cropped positions lo*s + t; keep our output rows
        first = o0 + geo.pads[i][0] - lo_hi[0] * geo.stride[i]
        last = o1 + geo.pads[i][0] - lo_hi[0] * geo.stride[i]
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


class DomainParallelConv2d(_DomainParallelConvNd):
    """Domain-parallel ``nn.Conv2d``; shares the conv's parameters and state_dict keys."""

    _expected = (nn.Conv2d,)

    def __init__(
        self, conv: nn.Conv2d, shard_dim: int = -2, *, manager=None, overlap: bool | None = None
    ):
        super().__init__(conv, shard_dim, manager=manager, overlap=overlap)


class DomainParallelConv3d(_DomainParallelConvNd):
    """Domain-parallel ``nn.Conv3d`` (latitude is dim 3 of B,C,T,H,W by default)."""

    _expected = (nn.Conv3d,)

    def __init__(
        self, conv: nn.Conv3d, shard_dim: int = 3, *, manager=None, overlap: bool | None = None
    ):
        super().__init__(conv, shard_dim, manager=manager, overlap=overlap)


class DomainParallelConvTranspose2d(_DomainParallelConvNd):
    """Domain-parallel ``nn.ConvTranspose2d`` (any kernel, stride, padding, output_padding)."""

    _expected = (nn.ConvTranspose2d,)

    def __init__(self, conv: nn.ConvTranspose2d, shard_dim: int = -2, *, manager=None):
        super().__init__(conv, shard_dim, manager=manager)


class DomainParallelConvTranspose3d(_DomainParallelConvNd):
    """Domain-parallel ``nn.ConvTranspose3d`` (latitude is dim 3 of B,C,Z,H,W by default)."""

    _expected = (nn.ConvTranspose3d,)

    def __init__(self, conv: nn.ConvTranspose3d, shard_dim: int = 3, *, manager=None):
        super().__init__(conv, shard_dim, manager=manager)


class DomainParallelPeriodicConv2d(_DomainParallelConvNd):
    """Domain-parallel periodic conv: reflect at the poles (H), circular in longitude (W).

    Wraps any module with ``.conv`` (an ``nn.Conv2d`` with padding 0) and ``.padding`` (int)
    that pads W circularly and H by reflection before the conv, e.g.
    ``credit_parallel.models.PeriodicConv2d``.  State dict keys stay ``conv.weight``/``conv.bias``.
    """

    def __init__(
        self,
        periodic_conv: nn.Module,
        shard_dim: int = -2,
        *,
        manager=None,
        overlap: bool | None = None,
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
        super().__init__(inner, shard_dim, manager=manager, geometry=geo, overlap=overlap)
        # share the periodic module's own dicts (keys "conv.weight"), not the inner conv's
        self._parameters = periodic_conv._parameters
        self._buffers = periodic_conv._buffers
        self._modules = periodic_conv._modules
        self._non_persistent_buffers_set = periodic_conv._non_persistent_buffers_set
        object.__setattr__(self, "periodic", periodic_conv)
        self.padding = p

    def _weight_and_bias(self, x):
        from .wrap import run_forward_pre_hooks

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
