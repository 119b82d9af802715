"""Device placement: one decision (NCCL -> cuda:LOCAL_RANK, gloo -> CPU), followed everywhere.

No GPU exists on the machines these tests run on, so the trainer, verify and benchmark paths are
proven device-generic by injecting a device that is NOT the default one: the decision function
is patched to return ``meta`` and every parameter, buffer, gradient and batch tensor of a real
forward/backward must end up there (a tensor created on a hard-coded device would stay on the
CPU, or make the mixed-device op raise).  A source scan keeps hard-coded devices out of src/.
"""

from __future__ import annotations

import ast
import pathlib

import pytest
import torch
import torch.distributed as dist

import credit_parallel
from credit_parallel.data import write_sample_dataset
from credit_parallel.layout import device as device_mod
from credit_parallel.layout.device import autocast_for, batch_to_device, device_for_process_group
from credit_parallel.testing import run_on_ranks
from sample_conf import unet_run_conf

__all__: list[str] = []

META = torch.device("meta")
H, W = 9, 16


@pytest.fixture(scope="module")
def store(tmp_path_factory):
    path = tmp_path_factory.mktemp("device") / "s.zarr"
    return str(write_sample_dataset(path, n_times=12, nlat=H, nlon=W))


def _conf(store):
    return unet_run_conf(store, H, W, time_slice=[0, 10], batch_size=2, seed=1)


def _assert_all_on(device, tensors, what):
    wrong = [name for name, t in tensors if t is not None and t.device != device]
    assert not wrong, f"{what} not on {device}: {wrong}"


def _model_tensors(model):
    yield from model.named_parameters()
    yield from model.named_buffers()
    yield from ((f"{n}.grad", p.grad) for n, p in model.named_parameters())


# --------------------------------------------------------------------------- the decision
def test_no_process_group_means_the_cpu():
    assert not dist.is_initialized()
    assert device_for_process_group() == torch.device("cpu")


def _gloo_worker(rank, world):
    return str(device_for_process_group())


def test_gloo_ranks_compute_on_the_cpu():
    assert run_on_ranks(_gloo_worker, 2) == ["cpu", "cpu"]


def test_nccl_means_cuda_local_rank(monkeypatch):
    monkeypatch.setattr(device_mod.dist, "is_initialized", lambda: True)
    monkeypatch.setattr(device_mod.dist, "get_backend", lambda group=None: "nccl")
    monkeypatch.setenv("LOCAL_RANK", "3")
    assert device_for_process_group() == torch.device("cuda", 3)


def test_batch_to_device_casts_floats_and_keeps_the_rest():
    batch = {"x": torch.ones(2, 3), "t": torch.tensor([1, 2]), "name": "a"}
    out = batch_to_device(batch, META, torch.float64)
    assert out["x"].device == META and out["x"].dtype == torch.float64
    assert out["t"].device == META and out["t"].dtype == torch.int64 and out["name"] == "a"
    assert batch["x"].device.type == "cpu"  # the host batch is left alone


def test_autocast_follows_the_device_type():
    assert isinstance(autocast_for(torch.device("cpu"), True), torch.autocast)
    assert autocast_for(torch.device("cpu"), True).device == "cpu"
    assert not isinstance(autocast_for(torch.device("cpu"), False), torch.autocast)


# --------------------------------------------------------------------------- the three paths
def test_trainer_puts_model_batches_and_loss_weights_on_the_decided_device(store, monkeypatch):
    import credit_parallel.train.trainer as trainer_mod

    monkeypatch.setattr(trainer_mod, "device_for_process_group", lambda group=None: META)
    trainer = trainer_mod.Trainer(_conf(store))
    assert trainer.device == META
    batch = next(trainer._micro_batches())
    _assert_all_on(META, batch.items(), "batch")
    share, outputs = trainer.step_fn.forward_backward(trainer.step_fn.shard(batch))
    trainer.step_fn.reduce_gradients()
    _assert_all_on(META, [("share", share), *(("out", o) for o in outputs)], "step outputs")
    _assert_all_on(META, _model_tensors(trainer.model), "model")
    _assert_all_on(META, [("lat", trainer.lat_weights), ("lat_local", trainer._lat_local)], "w")
    assert any(p.grad is not None for p in trainer.model.parameters())


def test_trainer_device_override_is_used(store):
    trainer = credit_parallel.train.trainer.Trainer(_conf(store), device="cpu")
    assert trainer.device == torch.device("cpu")
    assert trainer.train_step()["loss"] > 0


def test_verify_runs_models_and_batches_on_the_decided_device(store, monkeypatch):
    from credit_parallel.tools import verify

    conf = _conf(store)
    monkeypatch.setattr(verify, "device_for_process_group", lambda group=None: META)
    ref, par, batch, lat, _ = verify._prepare(conf, torch.float64, 1, None, META)
    _assert_all_on(META, batch.items(), "batch")
    xs, outs = verify.reference_run(ref, batch, lat)
    xl, pouts, _ = verify.layout_run(par, batch, lat, None, H)
    _assert_all_on(META, _model_tensors(ref), "reference model")
    _assert_all_on(META, _model_tensors(par), "parallel model")
    tensors = [*(("x", x) for x in xs + xl), *(("g", x.grad) for x in xs + xl)]
    _assert_all_on(META, tensors + [("o", o) for o in outs + pouts], "inputs/outputs")


def test_bench_step_runs_on_the_decided_device():
    from credit_parallel.tools.bench import Layout, default_models
    from credit_parallel.tools.bench.measure import setup_run

    spec = default_models(quick=True)[0]
    model, step = setup_run(0, spec, Layout(), {"batch_scale": 1}, META)
    step()
    _assert_all_on(META, step.batch.items(), "bench batch")
    _assert_all_on(META, _model_tensors(model), "bench model")
    assert all(p.grad is not None for p in model.parameters())


# --------------------------------------------------------------------------- the source
# (file, code) pairs allowed to name a device: each says why
ALLOWED = {
    ("layout/device.py", 'torch.device("cpu")'): "the decision itself",
    ("layout/device.py", "torch.device('cuda', ...)"): "the decision itself",
    (
        "domain/manager.py",
        'torch.device("cpu")',
    ): "the manager's buffers follow its group's backend",
    ("domain/manager.py", "torch.device('cuda', ...)"): "the manager's buffers follow its group",
    ("domain/layers/resample.py", 'device="cpu"'): "host-side interpolation weights for numpy",
    ("domain/layers/resample.py", ".cpu()"): "host-side interpolation weights for numpy",
    ("data/selection.py", ".cpu()"): "latitudes handed to numpy on the host",
    (
        "domain/layers/interp_rows.py",
        ".cpu()",
    ): "a kernel probe's weights handed to numpy on the host",
    ("train/model_init.py", 'device="cpu"'): "replays the plain build on the CPU (its RNG stream)",
    (
        "train/model_init.py",
        'torch.device("cpu")',
    ): "replays the plain build on the CPU (its RNG stream)",
    ("tools/bench/loader.py", 'device="cpu"'): "the loader-only benchmark times host batches",
    ("forecast/scores.py", ".cpu()"): "score sums kept on the host, for the CSV / JSON files",
    ("train/async_save.py", 'device="cpu"'): "a checkpoint is staged into host buffers (pinned)",
    (
        "train/preemption.py",
        'torch.device("cpu")',
    ): "the stop flag's all-reduce when no device is given (gloo)",
}


def _device_literals(tree):
    """(code) for every literal device in a call: torch.device("cpu"), device="cuda", .cuda()."""
    for node in ast.walk(tree):
        if isinstance(node, ast.Call):
            func = node.func
            name = func.attr if isinstance(func, ast.Attribute) else getattr(func, "id", "")
            if name == "device" and node.args and isinstance(node.args[0], ast.Constant):
                if len(node.args) > 1:
                    yield f"torch.device({node.args[0].value!r}, ...)"
                else:
                    yield f'torch.device("{node.args[0].value}")'
            if name in ("cuda", "cpu") and isinstance(func, ast.Attribute) and not node.args:
                owner = ast.unparse(func.value)
                if owner not in ("torch", "torch.backends"):
                    yield f".{name}()"
            for kw in node.keywords:
                if kw.arg == "device" and isinstance(kw.value, ast.Constant):
                    yield f'device="{kw.value.value}"'


def test_no_tensor_is_created_on_a_hard_coded_device_in_src():
    root = pathlib.Path(credit_parallel.__file__).parent
    found = []
    for path in sorted(root.rglob("*.py")):
        rel = path.relative_to(root).as_posix()
        tree = ast.parse(path.read_text())
        for code in _device_literals(tree):
            # "meta" holds shapes only (planning, preflight, register_row_batch's placeholders of
            # the global batch, model_init's recorded build): never where numbers are computed
            if (rel, code) not in ALLOWED and "meta" not in code:
                found.append(f"{rel}: {code}")
    assert not found, "hard-coded devices:\n" + "\n".join(found)
