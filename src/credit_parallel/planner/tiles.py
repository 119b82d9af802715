"""The planner's lat x lon tiles (SPEC §3b): per layer call, the tile exchange of every rank.

Pure arithmetic, the exchange's own algebra (``domain/exchange/halo.py``): a layer gives the
windows of global rows its owned outputs read per latitude rank and of global columns per
longitude rank (its ``tile_windows``); the rows are fetched COMPACT over the P ranks of a
longitude column (each real row once, ``compact_windows``), then the columns over the Q ranks
of a latitude band OF THE ROW-EXTENDED TILE (so the corners ride with the column pass and a
periodic longitude wraps from the last column shard), each by ``rows.plan_exchange``.  Rank
(lat, lon) therefore sends, per forward,

    rows_sent[lat] x columns of its tile  +  columns_sent[lon] x rows of its row-extended tile

elements (times the other dims: channels, a Conv3d's depth), and the backward returns the
gradients of what it received: the same formula with the received counts.  Messages are one per
peer per pass.  :func:`tile_halo_bytes` and :meth:`TileLayerPlan.messages` are what
``record_exchange_stats`` counts on each rank (tests/test_plan_tiles.py).

A layer with no tile exchange of its own (attention, the FuXi / Swin adapters, the gather
policy: the converter runs them on latitude strips, ``domain/tiles_relayout.py``) counts the
two all-to-alls around it instead: rank r sends the elements of its input tile that other strips
hold and the elements of its output strip that other tiles hold (``strips_sent[r]``, forward;
``strips_returned[r]``, backward, the same moves inverted), and what the module's 1-D
replacement exchanges on the strips: its rows over the P x Q strips (``rows.plan_exchange`` of
its 1-D windows, ``strip_rows_*``; twice for row-group attention, whose output rows go back the
same way), as do the layers inside it (no tile exchange of their own, only their strips' one).
CREDIT's ``TensorPadding`` inside a model's forward (``PaddingCall``) is such a call too: a move
to the strips, one row exchange there, a move back.  The all-to-alls of a bare ``nn.MultiheadAttention`` run on the tile's
tokens (``domain/attention/token_core.py``) are not counted.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Sequence
from dataclasses import dataclass

from ..domain.exchange.halo import compact_windows
from ..domain.geometry import domain_form_of, domain_kind_of, input_windows_of
from ..domain.rows import plan_exchange, shard_sizes
from ..domain.tiles_relayout import moved_elements, moved_peers, strip_rects, tile_rects

__all__ = [
    "TileLayerPlan",
    "tile_halo_bytes",
    "tile_layer_plan",
    "tile_layer_plans",
    "tile_levels",
    "tile_messages",
    "tile_p2p_calls",
]

# forms that never exchange on tiles: row- and column-local, or statistics over the group
_NO_EXCHANGE = ("local", "collective")


@dataclass(frozen=True)
class TileLayerPlan:
    """One call of a domain layer on a P x Q domain, as the tile exchange runs it.

    Per latitude rank ``a``: ``out_rows[a]`` owned output rows, ``rows_sent[a]`` /
    ``rows_received[a]`` in the row pass (compact), ``row_peers_sent[a]`` /
    ``row_peers_received[a]`` messages, ``band_rows[a]`` rows of the row-extended tile the
    column pass carries.  Per longitude rank ``b``: ``out_cols[b]``, ``in_cols[b]`` (columns of
    the input tile), ``cols_sent[b]`` / ``cols_received[b]`` and their peers.  ``cell_elements``:
    elements of one (row, column) at batch 1 (channels x other dims).  ``error``: why the layer
    cannot run on tiles (its exchange is then not counted)."""

    path: str
    kind: str
    form: str
    shape: tuple[int, int]
    in_hw: tuple[int, int]
    out_hw: tuple[int, int]
    out_rows: tuple[int, ...]
    out_cols: tuple[int, ...]
    in_rows: tuple[int, ...]
    in_cols: tuple[int, ...]
    cell_elements: int
    band_rows: tuple[int, ...] = ()
    rows_sent: tuple[int, ...] = ()
    rows_received: tuple[int, ...] = ()
    row_peers_sent: tuple[int, ...] = ()
    row_peers_received: tuple[int, ...] = ()
    cols_sent: tuple[int, ...] = ()
    cols_received: tuple[int, ...] = ()
    col_peers_sent: tuple[int, ...] = ()
    col_peers_received: tuple[int, ...] = ()
    error: str | None = None
    stats_with_exchange: bool = False  # a GroupNorm whose statistics ride with a conv's exchange
    # a conv after a linked GroupNorm: the pass ("rows", or "cols" at P = 1) that carries the
    # norm's statistics to (and its gradient sums from) every other rank of the P x Q group
    stats_pass: str = ""
    # a layer run on latitude strips: per domain rank, elements (batch 1) and messages of the
    # two all-to-alls, forward and backward
    strips_sent: tuple[int, ...] = ()
    strips_returned: tuple[int, ...] = ()
    strips_messages: tuple[tuple[int, int], ...] = ()
    # per domain rank: (in-move sent, in-move received, out-move sent, out-move received)
    # elements of the two all-to-alls, forward (the backward inverts them)
    strips_moves: tuple[tuple[int, int, int, int], ...] = ()
    # per domain rank: messages the first move's backward sends (skipped without input_grad)
    strips_back_messages: tuple[int, ...] = ()
    # the 1-D exchange of the call on the P x Q strips, per domain rank (strip r): rows sent /
    # received and their peers (forward; the backward returns the received rows' gradients),
    # ``strip_row_elements`` per row at batch 1; ``strip_returns``: the rows go back too
    strip_rows_sent: tuple[int, ...] = ()
    strip_rows_received: tuple[int, ...] = ()
    strip_row_peers_sent: tuple[int, ...] = ()
    strip_row_peers_received: tuple[int, ...] = ()
    strip_row_elements: int = 0
    strip_returns: bool = False
    # the most rows one strip computes on (its output rows; a row-group attention's whole
    # groups): the busiest strip's share of the call's compute is these over the height
    strip_compute_rows: int = 0
    # the layer's input needs a gradient; False for a model input: the backward of the input's
    # exchange (both passes, or the strips' first move) is skipped by autograd; its output
    # (False: no backward at all, e.g. a padding of the model's input)
    input_grad: bool = True
    output_grad: bool = True

    @property
    def exchanges(self) -> bool:
        if any(self.strip_rows_sent) or any(self.strip_rows_received):
            return True
        if self.strips_sent:
            return any(self.strips_sent)
        return bool(self.rows_sent) and (any(self.rows_sent) or any(self.cols_sent))

    def strip_elements(self, domain_rank: int) -> int:
        """Elements strip ``domain_rank`` sends per step (forward + backward) in the call's 1-D
        exchange on the strips, at batch 1."""
        if not self.strip_rows_sent:
            return 0
        rows = self.strip_rows_sent[domain_rank] + self.strip_rows_received[domain_rank]
        return rows * self.strip_row_elements * (2 if self.strip_returns else 1)

    def strip_messages(self, domain_rank: int) -> tuple[int, int]:
        """(forward, backward) messages of the 1-D exchange on the strips."""
        if not self.strip_rows_sent:
            return 0, 0
        sent = self.strip_row_peers_sent[domain_rank]
        received = self.strip_row_peers_received[domain_rank]
        if self.strip_returns:  # the way back sends to the peers it received from, and back
            return sent + received, received + sent
        return sent, received

    def strip_calls(self, domain_rank: int) -> int:
        """Batched P2P calls of one direction of the 1-D exchange on the strips."""
        if not self.strip_rows_sent:
            return 0
        moves = self.strip_rows_sent[domain_rank] or self.strip_rows_received[domain_rank]
        return (2 if self.strip_returns else 1) if moves else 0

    def pass_elements(self, lat: int, lon: int) -> tuple[tuple[int, int], tuple[int, int]]:
        """((row pass, column pass) elements rank (lat, lon) sends in forward, the same in
        backward) at batch 1."""
        if not self.rows_sent:
            return (0, 0), (0, 0)
        cell = self.cell_elements
        rows_fwd = self.rows_sent[lat] * self.in_cols[lon] * cell
        cols_fwd = self.cols_sent[lon] * self.band_rows[lat] * cell
        rows_bwd = self.rows_received[lat] * self.in_cols[lon] * cell
        cols_bwd = self.cols_received[lon] * self.band_rows[lat] * cell
        return (rows_fwd, cols_fwd), (rows_bwd, cols_bwd)

    def sent_elements(self, lat: int, lon: int) -> int:
        """Elements rank (lat, lon) sends per step (forward + backward) at batch 1."""
        r = lat * self.shape[1] + lon
        if self.strips_sent or self.strip_rows_sent:
            moved = self.strips_sent[r] + self.strips_returned[r] if self.strips_sent else 0
            strips = self.strip_elements(r)
            received = self.strip_rows_received[r] * self.strip_row_elements if strips else 0
            if not self.output_grad:  # no backward: the forward's sends only
                moved -= self.strips_returned[r] if self.strips_sent else 0
                strips -= received + (self.strip_rows_sent[r] * self.strip_row_elements
                                      if self.strip_returns else 0)  # fmt: skip
            elif not self.input_grad:  # the first move's and the exchange's backward skipped
                moved -= self.strips_moves[r][1] if self.strips_sent else 0
                strips -= received
            return moved + strips
        fwd, bwd = self.pass_elements(lat, lon)
        return sum(fwd) + (sum(bwd) if self.input_grad else 0)

    def messages(self, lat: int, lon: int) -> tuple[int, int]:
        """(forward, backward) messages rank (lat, lon) sends: one per peer per pass."""
        r = lat * self.shape[1] + lon
        if self.strips_sent or self.strip_rows_sent:
            fwd, bwd = self.strips_messages[r] if self.strips_sent else (0, 0)
            strip_fwd, strip_bwd = self.strip_messages(r)
            if not self.output_grad:
                return fwd + strip_fwd, 0
            if not self.input_grad:
                bwd -= self.strips_back_messages[r] if self.strips_sent else 0
                strip_bwd = self.strip_row_peers_sent[r] if self.strip_returns else 0
            return fwd + strip_fwd, bwd + strip_bwd
        if not self.rows_sent:
            return 0, 0
        fwd = self.row_peers_sent[lat] + self.col_peers_sent[lon]
        bwd = self.row_peers_received[lat] + self.col_peers_received[lon]
        if self.stats_pass:  # that pass sends to every other rank (statistics + halo)
            others = self.shape[0] * self.shape[1] - 1
            rows = self.stats_pass == "rows"
            fwd = others + (self.col_peers_sent[lon] if rows else self.row_peers_sent[lat])
            bwd = others + (self.col_peers_received[lon] if rows else self.row_peers_received[lat])
        return fwd, bwd if self.input_grad else 0

    def passes(self, lat: int, lon: int) -> tuple[bool, bool]:
        """Whether rank (lat, lon) takes part in the row pass / the column pass (a rank with
        nothing to send or receive in a pass makes no call)."""
        if not self.rows_sent:
            return False, False
        rows = bool(self.row_peers_sent[lat] or self.row_peers_received[lat])
        cols = bool(self.col_peers_sent[lon] or self.col_peers_received[lon])
        rows, cols = rows or self.stats_pass == "rows", cols or self.stats_pass == "cols"
        return rows, cols

    def rank_calls(self, domain_rank: int) -> int:
        """Batched P2P calls of one direction (``lat * Q + lon``): one per pass it takes part in."""
        if self.strips_sent or self.strip_rows_sent:
            # two all-to-alls, each one batched call when it moves anything, and the strips'
            moves = self.strips_sent and any(self.strips_messages[domain_rank])
            return (2 if moves else 0) + self.strip_calls(domain_rank)
        return sum(self.passes(*divmod(domain_rank, self.shape[1])))

    def rank_step_calls(self, domain_rank: int) -> int:
        """Batched P2P calls of one step, forward and backward (``lat * Q + lon``); without
        the input's exchange backward where the input needs no gradient (``input_grad``)."""
        calls = self.rank_calls(domain_rank)
        if self.input_grad:
            return 2 * calls
        if not self.output_grad:
            return calls
        if self.strips_sent or self.strip_rows_sent:
            # the first move's and the strips' exchange's backward are skipped (not a return)
            skipped = int(bool(self.strips_sent and any(self.strips_messages[domain_rank])))
            skipped += int(bool(self.strip_calls(domain_rank)))
            return 2 * calls - skipped
        return calls

    def received_elements(self, lat: int, lon: int) -> int:
        """Elements of other tiles in rank (lat, lon)'s window (batch 1): what it saves beyond
        its own tile."""
        if not self.rows_sent:
            return 0
        window = self.band_rows[lat] * (self.in_cols[lon] + self.cols_received[lon])
        return (window - self.in_rows[lat] * self.in_cols[lon]) * self.cell_elements


def _axis(length: int, n: int, windows) -> tuple:
    """(sent, received, peers sent, peers received) per rank of one pass."""
    plans = plan_exchange(length, n, tuple(windows))
    return (
        tuple(p.rows_sent for p in plans),
        tuple(p.rows_received for p in plans),
        tuple(len(p.sends) for p in plans),
        tuple(len(p.recvs) for p in plans),
    )


def tile_layer_plan(
    path: str,
    layer,
    in_shape,
    out_shape,
    shape: tuple[int, int],
    double: bool = False,
    windows=None,
) -> TileLayerPlan:
    """The :class:`TileLayerPlan` of one call of the domain layer ``layer`` (the converter's
    replacement) on an input of ``in_shape`` (batch 1, rows at ``layer.shard_dim``, columns
    last) giving ``out_shape``, on a ``shape`` = (P, Q) domain.  ``double``: float64
    activations (interpolation indices).  ``windows``: instead of ``layer.tile_windows``
    (a conv exchanging for the pad before it, ``tile_fusions.py``; ``in_shape`` the pad's)."""
    p, q = shape
    dim = getattr(layer, "shard_dim", -2) % len(in_shape)
    height, width = in_shape[dim], in_shape[-1]
    out_h, out_w = out_shape[dim % len(out_shape)], out_shape[-1]
    form = domain_form_of(layer) or ""
    base = dict(
        path=path, kind=domain_kind_of(layer), form=form, shape=(p, q), in_hw=(height, width),
        out_hw=(out_h, out_w), out_rows=shard_sizes(out_h, p), out_cols=shard_sizes(out_w, q),
        in_rows=shard_sizes(height, p), in_cols=shard_sizes(width, q),
        cell_elements=math.prod(in_shape) // max(1, height * width),
    )  # fmt: skip
    if form in _NO_EXCHANGE or not form:
        return TileLayerPlan(**base)
    if form == "sequence" and getattr(layer, "tile_exact", False):
        return TileLayerPlan(**base)  # token attention on the tile's tokens: not counted here
    windows = windows or getattr(layer, "tile_windows", None)
    if windows is None and dim != len(in_shape) - 1:
        moves = _strips(in_shape, out_shape, dim, shape)
        return TileLayerPlan(**base, **moves, **_on_strips(layer, in_shape, dim, p * q, double))
    if windows is None:
        return TileLayerPlan(**base, error=f"{form} layer not exact on lat x lon tiles")
    try:
        rows, cols = windows(height, width, (p, q), double=double)
        compact, _ = compact_windows(tuple(rows))
        r_sent, r_recv, r_ps, r_pr = _axis(height, p, compact)
        c_sent, c_recv, c_ps, c_pr = _axis(width, q, cols)
    except ValueError as err:
        return TileLayerPlan(**base, error=str(err))
    return TileLayerPlan(
        **base, band_rows=tuple(len(w) for w in compact), rows_sent=r_sent,
        rows_received=r_recv, row_peers_sent=r_ps, row_peers_received=r_pr, cols_sent=c_sent,
        cols_received=c_recv, col_peers_sent=c_ps, col_peers_received=c_pr,
    )  # fmt: skip


def _on_strips(layer, in_shape, dim: int, n: int, double: bool) -> dict:
    """The 1-D exchange of ``layer`` (a 1-D replacement) over ``n`` latitude strips: its
    windows (``geometry.input_windows_of``), fields of :class:`TileLayerPlan`; none for a
    layer that does not exchange by windows (gathered, sequence attention: collectives)."""
    height = in_shape[dim]
    form = domain_form_of(layer) or ""
    out_rows = max(shard_sizes(_output_height(layer, height), n))
    if n <= 1 or form in _NO_EXCHANGE or form in ("", "gather"):
        return dict(strip_compute_rows=out_rows) if n > 1 else {}
    try:
        windows = input_windows_of(layer, height, n, double=double)
        if windows is None:
            return dict(strip_compute_rows=out_rows)
        sent, received, peers_sent, peers_received = _axis(height, n, windows)
    except ValueError as err:  # not runnable on these strips: in the plan, not dropped
        return dict(strip_compute_rows=out_rows, error=f"on {n} latitude strips: {err}")
    returns = bool(getattr(layer, "returns_rows", False))
    if returns:  # the module runs on whole groups of rows
        out_rows = max(len(w) for w in windows)
    return dict(
        strip_compute_rows=out_rows,
        strip_rows_sent=sent, strip_rows_received=received, strip_row_peers_sent=peers_sent,
        strip_row_peers_received=peers_received,
        strip_row_elements=math.prod(in_shape) // max(1, height),
        strip_returns=returns,
    )  # fmt: skip


def _output_height(layer, height: int) -> int:
    try:
        return int(layer.output_height(height))
    except (AttributeError, TypeError, ValueError):
        return height


def _strips(in_shape, out_shape, dim: int, shape: tuple[int, int]) -> dict:
    """The two all-to-alls of a layer run on latitude strips (``TileStripRelayout``): rows at
    ``dim``, columns the next dim."""
    n = shape[0] * shape[1]
    moves = []
    for full in (in_shape, out_shape):
        h, w = full[dim], full[dim + 1]
        cell = math.prod(full) // max(1, h * w)
        tiles, strips = tile_rects(h, w, shape), strip_rects(h, w, n)
        moves.append((tiles, strips, cell))
    (t_in, s_in, c_in), (t_out, s_out, c_out) = moves
    fwd = [
        a * c_in + b * c_out
        for a, b in zip(moved_elements(t_in, s_in), moved_elements(s_out, t_out))
    ]
    bwd = [
        a * c_out + b * c_in
        for a, b in zip(moved_elements(t_out, s_out), moved_elements(s_in, t_in))
    ]
    moves = tuple(
        (a * c_in, b * c_in, c * c_out, d * c_out)
        for a, b, c, d in zip(
            moved_elements(t_in, s_in), moved_elements(s_in, t_in),
            moved_elements(s_out, t_out), moved_elements(t_out, s_out),
        )
    )  # fmt: skip
    msgs = [
        (a + b, c + d)
        for a, b, c, d in zip(
            moved_peers(t_in, s_in), moved_peers(s_out, t_out),
            moved_peers(t_out, s_out), moved_peers(s_in, t_in),
        )
    ]  # fmt: skip
    return dict(
        strips_sent=tuple(fwd), strips_returned=tuple(bwd), strips_messages=tuple(msgs),
        strips_moves=moves, strips_back_messages=tuple(moved_peers(s_in, t_in)),
    )  # fmt: skip


def tile_layer_plans(trace, shape: tuple[int, int], double: bool = False) -> list[TileLayerPlan]:
    """One :class:`TileLayerPlan` per domain-layer call of ``trace`` (``trace.trace_model``),
    labelled as the 1-D plan labels them (``path (call k)`` from the second call on).  Without
    the exchange fusions (``tile_fusions.fuse_tile_plans`` applies them)."""
    out, seen, calls = [], {}, []
    for path, _, replacement, in_shape, out_shape, *grads in getattr(trace, "relayouts", ()):
        # an adapter run whole on strips (FuXi): its two moves; every layer inside it below
        lay = _relayout_plan(path, replacement, in_shape, out_shape, shape)
        out.append(dataclasses.replace(lay, input_grad=grads[0], output_grad=grads[1]))
        calls.append((replacement, in_shape))
    for index, (path, _, replacement, in_shape, out_shape, x) in enumerate(trace.calls):
        seen[path] = seen.get(path, 0) + 1
        label = path if seen[path] == 1 else f"{path} (call {seen[path]})"
        lay = tile_layer_plan(label, replacement, in_shape, out_shape, shape, double)
        grads = dict(input_grad=x.requires_grad, output_grad=trace.output_grads[index])
        out.append(dataclasses.replace(lay, **grads))
        calls.append((replacement, in_shape))
    # a layer inside one run on strips exchanges over the strips (1-D), not as a tile
    tops = [lay.path for lay in out if lay.strips_sent]
    return [
        _inside_strips(lay, *call, double)
        if any(_under(lay.path, top) for top in tops if top != lay.path)
        else lay
        for lay, call in zip(out, calls)
    ]


def _under(path: str, top: str) -> bool:
    return top in ("", "<root>") or path.startswith(top + ".")


def _relayout_plan(path, replacement, in_shape, out_shape, shape) -> TileLayerPlan:
    """The :class:`TileLayerPlan` of an adapter the converter runs whole on latitude strips:
    its two all-to-alls (the layers inside it count their own exchange on the strips)."""
    dim = getattr(replacement, "shard_dim", -2) % len(in_shape)
    height, width = in_shape[dim], in_shape[-1]
    out_h, out_w = out_shape[dim % len(out_shape)], out_shape[-1]
    p, q = shape
    return TileLayerPlan(
        path=path or "<root>", kind=domain_kind_of(replacement), form="strips", shape=shape,
        in_hw=(height, width), out_hw=(out_h, out_w), out_rows=shard_sizes(out_h, p),
        out_cols=shard_sizes(out_w, q), in_rows=shard_sizes(height, p),
        in_cols=shard_sizes(width, q), cell_elements=math.prod(in_shape) // max(1, height * width),
        **_strips(in_shape, out_shape, dim, shape),
    )  # fmt: skip


def _inside_strips(layer: TileLayerPlan, replacement, in_shape, double: bool) -> TileLayerPlan:
    """``layer`` with no tile exchange of its own (it runs on latitude strips): only its 1-D
    exchange over the P x Q strips."""
    empty = ("band_rows", "rows_sent", "rows_received", "row_peers_sent", "row_peers_received")
    empty += ("cols_sent", "cols_received", "col_peers_sent", "col_peers_received")
    empty += ("strips_sent", "strips_returned", "strips_messages", "strips_moves")
    empty += ("strips_back_messages",)
    p, q = layer.shape
    dim = getattr(replacement, "shard_dim", -2) % len(in_shape)
    strips = _on_strips(replacement, in_shape, dim, p * q, double)
    return dataclasses.replace(layer, **{key: () for key in empty}, error=None, **strips)


def tile_levels(
    input_shapes, layers: Sequence[TileLayerPlan], shape: tuple[int, int]
) -> list[tuple[int, int, tuple[int, ...], tuple[int, ...]]]:
    """``(H, W, rows per latitude rank, columns per longitude rank)`` of every grid size an
    input or a domain layer has, largest first."""
    sizes = {(s[-2], s[-1]) for s in input_shapes if len(s) >= 2}
    for layer in layers:
        sizes.update((layer.in_hw, layer.out_hw))
    p, q = shape
    return [
        (h, w, shard_sizes(h, p), shard_sizes(w, q))
        for h, w in sorted(sizes, key=lambda hw: (hw[0] * hw[1], hw), reverse=True)
    ]


def tile_halo_bytes(
    layers: Sequence[TileLayerPlan],
    *,
    batch_size: int,
    dtype_bytes: int,
    domain_rank: int | None = None,
) -> int:
    """Halo bytes of one training step (forward + backward): what ``domain_rank`` (``lat * Q +
    lon``) sends, or (None) the sum over the domain group."""
    total = 0
    for layer in layers:
        p, q = layer.shape
        ranks = range(p * q) if domain_rank is None else (domain_rank,)
        total += sum(layer.sent_elements(*divmod(r, q)) for r in ranks)
    return total * batch_size * dtype_bytes


def tile_p2p_calls(layers: Sequence[TileLayerPlan], domain_rank: int) -> int:
    """Batched P2P calls of one step (forward + backward) of ``domain_rank``."""
    return sum(layer.rank_step_calls(domain_rank) for layer in layers)


def tile_messages(layers: Sequence[TileLayerPlan], domain_rank: int) -> int:
    """Messages ``domain_rank`` sends per step (forward + backward)."""
    q = layers[0].shape[1] if layers else 1
    return sum(sum(layer.messages(*divmod(domain_rank, q))) for layer in layers)
