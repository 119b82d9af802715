"""Saves off the step loop and saves that fail without losing anything (issue 42, items 1 and 3).

In process, one rank, the tiny U-Net in float64:

* an asynchronous save snapshots the state when it is staged: the steps taken while the writer
  writes do not leak into it; loading it restores the staged weights bit for bit and the run
  continues on the uninterrupted trajectory (1e-10); every checksum of the manifest (computed
  from the bytes as they were written) matches the file on disk;
* the stager reuses its host buffers, pins them on CUDA (a fake ``torch.cuda`` and an injected
  ``torch.empty`` on this CPU machine) and synchronises once after the non-blocking copies;
* at most one save is in flight: the next one waits, and the wait is counted;
* a write that fails (ENOSPC in the middle of a shard, a permission error on the directory),
  synchronous or not, raises ONE line naming the path and the cause, removes the partial
  directory and leaves the previous checkpoints loadable, also with ``keep: 1``;
  ``trainer.checkpoint_on_error: continue`` reports it and trains on, ``stop`` stops the run.
"""

from __future__ import annotations

import errno
import io
import threading
import time
from pathlib import Path

import pytest
import torch

from credit_parallel.data import write_sample_dataset
from credit_parallel.layout.run_config import TrainerConfig
from credit_parallel.train import async_save
from credit_parallel.train.async_save import AsyncCheckpointer, HostStager
from credit_parallel.train.checkpoint import (
    CheckpointSaveError,
    list_checkpoints,
    read_manifest,
    verify_files,
)
from credit_parallel.train.main import run_training
from credit_parallel.train.trainer import Trainer
from sample_conf import unet_run_conf

__all__: list[str] = []

pytestmark = pytest.mark.filterwarnings("ignore:torch.distributed is disabled:UserWarning")

TOL = 1e-10
H, W = 17, 16


@pytest.fixture(scope="module")
def store(tmp_path_factory):
    path = tmp_path_factory.mktemp("async_data") / "s.zarr"
    return str(write_sample_dataset(path, n_times=24, nlat=H, nlon=W))


def _conf(store, **trainer):
    keys = dict(steps=6, lr=0.01, warmup_steps=2, seed=5, dtype="float64", use_ema=True)
    keys.update(trainer)
    return unet_run_conf(
        store, H, W, time_slice=[0, 13], batch_size=2, data={"num_workers": 0}, **keys
    )


def _params(trainer):
    return {n: p.detach().clone() for n, p in trainer.model.named_parameters()}


def _losses(trainer, n):
    return [trainer.train_step()["loss"] for _ in range(n)]


# --------------------------------------------------------------------------- item 1
def test_async_save_is_the_staged_state_and_resumes_on_the_same_trajectory(store, tmp_path):
    reference = Trainer(_conf(store))
    want = _losses(reference, 4)
    reference.close()

    trainer = Trainer(_conf(store))
    _losses(trainer, 2)
    staged = _params(trainer)
    path = trainer.save(tmp_path, wait=False)  # returns once staged
    _losses(trainer, 1)  # the weights change while the writer writes
    trainer.wait_for_save()
    assert trainer.checkpointer.stager.allocations > 0
    assert trainer.staging_bytes == trainer.checkpointer.stager.nbytes
    verify_files(path)  # the checksums written while writing match the files
    files = read_manifest(path)["files"]
    assert ".metadata" in files and any(name.endswith(".distcp") for name in files)

    resumed = Trainer(_conf(store))
    resumed.load(path)
    assert all(torch.equal(staged[k], v) for k, v in _params(resumed).items())
    got = _losses(resumed, 2)
    assert max(abs(a - b) for a, b in zip(got, want[2:])) <= TOL, (got, want)
    resumed.close()
    trainer.close()


class _FakeCuda:
    def __init__(self):
        self.calls = []

    def synchronize(self, device):
        self.calls.append(("synchronize", str(device)))


def test_stager_pins_on_cuda_reuses_its_buffers_and_synchronises_once():
    cuda, allocated = _FakeCuda(), []

    def host_empty(shape, *, dtype, device, pin_memory):
        allocated.append((tuple(shape), dtype, device, pin_memory))
        cuda.calls.append(("alloc", tuple(shape)))
        return torch.empty(shape, dtype=dtype)

    stager = HostStager("cuda:0", host_empty=host_empty, cuda=cuda)
    state = {
        "model": {"w": torch.arange(6.0).view(2, 3), "b": torch.ones(3, dtype=torch.float64)},
        "optim": {"state": {"w": {"step": torch.tensor(3.0)}}, "param_groups": [{"lr": 0.1}]},
    }
    first = stager.stage(state)
    assert allocated == [
        ((2, 3), torch.float32, "cpu", True),
        ((3,), torch.float64, "cpu", True),
        ((), torch.float32, "cpu", True),
    ]
    assert cuda.calls[-1] == ("synchronize", "cuda:0")  # after every copy
    assert torch.equal(first["model"]["w"], state["model"]["w"])
    assert first["optim"]["param_groups"] == [{"lr": 0.1}]
    pointers = [first["model"]["w"].data_ptr(), first["model"]["b"].data_ptr()]

    state["model"]["w"].add_(1.0)
    second = stager.stage(state)
    assert len(allocated) == 3  # the buffers are reused
    assert [second["model"]["w"].data_ptr(), second["model"]["b"].data_ptr()] == pointers
    assert torch.equal(second["model"]["w"], torch.arange(6.0).view(2, 3) + 1)
    assert [c for c in cuda.calls if c[0] == "synchronize"] == [("synchronize", "cuda:0")] * 2
    assert stager.nbytes == 6 * 4 + 3 * 8 + 4

    cpu = HostStager("cpu")
    cpu.stage(state)
    assert not cpu.pinned and not next(iter(cpu.buffers.values())).is_pinned()


def test_one_save_in_flight_the_next_one_waits_and_the_wait_is_counted():
    gate, order = threading.Event(), []

    def write(staged, group):
        order.append(("write", staged["x"].item()))
        gate.wait(10)
        return staged["x"].item()

    checkpointer = AsyncCheckpointer("cpu")
    checkpointer.save(write, lambda: {"x": torch.tensor(1.0)})
    assert checkpointer.in_flight and checkpointer.waits == 0
    threading.Timer(0.3, gate.set).start()
    start = time.perf_counter()
    checkpointer.save(write, lambda: {"x": torch.tensor(2.0)})  # waits for the first
    blocked = time.perf_counter() - start
    assert order[0] == ("write", 1.0)
    assert checkpointer.waits == 1 and checkpointer.wait_s >= 0.25 and blocked >= 0.25
    assert checkpointer.block_s >= checkpointer.wait_s
    assert checkpointer.wait() == 2.0
    assert checkpointer.wait() is None
    checkpointer.close()


# --------------------------------------------------------------------------- item 3
def _no_space_after(monkeypatch, nbytes: int, step: int):
    """Writes into ``step_<step>.tmp`` fail with ENOSPC once ``nbytes`` were written."""
    real = async_save._HashingStream.write
    written = {"n": 0}

    def write(self, data):
        if f"step_{step:08d}.tmp" in str(getattr(self.raw, "name", "")):
            written["n"] += len(memoryview(data).cast("B"))
            if written["n"] > nbytes:
                raise OSError(errno.ENOSPC, "No space left on device")
        return real(self, data)

    monkeypatch.setattr(async_save._HashingStream, "write", write)


@pytest.mark.parametrize("mode", ["async", "sync"])
def test_full_disk_mid_shard_names_path_and_cause_and_keeps_the_previous(
    store, tmp_path, monkeypatch, mode
):
    trainer = Trainer(_conf(store, checkpoint_async=mode == "async", checkpoint_keep=1))
    _losses(trainer, 1)
    first = trainer.save(tmp_path)
    at_first = _params(trainer)
    _losses(trainer, 1)
    _no_space_after(monkeypatch, 1000, step=2)
    with pytest.raises(CheckpointSaveError) as info:
        trainer.save(tmp_path)
    message = str(info.value)
    tmp = tmp_path / "step_00000002.tmp"
    assert message == (
        f"checkpoint save of step 2 to {tmp} failed: OSError: [Errno 28] No space left on "
        f"device; newest complete checkpoint {first} intact"
    )
    assert "\n" not in message and info.value.path == tmp
    assert not tmp.exists()  # the partial directory is gone (its space too)
    assert list_checkpoints(tmp_path) == [first]  # keep: 1 deleted nothing
    verify_files(first)
    resumed = Trainer(_conf(store))
    assert resumed.resume_latest(tmp_path)["step"] == 1
    assert all(torch.equal(at_first[k], v) for k, v in _params(resumed).items())
    resumed.close()
    trainer.close()


def test_permission_error_on_the_directory_is_named(store, tmp_path, monkeypatch):
    trainer = Trainer(_conf(store))
    _losses(trainer, 1)
    real = Path.mkdir

    def mkdir(self, *args, **kwargs):
        if self == tmp_path / "denied":
            raise PermissionError(errno.EACCES, "Permission denied", str(self))
        return real(self, *args, **kwargs)

    monkeypatch.setattr(Path, "mkdir", mkdir)
    with pytest.raises(CheckpointSaveError, match="PermissionError: .*Permission denied") as info:
        trainer.save(tmp_path / "denied")
    assert str(tmp_path / "denied" / "step_00000001.tmp") in str(info.value)
    assert str(info.value).endswith("no complete checkpoint yet")
    trainer.close()


@pytest.mark.parametrize("policy", ["continue", "stop"])
def test_checkpoint_on_error_continues_or_stops_the_run(store, tmp_path, monkeypatch, policy):
    conf = _conf(store, steps=4, checkpoint_every=2, checkpoint_on_error=policy)
    _no_space_after(monkeypatch, 1000, step=2)
    stream = io.StringIO()
    if policy == "stop":
        with pytest.raises(CheckpointSaveError, match="step 2 .* No space left on device"):
            run_training(conf, tmp_path, stream=stream)
        assert list_checkpoints(tmp_path / "checkpoints") == []
        return
    result = run_training(conf, tmp_path, stream=stream)
    assert result["steps"] == 4 and result["stopped"] is None
    lines = [x for x in stream.getvalue().splitlines() if "failed" in x]
    assert len(lines) == 1, stream.getvalue()
    assert lines[0].startswith("checkpoint save of step 2 to ")
    assert lines[0].endswith("(trainer.checkpoint_on_error: continue: training goes on)")
    names = [p.name for p in list_checkpoints(tmp_path / "checkpoints")]
    assert names == ["step_00000004"]


def test_checkpoint_keys_are_validated():
    tc = TrainerConfig.from_conf({"trainer": {}})
    assert tc.checkpoint_async is True and tc.checkpoint_on_error == "stop"
    assert tc.checkpoint_keep == 3 and tc.stop_signals == ("SIGTERM", "SIGUSR1", "SIGINT")
    with pytest.raises(ValueError, match="trainer.checkpoint_on_error must be 'stop' or"):
        TrainerConfig.from_conf({"trainer": {"checkpoint_on_error": "ignore"}})
    with pytest.raises(ValueError, match="trainer.stop_signals must be a list of signal names"):
        TrainerConfig.from_conf({"trainer": {"stop_signals": ["SIGKILL"]}})
    with pytest.raises(ValueError, match="trainer.checkpoint_keep must be >= 1"):
        TrainerConfig.from_conf({"trainer": {"checkpoint_keep": 0}})


def test_plan_states_the_staging_host_memory(store):
    from credit_parallel.planner.make import make_plan

    conf = _conf(store)  # use_ema: parameters, two AdamW moments and the shadow
    plan = make_plan(conf, 1)
    param_bytes = plan.memory.param_bytes
    line = next(n for n in plan.notes if n.startswith("checkpoints:"))
    assert line == (
        f"checkpoints: asynchronous saves stage {4 * param_bytes / 2**20:.1f} MiB of host memory "
        "per rank (parameters + AdamW moments + EMA shadow; pinned on CUDA), held for the run"
    )
    sync = make_plan(_conf(store, checkpoint_async=False, use_ema=False), 1)
    assert "checkpoints: synchronous (trainer.checkpoint_async: false)" in "".join(sync.notes)
