"""One-rank overhead at torch's level: the library's training step against torch's own.

On ONE rank (gloo on the CPU, NCCL on a GPU) it times the same model, loss and AdamW step as

* ``plain``: a plain loop (forward, backward, ``optimizer.step``);
* ``plain+clip``: the plain loop with ``torch.nn.utils.clip_grad_norm_``;
* ``torch fsdp2 root``: torch's ``fully_shard`` on the root + ``clip_grad_norm_``;
* ``torch fsdp2 blocks``: ``fully_shard`` on every opted-in block, then the root, + clip;
* ``library``: ``parallelize(model, {data: fsdp2, tensor: 1, domain: 1})`` + ``TrainStep``
  (max_norm 1), at the library's default FSDP2 granularity (every opted-in block its own unit,
  SPEC §4);
* ``library merged``: the same with ``trainer.fsdp2_min_unit_params: 1000000`` (opted-in blocks
  under 1M parameters merged into their parent's unit).

The loss is the trainer's (latitude-weighted MSE) in every variant; bf16 autocast on CUDA
(``amp``), float32 on the CPU.  Each figure is the median over ``rounds`` x ``steps`` timed steps
after ``warmup`` untimed ones, variants interleaved round by round (wall clock on CUDA; on the
CPU the process's CPU time, which a loaded machine does not inflate); the peak memory is CUDA's
``max_memory_allocated`` during the timed steps (absent on the CPU).

COMPILE HOOK: :func:`compile_available` says whether the library has ``trainer.compile``; when it
does, :func:`build_step` with ``compiled=True`` compiles the plain model with ``torch.compile``
and passes ``trainer.compile: true`` to ``parallelize`` for the library variants.
"""

from __future__ import annotations

import copy
import statistics
import time
from collections.abc import Callable
from dataclasses import dataclass

import torch

__all__ = [
    "SIZES",
    "VARIANTS",
    "Figure",
    "build_step",
    "compile_available",
    "measure_variants",
    "model_conf",
]

VARIANTS = (
    "plain",
    "plain+clip",
    "torch fsdp2 root",
    "torch fsdp2 blocks",
    "library",
    "library merged",
)

MERGED_MIN_UNIT_PARAMS = 1_000_000  # the "library merged" variant's trainer.fsdp2_min_unit_params

# the bundled models at the sizes (gpu) and at sizes a CPU core steps in ~0.1-1 s
SIZES = {
    "gpu": {
        "crossformer": dict(
            in_channels=71, out_channels=71, image_height=192, image_width=288,
            dims=[64, 128], depths=[2, 2], dim_head=32, window_sizes=[4, 4],
        ),
        "unet": dict(
            in_channels=71, out_channels=71, image_height=721, image_width=1440,
            base_channels=64, channel_mults=[1, 2, 2, 4], norm_groups=8,
        ),
    },
    "cpu": {
        "crossformer": dict(
            in_channels=16, out_channels=16, image_height=48, image_width=80,
            dims=[32, 64], depths=[2, 2], dim_head=16, window_sizes=[4, 4],
        ),
        "unet": dict(
            in_channels=8, out_channels=8, image_height=65, image_width=128,
            base_channels=16, channel_mults=[1, 2, 2], norm_groups=4,
        ),
    },
}  # fmt: skip


def model_conf(kind: str, size: str) -> dict:
    """The ``model:`` block of a bundled model at ``size`` ("gpu" or "cpu")."""
    return {"type": kind, **SIZES[size][kind]}


def compile_available() -> bool:
    """COMPILE HOOK: True once the library knows ``trainer.compile`` (SPEC 5a)."""
    from ...layout.run_config import TrainerConfig

    return "compile" in getattr(TrainerConfig, "__dataclass_fields__", {})


@dataclass
class Figure:
    """One variant's result: median step time (ms) and CUDA peak memory (bytes, None on CPU)."""

    variant: str
    ms: float
    peak_bytes: int | None
    times_ms: list


def _batch(model_block: dict, batch: int, device, dtype=torch.float32):
    g = torch.Generator().manual_seed(0)
    c_in, c_out = model_block["in_channels"], model_block["out_channels"]
    h, w = model_block["image_height"], model_block["image_width"]
    x = torch.randn(batch, c_in, h, w, generator=g, dtype=dtype).to(device)
    y = torch.randn(batch, c_out, h, w, generator=g, dtype=dtype).to(device)
    return x, y


def _fully_shard_torch(model, per_block: bool, amp: bool):
    """torch's own FSDP2, as a user would write it (no library code)."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

    from ...layout.device import device_for_process_group

    mesh = init_device_mesh(device_for_process_group().type, (torch.distributed.get_world_size(),))
    mp = MixedPrecisionPolicy(torch.bfloat16, torch.float32) if amp else MixedPrecisionPolicy()
    if per_block:
        blocks = [m for m in model.modules() if m is not model and getattr(m, "_fsdp2_shard", 0)]
        for block in reversed(blocks):
            fully_shard(block, mesh=mesh, mp_policy=mp)
    fully_shard(model, mesh=mesh, mp_policy=mp)
    return model


def build_step(
    variant: str,
    block: dict,
    device,
    *,
    amp: bool,
    batch: int = 1,
    compiled: bool = False,
    parallelism: dict | None = None,
) -> Callable[[], None]:
    """A closure running one full training step of ``variant`` (see the module docstring).

    ``parallelism``: the library variants' layout (default ``{data: fsdp2, tensor: 1, domain:
    1}``); with domain > 1 each rank feeds its rows of the global batch (``TrainStep`` shards)."""
    from ...layout.device import autocast_for
    from ...models import build_model
    from ...parallel.composition import get_domain_manager, parallelize
    from ...train.loss import local_lat_weights
    from ...train.step import TrainStep, latitude_weighted_loss

    if compiled and not compile_available():
        raise ValueError("compiled steps need trainer.compile (not in this version)")
    torch.manual_seed(0)
    model = build_model(copy.deepcopy(block)).to(device)
    x, y = _batch(block, batch, device)
    lat = torch.ones(block["image_height"], device=device)
    loss_fn = latitude_weighted_loss(lat, block["image_height"])
    autocast = lambda: autocast_for(device, amp)  # noqa: E731
    if variant.startswith("library"):
        min_params = MERGED_MIN_UNIT_PARAMS if variant == "library merged" else None
        layout = parallelism or {"data": "fsdp2", "tensor": 1, "domain": 1}
        trainer = {"parallelism": dict(layout), "amp": amp}
        if min_params is not None:
            trainer["fsdp2_min_unit_params"] = min_params
        if compiled:  # COMPILE HOOK
            trainer["compile"] = True
        model = parallelize(model, {"model": block, "trainer": trainer})
        manager = get_domain_manager(model)
        opt = torch.optim.AdamW(model.parameters(), lr=1e-4)
        local_loss = latitude_weighted_loss(local_lat_weights(lat, manager), lat.shape[0])
        step = TrainStep(model, local_loss, manager=manager, max_norm=1.0, autocast=autocast)

        def library_step():
            opt.zero_grad(set_to_none=True)
            step([{"x": x, "y": y}])
            opt.step()

        return library_step
    if variant.startswith("torch fsdp2"):
        model = _fully_shard_torch(model, variant.endswith("blocks"), amp)
    elif compiled:  # COMPILE HOOK: the plain model compiled whole
        model = torch.compile(model)
    clip = variant != "plain"
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4)
    params = list(model.parameters())

    def plain_step():
        opt.zero_grad(set_to_none=True)
        with autocast():
            loss = loss_fn((model(x),), (y,))
        loss.backward()
        if clip:
            torch.nn.utils.clip_grad_norm_(params, 1.0)
        opt.step()

    return plain_step


def _time(step, steps: int, device) -> list[float]:
    """Per-step milliseconds: wall clock around synchronised steps on CUDA; on the CPU this
    process's CPU time (one intra-op thread: the work itself, not the time spent waiting for a
    core on a shared machine)."""
    from ...layout.device import synchronize

    clock = time.perf_counter if device.type == "cuda" else time.process_time
    out = []
    for _ in range(steps):
        synchronize(device)
        t0 = clock()
        step()
        synchronize(device)
        out.append((clock() - t0) * 1e3)
    return out


def measure_variants(
    block: dict,
    variants=VARIANTS,
    *,
    device,
    amp: bool,
    steps: int = 6,
    warmup: int = 2,
    rounds: int = 2,
    batch: int = 1,
    compiled: bool = False,
    parallelism: dict | None = None,
    log: Callable[[str], None] | None = None,
) -> list[Figure]:
    """Median step time (and CUDA peak) of each variant, interleaved over ``rounds``."""
    device = torch.device(device)
    steps_of = {}
    for v in variants:
        steps_of[v] = build_step(
            v, block, device, amp=amp, batch=batch, compiled=compiled, parallelism=parallelism
        )
        for _ in range(warmup):
            steps_of[v]()
    times = {v: [] for v in variants}
    peaks: dict[str, int | None] = {v: None for v in variants}
    for r in range(rounds):
        for v in variants:
            if device.type == "cuda":
                torch.cuda.reset_peak_memory_stats(device)
            times[v] += _time(steps_of[v], steps, device)
            if device.type == "cuda":
                peaks[v] = max(peaks[v] or 0, torch.cuda.max_memory_allocated(device))
            if log:
                log(f"round {r + 1}/{rounds} {v}: {statistics.median(times[v]):.1f} ms")
    return [Figure(v, statistics.median(times[v]), peaks[v], times[v]) for v in variants]
