"""``credit-parallel verify``: prove (or disprove) on a real batch that a layout is exact.

Every rank builds the configured model with the same seed, runs it UNSHARDED on the global batch
(the single-process reference) and a copy under the configured layout (``parallelize``) on its
dp slice and domain shard, then compares the gathered output, the input gradient and every
parameter gradient.  Rank 0 prints a table of max errors with PASS/FAIL against the project's
tolerances (float64: max abs error <= 1e-10; float32: max|a-b|/max|ref| <= 1e-5 for outputs and
input gradients, <= 1e-4 for parameter gradients).

On a GPU the two runs are made comparable first (:func:`credit_parallel.layout.device.deterministic_kernels`,
named in the table's header): TF32 off for matmuls and cuDNN convolutions, deterministic
algorithms, cuDNN deterministic and not benchmarking.  Without that, float32 runs of ONE function
differ by TF32 rounding (relative ~1e-4), above the float32 tolerance.

Mixed precision: verify always compares with ``trainer.amp`` off.  Under bf16 autocast (8
mantissa bits, a relative rounding of 2^-9 ~ 2e-3 per operation) two runs of one function that sum
in a different order (a different layout, kernel or shard) differ by bf16 rounding accumulated
over the layers: relative differences of order 1e-2 for outputs and gradients (measured on the
demo U-Net at 33 x 64, domain 2 against one process, both under CPU bf16 autocast: output 1.1e-2,
input gradient 1.3e-2, parameter gradients 1.1e-2; float32 without amp: 1-3e-6), so the float32
tolerances above do not apply; exactness is established in float64/float32 with amp off, and an
amp run of a layout is judged against the same amp run of the single process at a relative
tolerance of 5e-2.
"""

from __future__ import annotations

import argparse
import contextlib
import copy
import logging
import os
import sys

import torch
import torch.distributed as dist

from ..domain.guard import FunctionalCallGuard
from ..domain.sharding import gather_tensor, shard_batch
from ..layout.device import batch_to_device, deterministic_kernels, device_for_process_group
from ..layout.mesh import data_parallel_coords
from ..models import build_model
from ..parallel.composition import get_domain_manager, parallelize
from ..planner.trace import model_input_shapes
from ..train.loss import local_lat_weights
from ..train.step import TrainStep, batch_keys, latitude_weighted_loss
from .verify_ensemble import VerifyEnsemble

__all__ = [
    "format_table",
    "judge",
    "layout_run",
    "main",
    "quiet_sequential_gathers",
    "reference_run",
    "summarize",
    "verify_layout",
]


def _global_batch(conf: dict, dataset, batch: int, dtype, model=None) -> dict:
    """The global batch on the host: ``batch`` samples of the dataset, or random tensors of the
    model's shapes (the generator is a host one, so every rank draws the same numbers)."""
    if dataset is not None:
        samples = [dataset[i] for i in range(batch)]
        return {
            k: torch.stack([s[k] for s in samples]).to(dtype)
            for k in samples[0]
            if k != "time_index"
        }
    m = conf["model"]
    g = torch.Generator().manual_seed(1)
    h, w = m["image_height"], m["image_width"]
    if str(m.get("type", "")).lower() == "pangu":
        z = m["levels"]
        return {
            "x_upper": torch.randn(batch, m["upper_channels"], z, h, w, generator=g, dtype=dtype),
            "x_surface": torch.randn(batch, m["surface_channels"], h, w, generator=g, dtype=dtype),
            "y_upper": torch.randn(batch, m["upper_channels"], z, h, w, generator=g, dtype=dtype),
            "y_surface": torch.randn(batch, m["surface_channels"], h, w, generator=g, dtype=dtype),
        }
    if "in_channels" in m and "out_channels" in m:
        return {
            "x": torch.randn(batch, m["in_channels"], h, w, generator=g, dtype=dtype),
            "y": torch.randn(batch, m["out_channels"], h, w, generator=g, dtype=dtype),
        }
    return _batch_of_the_model(model, batch, dtype, g)


def _batch_of_the_model(model, batch: int, dtype, g) -> dict:
    """A random batch of the shapes the model itself declares (``input_shapes`` or its
    in_channels/image_height/image_width attributes: a CREDIT model block names its channels
    per variable group, not as ``in_channels``); the targets take the shape of its output."""
    if model is None:
        raise ValueError(
            "verify without data.path needs model.in_channels / out_channels, or a model that "
            "declares its input shapes"
        )
    (shape,) = model_input_shapes(model)
    x = torch.randn(batch, *shape, generator=g, dtype=dtype)
    probe = copy.deepcopy(model).eval()  # the model's buffers (norm statistics) stay untouched
    with torch.no_grad():
        out = probe(x.to(next(probe.parameters()).device))
    out = out[0] if isinstance(out, (tuple, list)) else out
    return {"x": x, "y": torch.randn(tuple(out.shape), generator=g, dtype=dtype)}


class _SequentialGatherFilter(logging.Filter):
    """Drops DTensor's "N sequential all_gather operations" warning.

    Gathering a gradient sharded over dp (FSDP2, strided) and tp takes one all-gather per mesh
    axis in non-ascending order; torch warns once per parameter and rank, which floods the
    output of a verify run with hundreds of identical lines.  Here it is harmless: the gathers
    run once, off the training path, and an all-gather copies values (no reduction whose order
    could differ between ranks).
    """

    def filter(self, record: logging.LogRecord) -> bool:
        return "sequential all_gather" not in record.getMessage()


@contextlib.contextmanager
def quiet_sequential_gathers():
    """Within the block, DTensor's sequential all-gather warning is not logged (see
    :class:`_SequentialGatherFilter` for why that is safe)."""
    logger = logging.getLogger("torch.distributed.tensor._redistribute")
    flt = _SequentialGatherFilter()
    logger.addFilter(flt)
    try:
        yield
    finally:
        logger.removeFilter(flt)


def _full(t: torch.Tensor) -> torch.Tensor:
    from torch.distributed.tensor import DTensor

    if not isinstance(t, DTensor):
        return t
    with quiet_sequential_gathers():
        return t.full_tensor()


def _err(a, b) -> tuple[float, float]:
    a, b = a.detach().double(), b.detach().double()
    return float((a - b).abs().max()), float(b.abs().max())


def _requires_grad(batch: dict, keys) -> dict:
    """A copy of ``batch`` whose ``keys`` are fresh leaves that record their gradient."""
    out = dict(batch)
    for k in keys:
        out[k] = batch[k].detach().clone().requires_grad_(True)
    return out


def reference_run(model, batch: dict, lat_weights: torch.Tensor, loss_fn=None, members: int = 1):
    """The single-process step on the global batch: (inputs with their gradients, outputs).
    ``loss_fn`` / ``members``: an ensemble's CRPS loss and its K members (verify_ensemble.py)."""
    in_keys, _ = batch_keys(batch)
    batch = _requires_grad(batch, in_keys)
    h = batch[in_keys[0]].shape[-2]
    loss_fn = loss_fn or latitude_weighted_loss(lat_weights, h)
    step = TrainStep(model, loss_fn, shard_inputs=False, members=members)
    _, outputs = step.forward_backward(batch)
    return [batch[k] for k in in_keys], outputs


def layout_run(
    model,
    local: dict,
    lat_weights: torch.Tensor,
    manager,
    global_height: int,
    global_width: int | None = None,
    loss_fn=None,
    members: int = 1,
):
    """The same step under the layout on this rank's dp slice and domain shard ``local``:
    (inputs with their gradients, outputs, functional-call findings), gradients reduced over
    the domain.  The model runs under the functional-call guard: a call such as F.interpolate
    on a sharded activation is reported with its module path and call site."""
    in_keys, _ = batch_keys(local)
    local = _requires_grad(local, in_keys)
    step = TrainStep(
        model,
        loss_fn
        or latitude_weighted_loss(
            local_lat_weights(lat_weights, manager), global_height, global_width
        ),
        manager=manager,
        shard_inputs=False,
        guard=FunctionalCallGuard,
        members=members,
    )
    _, outputs = step.forward_backward(local)
    step.reduce_gradients()
    return [local[k] for k in in_keys], outputs, step.findings


def _prepare(conf: dict, dtype, batch_size, dataset, device):
    """(reference model, its parallel copy, global batch, latitude weights), all on ``device``."""
    per_rank = batch_size or int(conf["trainer"].get("batch_size", 1))
    _, dp_size = data_parallel_coords(conf)
    torch.manual_seed(int(conf["trainer"].get("seed", 0)))
    ref = build_model(conf["model"]).to(device=device, dtype=dtype)
    par = copy.deepcopy(ref)
    batch = batch_to_device(
        _global_batch(conf, dataset, per_rank * dp_size, dtype, model=ref), device
    )
    h = batch[batch_keys(batch)[0][0]].shape[-2]
    if dataset is not None:
        lat = dataset.lat_weights.to(device=device, dtype=dtype)
    else:
        lat = torch.ones(h, dtype=dtype, device=device)
    return ref, par, batch, lat, per_rank


def verify_layout(
    conf: dict, *, dtype=torch.float64, batch_size: int | None = None, dataset=None, device=None
) -> list[tuple]:
    """Rows ``(quantity, max_abs_err, max_abs_ref, tolerance_kind)``, identical on every rank.

    ``device``: where models and batches live (default: the process group's device).
    """
    conf = copy.deepcopy(conf)
    conf.setdefault("trainer", {})["amp"] = False  # exactness is checked without bf16
    device = torch.device(device) if device is not None else device_for_process_group()
    dp_rank, dp_size = data_parallel_coords(conf)
    ref, par, batch, lat, per_rank = _prepare(conf, dtype, batch_size, dataset, device)
    in_keys, out_keys = batch_keys(batch)
    h = batch[in_keys[0]].shape[-2]
    ens = VerifyEnsemble.from_conf(conf)
    torch.manual_seed(ens.seed)  # a stochastic model draws from the same state in both runs
    xs, outs = reference_run(ref, batch, lat, ens.reference_loss(lat, h), ens.members)

    par = parallelize(par, conf)
    mgr = get_domain_manager(par)
    sl = slice(dp_rank * per_rank, (dp_rank + 1) * per_rank)
    local = {k: v[sl] for k, v in batch.items()}
    if mgr is not None:
        # only with the model's own manager: manager=None would fall back to a process-wide
        # manager left over from an earlier layout in this process
        local = shard_batch(local, manager=mgr)
    # on lat x lon tiles (SPEC §3b) the loss also needs the global width
    w = batch[in_keys[0]].shape[-1] if getattr(mgr, "is_tiled", False) else None
    torch.manual_seed(ens.seed)
    loss_fn = ens.layout_loss(par, lat, mgr, h, w)
    xl, pouts, findings = layout_run(par, local, lat, mgr, h, w, loss_fn, ens.local_members)

    def gathered(t):
        return gather_tensor(t, -2, mgr) if mgr is not None else t

    def over_dp(t):
        """Concatenate the dp slices of a (domain-gathered) batch tensor."""
        if dp_size == 1:
            return t
        group = mgr.data_parallel_group if mgr is not None else _dp_group(par)
        parts = [torch.empty_like(t) for _ in range(dp_size)]
        dist.all_gather(parts, t.contiguous(), group=group)
        return torch.cat(parts, 0)

    rows = [(f"functional call {f}", float("inf"), 0.0, "guard") for f in findings]
    for i, (po, ro) in enumerate(zip(pouts, outs)):
        full = over_dp(ens.members_gathered(gathered(po.detach()), par))
        rows.append((f"output {out_keys[i]}", *_err(full, ro), "out"))
    for i, (xp, xr) in enumerate(zip(xl, xs)):
        g = over_dp(ens.input_grad_summed(gathered(xp.grad), par)) / dp_size
        rows.append((f"input grad {in_keys[i]}", *_err(g, xr.grad), "out"))
    ref_params = dict(ref.named_parameters())
    for name, p in _named_params(par):
        rg = ref_params[name].grad
        g = _full(p.grad) if p.grad is not None else torch.zeros_like(ref_params[name])
        rows.append(
            (f"grad {name}", *_err(g, rg if rg is not None else torch.zeros_like(g)), "param")
        )
    rows += _tp_spread_rows(par)
    return rows


def _tp_spread_rows(model) -> list[tuple]:
    """A replicated parameter whose gradient differs across the tp ranks (each holding only
    its heads' share) is a FAIL row of its own: the cause, not only the symptom."""
    from ..parallel.composition import get_device_mesh, get_raw_model
    from ..parallel.tensor_parallel import tp_replicated_parameters
    from ..parallel.tensor_parallel_guard import replicated_gradient_spread

    mesh = get_device_mesh(model)
    if mesh is None or "tp" not in (mesh.mesh_dim_names or ()):
        return []
    params = tp_replicated_parameters(get_raw_model(model))
    spread = replicated_gradient_spread(params, mesh["tp"].get_group())
    return [(f"tp ranks agree on grad {n}", d, ref, "param") for n, d, ref in spread]


def _dp_group(model):
    from ..parallel.composition import get_device_mesh

    mesh = get_device_mesh(model)
    return (
        mesh["dp"].get_group() if mesh is not None and "dp" in (mesh.mesh_dim_names or ()) else None
    )


def _named_params(model):
    from ..parallel.composition import get_raw_model

    raw = get_raw_model(model)
    return list(raw.named_parameters())


def judge(rows, dtype) -> list[tuple]:
    """Append PASS/FAIL to each row by the project's tolerances."""
    out = []
    for name, err, ref, kind in rows:
        if dtype == torch.float64:
            tol = 1e-10
            ok = err <= tol
            shown = f"abs <= {tol:.0e}"
        else:
            tol = 1e-4 if kind == "param" else 1e-5
            ok = err <= tol * max(ref, 1e-30)
            shown = f"rel <= {tol:.0e}"
        out.append((name, err, ref, shown, "PASS" if ok else "FAIL"))
    return out


# Per-parameter checks: one summary row per group unless ``--all`` (longest prefix first).
GROUP_PREFIXES = ("tp ranks agree on grad ", "grad ")


def _severity(row) -> float:
    """How far a judged row is from its tolerance, comparable within a group: the absolute
    error under an absolute tolerance, the relative one under a relative tolerance."""
    _, err, ref, shown, _ = row
    return err if shown.startswith("abs") else err / max(ref, 1e-30)


def summarize(judged) -> list[tuple]:
    """The judged rows with each per-parameter group (:data:`GROUP_PREFIXES`: parameter
    gradients, tp agreement of replicated gradients) folded into ONE row at the group's first
    position: its count, its worst parameter (largest error against the tolerance) with that
    parameter's errors, and PASS only when every row of the group passes (a FAIL anywhere makes
    the group FAIL, naming how many failed and the worst).  Other rows (outputs, input
    gradients, functional-call findings) are kept as they are."""
    groups: dict[str, list] = {}
    order: list = []
    for row in judged:
        prefix = next((p for p in GROUP_PREFIXES if row[0].startswith(p)), None)
        if prefix is None:
            order.append(row)
            continue
        if prefix not in groups:
            groups[prefix] = []
            order.append(prefix)
        groups[prefix].append(row)
    out = []
    for item in order:
        if not isinstance(item, str):
            out.append(item)
            continue
        rows = groups[item]
        failed = [r for r in rows if r[-1] == "FAIL"]
        worst = max(failed or rows, key=_severity)
        what = "parameter" if len(rows) == 1 else "parameters"
        verdict = f"FAIL ({len(failed)} of {len(rows)})" if failed else "PASS"
        label = f"{item.rstrip()}: {len(rows)} {what}, worst {worst[0][len(item) :]}"
        out.append((label, worst[1], worst[2], worst[3], verdict))
    return out


def format_table(
    judged, layout: dict, world: int, dtype, device=None, pinned=None, full: bool = True
) -> str:
    """The table rank 0 prints; the header names the device and, on a GPU, the determinism
    settings the comparison ran under (``pinned``).  ``full=False``: one row per
    per-parameter group (:func:`summarize`); the pass/fail counts are those of every check."""
    shown_rows = judged if full else summarize(judged)
    width = max(len(r[0]) for r in shown_rows)
    where = f" on {device}" if device is not None else ""
    lines = [
        f"verify: layout {layout} on {world} rank(s){where}, {str(dtype).replace('torch.', '')}"
        + (f"; determinism: {pinned}" if pinned else ""),
        f"{'quantity'.ljust(width)}  {'max abs err':>12}  {'max |ref|':>10}  {'tolerance':>12}  result",
    ]
    for name, err, ref, shown, verdict in shown_rows:
        lines.append(f"{name.ljust(width)}  {err:12.3e}  {ref:10.3e}  {shown:>12}  {verdict}")
    failed = sum(1 for r in judged if r[-1] == "FAIL")
    lines.append(f"{len(judged) - failed} passed, {failed} failed")
    if len(shown_rows) < len(judged):
        lines.append(
            f"({len(judged)} checks in {len(shown_rows)} rows: one row per parameter group with "
            "its worst parameter; --all lists every row)"
        )
    return "\n".join(lines)


def main(argv=None) -> int:
    from ..layout.config import load_config, parse_parallelism_conf
    from ..layout.launch import init_distributed_from_env, under_launcher

    ap = argparse.ArgumentParser(prog="python -m credit_parallel.tools.verify")
    ap.add_argument("--config", required=True)
    ap.add_argument("--dtype", choices=("float64", "float32"), default="float64")
    ap.add_argument("--batch-size", type=int, default=None)
    ap.add_argument("--all", action="store_true", help="every row, not one per parameter group")
    args = ap.parse_args(argv)
    conf = load_config(args.config)
    dtype = torch.float64 if args.dtype == "float64" else torch.float32
    torch.set_num_threads(max(1, int(os.environ.get("OMP_NUM_THREADS", "1"))))
    if under_launcher():
        from ..train.preflight import dist_timeout_s

        init_distributed_from_env(timeout_s=dist_timeout_s(conf))
    dataset = None
    path = (conf.get("data") or {}).get("path")
    from ..data.multistore import missing_store

    if path and missing_store(path) is None:  # a store, a glob of stores or a list
        from ..data.dataset import dataset_from_conf

        dataset = dataset_from_conf(conf, "train")
    device = device_for_process_group()
    with deterministic_kernels(device) as pinned:
        rows = judge(
            verify_layout(
                conf, dtype=dtype, batch_size=args.batch_size, dataset=dataset, device=device
            ),
            dtype,
        )
    rank = dist.get_rank() if dist.is_initialized() else 0
    world = dist.get_world_size() if dist.is_initialized() else 1
    if rank == 0:
        layout = parse_parallelism_conf(conf)
        table = format_table(rows, layout, world, dtype, device, pinned, full=args.all)
        print(table, flush=True)
    failed = any(r[-1] == "FAIL" for r in rows)
    # only after success (see train.main)
    if dist.is_initialized():
        dist.destroy_process_group()
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
