"""Whole-model torch.compile through the library on one device: compile time, step time, parity.

One rank (NCCL on ``cuda:0`` when a GPU is visible, else gloo on the CPU).  Per bundled model,
forward + backward (no optimizer, so every variant sees the same weights) of:

- ``plain eager``: the reference;
- ``plain compiled``: ``torch.compile(model)``;
- ``library eager``: ``parallelize(model, conf)``;
- ``compile(parallelize)`` and ``parallelize(compile)``: the two orders of SPEC 5a.

Prints, per variant, the first step (which compiles; wall clock and this process's CPU time,
which counts the compile itself with ``TORCHINDUCTOR_COMPILE_THREADS=1`` and which a loaded
machine does not inflate), the median of the timed steps (wall clock,
synchronised) and the largest relative error of the output and of the parameter gradients
against the reference (float32, TF32 off).

    PYTHONPATH=src python benchmarks/compile_gpu.py --device cuda
"""

from __future__ import annotations

import argparse
import copy
import os
import statistics
import time

import torch
import torch.distributed as dist

from credit_parallel import parallelize
from credit_parallel.layout.device import synchronize
from credit_parallel.models import build_model
from credit_parallel.testing import free_port

SIZES = {
    "cuda": {
        "unet": dict(image_height=181, image_width=360, in_channels=16, out_channels=16,
                     base_channels=32, channel_mults=[1, 2, 2], norm_groups=8),
        "crossformer": dict(image_height=96, image_width=192, in_channels=16, out_channels=16,
                            dims=[64, 128], depths=[2, 2]),
    },
    "cpu": {
        "unet": dict(image_height=33, image_width=64, in_channels=8, out_channels=8,
                     base_channels=8, channel_mults=[1, 2], norm_groups=4),
        "crossformer": dict(image_height=48, image_width=80, in_channels=8, out_channels=8,
                            dims=[32, 64], depths=[2, 2]),
    },
}  # fmt: skip
VARIANTS = (
    "plain eager",
    "plain compiled",
    "library eager",
    "compile(parallelize)",
    "parallelize(compile)",
    "library trainer.compile",
)
LAYOUT = {"data": "none", "tensor": 1, "domain": 1}
AMP = False


def _build(kind: str, block: dict, variant: str, device):
    torch.manual_seed(0)
    conf = {"type": kind, **block}
    model = build_model(copy.deepcopy(conf)).to(device)
    full = {"model": conf, "trainer": {"parallelism": dict(LAYOUT), "amp": AMP}}
    if variant == "plain compiled":
        return torch.compile(model)
    if variant == "library eager":
        return parallelize(model, full)
    if variant == "compile(parallelize)":
        return torch.compile(parallelize(model, full))
    if variant == "parallelize(compile)":
        return parallelize(torch.compile(model), full)
    if variant == "library trainer.compile":  # per block, as trainer.compile: true does
        full["trainer"]["compile"] = True
        return parallelize(model, full)
    return model


def _step(model, x):
    for p in model.parameters():
        p.grad = None
    with torch.autocast(x.device.type, torch.bfloat16, enabled=AMP):
        out = model(x)
        loss = out.float().square().mean()
    loss.backward()
    return out


def _full(t):
    return t.full_tensor() if hasattr(t, "full_tensor") else t  # FSDP2 grads are DTensors


def _grads(model) -> dict:
    return {
        n.replace("_orig_mod.", "").replace("module.", ""): _full(p.grad).detach().float().cpu()
        for n, p in model.named_parameters()
        if p.grad is not None
    }


def _rel(a, b, floor: float = 1e-30) -> float:
    return float((a - b).abs().max() / b.abs().max().clamp_min(floor))


def run(device: torch.device, kinds, steps: int) -> None:
    sizes = SIZES[device.type]
    for kind in kinds:
        block = sizes[kind]
        g = torch.Generator().manual_seed(1)
        x = torch.randn(1, block["in_channels"], block["image_height"], block["image_width"],
                        generator=g).to(device)  # fmt: skip
        ref_out = ref_grads = None
        for variant in VARIANTS:
            torch._dynamo.reset()  # each compiled variant pays its own compile
            model = _build(kind, block, variant, device)
            synchronize(device)
            t0, c0 = time.perf_counter(), time.process_time()
            out = _step(model, x)
            synchronize(device)
            first, first_cpu = time.perf_counter() - t0, time.process_time() - c0
            times = []
            for _ in range(steps):
                t0 = time.perf_counter()
                out = _step(model, x)
                synchronize(device)
                times.append((time.perf_counter() - t0) * 1e3)
            out, grads = out.detach().float().cpu(), _grads(model)
            if ref_out is None:
                ref_out, ref_grads = out, grads
            err_out = _rel(out, ref_out)
            # a gradient that is zero in exact arithmetic (a conv bias before a GroupNorm) is
            # judged against 1e-3 of the largest gradient, not against its own rounding noise
            floor = 1e-3 * max(float(v.abs().max()) for v in ref_grads.values())
            err_grad = max(_rel(grads[n], ref_grads[n], floor) for n in ref_grads)
            print(f"{kind:12s} {variant:22s} first step {first:7.2f} s (CPU {first_cpu:7.2f} s)  step "
                  f"{statistics.median(times):8.2f} ms  rel err out {err_out:.1e} "
                  f"grads {err_grad:.1e} ({len(grads)}/{len(ref_grads)} grads)", flush=True)  # fmt: skip
            del model
            if device.type == "cuda":
                torch.cuda.empty_cache()


def main() -> int:
    global VARIANTS, AMP
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--device", choices=["auto", "cuda", "cpu"], default="auto")
    ap.add_argument("--models", default="unet,crossformer")
    ap.add_argument("--steps", type=int, default=5)
    ap.add_argument("--variants", default=",".join(VARIANTS))
    ap.add_argument("--data", default="none", help="the library variants' data mode (none, fsdp2)")
    ap.add_argument("--amp", action="store_true", help="bf16 autocast (and FSDP2's bf16 policy)")
    args = ap.parse_args()
    VARIANTS, AMP = tuple(args.variants.split(",")), args.amp
    LAYOUT["data"] = args.data
    kind = (
        args.device if args.device != "auto" else ("cuda" if torch.cuda.is_available() else "cpu")
    )
    device = torch.device(kind, 0) if kind == "cuda" else torch.device("cpu")
    os.environ.setdefault("LOCAL_RANK", "0")
    if kind == "cuda":
        torch.cuda.set_device(device)
        torch.backends.cuda.matmul.allow_tf32 = False
        torch.backends.cudnn.allow_tf32 = False
    dist.init_process_group(
        "nccl" if kind == "cuda" else "gloo",
        init_method=f"tcp://127.0.0.1:{free_port()}",
        rank=0,
        world_size=1,
        **({"device_id": device} if kind == "cuda" else {}),
    )
    print(f"torch {torch.__version__}, {device}"
          f"{', ' + torch.cuda.get_device_name(device) if kind == 'cuda' else ''}; float32, "
          f"TF32 off{', bf16 autocast' if AMP else ''}; forward + backward, median of {args.steps} after the first (compiling) step; "
          f"layout {LAYOUT}", flush=True)  # fmt: skip
    try:
        run(device, args.models.split(","), args.steps)
    finally:
        dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
