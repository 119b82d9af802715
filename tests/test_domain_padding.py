"""DomainParallelPad against the padding modules on one process: every mode, pads wider than a
shard (multi-hop), negative pads (cropping), 2-4 domain ranks, even and uneven heights."""

import itertools

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from credit_parallel.domain.convert import convert_to_domain_parallel
from credit_parallel.domain.layers.padding import DomainParallelPad, pad_windows
from credit_parallel.domain.manager import DomainParallelManager
from credit_parallel.domain.rows import FILL
from credit_parallel.testing import assert_parity, domain_parity_errors, run_on_ranks

MODULES = {
    "zero": lambda p: nn.ZeroPad2d(p),
    "constant2.5": lambda p: nn.ConstantPad2d(p, 2.5),
    "reflect": lambda p: nn.ReflectionPad2d(p),
    "replicate": lambda p: nn.ReplicationPad2d(p),
    "circular": lambda p: nn.CircularPad2d(p),
}
# (left, right, top, bottom): ordinary, wider than a shard (multi-hop at H=12/13 over 3-4
# ranks), one-sided, and cropping (negative) on either side
PADS = ((1, 2, 3, 1), (0, 1, 7, 9), (2, 0, 0, 4), (1, -1, -2, 3), (0, 0, 5, -3))


def _parity(build, x, mgr):
    # gather_tensor caches global heights per (registered input shape, call index); the cases
    # here share input shapes but not output heights, so start each case with a fresh cache
    mgr.__dict__.pop("_cp_gather_owner", None)
    return domain_parity_errors(build, x, mgr)


def _x(shape):
    return torch.randn(shape, generator=torch.Generator().manual_seed(3), dtype=torch.float64)


def _parity_worker(rank, world, heights):
    torch.set_default_dtype(torch.float64)
    mgr = DomainParallelManager(world, world)
    results = {}
    for h, (name, make), pads in itertools.product(heights, MODULES.items(), PADS):
        shape = (2, 3, h, 6) if pads[2] != 5 else (3, h, 6)  # one unbatched (C, H, W) case
        errs = _parity(lambda make=make, pads=pads: make(pads), _x(shape), mgr)
        assert_parity(errs)
        results[(h, name, pads)] = errs
    return results


@pytest.mark.parametrize("world, heights", [(2, (12, 13)), (3, (13, 17)), (4, (12, 19))])
def test_every_padding_mode_and_pad_matches_single_process(world, heights):
    results = run_on_ranks(_parity_worker, world, heights)[0]
    assert len(results) == len(heights) * len(MODULES) * len(PADS)
    assert all({"output", "input_grad"} <= set(errs) for errs in results.values())


def _float32_worker(rank, world):
    mgr = DomainParallelManager(world, world)
    x = _x((2, 4, 13, 5)).float()
    for make in MODULES.values():
        assert_parity(_parity(lambda make=make: make((1, 2, 3, 1)), x, mgr), torch.float32)
    return True


def test_padding_float32_spot_check_domain3():
    assert run_on_ranks(_float32_worker, 3) == [True] * 3


def _width_only_worker(rank, world):
    torch.set_default_dtype(torch.float64)
    mgr = DomainParallelManager(world, world)
    model = convert_to_domain_parallel(nn.Sequential(nn.ReflectionPad2d((2, 1, 0, 0))), mgr)
    left_alone = type(model[0]) is nn.ReflectionPad2d
    errs = domain_parity_errors(lambda: nn.ReflectionPad2d((2, 1, 0, 0)), _x((2, 3, 13, 6)), mgr)
    assert_parity(errs)
    return left_alone


def test_width_only_padding_is_left_alone_and_exact():
    assert run_on_ranks(_width_only_worker, 3) == [True] * 3


def _error_worker(rank, world, make, h):
    mgr = DomainParallelManager(world, world)
    layer = DomainParallelPad(make(), manager=mgr)
    mgr.begin_forward(("errors", h))
    n = world
    rows = h // n + (1 if rank < h % n else 0)
    try:
        layer(torch.zeros(1, 1, rows, 4))
    except ValueError as err:
        return str(err)
    return None


def test_reflection_pad_not_shorter_than_global_height_is_rejected_on_every_rank():
    # 3 rows per shard, but the GLOBAL height (6) is what PyTorch compares the pad with
    ok = run_on_ranks(_error_worker, 2, lambda: nn.ReflectionPad2d((0, 0, 5, 0)), 6)
    assert ok == [None, None]
    messages = run_on_ranks(_error_worker, 2, lambda: nn.ReflectionPad2d((0, 0, 6, 0)), 6)
    assert all(m and "global height 6" in m and "ReflectionPad2d" in m for m in messages)


def test_cropping_below_the_domain_size_leaves_the_last_rank_empty():
    make = lambda: nn.ZeroPad2d((0, 0, -4, -3))  # noqa: E731 - 8 rows -> 1 row on 2 ranks
    # exact with an empty shard (parity: tests/test_domain_empty_shards.py)
    assert run_on_ranks(_error_worker, 2, make, 8) == [None, None]


@pytest.mark.parametrize("mode", ["constant", "reflect", "replicate", "circular"])
def test_pad_windows_follow_torch_row_for_row(mode):
    # F.pad of a column of row indices shows which row each output row copies
    for length, top, bottom in itertools.product((5, 9), range(-3, 5), range(-3, 5)):
        index = torch.arange(length, dtype=torch.float64).view(1, 1, length, 1)
        try:
            padded = F.pad(index, (0, 0, top, bottom), mode=mode, value=float(FILL))
        except RuntimeError:
            continue  # PyTorch refuses; the layer re-raises that error (tested above)
        expected = tuple(int(v) for v in padded.flatten())
        for n in (1, 2, 3):
            if len(expected) < n:
                continue
            windows = pad_windows(length, n, top, bottom, mode)
            assert sum(windows, ()) == expected, (length, top, bottom, n)


def test_pad_layer_keeps_the_module_and_rejects_other_modules():
    pad = nn.ConstantPad2d((1, 2, 3, 4), 2.5)
    layer = DomainParallelPad(pad)
    assert layer.padding == (1, 2, 3, 4) and layer.value == 2.5 and layer.mode == "constant"
    assert list(layer.state_dict()) == []
    with pytest.raises(TypeError, match="ZeroPad2d"):
        DomainParallelPad(nn.ZeroPad1d(2))
