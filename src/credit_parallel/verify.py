"""``credit-parallel verify``: prove (or disprove) on a real batch that a layout is exact.

Every rank builds the configured model with the same seed, runs it UNSHARDED on the global batch
(the single-process reference) and a copy under the configured layout (``parallelize``) on its
dp slice and domain shard, then compares the gathered output, the input gradient and every
parameter gradient.  Rank 0 prints a table of max errors with PASS/FAIL against the project's
tolerances (float64: max abs error <= 1e-10; float32: max|a-b|/max|ref| <= 1e-5 for outputs and
input gradients, <= 1e-4 for parameter gradients).
"""

from __future__ import annotations

import argparse
import copy
import os
import sys

import torch
import torch.distributed as dist

__all__ = ["main", "verify_layout"]

INPUT_KEYS = (("x",), ("x_upper", "x_surface"))
TARGET_KEYS = (("y",), ("y_upper", "y_surface"))


def _global_batch(conf: dict, dataset, batch: int, dtype) -> dict:
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
    return {
        "x": torch.randn(batch, m["in_channels"], h, w, generator=g, dtype=dtype),
        "y": torch.randn(batch, m["out_channels"], h, w, generator=g, dtype=dtype),
    }


def _keys(batch: dict, options) -> tuple:
    for keys in options:
        if all(k in batch for k in keys):
            return keys
    raise ValueError(f"batch has none of the expected keys {options}; got {sorted(batch)}")


def _full(t: torch.Tensor) -> torch.Tensor:
    from torch.distributed.tensor import DTensor

    return t.full_tensor() if isinstance(t, DTensor) else t


def _err(a, b) -> tuple[float, float]:
    a, b = a.detach().double(), b.detach().double()
    return float((a - b).abs().max()), float(b.abs().max())


def verify_layout(
    conf: dict, *, dtype=torch.float64, batch_size: int | None = None, dataset=None
) -> list[tuple]:
    """Rows ``(quantity, max_abs_err, max_abs_ref, tolerance_kind)``, identical on every rank."""
    from .composition import get_domain_manager, parallelize
    from .domain.sharding import gather_tensor, shard_batch
    from .mesh import data_parallel_coords
    from .models import build_model
    from .train.loss import latitude_weighted_mse_share, local_lat_weights

    conf = copy.deepcopy(conf)
    conf.setdefault("trainer", {})["amp"] = False  # exactness is checked without bf16
    dp_rank, dp_size = data_parallel_coords(conf)
    per_rank = batch_size or int(conf["trainer"].get("batch_size", 1))
    seed = int(conf["trainer"].get("seed", 0))
    torch.manual_seed(seed)
    ref = build_model(conf["model"]).to(dtype)
    par = copy.deepcopy(ref)
    batch = _global_batch(conf, dataset, per_rank * dp_size, dtype)
    in_keys, out_keys = _keys(batch, INPUT_KEYS), _keys(batch, TARGET_KEYS)
    h = batch[in_keys[0]].shape[-2]
    lat = dataset.lat_weights.to(dtype) if dataset is not None else torch.ones(h, dtype=dtype)

    # ---- single-process reference on the global batch
    xs = [batch[k].clone().requires_grad_(True) for k in in_keys]
    outs = ref(*xs)
    outs = outs if isinstance(outs, tuple) else (outs,)
    targets = [batch[k][:, : o.shape[1]] for k, o in zip(out_keys, outs)]
    loss = sum(latitude_weighted_mse_share(o, t, lat, h) for o, t in zip(outs, targets)) / len(outs)
    loss.backward()

    # ---- the configured layout on this rank's dp slice and domain shard
    par = parallelize(par, conf)
    mgr = get_domain_manager(par)
    sl = slice(dp_rank * per_rank, (dp_rank + 1) * per_rank)
    local = {k: v[sl] for k, v in batch.items()}
    if mgr is not None:
        # only with the model's own manager: manager=None would fall back to a process-wide
        # manager left over from an earlier layout in this process
        local = shard_batch(local, manager=mgr)
    xl = [local[k].detach().clone().requires_grad_(True) for k in in_keys]
    from .domain.guard import FunctionalCallGuard  # functional calls over H on the shards

    with FunctionalCallGuard(par) as guard:
        if mgr is not None and mgr.domain_world_size > 1:
            guard.mark(*xl)
        pouts = par(*xl)
    pouts = pouts if isinstance(pouts, tuple) else (pouts,)
    lat_local = local_lat_weights(lat, mgr)
    ptargets = [local[k][:, : o.shape[1]] for k, o in zip(out_keys, pouts)]
    share = sum(
        latitude_weighted_mse_share(o, t, lat_local, h) for o, t in zip(pouts, ptargets)
    ) / len(pouts)
    share.backward()
    if mgr is not None and mgr.domain_world_size > 1:
        from .collectives import sync_domain_gradients

        sync_domain_gradients(par, mgr, op="sum")

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

    rows = [(f"functional call {f}", float("inf"), 0.0, "guard") for f in guard.findings]
    for i, (po, ro) in enumerate(zip(pouts, outs)):
        full = over_dp(gathered(po.detach()))
        rows.append((f"output {out_keys[i]}", *_err(full, ro), "out"))
    for i, (xp, xr) in enumerate(zip(xl, xs)):
        g = over_dp(gathered(xp.grad)) / dp_size
        rows.append((f"input grad {in_keys[i]}", *_err(g, xr.grad), "out"))
    ref_params = dict(ref.named_parameters())
    for name, p in _named_params(par):
        rg = ref_params[name].grad
        g = _full(p.grad) if p.grad is not None else torch.zeros_like(ref_params[name])
        rows.append(
            (f"grad {name}", *_err(g, rg if rg is not None else torch.zeros_like(g)), "param")
        )
    return rows


def _dp_group(model):
    from .composition import get_device_mesh

    mesh = get_device_mesh(model)
    return (
        mesh["dp"].get_group() if mesh is not None and "dp" in (mesh.mesh_dim_names or ()) else None
    )


def _named_params(model):
    from .composition import get_raw_model

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


def format_table(judged, layout: dict, world: int, dtype) -> str:
    width = max(len(r[0]) for r in judged)
    lines = [
        f"verify: layout {layout} on {world} rank(s), {str(dtype).replace('torch.', '')}",
        f"{'quantity'.ljust(width)}  {'max abs err':>12}  {'max |ref|':>10}  {'tolerance':>12}  result",
    ]
    for name, err, ref, shown, verdict in judged:
        lines.append(f"{name.ljust(width)}  {err:12.3e}  {ref:10.3e}  {shown:>12}  {verdict}")
    failed = sum(1 for r in judged if r[-1] == "FAIL")
    lines.append(f"{len(judged) - failed} passed, {failed} failed")
    return "\n".join(lines)


def main(argv=None) -> int:
    from .config import load_config, parse_parallelism_conf
    from .launch import init_distributed_from_env, under_launcher

    ap = argparse.ArgumentParser(prog="python -m credit_parallel.verify")
    ap.add_argument("--config", required=True)
    ap.add_argument("--dtype", choices=("float64", "float32"), default="float64")
    ap.add_argument("--batch-size", type=int, default=None)
    args = ap.parse_args(argv)
    conf = load_config(args.config)
    dtype = torch.float64 if args.dtype == "float64" else torch.float32
    torch.set_num_threads(max(1, int(os.environ.get("OMP_NUM_THREADS", "1"))))
    if under_launcher():
        from .validate import dist_timeout_s

        init_distributed_from_env(timeout_s=dist_timeout_s(conf))
    dataset = None
    path = (conf.get("data") or {}).get("path")
    if path and os.path.exists(path):
        from .train.trainer import Trainer

        dataset = Trainer._build_dataset(conf, "train")
    rows = judge(
        verify_layout(conf, dtype=dtype, batch_size=args.batch_size, dataset=dataset), dtype
    )
    rank = dist.get_rank() if dist.is_initialized() else 0
    world = dist.get_world_size() if dist.is_initialized() else 1
    if rank == 0:
        print(format_table(rows, parse_parallelism_conf(conf), world, dtype), flush=True)
    failed = any(r[-1] == "FAIL" for r in rows)
    # only after success (see train.main)
    if dist.is_initialized():
        dist.destroy_process_group()
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
