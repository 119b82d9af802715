"""Projected step time and efficiency E of the 0.25-degree U-Net and CrossFormer on GPU clusters.

No multi-GPU machine is at hand, so the step is projected (``credit_parallel.planner.projection``:
an alpha-beta model) from

* the planner's per-layer-call plan at each domain size (``make_plan``: rows per rank, halo rows,
  GroupNorm statistics collectives, attention bytes, parameter count);
* a single-device compute profile per layer path: ``--profile-file`` (JSON ``{"layers": {path:
  seconds}, "rest_s": s, "source": "..."}``, one sample, forward + backward, whole grid: e.g.
  measured on one GPU) or, by default, a roofline on an H100 SXM from the layers' FLOPs and bytes
  counted on the meta device (``torch.utils.flop_counter``): ``max(flops / (peak x
  --mfu), bytes / HBM bandwidth)`` per leaf module;
* links: NVLink 4 inside a node of 8 GPUs, NDR InfiniBand across (``--nvlink-*``, ``--ib-*``;
  docs/performance.md gives the figures and their sources).

Layouts: every domain size the planner accepts (powers of two) x dp = GPUs / domain, ``data:
none`` (dp 1) or ``ddp``; DDP's all-reduce overlapped with the backward, the domain group's after
it (``--domain-overlap 1`` for ``grad_overlap``).  ``--check`` compares the model with this CPU:
it fits gloo's alpha/beta from timed exchanges at 2 ranks, measures the single-process per-layer
profile, predicts the domain-2 step and times the real one (``efficiency.py``'s step).

    PYTHONPATH=src .venv/bin/python benchmarks/projection.py
    PYTHONPATH=src .venv/bin/python benchmarks/projection.py --check unet/large,conv_stack/large
    # 1-D vs every lat x lon split at 8/16/32/64 domain ranks (issue 26 item 5):
    PYTHONPATH=src .venv/bin/python benchmarks/projection.py --splits 8,16,32,64
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import statistics
import time

import torch
from torch import nn

from credit_parallel.planner.projection import (
    Cluster,
    ComputeProfile,
    Link,
    project_step,
)

__all__ = [
    "fit_gloo",
    "main",
    "measured_profile",
    "parse_args",
    "roofline_profile",
    "write_profile",
]

BUNDLED_UNET = "era5_025deg_unet.yaml"
# CREDIT's 0.25-degree WXFormer layout (640 x 1280 grid, 4 levels), in this package's CrossFormer
CROSSFORMER_025 = {
    "type": "crossformer",
    "in_channels": 71,
    "out_channels": 71,
    "image_height": 640,
    "image_width": 1280,
    "dims": [128, 256, 512, 1024],
    "depths": [2, 2, 8, 2],
    "dim_head": 32,
    "window_sizes": [10, 10, 10, 5],
    "embed_kernels": [[4, 8, 16, 32], [2, 4], [2, 4], [2, 4]],
    "embed_strides": [4, 2, 2, 2],
    "mlp_ratio": 4,
    "norm_groups": 32,
}
# H100 SXM5 (NVIDIA data sheet): 989 TFLOP/s dense bf16, 3.35 TB/s HBM3
H100_BF16_FLOPS = 989e12
H100_HBM_BYTES_S = 3.35e12


def parse_args(argv=None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--gpus", default="8,64,256")
    parser.add_argument("--models", default="unet,crossformer")
    parser.add_argument("--profile-file", default=None, help="per-layer GPU profile (JSON)")
    parser.add_argument("--mfu", type=float, default=0.4, help="roofline: sustained / peak")
    parser.add_argument("--gpus-per-node", type=int, default=8)
    parser.add_argument("--nvlink-alpha-us", type=float, default=3.0)
    parser.add_argument("--nvlink-gbs", type=float, default=360.0, help="GB/s, one direction")
    parser.add_argument("--ib-alpha-us", type=float, default=10.0)
    parser.add_argument("--ib-gbs", type=float, default=45.0, help="GB/s, one direction")
    parser.add_argument("--domain-overlap", type=float, default=0.0)
    parser.add_argument("--batch", type=int, default=1, help="samples per dp rank")
    parser.add_argument("--check", default="", help="CPU check workloads (efficiency.py names)")
    parser.add_argument("--check-rounds", type=int, default=3)
    parser.add_argument("--json", default=None, help="write the rows here")
    parser.add_argument("--measure-profile", default=None, help="write a per-layer profile here")
    parser.add_argument("--device", default="cpu", help="--measure-profile: cpu or cuda")
    parser.add_argument("--grid-divisor", type=int, default=4, help="--measure-profile: grid / k")
    parser.add_argument(
        "--splits",
        default="",
        help="domain sizes (e.g. 8,16,32,64): 1-D vs every lat x lon split (issue 26 item 5)",
    )
    return parser.parse_args(argv)


# --------------------------------------------------------------------------- compute profiles
def _leaf_modules(model: nn.Module, paths: set[str]) -> dict[str, nn.Module]:
    """The planned layer paths and every leaf module outside them (the units profiled)."""
    units = {p: model.get_submodule(p) for p in paths}
    for name, module in model.named_modules():
        if not name or list(module.children()):
            continue
        if any(name == p or name.startswith(p + ".") for p in paths):
            continue
        units[name] = module
    return units


def _io_numel(units: dict[str, nn.Module], run) -> dict[str, int]:
    """Elements read + written by each unit's calls during ``run()`` (forward hooks)."""
    numel: dict[str, int] = {}
    handles = []

    def hook(name):
        def record(module, args, output):
            total = sum(a.numel() for a in args if isinstance(a, torch.Tensor))
            outs = output if isinstance(output, (tuple, list)) else (output,)
            total += sum(o.numel() for o in outs if isinstance(o, torch.Tensor))
            numel[name] = numel.get(name, 0) + total

        return record

    for name, module in units.items():
        handles.append(module.register_forward_hook(hook(name)))
    try:
        run()
    finally:
        for h in handles:
            h.remove()
    return numel


def roofline_profile(
    model: nn.Module,
    input_shape,
    paths: set[str],
    *,
    dtype_bytes: int,
    flops_s: float,
    hbm_bytes_s: float,
) -> ComputeProfile:
    """Seconds per unit on one device: max(FLOPs / flops_s, 3 x bytes in+out / HBM) over the
    unit's forward + backward (FLOPs counted on meta, backward included)."""
    from torch.utils.flop_counter import FlopCounterMode

    model = model.to("meta")
    units = _leaf_modules(model, paths)
    root = type(model).__name__

    def run():
        x = torch.empty((1, *input_shape), device="meta", requires_grad=True)
        model(x).sum().backward()

    numel = _io_numel(units, run)
    with FlopCounterMode(display=False, depth=None) as counter:
        run()
    counts = counter.get_flop_counts()
    layers = {}
    for name in units:
        flops = sum(counts.get(f"{root}.{name}", {}).values())
        bytes_moved = 3 * numel.get(name, 0) * dtype_bytes  # forward, and twice in backward
        layers[name] = max(flops / flops_s, bytes_moved / hbm_bytes_s)
    source = f"roofline {flops_s / 1e12:.0f} TFLOP/s sustained, {hbm_bytes_s / 1e12:.2f} TB/s"
    return ComputeProfile(layers, 0.0, source)


def measured_profile(
    model: nn.Module,
    input_shape,
    paths: set[str],
    repeats: int = 3,
    *,
    device: str = "cpu",
    autocast: bool = False,
) -> ComputeProfile:
    """Per-unit forward + backward seconds on ``device`` (CPU: 1 thread, float32; ``autocast``:
    bf16 autocast), each unit timed alone on the inputs it gets in the model; ``rest_s``: the
    whole step minus them."""
    dev = torch.device(device)
    if dev.type == "cpu":
        torch.set_num_threads(1)
    model = model.to(dev)
    units = _leaf_modules(model, paths)
    inputs: dict[str, list] = {}
    handles = []

    def context():
        if not autocast:
            return contextlib.nullcontext()
        return torch.autocast(dev.type, dtype=torch.bfloat16)

    def sync():
        if dev.type == "cuda":
            torch.cuda.synchronize(dev)

    def hook(name):
        def record(module, args):
            inputs.setdefault(name, []).append(
                [a.detach().clone() if isinstance(a, torch.Tensor) else a for a in args]
            )

        return record

    for name, module in units.items():
        handles.append(module.register_forward_pre_hook(hook(name)))
    x = torch.randn(1, *input_shape, device=dev)
    with torch.no_grad(), context():
        model(x)
    for h in handles:
        h.remove()

    def whole():
        model.zero_grad(set_to_none=True)
        with context():
            out = model(x.clone().requires_grad_())
        out.float().square().mean().backward()

    def timed(fn) -> float:
        fn()
        samples = []
        for _ in range(repeats):
            sync()
            t0 = time.perf_counter()
            fn()
            sync()
            samples.append(time.perf_counter() - t0)
        return statistics.median(samples)

    layers = {}
    for name, module in units.items():
        calls = inputs.get(name, [])

        def unit(module=module, calls=calls):
            for args in calls:
                args = [a.requires_grad_() if torch.is_tensor(a) and a.is_floating_point() else a
                        for a in (t.clone() if torch.is_tensor(t) else t for t in args)]  # fmt: skip
                with context():
                    out = module(*args)
                out = out[0] if isinstance(out, (tuple, list)) else out
                out.backward(torch.ones_like(out))

        layers[name] = timed(unit) if calls else 0.0
    inputs.clear()
    total = timed(whole)
    rest = max(0.0, total - sum(layers.values()))
    where = "this CPU, 1 thread" if dev.type == "cpu" else torch.cuda.get_device_name(dev)
    return ComputeProfile(layers, rest, f"measured on {where} (step {total * 1e3:.1f} ms)")


def write_profile(args) -> None:
    """``--measure-profile OUT``: the per-layer profile of ``--models`` (one model) on
    ``--device``, on a grid ``--grid-divisor`` times smaller in each direction (memory), scaled
    back by the area ratio; written as the JSON ``--profile-file`` reads."""
    from credit_parallel.models import build_model
    from credit_parallel.planner.trace import model_input_shapes

    (name,) = [m.strip() for m in args.models.split(",") if m.strip()]
    conf = _model_conf(name)
    full = conf["model"]
    small = dict(full)
    k = args.grid_divisor
    small["image_height"], small["image_width"] = (
        -(-full["image_height"] // k),
        -(-full["image_width"] // k),
    )
    scale = (
        full["image_height"] * full["image_width"] / (small["image_height"] * small["image_width"])
    )
    small_conf = {**conf, "model": small}
    paths = {layer.path for layer in _plan(small_conf, 1, 1).layers}
    model = build_model(dict(small))
    shape = model_input_shapes(model)[0]
    profile = measured_profile(
        model, shape, paths, device=args.device, autocast=args.device != "cpu"
    )
    data = {
        "layers": {p: t * scale for p, t in profile.layers.items()},
        "rest_s": profile.rest_s * scale,
        "source": f"{profile.source}, {small['image_height']}x{small['image_width']} x {scale:.1f}",
    }
    with open(args.measure_profile, "w") as fh:
        json.dump(data, fh, indent=1)
    print(
        f"wrote {args.measure_profile}: {data['source']}, total {sum(data['layers'].values()) + data['rest_s']:.4f} s"
    )


# --------------------------------------------------------------------------- plans and tables
def _plan(conf: dict, domain: int, dp: int, model=None, shapes=None):
    from credit_parallel.planner.make import make_plan

    conf = dict(conf)
    data = "none" if dp == 1 else "ddp"
    conf["trainer"] = {
        **conf.get("trainer", {}),
        "parallelism": {"data": data, "tensor": 1, "domain": domain},
    }
    return make_plan(conf, domain * dp, model=model, input_shapes=shapes)


def _model_conf(name: str) -> dict:
    import importlib.resources

    import yaml

    if name == "unet":
        text = importlib.resources.files("credit_parallel.configs").joinpath(BUNDLED_UNET)
        conf = yaml.safe_load(text.read_text())
        conf["trainer"] = {"batch_size": 1, "amp": True}
        return {"model": conf["model"], "trainer": conf["trainer"]}
    if name == "crossformer":
        return {"model": dict(CROSSFORMER_025), "trainer": {"batch_size": 1, "amp": True}}
    raise SystemExit(f"--models: unknown {name!r} (unet, crossformer)")


def project_model(name: str, args, cluster: Cluster) -> list[dict]:
    from credit_parallel.planner.sync_points import sync_points_per_step
    from credit_parallel.planner.trace import build_meta_model, model_input_shapes

    conf = _model_conf(name)
    gpus = [int(g) for g in args.gpus.split(",")]
    plans = {}
    for domain in (2**k for k in range(0, 10)):
        if domain > max(gpus):
            break
        plan = _plan(conf, domain, 1)
        if plan.violations:
            print(f"  {name}: domain {domain} not planned: {plan.violations[0][:150]}")
            continue
        plans[domain] = plan
    base = plans[1]
    paths = {layer.path for layer in base.layers}
    if args.profile_file:
        with open(args.profile_file) as fh:
            data = json.load(fh)
        profile = ComputeProfile(data["layers"], data.get("rest_s", 0.0), data.get("source", ""))
    else:
        model, _ = build_meta_model(conf)
        shape = model_input_shapes(model)[0]
        profile = roofline_profile(
            model, shape, paths, dtype_bytes=2 if base.amp else 4,
            flops_s=H100_BF16_FLOPS * args.mfu, hbm_bytes_s=H100_HBM_BYTES_S,
        )  # fmt: skip
    grad_bytes = base.parameter_count * 4
    rows = []
    for n in gpus:
        for domain, plan in plans.items():
            if n % domain:
                continue
            dp = n // domain
            # the dp layout's collectives: the domain plan's, with DDP's buckets over dp
            coll = _plan(conf, domain, dp).collectives if dp > 1 else plan.collectives
            p = project_step(
                plan.layers, profile, domain=domain, dp=dp, cluster=cluster,
                batch_size=args.batch, dtype_bytes=plan.memory.activation_dtype_bytes,
                domain_grad_bytes=grad_bytes if domain > 1 else 0,
                dp_grad_bytes=grad_bytes if dp > 1 else 0,
                domain_grad_buckets=max(1, coll["domain_grad_all_reduce"]),
                dp_grad_buckets=max(1, coll["ddp_all_reduce"]),
                overlap=1.0, domain_overlap=args.domain_overlap,
                sync_points=sync_points_per_step(
                    coll, overlapped_domain_grads=args.domain_overlap > 0
                )["total"],
            )  # fmt: skip
            rows.append({"model": name, "gpus": n, "projection": p, "source": profile.source})
    return rows


def _print_rows(rows: list[dict]) -> None:
    head = (
        f"{'model':<12}| GPUs | domain x dp | step ms | compute | halo | norm | attn | "
        f"grad exposed | sync pts | E"
    )
    print(head)
    print("-" * len(head))
    for row in rows:
        p = row["projection"]
        print(
            f"{row['model']:<12}| {row['gpus']:>4} | {p.domain:>4} x {p.dp:<4} | "
            f"{p.step_s * 1e3:7.2f} | {p.compute_s * 1e3:7.2f} | {p.halo_s * 1e3:4.2f} | "
            f"{p.norm_s * 1e3:4.2f} | {p.attention_s * 1e3:4.2f} | "
            f"{p.exposed_grad_s * 1e3:12.2f} | {p.sync_points:>8} | {p.efficiency:.2f}"
        )


# --------------------------------------------------------------------------- lat x lon splits
def split_rows(name: str, args, cluster: Cluster) -> list[dict]:
    """Every P x Q split of each ``--splits`` domain size (dp 1) of ``name``, projected by
    ``planner.split.project_splits`` (tile halo bytes and messages per rank, the two passes of
    each exchange, GroupNorm statistics over P x Q) from the same compute profile as the
    domain x dp table.  The gradient all-reduce over the domain group (equal for every split of
    one size) is left out.  A model with layers refused on tiles (CrossFormer's attention) is
    projected without them: their compute as a perfect split, their communication not at all,
    at every split, 1-D included.  Calls run on latitude strips (the CrossFormer's attention on
    tiles) count their two all-to-alls and their exchange on the strips."""
    from credit_parallel.planner.split import project_splits
    from credit_parallel.planner.trace import (
        build_meta_model,
        conversion_plan,
        model_input_shapes,
        plan_relayouts,
        plan_targets,
        trace_model,
    )

    conf = _model_conf(name)
    model, _ = build_meta_model(conf)
    shape = model_input_shapes(model)[0]
    plan = conversion_plan(model)
    targets = [t for t in plan_targets(plan) if not isinstance(t[2], Exception)]
    trace = trace_model(model, [shape], targets, plan_relayouts(plan))
    paths = {path for path, *_ in trace.calls}
    profile = _split_profile(args, conf, paths, shape)
    from credit_parallel.planner.make import tile_refusals_of_model

    refused = tile_refusals_of_model(build_meta_model(conf)[0])
    rows = []
    for size in (int(v) for v in args.splits.split(",") if v.strip()):
        for s in project_splits(
            trace, size, batch_size=args.batch, dtype_bytes=2, profile=profile,
            cluster=cluster, exclude_refused_layers=bool(refused),
        ):  # fmt: skip
            rows.append({"model": name, "domain": size, "split": s, "excluded": len(refused)})
    return rows


def _split_profile(args, conf, paths, shape) -> ComputeProfile:
    if args.profile_file:
        with open(args.profile_file) as fh:
            data = json.load(fh)
        return ComputeProfile(data["layers"], data.get("rest_s", 0.0), data.get("source", ""))
    from credit_parallel.planner.trace import build_meta_model

    model, _ = build_meta_model(conf)
    return roofline_profile(
        model, shape, paths, dtype_bytes=2, flops_s=H100_BF16_FLOPS * args.mfu,
        hbm_bytes_s=H100_HBM_BYTES_S,
    )  # fmt: skip


def _print_splits(rows: list[dict]) -> None:
    """One line per model and domain size: 1-D (D x 1) and the best lat x lon split, then
    every split."""
    head = (
        f"{'model':<12}| D  | split  | step ms | compute | halo | norm | halo MiB/rank | "
        "msgs/rank | vs 1-D"
    )
    print(head)
    print("-" * len(head))
    for row in rows:
        s = row["split"]
        one = next(
            r["split"] for r in rows
            if r["model"] == row["model"] and r["domain"] == row["domain"] and r["split"].shape[1] == 1
        )  # fmt: skip
        best = min(
            (
                r["split"]
                for r in rows
                if r["model"] == row["model"] and r["domain"] == row["domain"]
            ),
            key=lambda x: x.step_s,
        )
        mark = " *" if s is best else ""
        print(
            f"{row['model']:<12}| {row['domain']:>2} | {s.shape[0]:>2}x{s.shape[1]:<3} | "
            f"{s.step_s * 1e3:7.3f} | {s.compute_s * 1e3:7.3f} | {s.halo_s * 1e3:4.2f} | "
            f"{s.norm_s * 1e3:4.2f} | {s.halo_bytes / 2**20:13.2f} | {s.messages:>9} | "
            f"{one.step_s / s.step_s:5.2f}x{mark}"
        )


# --------------------------------------------------------------------------- the CPU check
def _exchange_worker(rank, world, sizes, calls):
    import torch.distributed as dist

    torch.set_num_threads(1)
    out = {}
    peer = 1 - rank
    for nbytes in sizes:
        x = torch.randn(max(1, nbytes // 4))
        buf = torch.empty_like(x)
        samples = []
        for i in range(calls + 2):
            dist.barrier()
            t0 = time.perf_counter()
            ops = [dist.P2POp(dist.isend, x, peer), dist.P2POp(dist.irecv, buf, peer)]
            for work in dist.batch_isend_irecv(ops):
                work.wait()
            if i >= 2:
                samples.append(time.perf_counter() - t0)
        out[nbytes] = statistics.median(samples)
    return out


def fit_gloo(sizes=(64, 16384, 262144, 1048576, 4194304), calls: int = 20) -> Link:
    """alpha/beta of a 2-rank gloo exchange on this machine (smallest and largest of ``sizes``)."""
    from credit_parallel.testing import run_on_ranks

    per_rank = run_on_ranks(_exchange_worker, 2, list(sizes), calls, timeout=600)
    t = {s: max(r[s] for r in per_rank) for s in sizes}
    # two points, robust to a noisy middle: alpha = the smallest message, beta = the slope to
    # the largest (a least-squares line lets one slow large sample drive alpha to 0)
    small, large = min(sizes), max(sizes)
    beta = max(0.0, (t[large] - t[small]) / (large - small))
    alpha = max(0.0, t[small] - beta * small)
    print("gloo exchange at 2 ranks (median of", calls, "calls, slowest rank):")
    for s in sizes:
        print(f"  {s:>9} B: {t[s] * 1e6:9.1f} us (fit {(alpha + beta * s) * 1e6:9.1f} us)")
    print(
        f"  fit: alpha {alpha * 1e6:.1f} us, beta {beta * 1e9:.3f} ns/B ({1 / beta / 1e9:.2f} GB/s)"
    )
    return Link("gloo", alpha, max(beta, 0.0))


def check_cpu(names: list[str], rounds: int) -> list[dict]:
    """Predicted vs measured domain-2 step of ``names`` (efficiency.py workloads) on gloo."""
    from efficiency import _domain_worker, default_workloads

    from credit_parallel.planner.sync_points import sync_points_per_step
    from credit_parallel.testing import run_on_ranks

    link = fit_gloo()
    cluster = Cluster(1024, link, link)
    known = {w.name: w for w in default_workloads()}
    results = []
    for name in names:
        w = known[name]
        conf = {"model": {"type": w.kind}, "trainer": {"batch_size": w.batch}}
        shapes = [(w.channels, w.height, w.width)]
        plan1 = _plan(conf, 1, 1, model=w.build(w.height), shapes=shapes)
        plan2 = _plan(conf, 2, 1, model=w.build(w.height), shapes=shapes)
        torch.manual_seed(0)
        profile = measured_profile(w.build(w.height), shapes[0], {x.path for x in plan1.layers})
        proj = project_step(
            plan2.layers, profile, domain=2, dp=1, cluster=cluster,
            domain_grad_bytes=plan2.parameter_count * 4,
            domain_grad_buckets=max(1, plan2.collectives["domain_grad_all_reduce"]),
            sync_points=sync_points_per_step(plan2.collectives)["total"],
        )  # fmt: skip
        measured = []
        for _ in range(rounds):
            measured.append(max(run_on_ranks(_domain_worker, 2, w, 3, 1, timeout=1800)))
        got = statistics.median(measured)
        err = (proj.step_s - got) / got
        print(
            f"{name}: 1 process {profile.total_s * 1e3:.1f} ms ({profile.source}); domain 2 "
            f"predicted {proj.step_s * 1e3:.1f} ms (compute {proj.compute_s * 1e3:.1f}, halo "
            f"{proj.halo_s * 1e3:.1f}, norm {proj.norm_s * 1e3:.1f}, grad "
            f"{proj.exposed_grad_s * 1e3:.1f}), measured {got * 1e3:.1f} ms "
            f"(rounds {[round(m * 1e3, 1) for m in measured]}), error {err:+.0%}"
        )
        results.append({"workload": name, "predicted_s": proj.step_s, "measured_s": got})
    return results


def main(argv=None) -> list[dict]:
    args = parse_args(argv)
    if args.measure_profile:
        write_profile(args)
        return []
    nvlink = Link("NVLink 4", args.nvlink_alpha_us * 1e-6, 1 / (args.nvlink_gbs * 1e9))
    ib = Link("NDR InfiniBand", args.ib_alpha_us * 1e-6, 1 / (args.ib_gbs * 1e9))
    cluster = Cluster(args.gpus_per_node, nvlink, ib)
    print(
        f"links: {nvlink.name} alpha {args.nvlink_alpha_us} us, {args.nvlink_gbs} GB/s; "
        f"{ib.name} alpha {args.ib_alpha_us} us, {args.ib_gbs} GB/s; {args.gpus_per_node} "
        f"GPUs per node; domain gradient overlap {args.domain_overlap}; batch {args.batch}/dp rank"
    )
    if args.splits:
        rows = []
        for name in [m.strip() for m in args.models.split(",") if m.strip()]:
            model_rows = split_rows(name, args, cluster)
            excluded = model_rows[0]["excluded"] if model_rows else 0
            if excluded:
                print(
                    f"{name}: {excluded} modules refused on lat x lon tiles (attention): "
                    "projected without their communication, their compute as a perfect split"
                )
            rows += model_rows
        _print_splits(rows)
        return rows
    rows = []
    for name in [m.strip() for m in args.models.split(",") if m.strip()]:
        model_rows = project_model(name, args, cluster)
        print(f"{name}: compute profile: {model_rows[0]['source'] if model_rows else '-'}")
        rows += model_rows
    _print_rows(rows)
    if args.check:
        print(f"\nCPU check (load average {os.getloadavg()}):")
        check_cpu([n.strip() for n in args.check.split(",") if n.strip()], args.check_rounds)
    if args.json:
        with open(args.json, "w") as fh:
            json.dump([{**r, "projection": vars(r["projection"])} for r in rows], fh, indent=1)
    return rows


if __name__ == "__main__":
    main()
