"""Checkpoint saves off the step loop, measured (issue 42): the bundled 0.25-degree U-Net
(``configs/era5_025deg_unet.yaml``: 19.5 M parameters) with AdamW and miles-credit's EMA, one
process, float32: a ~313 MB checkpoint.

1. **Blocking time**: ``--rounds`` rounds, each one synchronous save (``write_checkpoint``: what
   ``trainer.checkpoint_async: false`` does) and one asynchronous save
   (``AsyncCheckpointer``: what the trainer does by default), interleaved so that both see the
   same load.  Printed: the synchronous save's time, the asynchronous save's time on the calling
   thread (staging into the reused host buffers; the first save also allocates them) and its
   writer's time, and their ratio.
2. **Step-time overhead at ``checkpoint_every`` = ``--every``**: the same U-Net on a
   ``--grid`` stand-in field (the full 721 x 1440 step takes minutes on a CPU) trains ``--every``
   steps (forward, backward, AdamW, EMA) three ways, interleaved, per round: no save; one
   asynchronous save of the 0.25-degree state at the first step (its write runs behind the
   following steps); one synchronous save there.  Overhead = (time - no-save time) / no-save
   time.

    PYTHONPATH=src .venv/bin/python benchmarks/checkpoint_async.py --rounds 3

On a GPU the staging is a device-to-host copy into pinned memory (about 313 MB at 10-25 GB/s:
15-30 ms) instead of a host memcpy, and the write overlaps device compute instead of competing
with it for the CPU cores: docs/performance.md says what a GPU run must confirm.
"""

from __future__ import annotations

import argparse
import shutil
import statistics
import tempfile
import time
from pathlib import Path

import torch

__all__ = ["main"]


def _state_model(conf: dict, grid=None):
    from credit_parallel.models import build_model

    model_conf = dict(conf["model"])
    if grid is not None:
        model_conf.update(image_height=grid[0], image_width=grid[1])
    torch.manual_seed(0)
    return build_model(model_conf).float()


def _trained(model):
    """AdamW with its moments and the EMA shadow, as after a step (no full-grid step needed)."""
    from credit_parallel.train.ema import build_ema

    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4)
    for p in model.parameters():
        p.grad = torch.randn_like(p) * 1e-3
    optimizer.step()
    ema = build_ema(model, 0.999)
    ema.update(model)
    return optimizer, ema


def _state_fn(model, optimizer, ema):
    from credit_parallel.train.checkpoint import checkpoint_state
    from credit_parallel.train.ema import ema_checkpoint_state

    return lambda: checkpoint_state(model, optimizer, ema_checkpoint_state(ema, model))


def _blocking(args, state_fn, root: Path) -> list[dict]:
    from credit_parallel.train.async_save import AsyncCheckpointer
    from credit_parallel.train.checkpoint import write_checkpoint

    checkpointer = AsyncCheckpointer("cpu")
    rows = []
    for r in range(args.rounds):
        t = time.perf_counter()
        write_checkpoint(state_fn(), root / "sync", r + 1, keep=1)
        sync_s = time.perf_counter() - t
        t = time.perf_counter()
        checkpointer.save(
            lambda staged, group, step=r + 1: write_checkpoint(
                staged, root / "async", step, keep=1, group=group
            ),
            state_fn,
        )
        block_s = time.perf_counter() - t
        t = time.perf_counter()
        checkpointer.wait()
        rows.append(
            dict(sync_s=sync_s, block_s=block_s, write_s=time.perf_counter() - t, first=r == 0)
        )
        print(
            f"round {r}: sync save {sync_s:.3f} s | async: blocked {block_s:.3f} s "
            f"(staging {checkpointer.stage_s:.3f} s{', buffers allocated' if r == 0 else ''}), "
            f"writer {rows[-1]['write_s']:.3f} s more | blocked / sync {block_s / sync_s:.3f}",
            flush=True,
        )
    checkpointer.close()
    print(f"staging buffers: {checkpointer.stager.nbytes / 1e6:.1f} MB host memory")
    return rows


def _steps(args, step_model, state_fn, root: Path, mode: str, r: int) -> float:
    from credit_parallel.train.async_save import AsyncCheckpointer
    from credit_parallel.train.checkpoint import write_checkpoint

    optimizer = torch.optim.AdamW(step_model.parameters(), lr=1e-5)
    x = torch.randn(1, step_model.in_channels, *args.grid)
    checkpointer = AsyncCheckpointer("cpu") if mode == "async" else None
    start = time.perf_counter()
    for k in range(args.every):
        optimizer.zero_grad(set_to_none=True)
        step_model(x).square().mean().backward()
        optimizer.step()
        if k == 0 and mode == "async":
            checkpointer.save(
                lambda staged, group: write_checkpoint(
                    staged, root / f"steps_{r}", 1, keep=1, group=group
                ),
                state_fn,
            )
        elif k == 0 and mode == "sync":
            write_checkpoint(state_fn(), root / f"steps_{r}", 1, keep=1)
    elapsed = time.perf_counter() - start
    if checkpointer is not None:
        checkpointer.wait()  # after the timed steps: did the write end within them?
        checkpointer.close()
    shutil.rmtree(root / f"steps_{r}", ignore_errors=True)
    return elapsed


def main(argv=None) -> None:
    from credit_parallel.cli import resolve_config
    from credit_parallel.layout.config import load_config

    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--config", default="era5_025deg_unet")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--every", type=int, default=100, help="steps per checkpoint")
    ap.add_argument("--grid", type=int, nargs=2, default=[32, 64], help="stand-in step grid")
    ap.add_argument("--threads", type=int, default=1, help="torch intra-op threads")
    ap.add_argument("--dir", default=None, help="where to write (default: a temp dir)")
    args = ap.parse_args(argv)
    torch.set_num_threads(args.threads)
    conf = load_config(resolve_config(args.config))
    model = _state_model(conf)
    optimizer, ema = _trained(model)
    n = sum(p.numel() for p in model.parameters())
    print(f"{args.config}: {n / 1e6:.1f} M parameters, AdamW + EMA, one process, float32")
    root = Path(tempfile.mkdtemp(prefix="ckpt_bench_", dir=args.dir))
    try:
        state_fn = _state_fn(model, optimizer, ema)
        rows = _blocking(args, state_fn, root)
        size = sum(f.stat().st_size for f in (root / "sync").rglob("*") if f.is_file())
        print(f"checkpoint on disk: {size / 1e6:.0f} MB")
        later = [r for r in rows if not r["first"]] or rows
        ratio = statistics.median(r["block_s"] / r["sync_s"] for r in later)
        print(f"BLOCK median blocked / sync save (rounds after the first): {ratio:.4f}")

        step_model = _state_model(conf, args.grid)
        times = {"none": [], "async": [], "sync": []}
        for r in range(args.rounds):
            for mode in times:
                times[mode].append(_steps(args, step_model, state_fn, root, mode, r))
            print(
                f"round {r}: {args.every} steps: "
                + ", ".join(f"{m} {t[-1]:.2f} s" for m, t in times.items()),
                flush=True,
            )
        base = statistics.median(times["none"])
        for mode in ("async", "sync"):
            over = statistics.median(
                (t - b) / b for t, b in zip(times[mode], times["none"], strict=True)
            )
            print(
                f"OVERHEAD {mode} save every {args.every} steps: {100 * over:+.2f} % of the "
                f"step time ({base / args.every * 1e3:.0f} ms/step without saves)"
            )
    finally:
        shutil.rmtree(root, ignore_errors=True)


if __name__ == "__main__":
    main()
