"""Worker entry point of ``credit-parallel train``: one process per rank (under torchrun or the
CLI's own use of PyTorch's elastic launcher), or the whole job on one process.

Rank 0 shows a progress bar (step, loss, samples/s, ETA) on a terminal and one plain line per
logged step (``step N loss X grad_norm G lr L samples/s S``) when stdout is a file (batch
jobs), writes ``metrics.csv`` and ``metrics.json`` and, at the end, ``loss_curve.png`` into the
output directory.  ``--resume PATH`` continues from a checkpoint written under any layout,
``--resume auto`` from the run's own newest complete checkpoint (:mod:`.resume`).  Checkpoints go to
``trainer.save_dir`` (default ``OUTPUT/checkpoints``) every ``trainer.checkpoint_every`` steps
and, unless ``trainer.final_checkpoint: false``, after the last step (what ``credit-parallel
forecast --checkpoint`` starts from); asynchronously unless ``trainer.checkpoint_async: false``
(:mod:`.async_save`).  A stop signal (SIGTERM, SIGUSR1: :mod:`.preemption`) on any rank stops
every rank at the same step with a checkpoint there; the worker then exits with status 75.
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

from .progress import RankZeroReport
from .schedule import job_end_step

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


def _log_line(record: dict) -> str:
    """The plain line of one logged step (batch jobs: stdout is a file, not a terminal)."""
    return (
        f"step {record['step']} loss {record['loss']:.6g} grad_norm {record['grad_norm']:.6g} "
        f"lr {record['lr']:.6g} samples/s {record['samples_per_s']:.3g}"
        + (
            f" data_wait_ms {record['data_wait_ms']:.1f} "
            f"data_wait_frac {record['data_wait_frac']:.2f}"
            if "data_wait_ms" in record
            else ""
        )
    )


class _Progress(RankZeroReport):
    """Rank 0's view of the run: the bar, or one plain line per logged step."""

    def __init__(self, stream, total: int, initial: int, log_every: int, enabled: bool):
        super().__init__(
            stream, total, enabled, initial=initial, desc="train", unit="step", dynamic_ncols=True
        )
        self.log_every = log_every

    def step(self, record: dict, last: bool) -> None:
        if not self.enabled:
            return
        due = record["step"] % self.log_every == 0 or last
        if self.bar is not None:
            if due:
                self.bar.set_postfix(
                    loss=f"{record['loss']:.4f}", samples_s=f"{record['samples_per_s']:.1f}"
                )
            self.bar.update(1)
        elif due:
            self.line(_log_line(record))


def _resume(trainer, save_dir: Path, resume: str | None) -> list[str]:
    """``--resume PATH`` / ``auto`` or ``trainer.resume`` (:mod:`.resume`); the lines to report."""
    from ..layout.launch import elastic_restart_count
    from .resume import resume_run

    return resume_run(trainer, save_dir, resume, restarts=elastic_restart_count())


class _Saves:
    """The run's checkpoints: when they are due, what a failed one does
    (``trainer.checkpoint_on_error``), and the lines that say so."""

    def __init__(self, trainer, save_dir: Path, report):
        self.trainer, self.save_dir, self.report = trainer, save_dir, report
        self.saved_at = trainer.step  # a resumed run's step is saved already
        self.count = 0

    def first_line(self) -> str | None:
        tc = self.trainer.tc
        if not (tc.checkpoint_every or tc.final_checkpoint):
            return None
        every = f"every {tc.checkpoint_every} steps and " if tc.checkpoint_every else ""
        if not tc.checkpoint_async:
            how = "synchronous (trainer.checkpoint_async: false)"
        else:
            kind = "pinned host" if self.trainer.device.type == "cuda" else "host"
            how = (
                f"asynchronous: staged into {self.trainer.staging_bytes / 1e6:.1f} MB of {kind} "
                "memory per rank, written behind the step loop, one save in flight"
            )
        return f"checkpoints: {every}at the end, to {self.save_dir}; {how}"

    def save(self, *, wait: bool) -> None:
        """Save this step (unless saved already); a failed save (this one or the one in
        flight) stops the run or is reported, as trainer.checkpoint_on_error says."""
        from .checkpoint import CheckpointSaveError

        if self.saved_at == self.trainer.step:
            if wait:
                self.wait()
            return
        self.wait()  # the save in flight first: its failure is named before this one starts
        self.saved_at = self.trainer.step
        try:
            self.trainer.save(self.save_dir, wait=wait)
            self.count += 1
        except CheckpointSaveError as exc:
            self._failed(exc)

    def wait(self) -> None:
        from .checkpoint import CheckpointSaveError

        checkpointer = self.trainer.checkpointer
        try:
            if checkpointer is not None:
                checkpointer.wait()
        except CheckpointSaveError as exc:
            self._failed(exc)

    def _failed(self, exc) -> None:
        if self.trainer.tc.checkpoint_on_error == "stop":
            raise exc
        self.report.write(f"{exc} (trainer.checkpoint_on_error: continue: training goes on)")

    @property
    def failed(self) -> bool:
        checkpointer = self.trainer.checkpointer
        return checkpointer is not None and checkpointer.failed

    def summary(self) -> str | None:
        c = self.trainer.checkpointer
        if c is None or not self.count:
            return None
        return (
            f"checkpoints: {self.count} saved; the step loop waited {c.wait_s:.2f} s in all for "
            f"saves in flight ({c.waits} save(s) found one), the last staging took "
            f"{c.stage_s:.3f} s"
        )


def _stop_here(trainer, saves: _Saves, report, verdict) -> dict:
    """Every rank agreed to stop at this step: save it, wait for the write, say why/where."""
    report.write(f"stopping at step {trainer.step}: {verdict.reason}; saving a checkpoint there")
    saves.save(wait=True)
    from .preemption import STOPPED_EXIT_CODE

    path = saves.save_dir / f"step_{trainer.step:08d}"
    report.write(
        f"stopped at step {trainer.step} ({verdict.reason}): checkpoint {path} complete; "
        f"continue with --resume auto (exit status {STOPPED_EXIT_CODE})"
    )
    return {"step": trainer.step, "signal": verdict.signum, "rank": verdict.rank}


def _validate(trainer, report, validation: list) -> None:
    metrics = trainer.evaluate()
    metrics["step"] = trainer.step
    validation.append(metrics)
    rmse = [v for k, v in metrics.items() if k.startswith("rmse/")]
    if rmse:
        report.write(f"step {trainer.step}: validation mean RMSE {sum(rmse) / len(rmse):.4f}")


def run_training(
    conf: dict, out_dir: Path, *, progress: bool = True, resume: str | None = None, stream=None
) -> dict:
    """Train ``conf`` to ``trainer.steps``; metrics, plot and checkpoints go to ``out_dir``.

    ``resume``: a checkpoint (a ``step_*`` directory or a directory of them) written under any
    layout, or ``"auto"`` (the newest complete one in the run's save_dir, else a fresh start);
    training continues from it into ``out_dir``.  ``stream``: where rank 0 reports
    (default stdout): a bar when it is a terminal, plain lines otherwise.  A stop signal
    (``trainer.stop_signals``, :mod:`.preemption`) ends the run early at a step every rank
    agrees on, checkpointed: the result's ``stopped`` says where and why (else None).
    """
    from .preemption import StopRequest
    from .trainer import Trainer

    rank = dist.get_rank() if dist.is_initialized() else 0
    stream = stream if stream is not None else sys.stdout
    trainer = Trainer(conf)
    tc = trainer.tc
    save_dir = Path(tc.save_dir or out_dir / "checkpoints")
    resumed = _resume(trainer, save_dir, resume)
    report = _Progress(stream, tc.steps, trainer.step, tc.log_every, rank == 0 and progress)
    saves = _Saves(trainer, save_dir, report)
    for line in [*trainer.layout_notes, saves.first_line(), *resumed]:
        if line:
            report.write(line)
    validation, stopped = [], None
    samples_per_step = tc.batch_size * tc.grad_accum * trainer.dp_size
    t0, s0 = time.perf_counter(), trainer.step
    end = job_end_step(tc, s0)  # trainer.steps, or CREDIT's num_epoch epochs of this job
    with StopRequest(tc.stop_signals, device=trainer.device) as stop:
        while trainer.step < end:
            started = time.perf_counter()
            record = trainer.train_step()
            elapsed = max(1e-9, time.perf_counter() - t0)
            record["samples_per_s"] = (trainer.step - s0) * samples_per_step / elapsed
            report.step(record, last=trainer.step == tc.steps)
            verdict = stop.agreed(failed=saves.failed)
            if verdict.failed:  # a write in flight failed on some rank: every rank learns it
                saves.wait()
            if verdict.stop:
                stopped = _stop_here(trainer, saves, report, verdict)
                break
            if tc.validate_every and trainer.step % tc.validate_every == 0:
                _validate(trainer, report, validation)
            if tc.checkpoint_every and trainer.step % tc.checkpoint_every == 0:
                saves.save(wait=trainer.step == end)
            stop.timed(started)
        job_ends = stopped is None and trainer.step < tc.steps  # CREDIT's num_epoch
        if job_ends:
            report.write(
                f"trainer.job_epochs (CREDIT's num_epoch = {tc.job_epochs['num_epoch']}): this "
                f"job stops at step {trainer.step} of {tc.steps}; its checkpoint goes to "
                f"{save_dir}, `--resume auto` goes on"
            )
        stop.finishing()
        report.close()
        trainer.close()
        wanted = tc.checkpoint_every or tc.final_checkpoint or job_ends
        if stopped is None and trainer.step > s0 and wanted:
            saves.save(wait=True)  # the final checkpoint (trainer.final_checkpoint, default true)
        saves.wait()
        trainer.wait_for_save()
    result = {"steps": trainer.step, "history": trainer.history, "validation": validation}
    result["stopped"] = stopped
    if rank == 0 and trainer.history:
        _write_metrics(out_dir, trainer.history, validation)
        png = _plot(out_dir, trainer.history, validation)
        first, last = trainer.history[0]["loss"], trainer.history[-1]["loss"]
        for line in filter(None, [saves.summary()]):
            print(line, file=stream, flush=True)
        print(
            f"loss {first:.4f} -> {last:.4f} over {len(trainer.history)} steps; metrics and "
            f"{png.name} in {out_dir}",
            file=stream,
            flush=True,
        )
    return result


def main(argv=None) -> int:
    from ..layout.config import load_config
    from ..layout.launch import init_distributed_from_env, under_launcher

    ap = argparse.ArgumentParser(prog="python -m credit_parallel.train.main")
    ap.add_argument("--config", required=True)
    ap.add_argument("--output", default="outputs/train")
    ap.add_argument("--steps", type=int, default=None)
    ap.add_argument("--resume", default=None, help="checkpoint directory to continue from, or auto")
    args = ap.parse_args(argv)
    conf = load_config(args.config)
    if args.steps is not None:
        conf.setdefault("trainer", {})["steps"] = args.steps
    torch.set_num_threads(max(1, int(os.environ.get("OMP_NUM_THREADS", "1"))))
    if under_launcher():
        from .preflight import dist_timeout_s

        init_distributed_from_env(timeout_s=dist_timeout_s(conf))
    result = run_training(conf, Path(args.output), resume=args.resume)
    # only after success: after a failure the process group's teardown can block (NCCL), and
    # the launcher's worker wrapper leaves at once instead
    if dist.is_initialized():
        dist.destroy_process_group()
    if result["stopped"] is not None:
        from .preemption import STOPPED_EXIT_CODE

        return STOPPED_EXIT_CODE
    return 0


if __name__ == "__main__":
    sys.exit(main())
