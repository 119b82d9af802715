"""A clean stop on preemption, and an asynchronous save killed mid-write (issue 42, item 2).

In process: the stop request's handlers and agreement; a rank sent SIGTERM that never reaches a
step boundary dies of it with its stacks dumped (as torchrun's survivors of a failure must); a
SIGUSR1 mid-run stops a one-process run at that step with a checkpoint, and ``--resume auto``
continues on the uninterrupted trajectory (float64, 1e-10); a forecast stopped between rounds
keeps its finished initial times and ``--resume`` completes the same store; the launcher's one
line when every rank stopped.

Real processes (``credit-parallel train --nproc N`` -> torchrun -> ranks; faults injected by a
``sitecustomize`` on the first command only): SIGTERM to ONE rank in the middle of step 3 at 2
ranks (domain 2) and at 4 ranks (ddp 2 x domain 2): every rank stops after step 3, the command
exits 75 with one line, and the same command with ``--resume auto`` ends with the losses of an
uninterrupted one-process run.  An asynchronous save killed mid-write (rank 1 SIGKILLed by its
writer thread inside the shard of step 4, the step loop running on) under ``--max-restarts 1``:
the restart resumes from step 2 and ends on the uninterrupted trajectory.
"""

from __future__ import annotations

import io
import json
import multiprocessing
import os
import signal
import subprocess
import sys
import textwrap
import threading
import time

import pytest
import yaml

import credit_parallel
from credit_parallel.data import write_sample_dataset
from credit_parallel.forecast.command import run_forecast
from credit_parallel.tools import forensics
from credit_parallel.tools.launcher import stopped_line
from credit_parallel.train import preemption
from credit_parallel.train.checkpoint import list_checkpoints
from credit_parallel.train.main import run_training
from credit_parallel.train.preemption import STOPPED_EXIT_CODE, StopRequest
from credit_parallel.train.trainer import Trainer
from sample_conf import unet_run_conf

__all__: list[str] = []

pytestmark = pytest.mark.filterwarnings("ignore:torch.distributed is disabled:UserWarning")

PACKAGE_ROOT = os.path.dirname(os.path.dirname(os.path.abspath(credit_parallel.__file__)))
TOL = 1e-10
H, W = 17, 16
STEPS = 6
LAYOUTS = {  # world size: (trainer.parallelism, per-dp-rank batch): the same global batch of 2
    2: ({"data": "none", "tensor": 1, "domain": 2}, 2),
    4: ({"data": "ddp", "tensor": 1, "domain": 2}, 1),
}


@pytest.fixture(scope="module")
def store(tmp_path_factory):
    path = tmp_path_factory.mktemp("stop_data") / "s.zarr"
    return str(write_sample_dataset(path, n_times=24, nlat=H, nlon=W))


def _conf(store, parallelism=None, batch_size=2, **trainer):
    keys = dict(steps=STEPS, lr=0.01, warmup_steps=2, seed=5, dtype="float64", use_ema=True)
    keys.update(trainer)
    return unet_run_conf(
        store,
        H,
        W,
        time_slice=[0, 13],
        parallelism=parallelism,
        batch_size=batch_size,
        data={"num_workers": 0},
        dist_timeout_s=60,
        **keys,
    )


def _assert_losses_equal(got, want):
    assert [s for s, _ in got] == [s for s, _ in want], (got, want)
    for (step, a), (_, b) in zip(got, want):
        assert abs(a - b) <= TOL, f"step {step}: {a} vs {b}"


@pytest.fixture(scope="module")
def reference(store):
    trainer = Trainer(_conf(store))
    losses = [(r["step"], r["loss"]) for r in (trainer.train_step() for _ in range(STEPS))]
    trainer.close()
    return losses


# --------------------------------------------------------------------------- in process
def test_stop_request_agrees_names_the_signal_and_restores_the_handlers():
    before = signal.getsignal(signal.SIGUSR1)
    with StopRequest(["SIGUSR1"]) as stop:
        assert not stop.agreed().stop
        os.kill(os.getpid(), signal.SIGUSR1)
        verdict = stop.agreed(failed=True)
        assert verdict.stop and verdict.failed
        assert verdict.reason == "SIGUSR1 received on rank 0"
    assert signal.getsignal(signal.SIGUSR1) == before
    assert preemption.STATUS_DIR_ENV == forensics.STATUS_DIR_ENV


def _hung_child(status_dir: str) -> None:
    os.environ[preemption.STATUS_DIR_ENV], os.environ["RANK"] = status_dir, "0"
    with StopRequest(["SIGTERM"]):
        os.kill(os.getpid(), signal.SIGTERM)
        time.sleep(30)  # never reaches a step boundary
    os._exit(0)


def test_a_rank_that_never_reaches_the_boundary_dies_of_sigterm_with_its_stacks(tmp_path):
    child = multiprocessing.get_context("fork").Process(target=_hung_child, args=(str(tmp_path),))
    start = time.perf_counter()
    child.start()
    child.join(20)
    assert child.exitcode == 128 + signal.SIGTERM
    assert time.perf_counter() - start < 10  # 1 s + 2 x its last step (none yet)
    stack = (tmp_path / "rank0.stack").read_text()
    assert "_hung_child" in stack and "most recent call first" in stack


def test_sigusr1_mid_run_stops_at_that_step_and_auto_resume_loses_nothing(
    store, reference, tmp_path, monkeypatch
):
    real = Trainer.train_step

    def step(self):
        if self.step + 1 == 3:  # the signal arrives in the middle of step 3
            os.kill(os.getpid(), signal.SIGUSR1)
        return real(self)

    monkeypatch.setattr(Trainer, "train_step", step)
    stream = io.StringIO()
    result = run_training(_conf(store, checkpoint_every=4), tmp_path, stream=stream)
    ckpt = tmp_path / "checkpoints"
    assert result["stopped"] == {"step": 3, "signal": signal.SIGUSR1, "rank": 0}
    assert [p.name for p in list_checkpoints(ckpt)] == ["step_00000003"]
    text = stream.getvalue()
    assert "stopping at step 3: SIGUSR1 received on rank 0; saving a checkpoint there" in text
    assert (
        f"stopped at step 3 (SIGUSR1 received on rank 0): checkpoint {ckpt / 'step_00000003'} "
        f"complete; continue with --resume auto (exit status {STOPPED_EXIT_CODE})"
    ) in text
    monkeypatch.setattr(Trainer, "train_step", real)
    result = run_training(_conf(store, checkpoint_every=4), tmp_path, resume="auto")
    _assert_losses_equal([(r["step"], r["loss"]) for r in result["history"]], reference[3:])


@pytest.mark.slow  # three small forecasts: 37-44 s on the loaded 2-core machine
def test_forecast_stopped_between_rounds_keeps_finished_times_and_resume_completes(
    tmp_path, monkeypatch
):
    import credit_parallel.forecast.command as command
    from test_forecast_command import (
        INITS,
        _args,
        _assert_same_store,
        _checkpoint,
        _conf,
        _model_conf,
    )

    store = write_sample_dataset(tmp_path / "s.zarr", n_times=40, nlat=H, nlon=W)
    ckpt, _ = _checkpoint(tmp_path / "ckpt", _model_conf(8))
    conf_path = tmp_path / "conf.yaml"
    conf_path.write_text(yaml.safe_dump(_conf(store)))
    one = _args(conf_path, ckpt, tmp_path / "one", steps=2)
    run_forecast(_conf(store), one, stream=io.StringIO())

    real = command._maybe_fail

    def stop_in_round_1(rank, round_index):
        if round_index == 1:  # the signal arrives while round 1 computes
            os.kill(os.getpid(), signal.SIGTERM)
        return real(rank, round_index)

    monkeypatch.setattr(command, "_maybe_fail", stop_in_round_1)
    stream = io.StringIO()
    out = tmp_path / "stopped"
    result = run_forecast(_conf(store), _args(conf_path, ckpt, out, steps=2), stream=stream)
    assert result["stopped"] == "SIGTERM received on rank 0"
    assert result["computed"] == [str(result["computed"][0]), str(result["computed"][1])]
    assert (
        f"forecast: stopping after 2 of {len(INITS)} initial time(s) (SIGTERM received on rank "
        f"0): those are complete in {out / 'forecast.zarr'}; continue with --resume (exit "
        f"status {STOPPED_EXIT_CODE})"
    ) in stream.getvalue()
    from credit_parallel.forecast.store import ForecastStore

    assert list(ForecastStore.open(out / "forecast.zarr", 1).complete_times()) == [1, 1, 0]
    monkeypatch.setattr(command, "_maybe_fail", real)
    stream = io.StringIO()
    resumed = _args(conf_path, ckpt, out, "--resume", steps=2)
    result = run_forecast(_conf(store), resumed, stream=stream)
    assert result["skipped"] == 2 and len(result["computed"]) == 1
    assert "forecast: 1 initial time(s) x 2 steps in " in stream.getvalue()
    _assert_same_store(tmp_path / "one" / "forecast.zarr", out / "forecast.zarr")


def test_launcher_says_stopped_only_when_every_rank_stopped(tmp_path):
    for rank in (0, 1):
        (tmp_path / f"rank{rank}.json").write_text(
            json.dumps({"rank": rank, "message": f"m exited with status {STOPPED_EXIT_CODE}"})
        )
    line = stopped_line(str(tmp_path), 2)
    assert line.startswith("credit-parallel: stopped on request: all 2 ranks saved")
    # the agent may SIGTERM a rank on its way out after the first one exited with 75
    assert stopped_line(str(tmp_path), 2, {0: -signal.SIGTERM, 1: STOPPED_EXIT_CODE}) == line
    assert stopped_line(str(tmp_path), 3, {2: STOPPED_EXIT_CODE}) == line.replace("2", "3", 1)
    assert stopped_line(str(tmp_path), 3) is None  # rank 2 said nothing
    assert stopped_line(str(tmp_path), 3, {2: 1}) is None


# --------------------------------------------------------------------------- real processes
SITECUSTOMIZE = """
import os

_rank, _attempt = os.environ.get("RANK"), os.environ.get("TORCHELASTIC_RESTART_COUNT")
if _rank is not None and _attempt == "0":
    import signal

    _stop = os.environ.get("CP_STOP", "")  # "rank:step:SIGNAME": the signal in that step
    if _stop and _stop.split(":")[0] == _rank:
        import credit_parallel.train.trainer as _trainer

        _r, _step, _sig = _stop.split(":")
        _train_step = _trainer.Trainer.train_step

        def _signalled_step(self):
            if self.step + 1 == int(_step):
                os.kill(os.getpid(), getattr(signal, _sig))
            return _train_step(self)

        _trainer.Trainer.train_step = _signalled_step
    _kill = os.environ.get("CP_KILL_WRITE", "")  # "rank:step": SIGKILL inside that shard write
    if _kill and _kill.split(":")[0] == _rank:
        import credit_parallel.train.async_save as _async

        _tmp = "step_%08d.tmp" % int(_kill.split(":")[1])
        _write = _async._HashingStream.write

        def _killing_write(self, data):
            if _tmp in str(getattr(self.raw, "name", "")):
                os.kill(os.getpid(), signal.SIGKILL)  # the writer thread, mid-shard
            return _write(self, data)

        _async._HashingStream.write = _killing_write
"""


def _cli(root, argv, **env):
    env = dict(
        os.environ,
        PYTHONPATH=os.pathsep.join([str(root / "site"), PACKAGE_ROOT]),
        OMP_NUM_THREADS="1",
        **env,
    )
    cmd = [sys.executable, "-m", "credit_parallel.cli", *argv]
    return subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=420)


def _concurrently(jobs: dict) -> dict:
    results = {}
    threads = [
        threading.Thread(target=lambda k=k, f=f: results.__setitem__(k, f()))
        for k, f in jobs.items()
    ]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    return results


@pytest.fixture(scope="module")
def stopped(store, tmp_path_factory):
    """The stopped runs and the killed write (first commands, concurrently), then the resumed
    runs (concurrently)."""
    root = tmp_path_factory.mktemp("stop")
    (root / "site").mkdir()
    (root / "site" / "sitecustomize.py").write_text(textwrap.dedent(SITECUSTOMIZE))
    argv, first = {}, {}
    for world, (parallelism, batch) in LAYOUTS.items():
        path = root / f"train{world}.yaml"
        path.write_text(yaml.safe_dump(_conf(store, parallelism, batch, checkpoint_every=4)))
        argv[world] = ["train", "--nproc", str(world), "--config", str(path)]
        argv[world] += ["--output", str(root / f"train{world}")]
        victim = world - 1  # rank 1 of 2, rank 3 of 4 (the second dp replica)
        first[world] = lambda w=world, v=victim: _cli(root, argv[w], CP_STOP=f"{v}:3:SIGTERM")
    path = root / "killed.yaml"
    path.write_text(yaml.safe_dump(_conf(store, LAYOUTS[2][0], 2, checkpoint_every=2)))
    killed = ["train", "--nproc", "2", "--max-restarts", "1", "--config", str(path)]
    killed += ["--output", str(root / "killed")]
    first["killed"] = lambda: _cli(root, killed, CP_KILL_WRITE="1:4")
    results = {("first", k): v for k, v in _concurrently(first).items()}
    resumed = {w: (lambda w=w: _cli(root, [*argv[w], "--resume", "auto"])) for w in LAYOUTS}
    results.update({("resumed", k): v for k, v in _concurrently(resumed).items()})
    results["root"] = root
    return results


@pytest.mark.slow
@pytest.mark.timeout(900)
@pytest.mark.parametrize("world", list(LAYOUTS))
def test_sigterm_on_one_rank_stops_every_rank_and_auto_resume_loses_nothing(
    stopped, reference, world
):
    proc = stopped[("first", world)]
    assert proc.returncode == STOPPED_EXIT_CODE, proc.stdout[-3000:] + proc.stderr[-5000:]
    victim = world - 1
    ckpt = stopped["root"] / f"train{world}" / "checkpoints"
    assert f"stopping at step 3: SIGTERM received on rank {victim}" in proc.stdout, proc.stdout
    assert f"stopped at step 3 (SIGTERM received on rank {victim}): checkpoint " in proc.stdout
    lines = [x for x in proc.stderr.splitlines() if x.startswith("credit-parallel: ")]
    assert lines == [
        f"credit-parallel: stopped on request: all {world} ranks saved at the same step and "
        f"exited with status {STOPPED_EXIT_CODE}; run the same command with --resume auto "
        "(forecast: --resume) to continue"
    ], proc.stderr[-3000:]
    # the stop's checkpoint (4 and 6: the resumed run's); nothing else was saved before it
    assert [p.name for p in list_checkpoints(ckpt)] == [f"step_{s:08d}" for s in (3, 4, 6)]

    again = stopped[("resumed", world)]
    assert again.returncode == 0, again.stdout[-3000:] + again.stderr[-5000:]
    assert f"resumed from step 3 ({ckpt / 'step_00000003'})" in again.stdout
    metrics = json.loads((stopped["root"] / f"train{world}" / "metrics.json").read_text())
    _assert_losses_equal([(r["step"], r["loss"]) for r in metrics["train"]], reference[3:])


@pytest.mark.slow
@pytest.mark.timeout(900)
def test_async_save_killed_mid_write_resumes_from_the_previous_one(stopped, reference):
    proc = stopped[("first", "killed")]
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-5000:]
    ckpt = stopped["root"] / "killed" / "checkpoints"
    assert "elastic restart 1: continuing from this run's checkpoints" in proc.stdout
    assert f"resumed from step 2 ({ckpt / 'step_00000002'})" in proc.stdout, proc.stdout
    assert [p.name for p in list_checkpoints(ckpt)][-1] == f"step_{STEPS:08d}"
    metrics = json.loads((stopped["root"] / "killed" / "metrics.json").read_text())
    _assert_losses_equal([(r["step"], r["loss"]) for r in metrics["train"]], reference[2:])
