"""SPEC §4: FSDP2 only where it shards.  A shard group of one rank (dp 1 x domain 1) gets no
``fully_shard``: the model stays the user's class (an autocast subclass under ``trainer.amp``),
its parameters plain tensors; the function is the same (float64 exact), ``trainer.amp`` computes
in bf16 within bf16's tolerance of FSDP2's policy; checkpoints move between dp 1 (no FSDP2) and
dp 2 (FSDP2) both ways on the exact trajectory; ``plan`` and the run's first lines say so;
``trainer.fsdp2_single_rank: true`` keeps FSDP2 at one rank.
"""

from __future__ import annotations

import copy
import io

import pytest
import torch
import torch._dynamo  # noqa: F401  (imported once here so forked workers inherit it)
import torch.distributed.tensor  # noqa: F401
from torch.distributed.fsdp import FSDPModule
from torch.distributed.tensor import DTensor

from credit_parallel.data import write_sample_dataset
from credit_parallel.models import UNet
from credit_parallel.parallel.composition import parallelize
from credit_parallel.parallel.fsdp import fsdp2_applies, fsdp2_layout_note
from credit_parallel.parallel.precision import declared_compute_dtype
from credit_parallel.planner.make import make_plan
from credit_parallel.testing import run_on_ranks
from credit_parallel.train.main import run_training
from credit_parallel.train.trainer import Trainer
from sample_conf import tiny_unet, unet_run_conf

__all__: list[str] = []

pytestmark = pytest.mark.filterwarnings("ignore:torch.distributed is disabled:UserWarning")

H, W = 17, 32
TOL = 1e-10
K = 2  # steps before the first checkpoint
FSDP2 = {"data": "fsdp2", "tensor": 1, "domain": 1}


def _unet(dtype=torch.float64):
    torch.manual_seed(3)
    conf = tiny_unet(H, W)
    conf.pop("type")
    return UNet(**conf).to(dtype)


def test_fsdp2_applies_only_where_the_group_shards():
    assert [fsdp2_applies(n) for n in (1, 2, 8)] == [False, True, True]
    assert fsdp2_applies(1, single_rank=True)
    note = fsdp2_layout_note(1, False, amp=True)
    assert "FSDP2 not applied" in note and "bf16" in note and "fsdp2_single_rank" in note
    assert fsdp2_layout_note(2, False, amp=True) is None
    assert fsdp2_layout_note(1, True, amp=False) is None


# ------------------------------------------------------------------ the model, one rank
def _one_rank_worker(rank, world):
    out = {}
    x = torch.randn(2, 8, H, W, dtype=torch.float64, generator=torch.Generator().manual_seed(1))
    ref = _unet()
    y_ref = ref(x)
    y_ref.square().mean().backward()
    model = parallelize(_unet(), {"trainer": {"parallelism": FSDP2}})
    out["plain"] = not isinstance(model, FSDPModule) and type(model) is UNet
    out["dtensors"] = [n for n, p in model.named_parameters() if isinstance(p, DTensor)]
    y = model(x)
    y.square().mean().backward()
    out["out_err"] = (y - y_ref).abs().max().item()
    out["grad_err"] = max(
        (p.grad - q.grad).abs().max().item()
        for p, q in zip(model.parameters(), ref.parameters(), strict=True)
    )
    # trainer.amp: autocast bf16 (fp32 weights) against FSDP2's bf16 policy kept at one rank
    x32 = x.float()
    amp = {"trainer": {"parallelism": FSDP2, "amp": True}}
    auto = parallelize(_unet(torch.float32), amp)
    kept = parallelize(
        _unet(torch.float32), {"trainer": {**amp["trainer"], "fsdp2_single_rank": True}}
    )
    out["auto_class"] = type(auto).__name__
    out["auto_declared"] = declared_compute_dtype(auto)
    out["kept_fsdp"] = isinstance(kept, FSDPModule)
    out["kept_dtensor"] = all(isinstance(p, DTensor) for p in kept.parameters())
    ya, yk = auto(x32), kept(x32)
    fp32 = _unet(torch.float32)(x32)
    out["auto_dtype"], out["kept_dtype"] = ya.dtype, yk.dtype
    scale = fp32.abs().max().item()
    out["auto_vs_fsdp2"] = (ya.float() - yk.float()).abs().max().item() / scale
    out["auto_vs_fp32"] = (ya.float() - fp32).abs().max().item() / scale
    out["kept_vs_fp32"] = (yk.float() - fp32).abs().max().item() / scale
    ya.float().square().mean().backward()
    out["auto_grad_dtype"] = {p.grad.dtype for p in auto.parameters()}
    # the class swap keeps state_dict keys and survives deepcopy (EMA copies the model)
    out["keys_same"] = list(auto.state_dict()) == list(_unet().state_dict())
    out["deepcopy_class"] = type(copy.deepcopy(auto)).__name__
    return out


def test_one_rank_fsdp2_is_no_fully_shard_exact_and_amp_within_bf16_of_fsdp2():
    (out,) = run_on_ranks(_one_rank_worker, 1, timeout=180)
    assert out["plain"] and out["dtensors"] == []
    assert out["out_err"] <= TOL and out["grad_err"] <= TOL
    assert out["auto_class"] == "AutocastUNet"
    assert out["auto_declared"] == ("cpu", torch.bfloat16)
    assert out["kept_fsdp"] and out["kept_dtensor"]
    assert out["auto_dtype"] == torch.bfloat16 == out["kept_dtype"]
    # both compute in bf16 (a few bf16 ulps, 2**-8 = 0.4 %, from fp32); autocast keeps norms in
    # fp32 and so stays at least as close to fp32 as FSDP2's all-bf16 policy
    assert 0 < out["auto_vs_fp32"] <= 0.03, out
    assert out["auto_vs_fsdp2"] <= 0.03, out
    assert out["auto_vs_fp32"] <= out["kept_vs_fp32"] * 1.5, out
    assert out["auto_grad_dtype"] == {torch.float32}
    assert out["keys_same"] and out["deepcopy_class"] == "AutocastUNet"


# ------------------------------------------------------------------ plan and the run's lines
def test_plan_and_the_runs_first_lines_say_fsdp2_is_not_applied(tmp_path):
    conf = {"model": tiny_unet(H, W), "trainer": {"parallelism": FSDP2, "batch_size": 1}}
    plan = make_plan(conf, 1)
    assert not plan.fsdp2_applied and plan.fsdp_units == []
    assert any("FSDP2 not applied" in n for n in plan.notes)
    assert plan.memory.param_bytes == plan.memory.param_bytes_unsharded
    kept = make_plan({**conf, "trainer": {**conf["trainer"], "fsdp2_single_rank": True}}, 1)
    assert kept.fsdp2_applied and kept.fsdp_units
    assert not any("FSDP2 not applied" in n for n in kept.notes)
    two = make_plan(conf, 2)
    assert two.fsdp2_applied and not any("FSDP2 not applied" in n for n in two.notes)


def _run_lines_worker(rank, world, store, out_dir):
    stream = io.StringIO()
    conf = unet_run_conf(store, H, W, time_slice=[0, 8], parallelism=FSDP2, steps=1)
    run_training(conf, out_dir, stream=stream, progress=True)
    return stream.getvalue().splitlines()


@pytest.fixture(scope="module")
def store(tmp_path_factory):
    path = tmp_path_factory.mktemp("data") / "s.zarr"
    return str(write_sample_dataset(path, n_times=24, nlat=H, nlon=W))


def test_the_runs_first_line_says_fsdp2_is_not_applied(store, tmp_path):
    (lines,) = run_on_ranks(_run_lines_worker, 1, store, tmp_path, timeout=180)
    assert lines[0].startswith("FSDP2 not applied"), lines


# ------------------------------------------------------------------ checkpoints, both ways
def _conf(store, batch_size, **trainer):
    return unet_run_conf(
        store, H, W, time_slice=[0, 20], parallelism=FSDP2, steps=8, batch_size=batch_size,
        lr=0.01, warmup_steps=1, seed=5, dtype="float64", **trainer,
    )  # fmt: skip


def _losses(trainer, steps):
    return [r["loss"] for r in (trainer.train_step() for _ in range(steps))]


def _dp1_save(rank, world, store, ckpt, steps_after):
    trainer = Trainer(_conf(store, 2, use_ema=True, ema_decay=0.5))
    assert not isinstance(trainer.model, FSDPModule)
    _losses(trainer, K)
    path = str(trainer.save(ckpt))
    return path, _losses(trainer, steps_after)


def _dp2_resume_and_save(rank, world, store, path, ckpt):
    trainer = Trainer(_conf(store, 1, use_ema=True, ema_decay=0.5))
    assert isinstance(trainer.model, FSDPModule)
    trainer.load(path)
    first = _losses(trainer, 1)
    return first, str(trainer.save(ckpt)), _losses(trainer, 1)


def _dp1_resume(rank, world, store, path):
    trainer = Trainer(_conf(store, 2, use_ema=True, ema_decay=0.5))
    trainer.load(path)
    return trainer.step, _losses(trainer, 1)


def test_checkpoints_move_between_dp1_without_fsdp2_and_dp2_with_fsdp2(store, tmp_path):
    # dp 1 (no fully_shard): K steps, save, then the uninterrupted continuation
    ((path_a, want),) = run_on_ranks(_dp1_save, 1, store, str(tmp_path / "a"), 2, timeout=180)
    # dp 2 (FSDP2, 1 sample per rank: the same global batch) loads it: the same next step,
    # then saves; its following step is the reference for the way back
    outs = run_on_ranks(_dp2_resume_and_save, 2, store, path_a, str(tmp_path / "b"), timeout=240)
    for first, _, second in outs:
        assert abs(first[0] - want[0]) <= TOL and abs(second[0] - want[1]) <= TOL
    # dp 1 again loads the FSDP2 (DTensor) checkpoint: the same step
    ((step, back),) = run_on_ranks(_dp1_resume, 1, store, outs[0][1], timeout=180)
    assert step == K + 1 and abs(back[0] - want[1]) <= TOL


# ------------------------------------------------------------------ trainer.fsdp2_prefetch
def _prefetch_worker(rank, world):
    x = torch.randn(2, 8, H, W, dtype=torch.float64, generator=torch.Generator().manual_seed(1))
    x = x.chunk(world)[rank]
    params, kept = [], []
    for prefetch in (False, True):
        conf = {"trainer": {"parallelism": FSDP2, "fsdp2_prefetch": prefetch}}
        model = parallelize(_unet(), conf)
        units = [m for m in model.modules() if isinstance(m, FSDPModule) and m is not model]
        # FSDP2 keeps a unit unsharded after forward when it has no post-forward mesh
        groups = [u._get_fsdp_state()._fsdp_param_group for u in units]
        kept.append([g.post_forward_mesh_info is None for g in groups])
        opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
        for _ in range(2):
            model(x).square().mean().backward()
            opt.step()
            opt.zero_grad(set_to_none=True)
        params.append([p.full_tensor() for p in model.parameters()])
    err = max((a - b).abs().max().item() for a, b in zip(*params, strict=True))
    return err, kept


def test_fsdp2_prefetch_at_dp2_gives_the_same_steps():
    # explicit forward/backward prefetch and the last unit kept unsharded change when the
    # all-gathers run, never what they compute
    for err, kept in run_on_ranks(_prefetch_worker, 2, timeout=180):
        assert err <= TOL
        assert not any(kept[0]) and len(kept[0]) > 1  # default: every unit resharded
        assert kept[1] == [False] * (len(kept[1]) - 1) + [True]  # prefetch: not the last
