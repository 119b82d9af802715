"""``credit-parallel bench --gpu``: the check anyone can run on one node.

It prints, in order:

1. the environment: GPUs (name, count, memory) or the CPU, torch, CUDA and NCCL versions;
2. a trainer smoke run on 1 rank (``{data: fsdp2, tensor: 1, domain: 1}``, the sample data
   written to a temporary directory, a few steps, the loss before and after);
3. ``verify`` of that layout in float32 and float64 (on a GPU under
   :func:`credit_parallel.layout.device.deterministic_kernels`);
4. per bundled model (CrossFormer, U-Net; the issue's sizes on a GPU, small ones on the CPU):
   step time and peak memory of the plain loop, torch's FSDP2 on the root + clip, and the
   library, eager and compiled (compiled only once ``trainer.compile`` exists: the COMPILE HOOK
   of :mod:`.overhead`; "-" otherwise);
5. with N >= 2 GPUs, the library at domain 2..N on N local NCCL ranks (started through the
   CLI's launcher); on the CPU, domain 2 on two gloo ranks, so the table has the same shape.

The process itself is one rank (NCCL with ``device_id`` on ``cuda:0``, else gloo).
``python -m credit_parallel.tools.bench.node_check --domain-worker MODEL SIZE DOMAIN OUT`` is
the per-rank entry of step 5.
"""

from __future__ import annotations

import json
import os
import platform
import sys
import tempfile
import time

import torch
import torch.distributed as dist

from .overhead import compile_available, measure_variants, model_conf

__all__ = ["environment_line", "main", "run_node_check"]

TABLE_VARIANTS = ("plain", "torch fsdp2 root", "torch fsdp2 blocks", "library", "library merged")


def environment_line(device: str) -> str:
    torch_part = f"torch {torch.__version__}"
    if device == "cuda":
        n = torch.cuda.device_count()
        props = torch.cuda.get_device_properties(0)
        nccl = ".".join(str(v) for v in torch.cuda.nccl.version())
        return (
            f"environment: {n} x {props.name} ({props.total_memory / 2**30:.0f} GiB), "
            f"{torch_part}, CUDA {torch.version.cuda}, NCCL {nccl}, {os.cpu_count()} CPU cores"
        )
    return (
        f"environment: no GPU ({platform.processor() or platform.machine()}, "
        f"{os.cpu_count()} CPU cores), {torch_part}, gloo"
    )


def _torch_device(device: str) -> torch.device:
    """``cuda:0`` (this one-rank process's GPU) or the CPU, for ``device`` "cuda" / "cpu"."""
    return torch.device(device, 0) if device == "cuda" else torch.device(device)


def _init_one_rank(device: str) -> None:
    from ...layout.device import DEVICE_ENV, set_local_cuda_device
    from ...testing import free_port

    os.environ[DEVICE_ENV] = device
    os.environ.setdefault("LOCAL_RANK", "0")
    kwargs = {"device_id": set_local_cuda_device()} if device == "cuda" else {}
    dist.init_process_group(
        "nccl" if device == "cuda" else "gloo",
        init_method=f"tcp://127.0.0.1:{free_port()}",
        rank=0,
        world_size=1,
        **kwargs,
    )


def _smoke_conf(store: str, steps: int) -> dict:
    return {
        "model": {
            "type": "unet",
            "in_channels": 8,
            "out_channels": 8,
            "image_height": 17,
            "image_width": 32,
            "base_channels": 8,
            "channel_mults": [1, 2],
            "norm_groups": 4,
        },
        "data": {
            "path": store,
            "upper_air_variables": ["T", "U", "V"],
            "surface_variables": ["t2m", "SP"],
            "levels": [500, 850],
            "time_slice": [0, 20],
            "valid_time_slice": [20, 24],
        },
        "trainer": {
            "parallelism": {"data": "fsdp2", "tensor": 1, "domain": 1},
            "steps": steps,
            "batch_size": 2,
            "lr": 0.01,
            "seed": 0,
        },
    }


def trainer_smoke(device: str, store: str, steps: int = 5) -> str:
    from ...train.trainer import Trainer

    t0 = time.perf_counter()
    trainer = Trainer(_smoke_conf(store, steps), device=_torch_device(device))
    losses = [trainer.train_step()["loss"] for _ in range(steps)]
    ok = all(torch.isfinite(torch.tensor(losses))) and losses[-1] < losses[0]
    return (
        f"trainer smoke (1 rank, fsdp2): loss {losses[0]:.4f} -> {losses[-1]:.4f} over {steps} "
        f"steps in {time.perf_counter() - t0:.1f} s: {'PASS' if ok else 'FAIL'}"
    )


def verify_line(device: str, store: str, dtype: torch.dtype) -> tuple[str, bool]:
    from ...data.dataset import dataset_from_conf
    from ...layout.device import deterministic_kernels
    from ..verify import judge, verify_layout

    conf = _smoke_conf(store, 1)
    where = _torch_device(device)
    with deterministic_kernels(where) as pinned:
        rows = judge(
            verify_layout(conf, dtype=dtype, dataset=dataset_from_conf(conf), device=where), dtype
        )
    failed = [r for r in rows if r[-1] == "FAIL"]
    worst = max(rows, key=lambda r: (r[1] / max(r[2], 1e-30), r[1]))
    name = str(dtype).replace("torch.", "")
    line = (
        f"verify {name} (1 rank, fsdp2{'; ' + pinned if pinned else ''}): "
        f"{len(rows) - len(failed)} passed, {len(failed)} failed; largest relative error: "
        f"{worst[0]}, {worst[1]:.2e} of {worst[2]:.2e}"
    )
    return line, not failed


def _describe(block: dict) -> str:
    h, w, c = block["image_height"], block["image_width"], block["in_channels"]
    if block["type"] == "crossformer":
        return f"{h}x{w} C={c} dims {block['dims']} depths {block['depths']}"
    return f"{h}x{w} C={c} base {block['base_channels']} x {block['channel_mults']}"


def _fmt(ms, peak) -> tuple[str, str]:
    return (f"{ms:.1f}" if ms is not None else "-", f"{peak / 2**30:.2f}" if peak else "-")


def _domain_figure(model: str, size: str, domain: int, device: str) -> float | None:
    """The library's step at ``domain`` on ``domain`` local ranks (rank 0's median), or None."""
    from ...layout.device import DEVICE_ENV
    from ..launcher import launch_local

    out = os.path.join(tempfile.mkdtemp(prefix="credit-parallel-node-"), "domain.json")
    os.environ[DEVICE_ENV] = device
    if device == "cuda":  # the ranks share GPU 0 with this process: give its cache back first
        torch.cuda.empty_cache()
    rc = launch_local(
        domain,
        "credit_parallel.tools.bench.node_check",
        ["--domain-worker", model, size, str(domain), out],
    )
    if rc != 0 or not os.path.exists(out):
        return None
    with open(out) as fh:
        return json.load(fh)["ms"]


def step_rows(
    device: str, size: str, *, steps: int, warmup: int, rounds: int, domains, emit=None
) -> list:
    """The table's rows; ``emit(row)`` is called as each row is measured (progress)."""
    rows = []
    emit = emit or (lambda row: None)
    amp = device == "cuda"
    where = _torch_device(device)
    for kind in ("crossformer", "unet"):
        block = model_conf(kind, size)
        eager = measure_variants(
            block, TABLE_VARIANTS, device=where, amp=amp, steps=steps, warmup=warmup, rounds=rounds
        )
        for f in eager:
            emit((kind, _describe(block), f.variant, *_fmt(f.ms, f.peak_bytes), "(next)"))
        compiled = {}
        for variant in ("plain", "library") if compile_available() else ():  # COMPILE HOOK
            compiled[variant] = _compiled_figure(block, variant, where, amp, steps, warmup, rounds)
            emit((kind, _describe(block), variant, "-", "-", compiled[variant]))
        for f in eager:
            rows.append(
                (kind, _describe(block), f.variant, *_fmt(f.ms, f.peak_bytes),
                 compiled.get(f.variant, "-"))
            )  # fmt: skip
        for d in domains:
            ms = _domain_figure(kind, size, d, device)
            rows.append(
                (kind, _describe(block), f"library domain {d} ({d} ranks)", *_fmt(ms, None), "-")
            )
            emit(rows[-1])
    return rows


def _compiled_figure(block, variant, where, amp, steps, warmup, rounds) -> str:
    """The compiled step's median ms, or "failed" (the error printed): one variant that the
    compiler rejects does not end the check."""
    try:
        (fig,) = measure_variants(
            block, (variant,), device=where, amp=amp, steps=steps, warmup=warmup,
            rounds=rounds, compiled=True,
        )  # fmt: skip
    except Exception as exc:  # noqa: BLE001 - reported, the table goes on
        first = str(exc).strip().splitlines()
        print(f"  compiled {variant} failed: {type(exc).__name__}: {first[0] if first else ''}",
              flush=True)  # fmt: skip
        return "failed"
    finally:
        torch._dynamo.reset()
    return f"{fig.ms:.1f}"


def _progress_row(row) -> None:
    kind, _, variant, ms, peak, compiled = row
    print(f"  measured {kind} {variant}: eager {ms} ms, peak {peak} GiB, compiled {compiled} ms",
          flush=True)  # fmt: skip


def format_rows(rows) -> str:
    head = ("model", "size", "variant", "eager ms", "peak GiB", "compiled ms")
    widths = [max(len(str(r[i])) for r in [head, *rows]) for i in range(len(head))]
    lines = [head, *rows]
    return "\n".join("  ".join(str(v).ljust(w) for v, w in zip(r, widths)).rstrip() for r in lines)


def run_node_check(device: str = "auto", quick: bool = False) -> int:
    """The whole check; returns 0 when the smoke run and both verifies pass."""
    from ...data import write_sample_dataset
    from ...layout.device import choose_device, visible_gpu_count

    device = choose_device(device, 1)
    size = "gpu" if device == "cuda" and not quick else "cpu"
    gpus = visible_gpu_count() if device == "cuda" else 0
    domains = list(range(2, gpus + 1)) if device == "cuda" else [2]
    if device == "cpu":  # one thread, as each of the domain rows' ranks gets on a 2-core node
        torch.set_num_threads(max(1, (os.cpu_count() or 1) // max(domains)))
    print(environment_line(device), flush=True)
    _init_one_rank(device)
    ok = True
    with tempfile.TemporaryDirectory(prefix="credit-parallel-node-") as tmp:
        store = str(write_sample_dataset(os.path.join(tmp, "s.zarr"), n_times=24, nlat=17, nlon=32))
        line = trainer_smoke(device, store)
        ok &= line.endswith("PASS")
        print(line, flush=True)
        for dtype in (torch.float32, torch.float64):
            line, passed = verify_line(device, store, dtype)
            ok &= passed
            print(line, flush=True)
    steps, warmup, rounds = (2, 1, 1) if quick else (6, 2, 2)
    rows = step_rows(
        device, size, steps=steps, warmup=warmup, rounds=rounds, domains=domains,
        emit=_progress_row,
    )  # fmt: skip
    print(f"step = forward + backward + AdamW{' (bf16 autocast)' if device == 'cuda' else ''}, "
          f"batch 1, median of {steps * rounds} after {warmup} warm-up "
          f"({'wall clock' if device == 'cuda' else 'CPU time of the rank, 1 thread'}); library = parallelize + "
          f"TrainStep(max_norm=1); torch fsdp2 root = fully_shard(root) + clip_grad_norm_; "
          f"compiled: {'trainer.compile' if compile_available() else 'not available in this version'}")  # fmt: skip
    print(format_rows(rows), flush=True)
    dist.destroy_process_group()
    return 0 if ok else 1


def _domain_worker(model: str, size: str, domain: int, out: str) -> int:
    from ...layout.device import device_for_process_group
    from ...layout.launch import init_distributed_from_env

    init_distributed_from_env(120)
    device = device_for_process_group()
    figures = measure_variants(
        model_conf(model, size),
        ("library",),
        device=device,
        amp=device.type == "cuda",
        steps=4,
        warmup=2,
        rounds=1,
        parallelism={"data": "none", "tensor": 1, "domain": domain},
    )
    if dist.get_rank() == 0:
        with open(out, "w") as fh:
            json.dump({"ms": figures[0].ms}, fh)
    dist.destroy_process_group()
    return 0


def main(argv=None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if argv[:1] == ["--domain-worker"] and len(argv) == 5:
        return _domain_worker(argv[1], argv[2], int(argv[3]), argv[4])
    print("usage: credit-parallel bench --gpu [--device D] [--quick]", file=sys.stderr)
    return 2


if __name__ == "__main__":
    sys.exit(main())
