"""Checkpoints: saved under one layout, resumed under another on the exact trajectory; atomic
under a crash mid-save; corrupted files and mismatched models refused with a clear
``CheckpointError``; no unsafe ``torch.load`` anywhere in the package.

The uninterrupted reference runs in this process (float64, no process group); the layout
changes run in ONE 2-rank worker call: domain 2 trains and saves, then new Trainers under
tensor 2 and FSDP2 (dp 2) load the checkpoint and take two more steps each.  The losses of the
next two steps (the first depends on the restored weights, the second also on the restored
optimizer state and LR schedule) must equal the uninterrupted run's to 1e-10.
"""

from __future__ import annotations

import ast
import multiprocessing
import os
import shutil
from pathlib import Path

import pytest
import torch
import torch._dynamo  # noqa: F401  (imported once here so forked workers inherit it)
import torch.distributed as dist
import torch.distributed.tensor  # noqa: F401

import credit_parallel
from credit_parallel.data import write_sample_dataset
from credit_parallel.models import UNet
from credit_parallel.testing import run_on_ranks
from credit_parallel.train.checkpoint import (
    MARKER,
    CheckpointError,
    latest_checkpoint,
    list_checkpoints,
    load_checkpoint,
)
from credit_parallel.train.trainer import Trainer
from sample_conf import tiny_unet, unet_run_conf

__all__: list[str] = []

# single-process saves/loads (the reference runs): DCP warns that it assumes one process
pytestmark = pytest.mark.filterwarnings("ignore:torch.distributed is disabled:UserWarning")

TOL = 1e-10
H, W = 17, 32
K = 3  # the checkpoint is taken after step K; steps K+1 and K+2 are compared
MODEL = tiny_unet(H, W)


@pytest.fixture(scope="module")
def store(tmp_path_factory):
    return str(
        write_sample_dataset(tmp_path_factory.mktemp("data") / "s.zarr", n_times=40, nlat=H, nlon=W)
    )


def _conf(store, parallelism=None, batch_size=2):
    return unet_run_conf(
        store,
        H,
        W,
        time_slice=[0, 33],
        parallelism=parallelism,
        steps=8,
        batch_size=batch_size,
        lr=0.01,
        warmup_steps=2,
        seed=5,
        dtype="float64",
    )


def _losses(trainer, steps):
    return [(r["step"], r["loss"]) for r in (trainer.train_step() for _ in range(steps))]


def _params(trainer):
    return {n: p.detach().clone() for n, p in trainer.model.named_parameters()}


def _assert_losses_equal(got, want):
    assert [s for s, _ in got] == [s for s, _ in want]
    for (step, a), (_, b) in zip(got, want):
        assert abs(a - b) <= TOL, f"step {step}: {a} vs {b}"


# --------------------------------------------------------------------------- layout changes
def _layouts_worker(rank, world, store, ckpt_dir):
    out = {}
    saver = Trainer(_conf(store, {"data": "none", "tensor": 1, "domain": 2}))
    _losses(saver, K)
    path = saver.save(ckpt_dir)
    out["path"] = str(path)
    out["domain2_continued"] = _losses(saver, 2)

    tp = Trainer(_conf(store, {"data": "none", "tensor": 2, "domain": 1}))
    out["tp2_manifest"] = tp.load(path)
    out["tp2"] = _losses(tp, 2)

    # dp 2 with 1 sample per rank sees the same global batches as 2 samples on one rank
    fsdp = Trainer(_conf(store, {"data": "fsdp2", "tensor": 1, "domain": 1}, batch_size=1))
    fsdp.load(path)
    out["fsdp2"] = _losses(fsdp, 2)

    # a corrupted shard is refused on EVERY rank (rank 0 checks, all learn the verdict)
    bad = Path(ckpt_dir).parent / "corrupt" / Path(path).name
    if rank == 0:
        shutil.copytree(path, bad)
        shard = sorted(bad.glob("*.distcp"))[-1]
        data = bytearray(shard.read_bytes())
        data[len(data) // 2] ^= 0xFF
        shard.write_bytes(bytes(data))
    dist.barrier()
    try:
        Trainer(_conf(store, {"data": "none", "tensor": 1, "domain": 2})).load(bad)
        out["corrupt"] = None
    except CheckpointError as exc:
        out["corrupt"] = str(exc)
    return out


def test_checkpoint_from_domain2_resumes_at_domain1_tp2_and_fsdp2_on_the_same_trajectory(
    store, tmp_path
):
    ckpt_dir = tmp_path / "ckpt"
    outs = run_on_ranks(_layouts_worker, 2, store, str(ckpt_dir), timeout=240)
    reference = Trainer(_conf(store))
    uninterrupted = _losses(reference, K + 2)
    want = uninterrupted[K:]

    manifest = outs[0]["tp2_manifest"]
    assert manifest["step"] == K and manifest["world_size"] == 2
    assert manifest["layout"]["domain"] == 2
    for out in outs:
        _assert_losses_equal(out["domain2_continued"], want)
        _assert_losses_equal(out["tp2"], want)
        _assert_losses_equal(out["fsdp2"], want)
        assert out["corrupt"] is not None, "a corrupted shard was loaded without an error"
        assert ".distcp" in out["corrupt"] and "checksum" in out["corrupt"]

    # domain 1: a single process without any process group
    single = Trainer(_conf(store))
    single.load(outs[0]["path"])
    assert single.step == K
    _assert_losses_equal(_losses(single, 2), want)


# --------------------------------------------------------------------------- crash mid-save
KILLED = 17


def _crash_while_saving(trainer, directory, where):
    """Runs in a forked child: one more step, then a save that dies at ``where``."""
    import pathlib

    import torch.distributed.checkpoint as dcp

    trainer.train_step()
    if where == "writing shards":
        real_save = dcp.save

        def save(state, *, checkpoint_id, **kw):
            # as if the process died while the shard file was half written, before the
            # metadata file that DCP writes last
            real_save(state, checkpoint_id=checkpoint_id, **kw)
            shard = sorted(Path(checkpoint_id).glob("*.distcp"))[0]
            shard.write_bytes(shard.read_bytes()[: shard.stat().st_size // 2])
            (Path(checkpoint_id) / ".metadata").unlink()
            os._exit(KILLED)

        dcp.save = save
    elif where == "before rename":
        os.replace = lambda *a, **k: os._exit(KILLED)
    elif where == "before marker":
        real_write = pathlib.Path.write_text

        def write_text(self, *a, **k):
            if self.name == MARKER:
                os._exit(KILLED)
            return real_write(self, *a, **k)

        pathlib.Path.write_text = write_text
    trainer.save(directory)
    os._exit(0)


# "before rename": 25 s alone, 44 s in the whole suite on the loaded 2-core machine
@pytest.mark.parametrize(
    "where",
    ["writing shards", pytest.param("before rename", marks=pytest.mark.slow), "before marker"],
)
def test_kill_during_save_leaves_previous_checkpoint_loadable(store, tmp_path, where):
    directory = tmp_path / "ckpt"
    trainer = Trainer(_conf(store))
    _losses(trainer, 1)
    first = trainer.save(directory)
    saved = _params(trainer)

    child = multiprocessing.get_context("fork").Process(
        target=_crash_while_saving, args=(trainer, directory, where)
    )
    child.start()
    child.join(120)
    assert child.exitcode == KILLED, f"the save did not reach the kill point ({where})"

    partial = [p for p in directory.iterdir() if p != first]
    assert partial, "the killed save left nothing behind: the kill point was not mid-save"
    assert all(not (p / MARKER).exists() for p in partial)
    assert list_checkpoints(directory) == [first]
    assert latest_checkpoint(directory) == first

    resumed = Trainer(_conf(store))
    manifest = resumed.resume_latest(directory)
    assert manifest["step"] == 1 and resumed.step == 1
    assert all(torch.equal(saved[k], v) for k, v in _params(resumed).items())
    # the next save of the same step replaces the partial one and is complete
    _losses(resumed, 1)
    second = resumed.save(directory)
    assert list_checkpoints(directory) == [first, second]


# --------------------------------------------------------------------------- corruption
def _two_checkpoints(store, directory):
    trainer = Trainer(_conf(store))
    _losses(trainer, 1)
    first = trainer.save(directory)
    at_first = _params(trainer)
    _losses(trainer, 1)
    second = trainer.save(directory)
    return first, second, at_first


def _flip_byte(path: Path):
    data = bytearray(path.read_bytes())
    data[len(data) // 2] ^= 0x01
    path.write_bytes(bytes(data))


def _truncate(path: Path):
    path.write_bytes(path.read_bytes()[: path.stat().st_size // 3])


@pytest.mark.parametrize("damage", [_flip_byte, _truncate], ids=["byte-flip", "truncate"])
def test_damaged_shard_raises_naming_the_file_and_resume_falls_back(store, tmp_path, damage):
    directory = tmp_path / "ckpt"
    first, second, at_first = _two_checkpoints(store, directory)
    shard = sorted(second.glob("*.distcp"))[0]
    damage(shard)

    fresh = Trainer(_conf(store))
    before = _params(fresh)
    with pytest.raises(CheckpointError) as info:
        fresh.load(second)
    assert shard.name in str(info.value) and str(second) in str(info.value)
    assert all(torch.equal(before[k], v) for k, v in _params(fresh).items()), "partial load"

    with pytest.raises(CheckpointError, match=shard.name):
        Trainer(_conf(store)).resume_latest(directory, fallback=False)

    resumed = Trainer(_conf(store))
    manifest = resumed.resume_latest(directory)
    assert manifest["step"] == 1 and resumed.step == 1
    assert all(torch.equal(at_first[k], v) for k, v in _params(resumed).items())


def test_damaged_only_checkpoint_reports_every_failure(store, tmp_path):
    directory = tmp_path / "ckpt"
    first, second, _ = _two_checkpoints(store, directory)
    for path in (first, second):
        _truncate(sorted(path.glob("*.distcp"))[0])
    with pytest.raises(CheckpointError, match="no loadable checkpoint") as info:
        Trainer(_conf(store)).resume_latest(directory)
    assert first.name in str(info.value) and second.name in str(info.value)


# --------------------------------------------------------------------------- model mismatch
def test_model_with_a_renamed_layer_is_refused_listing_the_key_differences(store, tmp_path):
    trainer = Trainer(_conf(store))
    path = trainer.save(tmp_path / "ckpt")

    torch.manual_seed(0)
    model = UNet(**{k: v for k, v in MODEL.items() if k != "type"}).double()
    model.stem_conv = model.stem  # the same layer under a new name
    del model.stem
    before = {n: p.detach().clone() for n, p in model.named_parameters()}
    with pytest.raises(CheckpointError) as info:
        load_checkpoint(path, model)
    message = str(info.value)
    assert "does not match the model" in message
    for name in ("stem.conv.weight", "stem.conv.bias"):
        assert f"missing in checkpoint: model.stem_conv.{name[5:]}" in message
        assert f"unexpected in checkpoint: model.{name}" in message
    # nothing else is reported and nothing was loaded
    assert message.count("missing in checkpoint") == 2
    assert all(torch.equal(before[n], p) for n, p in model.named_parameters())


# --------------------------------------------------------------------------- torch.load


def _torch_load_calls(tree):
    for node in ast.walk(tree):
        if not isinstance(node, ast.Call):
            continue
        func = node.func
        name = (
            func.attr
            if isinstance(func, ast.Attribute)
            else func.id
            if isinstance(func, ast.Name)
            else None
        )
        if name == "load" and isinstance(func, ast.Attribute):
            base = func.value
            if isinstance(base, ast.Name) and base.id == "torch":
                yield node


def test_torch_load_is_only_called_with_weights_only_true_in_the_package():
    # the walker itself finds calls, with or without the flag
    sample = "import torch\ntorch.load(f)\nx = torch.load(g, weights_only=True)\n"
    assert [c.lineno for c in _torch_load_calls(ast.parse(sample))] == [2, 3]
    root = Path(credit_parallel.__file__).parent
    files = sorted(root.rglob("*.py"))
    assert len(files) > 20
    unsafe = []
    for path in files:
        source = path.read_text()
        calls = list(_torch_load_calls(ast.parse(source)))
        # an alias (from torch import load / serialization.load) would slip past the AST walk
        assert "from torch import load" not in source, path
        assert "serialization.load(" not in source, path
        for call in calls:
            flag = {k.arg: k.value for k in call.keywords}.get("weights_only")
            if not (isinstance(flag, ast.Constant) and flag.value is True):
                unsafe.append(f"{path.relative_to(root)}:{call.lineno}")
    assert not unsafe, f"torch.load without weights_only=True: {unsafe}"


# --------------------------------------------------------------------------- FSDP2 over dp x domain
def _fsdp_domain_saver(rank, world, store, ckpt_dir):
    # dp 2 x domain 2, one sample per dp rank: the same global batches as 2 samples on one rank
    saver = Trainer(_conf(store, {"data": "fsdp2", "tensor": 1, "domain": 2}, batch_size=1))
    _losses(saver, K)
    path = saver.save(ckpt_dir)
    return str(path), _losses(saver, 2)


def _fsdp2_tp2_domain2_resume(rank, world, store, path):
    trainer = Trainer(_conf(store, {"data": "fsdp2", "tensor": 2, "domain": 2}))
    trainer.load(path)
    return trainer.step, _losses(trainer, 2)


@pytest.mark.slow  # 23 s alone, 30 s in the whole suite on the loaded 2-core machine
def test_checkpoint_reshards_fsdp2_dp_x_domain_to_one_process_to_fsdp2_tp2_domain2(store, tmp_path):
    uninterrupted = _losses(Trainer(_conf(store)), K + 3)
    # {fsdp2, 1, 2} on 4 ranks (parameters and AdamW state sharded over dp x domain) saves
    outs = run_on_ranks(_fsdp_domain_saver, 4, store, str(tmp_path / "a"), timeout=300)
    path_a = outs[0][0]
    for _, continued in outs:
        _assert_losses_equal(continued, uninterrupted[K : K + 2])
    # {none, 1, 1}: one process without a process group loads it, steps once and saves again
    single = Trainer(_conf(store))
    single.load(path_a)
    assert single.step == K
    _assert_losses_equal(_losses(single, 1), uninterrupted[K : K + 1])
    path_b = str(single.save(tmp_path / "b"))
    # {fsdp2, 2, 2} on 4 ranks: (dp_domain, tp) 2-D sharding loads the single-process state
    for step, losses in run_on_ranks(_fsdp2_tp2_domain2_resume, 4, store, path_b, timeout=300):
        assert step == K + 1
        _assert_losses_equal(losses, uninterrupted[K + 1 : K + 3])
