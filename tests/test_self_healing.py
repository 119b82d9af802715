"""Runs that heal themselves: ``--resume auto`` / ``trainer.resume: auto``, and
``--max-restarts N`` (torchrun's elastic agent restarts every rank after one is SIGKILLed).

In process (one rank): ``auto`` starts afresh saying so, continues from the newest complete
checkpoint, and names the newer directories it skips (a save without its ``COMPLETE`` marker, a
truncated shard) with the reason; the losses after the resume equal an uninterrupted run's.

Real processes (``credit-parallel train|forecast --nproc N --max-restarts 2`` -> torchrun ->
ranks), 2 and 4 CPU ranks, the faults injected through a ``sitecustomize`` on the first starts
only (torchrun's ``TORCHELASTIC_RESTART_COUNT``):

* train, 2 ranks: start 0, rank 1 SIGKILLs itself before step 3 (checkpoint of step 2
  complete); start 1, rank 1 SIGKILLs itself inside the save of step 4, after its shards are
  written (``step_00000004.tmp``, no marker); start 2 names and skips it, continues from step 2
  and finishes.  4 ranks: start 0, rank 2 dies inside the save of step 4; start 1 skips it and
  continues from step 2.  The losses equal a one-process uninterrupted run's (float64, 1e-10),
  and the data order continues: every rank's sampler restarts at the micro-batch of the
  checkpoint, batches replayed after a restart are the ones read before it, and the run as
  healed reads every sample of the epoch once.
* forecast: start 0, the last rank SIGKILLs itself at the start of round 2; start 1 continues
  the store (complete initial times kept) and the final store equals a one-process
  uninterrupted forecast's.
"""

from __future__ import annotations

import argparse
import io
import json
import os
import subprocess
import sys
import textwrap
import threading

import numpy as np
import pytest
import torch
import xarray as xr
import yaml

import credit_parallel
from credit_parallel.data import write_sample_dataset
from credit_parallel.data.sampler import StepBatchSampler
from credit_parallel.forecast.command import build_arguments, run_forecast
from credit_parallel.layout.config import ParallelDims
from credit_parallel.layout.run_config import TrainerConfig
from credit_parallel.models import build_model
from credit_parallel.train.checkpoint import MARKER, list_checkpoints, save_checkpoint
from credit_parallel.train.main import run_training
from credit_parallel.train.trainer import Trainer
from sample_conf import tiny_unet, unet_run_conf

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
    path = tmp_path_factory.mktemp("heal_data") / "s.zarr"
    return str(write_sample_dataset(path, n_times=24, nlat=H, nlon=W))


def _conf(store, parallelism=None, batch_size=2, **trainer):
    # synchronous saves: a rank killed right after a save must find it complete (the killed
    # asynchronous save: tests/test_preemption.py)
    keys = dict(steps=STEPS, lr=0.01, warmup_steps=2, seed=5, dtype="float64")
    keys["checkpoint_async"] = False
    keys.update(trainer)
    return unet_run_conf(
        store,
        H,
        W,
        time_slice=[0, 13],
        parallelism=parallelism,
        batch_size=batch_size,
        data={"num_workers": 0},
        # ranks start seconds apart on a loaded machine; a SIGKILLed peer is seen at once
        dist_timeout_s=60,
        **keys,
    )


def _losses(history):
    return [(r["step"], r["loss"]) for r in history]


def _assert_losses_equal(got, want):
    assert [s for s, _ in got] == [s for s, _ in want], (got, want)
    for (step, a), (_, b) in zip(got, want):
        assert abs(a - b) <= TOL, f"step {step}: {a} vs {b}"


@pytest.fixture(scope="module")
def reference(store):
    """The uninterrupted run: every step's loss in one process."""
    trainer = Trainer(_conf(store))
    losses = [(r["step"], r["loss"]) for r in (trainer.train_step() for _ in range(STEPS))]
    n = len(trainer.loader.dataset)
    trainer.close()
    return {"losses": losses, "samples": n}


# --------------------------------------------------------------------------- --resume auto
def test_trainer_resume_accepts_auto_and_names_the_choices():
    assert TrainerConfig.from_conf({"trainer": {"resume": "auto"}}).resume == "auto"
    assert TrainerConfig.from_conf({"trainer": {"resume": True}}).resume is True
    with pytest.raises(ValueError, match="trainer.resume must be true, false or 'auto'"):
        TrainerConfig.from_conf({"trainer": {"resume": "latest"}})


def test_resume_auto_starts_afresh_then_continues_skipping_unfinished_saves(
    store, reference, tmp_path
):
    out = tmp_path / "run"
    conf = _conf(store, checkpoint_every=1)
    stream = io.StringIO()
    run_training(
        dict(conf, trainer=dict(conf["trainer"], steps=2)), out, resume="auto", stream=stream
    )
    ckpt = out / "checkpoints"
    assert f"resume: no complete checkpoint in {ckpt}; starting at step 0" in stream.getvalue()
    assert [p.name for p in list_checkpoints(ckpt)] == ["step_00000001", "step_00000002"]

    # a save killed before its marker (step 4), and a complete-looking step 3 with a truncated
    # shard: both newer than step 2, both named with the reason and skipped
    (ckpt / "step_00000004.tmp").mkdir()
    (ckpt / "step_00000004.tmp" / "__0_0.distcp").write_bytes(b"partial")
    third = ckpt / "step_00000003"
    import shutil

    shutil.copytree(ckpt / "step_00000002", third)
    manifest = json.loads((third / "manifest.json").read_text())
    manifest["step"] = 3
    (third / "manifest.json").write_text(json.dumps(manifest))
    shard = sorted(third.glob("*.distcp"))[0]
    shard.write_bytes(shard.read_bytes()[: shard.stat().st_size // 3])

    stream = io.StringIO()
    result = run_training(conf, out, resume="auto", stream=stream)
    lines = [x for x in stream.getvalue().splitlines() if x.startswith("resume")]
    assert lines[0] == (
        f"resume: skipped {ckpt / 'step_00000004.tmp'} (no {MARKER} marker: its save did not finish)"
    ), lines
    assert lines[1].startswith(f"resume: skipped {third} (checkpoint {third} is corrupted: ")
    assert f"{shard.name}: checksum mismatch (truncated or corrupted)" in lines[1], lines
    assert lines[2] == f"resumed from step 2 ({ckpt / 'step_00000002'})", lines
    assert len(lines) == 3, lines
    _assert_losses_equal(_losses(result["history"]), reference["losses"][2:])


def test_trainer_resume_true_keeps_its_meaning(store, tmp_path):
    """``trainer.resume: true``: the newest checkpoint in save_dir (SPEC §5), said in one line."""
    out = tmp_path / "run"
    conf = _conf(store, steps=1)
    run_training(conf, out, stream=io.StringIO())
    stream = io.StringIO()
    conf = _conf(store, steps=2, resume=True)
    result = run_training(conf, out, stream=stream)
    assert f"resumed from step 1 ({out / 'checkpoints' / 'step_00000001'})" in stream.getvalue()
    assert [r["step"] for r in result["history"]] == [2]


# --------------------------------------------------------------------------- real processes
SITECUSTOMIZE = """
import os

_attempt, _rank = os.environ.get("TORCHELASTIC_RESTART_COUNT"), os.environ.get("RANK")
if _attempt is not None and _rank is not None:
    import json
    import signal

    _kills = {{}}
    for _item in filter(None, os.environ.get("CP_HEAL_KILL", "").split(",")):
        _a, _r, _what, _at = _item.split(":")
        if _a == _attempt and _r == _rank:
            _kills[_what] = int(_at)

    def _die():  # as a node fault or the OOM killer would: no Python error, no cleanup
        os.kill(os.getpid(), signal.SIGKILL)

    if "step" in _kills:
        import credit_parallel.train.trainer as _trainer

        _train_step = _trainer.Trainer.train_step

        def _killing_step(self):
            if self.step + 1 == _kills["step"]:
                _die()
            return _train_step(self)

        _trainer.Trainer.train_step = _killing_step
    if "save" in _kills:
        import torch.distributed.checkpoint as _dcp

        _save = _dcp.save

        def _killing_save(state, *args, checkpoint_id=None, **kwargs):
            result = _save(state, *args, checkpoint_id=checkpoint_id, **kwargs)
            if str(checkpoint_id).endswith("step_%08d.tmp" % _kills["save"]):
                _die()  # this rank's shards are written; no manifest, no marker
            return result

        _dcp.save = _killing_save
    if "round" in _kills:
        import credit_parallel.forecast.command as _forecast

        _maybe_fail = _forecast._maybe_fail

        def _killing_round(rank, round_index):
            if round_index == _kills["round"]:
                _die()
            return _maybe_fail(rank, round_index)

        _forecast._maybe_fail = _killing_round
    if os.environ.get("CP_HEAL_LOG"):  # the batches every sampler yields, by micro-batch number
        from credit_parallel.data.sampler import StepBatchSampler as _Sampler

        _iter = _Sampler.__iter__
        _log = os.path.join(os.environ["CP_HEAL_LOG"], "a%s_r%s.jsonl" % (_attempt, _rank))

        def _logged(self):
            it, m = id(self), self.start_batch
            for batch in _iter(self):
                with open(_log, "a") as fh:
                    fh.write(json.dumps([it, m, list(map(int, batch))]) + "\\n")
                yield batch
                m += 1

        _Sampler.__iter__ = _logged
"""


def _cli(root, argv, kill: str, log_dir=None):
    env = dict(
        os.environ,
        PYTHONPATH=os.pathsep.join([str(root / "site"), PACKAGE_ROOT]),
        CP_HEAL_KILL=kill,
        OMP_NUM_THREADS="1",
    )
    if log_dir is not None:
        env["CP_HEAL_LOG"] = str(log_dir)
    cmd = [sys.executable, "-m", "credit_parallel.cli", *argv]
    return subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=420)


def _forecast_setup(root, store):
    """A checkpoint of the tiny U-Net, the forecast config and the flags."""
    torch.manual_seed(3)
    model = build_model(tiny_unet(H, W))
    ckpt = save_checkpoint(root / "fc_ckpt", 1, model)
    inits = [f"2020-01-0{d}T{h:02d}" for d in (2, 3, 4) for h in (0, 6)]
    return ckpt, inits


def _forecast_conf(store, parallelism=None):
    conf = _conf(store, parallelism=parallelism)
    conf["data"] = {k: v for k, v in conf["data"].items() if k != "time_slice"}
    return conf


FORECAST_STEPS = 2
# "start:rank:where:when" (start: torchrun's restart count).  2 ranks: start 0, rank 1 dies
# before step 3; start 1, rank 1 dies inside the save of step 4.  4 ranks: start 0, rank 2 dies
# inside the save of step 4.  Either way the run continues from step 2 at the last start.
TRAIN_KILLS = {2: "0:1:step:3,1:1:save:4", 4: "0:2:save:4"}


@pytest.fixture(scope="module")
def healed(store, tmp_path_factory):
    """Every killed run through the real command line, run concurrently (each starts torchrun
    and its ranks three times); the train and forecast runs at 2 and 4 ranks."""
    root = tmp_path_factory.mktemp("heal")
    (root / "site").mkdir()
    (root / "site" / "sitecustomize.py").write_text(textwrap.dedent(SITECUSTOMIZE.format()))
    ckpt, inits = _forecast_setup(root, store)
    results, jobs = {}, []
    for world, (parallelism, batch) in LAYOUTS.items():
        conf = _conf(store, parallelism, batch, checkpoint_every=2)
        path = root / f"train{world}.yaml"
        path.write_text(yaml.safe_dump(conf))
        log = root / f"log{world}"
        log.mkdir()
        out = root / f"train{world}"
        argv = ["train", "--nproc", str(world), "--max-restarts", "2", "--config", str(path)]
        argv += ["--output", str(out)]
        jobs.append((("train", world), root, argv, TRAIN_KILLS[world], log, out))

        fconf = _forecast_conf(store, parallelism)
        fpath = root / f"forecast{world}.yaml"
        fpath.write_text(yaml.safe_dump(fconf))
        fout = root / f"forecast{world}"
        argv = ["forecast", "--nproc", str(world), "--max-restarts", "2", "--config", str(fpath)]
        argv += ["--checkpoint", str(ckpt), "--steps", str(FORECAST_STEPS), "--output", str(fout)]
        argv += ["--init-times", *inits]
        jobs.append((("forecast", world), root, argv, f"0:{world - 1}:round:2", None, fout))

    def run(key, root, argv, kill, log, out):
        results[key] = (_cli(root, argv, kill, log), log, out)

    threads = [threading.Thread(target=run, args=job) for job in jobs]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    results["forecast_inputs"] = (ckpt, inits)
    return results


def _sampler_log(log_dir, attempt, rank):
    """The micro-batches of the LAST sampler an attempt started (the training stream; the one
    built before a resume may have been read ahead): ``[(m, indices), ...]``."""
    rows = [json.loads(x) for x in (log_dir / f"a{attempt}_r{rank}.jsonl").read_text().splitlines()]
    last = rows[-1][0]
    return [(m, idx) for it, m, idx in rows if it == last]


@pytest.mark.slow
@pytest.mark.timeout(900)  # the fixture's four commands: 316 s on the loaded 2-core machine
@pytest.mark.parametrize("world", list(LAYOUTS))
def test_train_killed_rank_and_killed_save_heal_on_the_uninterrupted_trajectory(
    healed, reference, world
):
    proc, log, out = healed[("train", world)]
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-5000:]
    text = proc.stdout
    ckpt = out / "checkpoints"
    starts = len(TRAIN_KILLS[world].split(",")) + 1
    for restart in range(1, starts):
        assert f"elastic restart {restart}: continuing from this run's checkpoints" in text, text
    assert f"elastic restart {starts}" not in text
    # the last start named the unfinished save of step 4 and skipped it
    skipped = f"resume: skipped {ckpt / 'step_00000004.tmp'} (no {MARKER} marker: its save did not finish)"
    assert text.count(skipped) == 1, text
    assert text.count(f"resumed from step 2 ({ckpt / 'step_00000002'})") == starts - 1, text
    assert [p.name for p in list_checkpoints(ckpt)][-1] == f"step_{STEPS:08d}"

    # the losses of the healed run (its last start: steps 3..6) equal the uninterrupted run's
    metrics = json.loads((out / "metrics.json").read_text())
    _assert_losses_equal(_losses(metrics["train"]), reference["losses"][2:])

    # the data order continues: per rank, each start's training sampler begins at its resume
    # step's micro-batch; the healed stream (start 0 up to step 2, start 2 from step 2) is the
    # uninterrupted one; batches read again after a restart are the ones read before it
    parallelism, batch = LAYOUTS[world]
    dims = ParallelDims.from_conf({"trainer": {"parallelism": parallelism}}, world)
    dp = dims.dp
    epoch_share = {}
    for rank in range(world):
        dp_rank = dims.coords(rank)["dp"]
        streams = [_sampler_log(log, a, rank) for a in range(starts)]
        assert [s[0][0] for s in streams] == [0] + [2] * (starts - 1), [s[0] for s in streams]
        healed_stream = [b for b in streams[0] if b[0] < 2] + [
            b for b in streams[-1] if b[0] < STEPS
        ]
        assert [m for m, _ in healed_stream] == list(range(STEPS))
        want = StepBatchSampler(reference["samples"], batch, dp_rank, dp, seed=5)
        assert [idx for _, idx in healed_stream] == [want.batch_indices(m) for m in range(STEPS)]
        read = {m: idx for s in streams for m, idx in s}
        for s in streams:
            assert all(read[m] == idx for m, idx in s), f"rank {rank}: a replayed batch differs"
        epoch_share[dp_rank] = [
            i for m, idx in healed_stream if m < want.batches_per_epoch for i in idx
        ]
    seen = [i for share in epoch_share.values() for i in share]
    assert len(seen) == len(set(seen)), f"a sample was read twice in the epoch: {seen}"
    assert len(seen) == reference["samples"] - reference["samples"] % (batch * dp), seen


def _forecast_reference(store, tmp_path, ckpt, inits):
    ap = argparse.ArgumentParser()
    build_arguments(ap)
    out = tmp_path / "one"
    args = ap.parse_args(
        ["--config", "unused", "--checkpoint", str(ckpt), "--steps", str(FORECAST_STEPS)]
        + ["--output", str(out), "--init-times", *inits]
    )
    args.progress = False
    run_forecast(_forecast_conf(store), args, stream=io.StringIO())
    return out / "forecast.zarr"


@pytest.mark.slow
@pytest.mark.timeout(900)  # the fixture's four commands: 316 s on the loaded 2-core machine
@pytest.mark.parametrize("world", list(LAYOUTS))
def test_forecast_killed_rank_heals_into_the_uninterrupted_store(healed, store, tmp_path, world):
    proc, _, out = healed[("forecast", world)]
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-5000:]
    assert "elastic restart 1: continuing the store (--resume)" in proc.stdout, proc.stdout
    done = 1 if world == 2 else 2  # the initial times of round 0 were marked complete
    assert f"resume: {done} initial time(s) already complete, skipped" in proc.stdout
    one = xr.open_zarr(_forecast_reference(store, tmp_path, *healed["forecast_inputs"]))
    got = xr.open_zarr(out / "forecast.zarr")
    assert sorted(got.data_vars) == sorted(one.data_vars)
    assert np.all(got["complete"].values == 1)
    for name in one.data_vars:
        a, b = got[name].values, one[name].values
        assert a.shape == b.shape and np.isfinite(a).all(), name
        np.testing.assert_allclose(a, b, rtol=1e-6, atol=1e-6, err_msg=name)


def test_cli_names_auto_when_the_resume_path_is_missing_and_refuses_negative_restarts(
    store, tmp_path, capsys
):
    from credit_parallel import cli

    path = tmp_path / "c.yaml"
    path.write_text(yaml.safe_dump(_conf(store)))
    missing = str(tmp_path / "nothing")
    assert cli.main(["train", "--config", str(path), "--resume", missing]) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith(f"credit-parallel train: error: --resume {missing!r} is not a checkpoint")
    assert "--resume auto" in err and len(err.splitlines()) == 1, err
    with pytest.raises(SystemExit) as info:
        cli.main(["train", "--config", str(path), "--max-restarts", "-1"])
    assert info.value.code == 2
    err = capsys.readouterr().err
    assert "--max-restarts: must be an integer >= 0, got -1" in err and len(err.splitlines()) == 1


class _Recorder:
    """Stands in for the Trainer in the choice of what to load: records what is loaded."""

    def __init__(self, configured=False):
        self.tc = argparse.Namespace(resume=configured)
        self.loaded = []

    def resume_latest(self, directory, on_skip=None):
        found = list_checkpoints(directory)
        self.loaded.append(("latest", found[-1].name if found else None))
        return {"step": int(found[-1].name[5:])} if found else None

    def resume_from(self, path):
        self.loaded.append(("path", str(path)))
        return {"step": 7}


@pytest.mark.parametrize(
    "resume, configured, restarts, own, loaded",
    [
        (None, False, 0, True, []),  # nothing asked: a fresh start, nothing said
        (None, True, 0, True, [("latest", "step_00000004")]),  # trainer.resume: true
        (None, "auto", 0, False, [("latest", None)]),  # auto without checkpoints: fresh
        ("auto", False, 0, True, [("latest", "step_00000004")]),
        ("PATH", False, 0, True, [("path", "PATH")]),  # the first start: --resume PATH
        ("PATH", False, 1, True, [("latest", "step_00000004")]),  # a restart: its own, not PATH
        ("PATH", False, 1, False, [("path", "PATH")]),  # a restart before any save: PATH again
        (None, False, 2, True, [("latest", "step_00000004")]),  # a restart resumes unasked
    ],
)
def test_what_a_start_continues_from(tmp_path, resume, configured, restarts, own, loaded):
    from credit_parallel.train.resume import resume_run

    save_dir = tmp_path / "checkpoints"
    if own:
        (save_dir / "step_00000004").mkdir(parents=True)
        (save_dir / "step_00000004" / MARKER).write_text("ok\n")
    trainer = _Recorder(configured)
    lines = resume_run(trainer, save_dir, resume, restarts=restarts)
    assert trainer.loaded == loaded
    assert bool(lines) == bool(loaded)
    if restarts and loaded[0][0] == "latest":
        assert lines[0] == f"elastic restart {restarts}: continuing from this run's checkpoints"
