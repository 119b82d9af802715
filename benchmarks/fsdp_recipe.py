"""FSDP2 where it shards (dp >= 2): the library's compiled step against torch's own recipe on the
same units (issue 33, item 3).

Every variant shards the same units (each ``_fsdp2_shard`` block, then the root) over dp = the
world size and compiles each block before ``fully_shard`` (hooks outside the graphs):

- ``torch recipe``: torch alone, as torchtitan writes it: ``torch.compile`` of each block (the
  compiled module put back in its parent; ``dynamic=False``: the blocks of one class run at
  several resolutions, and with automatic dynamic shapes inductor on the CPU stops at
  "cannot determine truth value of Relational" on the CrossFormer), ``fully_shard`` of each
  block, then of the root;
- ``library``: ``parallelize(model, {data: fsdp2, compile: true})`` (``compile_blocks``);
- ``library prefetch``: the same with ``trainer.fsdp2_prefetch: true`` (explicit forward and
  backward prefetch of the neighbouring unit, the last unit not resharded after forward).

One step = forward, the mean-square loss, backward, AdamW.  The variants are interleaved step
by step after ``--warmup`` untimed steps (the first compiles).  Rank 0 prints per variant the
median wall time per step, the median host CPU time per step (``time.process_time``: what a
loaded machine does not inflate) and the number of operators one step dispatches on the host
(``torch.profiler`` events), with the ratios to the torch recipe.

    CPU, gloo ranks:  PYTHONPATH=src python benchmarks/fsdp_recipe.py --nproc 2
    GPUs, NCCL:       PYTHONPATH=src torchrun --nproc-per-node 2 benchmarks/fsdp_recipe.py --device cuda
"""

from __future__ import annotations

import argparse
import copy
import os
import statistics
import time

import torch
import torch.distributed as dist
from torch import nn

from credit_parallel import parallelize
from credit_parallel.layout.device import synchronize
from credit_parallel.models import build_model
from credit_parallel.testing import run_on_ranks
from credit_parallel.tools.bench.overhead import SIZES

VARIANTS = ("torch recipe", "library", "library prefetch")


def _torch_recipe(model: nn.Module, amp: bool, backend: str) -> nn.Module:
    """torch's recipe on the library's units, with no library code."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

    device_type = "cuda" if next(model.parameters()).is_cuda else "cpu"
    mesh = init_device_mesh(device_type, (dist.get_world_size(),))
    mp = MixedPrecisionPolicy(torch.bfloat16, torch.float32) if amp else MixedPrecisionPolicy()
    names = [n for n, m in model.named_modules() if n and getattr(m, "_fsdp2_shard", False)]
    inner = [n for n in names if not any(o.startswith(n + ".") for o in names)]
    for name in inner:  # compile each innermost block, put the compiled module back
        parent_name, _, child = name.rpartition(".")
        parent = model.get_submodule(parent_name) if parent_name else model
        compiled = torch.compile(getattr(parent, child), backend=backend, dynamic=False)
        parent.register_module(child, compiled)
    units = [m for n, m in model.named_modules() if n and getattr(m, "_fsdp2_shard", False)]
    for unit in reversed(units):
        fully_shard(unit, mesh=mesh, mp_policy=mp)
    fully_shard(model, mesh=mesh, mp_policy=mp)
    return model


def _build(variant: str, model: nn.Module, amp: bool, backend: str) -> nn.Module:
    model = copy.deepcopy(model)
    if variant == "torch recipe":
        return _torch_recipe(model, amp, backend)
    trainer = {
        "parallelism": {"data": "fsdp2", "tensor": 1, "domain": 1},
        "amp": amp,
        "compile": True,
        "fsdp2_prefetch": variant.endswith("prefetch"),
    }
    if backend != "inductor":  # compile_blocks' backend (trainer.compile uses inductor)
        from credit_parallel.parallel import compile as compile_mod

        compile_mod.compile_blocks.__kwdefaults__["backend"] = backend
    return parallelize(model, {"trainer": trainer})


def _step(model, opt, x, y):
    loss = (model(x).float() - y).square().mean()
    loss.backward()
    opt.step()
    opt.zero_grad(set_to_none=True)


def _ops(model, opt, x, y) -> int:
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof:
        _step(model, opt, x, y)
    return len(prof.events())


def measure(rank, world, kind, device_type, steps, warmup, amp, backend):
    # the variants live side by side and compile the same block classes' forward code: each
    # variant's per-shape graphs count against one code object's recompile limit (8)
    torch._dynamo.config.recompile_limit = 64
    torch._dynamo.config.accumulated_recompile_limit = 1024
    device = torch.device(device_type, rank) if device_type == "cuda" else torch.device("cpu")
    torch.manual_seed(0)
    block = SIZES["gpu" if device_type == "cuda" else "cpu"][kind]
    base = build_model({"type": kind, **block}).to(device)
    g = torch.Generator().manual_seed(rank)
    shape = (1, block["in_channels"], block["image_height"], block["image_width"])
    x = torch.randn(shape, generator=g).to(device)
    y = torch.randn(1, block["out_channels"], *shape[2:], generator=g).to(device)
    runs = {}
    for variant in VARIANTS:
        model = _build(variant, base, amp, backend)
        runs[variant] = (model, torch.optim.AdamW(model.parameters(), lr=1e-4))
    first = {}
    for variant, (model, opt) in runs.items():  # the first step compiles
        t0 = time.perf_counter()
        for _ in range(warmup):
            _step(model, opt, x, y)
        synchronize(device)
        first[variant] = time.perf_counter() - t0
    wall = {v: [] for v in VARIANTS}
    cpu = {v: [] for v in VARIANTS}
    for _ in range(steps):  # interleaved, step by step
        for variant, (model, opt) in runs.items():
            dist.barrier()
            t0, c0 = time.perf_counter(), time.process_time()
            _step(model, opt, x, y)
            synchronize(device)
            wall[variant].append((time.perf_counter() - t0) * 1e3)
            cpu[variant].append((time.process_time() - c0) * 1e3)
    ops = {v: _ops(m, o, x, y) for v, (m, o) in runs.items()}
    return {
        v: (first[v], statistics.median(wall[v]), statistics.median(cpu[v]), ops[v])
        for v in VARIANTS
    }


def report(kind, figures, header) -> None:
    print(header, flush=True)
    ref = figures["torch recipe"]
    for variant, (first, wall, cpu, ops) in figures.items():
        print(
            f"{kind:12s} {variant:17s} warmup {first:6.1f} s  step {wall:8.2f} ms "
            f"({wall / ref[1]:.2f}x)  host CPU {cpu:8.2f} ms ({cpu / ref[2]:.2f}x)  "
            f"operators {ops:6d} ({ops / ref[3]:.2f}x)",
            flush=True,
        )


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--device", choices=["cpu", "cuda"], default="cpu")
    ap.add_argument("--nproc", type=int, default=2, help="gloo ranks (CPU, without torchrun)")
    ap.add_argument("--models", default="crossformer,unet")
    ap.add_argument("--steps", type=int, default=5)
    ap.add_argument("--warmup", type=int, default=2)
    ap.add_argument("--backend", default="inductor", help="torch.compile backend of every block")
    args = ap.parse_args()
    amp = args.device == "cuda"
    common = (args.device, args.steps, args.warmup, amp, args.backend)
    if "RANK" in os.environ:  # under torchrun
        from credit_parallel.layout.launch import init_distributed_from_env

        init_distributed_from_env()
        rank, world = dist.get_rank(), dist.get_world_size()
        if args.device == "cuda":
            torch.cuda.set_device(rank % torch.cuda.device_count())
        for kind in args.models.split(","):
            figures = measure(rank, world, kind, *common)
            if rank == 0:
                report(kind, figures, _header(world, args))
        dist.destroy_process_group()
        return 0
    for kind in args.models.split(","):
        figures = run_on_ranks(measure, args.nproc, kind, *common, timeout=3000)[0]
        report(kind, figures, _header(args.nproc, args))
    return 0


def _header(world, args) -> str:
    return (
        f"torch {torch.__version__}; dp {world} on {args.device} "
        f"({'NCCL, bf16 policy' if args.device == 'cuda' else 'gloo, fp32'}); backend "
        f"{args.backend}; median of {args.steps} interleaved steps after {args.warmup}"
    )


if __name__ == "__main__":
    raise SystemExit(main())
