"""The text report of a plan: what ``credit-parallel plan`` prints (layout, rows per level,
domain layers, memory, communication, constraints, notes)."""

from __future__ import annotations

from ..domain.rows import shard_range
from ..layout.config import DataMode
from .make import MAX_RANKS_LISTED, Plan

__all__ = ["format_plan"]


def _human(nbytes: int) -> str:
    value = float(nbytes)
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if value < 1024 or unit == "TiB":
            return f"{value:.0f} {unit}" if unit == "B" else f"{value:.2f} {unit}"
        value /= 1024
    return f"{nbytes} B"


def _ranges(height: int, n: int) -> str:
    return " ".join(f"[{a}:{b})" for a, b in (shard_range(height, n, r) for r in range(n)))


def _table(rows: list[list[str]]) -> list[str]:
    widths = [max(len(row[i]) for row in rows) for i in range(len(rows[0]))]
    return ["  ".join(c.ljust(w) for c, w in zip(row, widths)).rstrip() for row in rows]


def _layout_section(plan: Plan) -> list[str]:
    out: list[str] = []
    n = plan.domain
    out.append("== Layout ==")
    dp = plan.dp if plan.dims is not None else "-"
    lat, lon = plan.dims.domain_shape if plan.dims is not None else (n, 1)
    domain = f"{lat}x{lon} (lat x lon)" if lon > 1 else str(n)
    out.append(
        f"trainer.parallelism: data={plan.data} tensor={plan.tp} domain={domain} -> "
        f"dp={dp} x tp={plan.tp} x domain={domain}"
    )
    if plan.dims is not None and plan.dims.ensemble > 1:
        out[-1] += f" x ensemble={plan.dims.ensemble}"
    if plan.dims is not None:
        axes = ", ".join(f"{name}={size}" for name, size in plan.mesh_axes) or "(none: no mesh)"
        out.append(f"mesh axes kept (build_device_mesh): {axes}")
        h0 = plan.input_shapes[0][-2] if plan.input_shapes else None
        ens = plan.dims.ensemble > 1  # the ensemble axis's columns (SPEC §2)
        rows = [["rank", "dp", "tp", "domain", "dp group", "tp group", "domain group", "rows"]]
        if ens:
            rows[0][2:2], rows[0][6:6] = ["ensemble"], ["ensemble group"]
        w0 = plan.input_shapes[0][-1] if plan.input_shapes else None
        for e in plan.ranks:
            own = "-"
            row, col = divmod(e.domain, lon)  # a lat x lon tile (SPEC §3b)
            if h0 is not None and h0 >= lat:
                a, b = shard_range(h0, lat, row)
                own = f"[{a}:{b}) of {h0}"
                if lon > 1 and w0 is not None:
                    c, d = shard_range(w0, lon, col)
                    own += f" x cols [{c}:{d}) of {w0}"
            rows.append(
                [
                    str(e.rank),
                    str(e.dp),
                    str(e.tp),
                    str(e.domain),
                    str(list(e.dp_group)),
                    str(list(e.tp_group)),
                    str(list(e.domain_group)),
                    own,
                ]
            )
            if ens:
                rows[-1][2:2], rows[-1][6:6] = [str(e.ensemble)], [str(list(e.ensemble_group))]
        out.extend(_table(rows))
        if plan.ranks_omitted:
            out.append(
                f"... {plan.ranks_omitted} ranks not listed (world size > {MAX_RANKS_LISTED}; "
                "the layout repeats: rank g has domain g % domain, tp (g // domain) % tp, "
                "dp g // (tp*domain))"
            )
    else:
        out.append("no rank layout (see violations)")
    return out


def _levels_section(plan: Plan) -> list[str]:
    out: list[str] = []
    n = plan.domain
    what = f"latitude ranks P = {n}" if plan.domain_shape[1] > 1 else f"domain = {n}"
    out.append(f"== Rows per domain rank by resolution level ({what}) ==")
    for index, (h, sizes) in enumerate(plan.levels):
        empty = f"  ({n - h} empty ranks)" if h < n else ""
        out.append(f"level {index}: H={h}  rows {list(sizes)}  {_ranges(h, n)}{empty}")
    if plan.tile_levels:
        p, q = plan.domain_shape
        out.append("")
        out.append(f"== Tiles per domain rank by grid size (lat x lon = {p} x {q}) ==")
        for index, (h, w, rows, cols) in enumerate(plan.tile_levels):
            largest = max(rows) * max(cols)
            empty = sum(1 for r in rows for c in cols if r * c == 0)
            idle = f"  ({empty} tiles empty)" if empty else ""
            out.append(
                f"grid {index}: {h} x {w}  rows {list(rows)} x cols {list(cols)}  "
                f"largest tile {max(rows)} x {max(cols)} = {largest} cells{idle}"
            )
    return out


def _tiles_section(plan: Plan) -> list[str]:
    """Per tile-exchanging layer call: its grid, the halo bytes per step of the busiest rank
    and of the group, and the messages of the busiest rank (forward + backward)."""
    layers = [layer for layer in plan.tile_layers if layer.exchanges or layer.error]
    if not plan.tile_layers:
        return []
    p, q = plan.domain_shape
    b, item = plan.batch_size, plan.memory.activation_dtype_bytes
    out = [f"== Tile exchanges ({len(layers)} of {len(plan.tile_layers)} calls exchange) =="]
    rows = [["module", "kind", "H x W in", "halo/step busiest", "halo/step group", "msgs", ""]]
    ranks = [divmod(r, q) for r in range(p * q)]
    for layer in layers:
        sent = [layer.sent_elements(a, c) * b * item for a, c in ranks]
        msgs = max(sum(layer.messages(a, c)) for a, c in ranks)
        rows.append(
            [
                layer.path,
                layer.kind,
                f"{layer.in_hw[0]} x {layer.in_hw[1]}",
                _human(max(sent)),
                _human(sum(sent)),
                str(msgs),
                f"NOT ON TILES: {layer.error}" if layer.error else _on_strips_note(layer),
            ]
        )
    out.extend(_table(rows))
    out.append(
        "halo/step: bytes sent forward + backward (rows first, then columns of the "
        "row-extended tile); msgs: messages the busiest rank sends per step (one per peer "
        "per pass, each direction)"
    )
    return out


def _on_strips_note(layer) -> str:
    """How a call run on latitude strips exchanges (``tiles.TileLayerPlan``)."""
    if layer.strips_sent:
        inside = " + its 1-D exchange there" if any(layer.strip_rows_sent) else ""
        return f"on strips: 2 all-to-alls{inside}"
    if any(layer.strip_rows_sent):
        return "inside a call on strips: its 1-D exchange there"
    return ""


def _layer_bytes(plan: Plan, layer) -> tuple[str, str]:
    """(extra communication per call over all ranks, activation per rank) of one layer call at
    the run's batch: what attention and gathered modules report, the halo rows otherwise."""
    b, item = plan.batch_size, plan.memory.activation_dtype_bytes
    if layer.communication_bytes or layer.activation_bytes:
        return _human(layer.communication_bytes * b), _human(layer.activation_bytes * b)
    halo = sum(layer.rows_received) * layer.row_elements * b * item
    own = max(layer.out_rows, default=0) * layer.row_elements * b * item
    return (_human(halo) if halo else "-"), _human(own)


def _layers_section(plan: Plan) -> list[str]:
    out: list[str] = []
    out.append(f"== Domain-parallel layers ({len(plan.layers)} calls) ==")
    if plan.layers:
        rows = [
            [
                "module",
                "kind",
                "form",
                "H in->out",
                "out rows/rank",
                "halo before",
                "halo after",
                "comm/call",
                "act/rank",
                "",
            ]
        ]
        for layer in plan.layers:
            comm, act = _layer_bytes(plan, layer)
            rows.append(
                [
                    layer.path,
                    layer.kind,
                    layer.form or "-",
                    f"{layer.in_height}->{layer.out_height}",
                    str(list(layer.out_rows)),
                    str(list(layer.halo_before)),
                    str(list(layer.halo_after)),
                    comm,
                    act,
                    f"ERROR: {layer.error}" if layer.error else "",
                ]
            )
        out.extend(_table(rows))
        out.append(
            "comm/call: extra bytes sent over all domain ranks per forward (the backward sends "
            "as much again); act/rank: the input the busiest rank holds (attention, gather) or "
            "its own rows of the input (other layers), at the run's batch"
        )
    else:
        out.append("(none)")
    return out


def _memory_section(plan: Plan) -> list[str]:
    out: list[str] = []
    m = plan.memory
    out.append("== Memory per rank (estimate) ==")
    if plan.data == DataMode.FSDP2 and not plan.fsdp2_applied:
        sharding = "not sharded: FSDP2 not applied at a one-rank shard group (see the notes)"
    elif plan.data == DataMode.FSDP2:
        size = plan.domain * plan.domain_shape[1]  # P x Q on a lat x lon domain
        over = max(plan.dp, 1) * size
        sharding = (
            f"sharded over dp x domain = {max(plan.dp, 1)} x {size} (FSDP2, dim 0 padded)"
            if size > 1
            else f"sharded over dp={over} (FSDP2, dim 0 padded)"
        )
    else:
        sharding = f"replicated over dp ({plan.data})"
    tp_part = f", TP layers split over tp={plan.tp}" if plan.tp > 1 else ""
    out.append(
        f"parameters      {_human(m.param_bytes):>12}  fp32, {sharding}{tp_part}; "
        f"whole model {_human(m.param_bytes_unsharded)}"
    )
    out.append(f"gradients       {_human(m.grad_bytes):>12}  same layout as the parameters")
    out.append(f"AdamW state     {_human(m.optimizer_bytes):>12}  2 x parameters (fp32 moments)")
    out.append(
        f"saved activ.    {_human(m.activation_bytes):>12}  what autograd saves for backward "
        f"(traced on meta) x batch {plan.batch_size} x {m.activation_dtype_bytes} B, "
        "4-D/5-D fields at the largest rank's rows (tile)"
    )
    if m.exchange_bytes:
        out.append(
            f"exchange        {_human(m.exchange_bytes):>12}  halo-extended inputs the domain "
            "layers save, whole-globe inputs of gathered modules"
        )
    out.append(
        f"backward peak   {_human(m.backward_transient_bytes):>12}  activation gradients alive "
        "at once: the largest layer's output and input gradients"
    )
    out.append(f"conv workspace  {_human(m.workspace_bytes):>12}  {_workspace_reason(m)}")
    out.append(f"batch           {_human(m.batch_bytes):>12}  this rank's inputs and targets")
    other = "cpu" if m.workspace_device == "cuda" else "cuda"
    elsewhere = (
        f"; with --device {other}: {_human(m.total_on(other))}"
        if m.total_on(other) != m.total_bytes
        else ""
    )
    out.append(
        f"total           {_human(m.total_bytes):>12}  peak of a step on {m.workspace_device}"
        f"{elsewhere}; not counted: the framework's own per-process memory (torch "
        "kernels/caches, the CUDA context) and prefetched batches"
    )
    if plan.fsdp_units:
        out.append(
            f"FSDP2 units: {len(plan.fsdp_units)} (largest unsharded while in use: "
            f"{_human(m.fsdp_largest_unit_bytes)}): {', '.join(plan.fsdp_units)}; every "
            "_fsdp2_shard block is a unit unless trainer.fsdp2_min_unit_params: N merges those "
            "under N parameters into their parent's unit"
        )
    return out


def _workspace_reason(m) -> str:
    """Which convolution workspace the memory counts, and why (``cost.conv_workspace_bytes``)."""
    if m.workspace_device == "cuda":
        return (
            "counted for cuda: cuDNN's workspace is bounded by the memory free at the call "
            "(PyTorch takes engines whose workspace fits the caching allocator's largest free "
            "block, and falls back on OOM down to implicit-GEMM engines that need none), so it "
            "never decides whether a step fits; the CPU would allocate the largest "
            f"convolution's im2col columns, {_human(m.im2col_bytes)} (--device cpu)"
        )
    return (
        "counted for cpu: the largest convolution's im2col columns (C_in/groups x kernel x "
        "output positions, whole batch), which PyTorch's CPU convolution allocates; on cuda "
        "cuDNN's bounded workspace counts 0 (--device cuda)"
    )


def _communication_section(plan: Plan) -> list[str]:
    out: list[str] = []
    out.append("== Communication per training step ==")
    q = plan.domain_shape[1]
    per_rank = ", ".join(
        (f"r{r} {divmod(r, q)}: " if q > 1 else f"r{r}: ") + _human(b)
        for r, b in enumerate(plan.halo_bytes_per_rank)
    )
    n = len(plan.halo_bytes_per_rank)
    out.append(
        f"halo bytes (forward + backward): {_human(plan.halo_bytes_per_step)} per domain group"
        + (f"; sent per domain rank {per_rank}" if n > 1 else "")
    )
    out.append("collectives per rank (busiest domain rank):")
    nonzero = {k: v for k, v in plan.collectives.items() if v}
    if nonzero:
        for kind, count in nonzero.items():
            out.append(f"  {kind:<28} {count}")
    else:
        out.append("  (none)")
    if plan.tp_targets and plan.tp > 1:
        listed = ", ".join(f"{p} ({role})" for p, role in plan.tp_targets)
        out.append(f"tensor-parallel layers: {listed}")
    return out


def _constraints_section(plan: Plan) -> list[str]:
    out: list[str] = []
    out.append(f"== Constraints ({len(plan.violations)} violated) ==")
    if plan.violations:
        out.extend(f"- {v}" for v in plan.violations)
    else:
        out.append("all satisfied")
    if plan.notes:
        out.append("")
        out.append("== Notes ==")
        out.extend(f"- {note}" for note in plan.notes)
    return out


def format_plan(plan: Plan) -> str:
    """A readable multi-section report of ``plan`` (what ``credit-parallel plan`` prints)."""
    out: list[str] = []
    shapes = ", ".join(str((plan.batch_size, *s)) for s in plan.input_shapes)
    out.append(
        f"credit-parallel plan: model {plan.model_type} ({plan.model_class}, "
        f"{plan.parameter_count:,} parameters), world size {plan.world_size}"
    )
    out.append(f"inputs per rank (batch x shape): {shapes}; amp={plan.amp}")
    for section in (
        _layout_section,
        _levels_section,
        _layers_section,
        _tiles_section,
        _memory_section,
        _communication_section,
        _constraints_section,
    ):
        lines = section(plan)
        if lines:
            out.append("")
            out.extend(lines)
    return "\n".join(out) + "\n"
