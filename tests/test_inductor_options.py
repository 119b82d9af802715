"""The inductor options the library sets (parallel/inductor_options.py): per-block compiles keep
the model's memory format, and FSDP2 with bf16 parameters on CUDA switches the process's
channels-last layout optimisation off unless the user chose it.  (The failure they avoid needs a
GPU: inductor on CUDA, seen on an H200; here the choice itself is checked with the device type
injected.)"""

from __future__ import annotations

import warnings

import pytest
import torch
import torch._inductor.config as inductor_config
from torch import nn

from credit_parallel import compile_blocks
from credit_parallel.parallel import compile as compile_module
from credit_parallel.parallel.fsdp import apply_fsdp2
from credit_parallel.parallel.inductor_options import (
    BLOCK_INDUCTOR_OPTIONS,
    LAYOUT_ENV,
    guard_inductor_layout,
)
from credit_parallel.testing import run_on_ranks


class _Block(nn.Module):
    _fsdp2_shard = True

    def __init__(self):
        super().__init__()
        self.conv = nn.Conv2d(2, 2, 3, padding=1)

    def forward(self, x):
        return self.conv(x)


class _Net(nn.Module):
    def __init__(self):
        super().__init__()
        self.a, self.b = _Block(), _Block()

    def forward(self, x):
        return self.b(self.a(x))


def _recorded_compile_kwargs(monkeypatch, **kwargs) -> list[dict]:
    seen = []

    def fake_compile(fn, **kw):
        seen.append(kw)
        return fn

    monkeypatch.setattr(compile_module.torch, "compile", fake_compile)
    compile_blocks(_Net(), **kwargs)
    return seen


def test_inductor_blocks_compile_without_layout_optimization(monkeypatch):
    seen = _recorded_compile_kwargs(monkeypatch)
    assert len(seen) == 2
    for kw in seen:
        assert kw["backend"] == "inductor"
        assert kw["options"] == {"layout_optimization": False}
        assert "mode" not in kw  # torch.compile takes mode or options, not both


def test_a_mode_becomes_its_options_under_the_block_options(monkeypatch):
    from torch._inductor import list_mode_options

    (kw, _) = _recorded_compile_kwargs(monkeypatch, mode="max-autotune-no-cudagraphs")
    assert kw["options"] == {
        **list_mode_options("max-autotune-no-cudagraphs"),
        **BLOCK_INDUCTOR_OPTIONS,
    }
    # the caller's options win over the library's
    (kw, _) = _recorded_compile_kwargs(monkeypatch, options={"layout_optimization": True})
    assert kw["options"] == {"layout_optimization": True}


def test_other_backends_get_no_inductor_options(monkeypatch):
    (kw, _) = _recorded_compile_kwargs(monkeypatch, backend="aot_eager")
    assert kw["backend"] == "aot_eager" and "options" not in kw and kw["mode"] is None


def test_per_block_inductor_compile_with_the_options_matches_eager():
    torch.manual_seed(0)
    net = _Net()
    ref = _Net()
    ref.load_state_dict(net.state_dict())
    compile_blocks(net)
    x = torch.randn(1, 2, 5, 6)
    torch.testing.assert_close(net(x), ref(x))


@pytest.fixture
def layout_option(monkeypatch):
    monkeypatch.delenv(LAYOUT_ENV, raising=False)
    with inductor_config.patch(layout_optimization=True):  # restored after the test
        yield monkeypatch


def test_fsdp2_bf16_on_cuda_switches_layout_optimization_off(layout_option):
    with pytest.warns(UserWarning, match="layout_optimization set to False"):
        assert guard_inductor_layout("cuda", torch.bfloat16) is True
    assert inductor_config.layout_optimization is False
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # once: already off, nothing to say
        assert guard_inductor_layout("cuda", torch.bfloat16) is False


@pytest.mark.parametrize("device,dtype", [("cpu", torch.bfloat16), ("cuda", None)])
def test_cpu_or_fp32_parameters_keep_layout_optimization(layout_option, device, dtype):
    assert guard_inductor_layout(device, dtype) is False
    assert inductor_config.layout_optimization is True


def test_a_user_setting_of_the_option_is_kept(layout_option):
    layout_option.setenv(LAYOUT_ENV, "1")
    assert guard_inductor_layout("cuda", torch.bfloat16) is False
    assert inductor_config.layout_optimization is True


def _fsdp2_guard_args(rank, world):
    import credit_parallel.parallel.fsdp as fsdp

    seen = []
    fsdp.guard_inductor_layout = lambda device, dtype: seen.append((device, dtype)) or False
    # one rank: FSDP2 is applied only where the user keeps it there (SPEC §4)
    apply_fsdp2(_Net(), None, {"trainer": {"amp": True, "fsdp2_single_rank": True}})
    apply_fsdp2(_Net(), None, {"trainer": {"amp": False, "fsdp2_single_rank": True}})
    apply_fsdp2(_Net(), None, {"trainer": {"amp": True}})  # not applied: the guard not asked
    return seen


def test_apply_fsdp2_asks_the_guard_with_its_mesh_device_and_param_dtype():
    (seen,) = run_on_ranks(_fsdp2_guard_args, 1)
    assert seen == [("cpu", torch.bfloat16), ("cpu", None)]
