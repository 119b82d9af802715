"""Worker entry point of ``credit-parallel train``: one process per rank (under torchrun or the
CLI's own use of PyTorch's elastic launcher), or the whole job on one process.

Rank 0 shows a progress bar (step, loss, samples/s, ETA), writes ``metrics.csv`` and
``metrics.json`` and, at the end, ``loss_curve.png`` into the output directory.
"""

from __future__ import annotations

import argparse
import csv
import json
import os
import sys
import time
from pathlib import Path

import torch
import torch.distributed as dist

__all__ = ["main", "run_training"]


def _write_metrics(out_dir: Path, history: list[dict], validation: list[dict]) -> None:
    out_dir.mkdir(parents=True, exist_ok=True)
    keys = sorted({k for r in history for k in r}, key=lambda k: (k != "step", k))
    with open(out_dir / "metrics.csv", "w", newline="") as fh:
        writer = csv.DictWriter(fh, fieldnames=keys)
        writer.writeheader()
        writer.writerows(history)
    (out_dir / "metrics.json").write_text(
        json.dumps({"train": history, "validation": validation}, indent=1)
    )


def _plot(out_dir: Path, history: list[dict], validation: list[dict]) -> Path:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 4))
    ax.plot(
        [r["step"] for r in history],
        [r["loss"] for r in history],
        label="train loss (lat-weighted MSE)",
    )
    if validation:
        steps = [v["step"] for v in validation]
        mean_rmse = [
            sum(v[k] for k in v if k.startswith("rmse/"))
            / max(1, sum(1 for k in v if k.startswith("rmse/")))
            for v in validation
        ]
        ax.plot(steps, [m * m for m in mean_rmse], "o-", label="validation mean MSE")
    ax.set_yscale("log")
    ax.set_xlabel("step")
    ax.set_ylabel("loss")
    ax.grid(True, alpha=0.3)
    ax.legend()
    fig.tight_layout()
    path = out_dir / "loss_curve.png"
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def run_training(conf: dict, out_dir: Path, *, progress: bool = True) -> dict:
    from .trainer import Trainer

    rank = dist.get_rank() if dist.is_initialized() else 0
    trainer = Trainer(conf)
    tc = trainer.tc
    save_dir = Path(conf["trainer"].get("save_dir") or out_dir / "checkpoints")
    if conf["trainer"].get("resume", False):
        manifest = trainer.resume_latest(save_dir)
        if manifest is not None and rank == 0:
            print(f"resumed from step {manifest['step']} ({save_dir})", flush=True)
    validation = []
    bar = None
    if rank == 0 and progress:
        from tqdm import tqdm

        bar = tqdm(
            total=tc.steps,
            initial=trainer.step,
            desc="train",
            unit="step",
            dynamic_ncols=True,
            file=sys.stdout,
        )
    samples_per_step = tc.batch_size * tc.grad_accum * trainer.dp_size
    t0, s0 = time.perf_counter(), trainer.step
    log_every = int(conf["trainer"].get("log_every", 1) or 1)
    while trainer.step < tc.steps:
        record = trainer.train_step()
        if bar is not None:
            rate = (trainer.step - s0) * samples_per_step / max(1e-9, time.perf_counter() - t0)
            record["samples_per_s"] = rate
            if trainer.step % log_every == 0 or trainer.step == tc.steps:
                bar.set_postfix(loss=f"{record['loss']:.4f}", samples_s=f"{rate:.1f}")
            bar.update(1)
        if tc.validate_every and trainer.step % tc.validate_every == 0:
            metrics = trainer.evaluate()
            metrics["step"] = trainer.step
            validation.append(metrics)
            if rank == 0 and metrics:
                mean = sum(v for k, v in metrics.items() if k.startswith("rmse/")) / max(
                    1, len(metrics) - 1
                )
                (bar.write if bar else print)(
                    f"step {trainer.step}: validation mean RMSE {mean:.4f}"
                )
        if tc.checkpoint_every and trainer.step % tc.checkpoint_every == 0:
            trainer.save(save_dir)
    if bar is not None:
        bar.close()
    if tc.checkpoint_every and trainer.step % tc.checkpoint_every:
        trainer.save(save_dir)
    result = {"steps": trainer.step, "history": trainer.history, "validation": validation}
    if rank == 0:
        _write_metrics(out_dir, trainer.history, validation)
        png = _plot(out_dir, trainer.history, validation)
        first, last = trainer.history[0]["loss"], trainer.history[-1]["loss"]
        print(
            f"loss {first:.4f} -> {last:.4f} over {len(trainer.history)} steps; metrics and {png.name} in {out_dir}",
            flush=True,
        )
    return result


def main(argv=None) -> int:
    from ..config import load_config
    from ..launch import init_distributed_from_env, under_launcher

    ap = argparse.ArgumentParser(prog="python -m credit_parallel.train.main")
    ap.add_argument("--config", required=True)
    ap.add_argument("--output", default="outputs/train")
    ap.add_argument("--steps", type=int, default=None)
    args = ap.parse_args(argv)
    conf = load_config(args.config)
    if args.steps is not None:
        conf.setdefault("trainer", {})["steps"] = args.steps
    torch.set_num_threads(max(1, int(os.environ.get("OMP_NUM_THREADS", "1"))))
    if under_launcher():
        from ..preflight import dist_timeout_s

        init_distributed_from_env(timeout_s=dist_timeout_s(conf))
    run_training(conf, Path(args.output))
    # only after success: after a failure the process group's teardown can block (NCCL), and
    # the launcher's worker wrapper leaves at once instead
    if dist.is_initialized():
        dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    sys.exit(main())
