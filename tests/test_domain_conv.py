"""Parity matrix of the domain-parallel convolutions against the single-process modules.

Every case runs through ``credit_parallel.testing.domain_parity_errors`` (forward, input gradient
and every parameter gradient, float64 max abs error <= 1e-10) on 2, 3 and 4 domain ranks, for
even (16) and uneven (13, 17, 19) heights: Conv2d over kernels, strides, paddings (ints, tuples,
"same", "valid"), dilation, groups and padding modes; ConvTranspose2d over kernels, strides,
output_padding, dilation (including ranks whose outputs no input reaches); Conv3d /
ConvTranspose3d including Pangu's patch embedding / recovery (kernel = stride) on B,C,Z,H,W;
the periodic (reflect-at-the-poles) conv; spectral-normalised convs; float32 spot checks.  Each
family and domain size is ONE ``run_on_ranks`` call looping over its cases.
"""

from __future__ import annotations

from collections import OrderedDict

import pytest
import torch
from torch import nn

from credit_parallel.domain.layers.conv import (
    DomainParallelConv2d,
    DomainParallelConv3d,
    DomainParallelConvTranspose2d,
    DomainParallelConvTranspose3d,
    DomainParallelPeriodicConv2d,
)
from credit_parallel.domain.manager import DomainParallelManager
from credit_parallel.domain.rows import shard_range
from credit_parallel.models import PeriodicConv2d
from credit_parallel.testing import assert_parity, domain_parity_errors, run_on_ranks
from helpers import assert_parity_matrix, parity_matrix_worker, wrap_with

__all__: list[str] = []

HEIGHTS = (16, 13, 17, 19)


def _heights(i: int) -> tuple[int, int]:
    """Case i runs at the even height 16 and one uneven height, rotating over 13, 17, 19."""
    return HEIGHTS[0], HEIGHTS[1 + i % 3]


# (name, kwargs) of nn.Conv2d(4, 6, **kwargs) cases
CONV2D = [
    ("k3s1p1", dict(kernel_size=3, padding=1)),
    ("k5s1p2", dict(kernel_size=5, padding=2)),
    ("k3s2p1", dict(kernel_size=3, stride=2, padding=1)),
    ("k4s2p1", dict(kernel_size=4, stride=2, padding=1)),
    ("k3s1p2_dilation2", dict(kernel_size=3, padding=2, dilation=2)),
    ("k3s2p3_dilation3", dict(kernel_size=3, stride=2, padding=3, dilation=3)),
    ("k1", dict(kernel_size=1)),
    ("k1s2", dict(kernel_size=1, stride=2)),
    ("k2s2_patchify", dict(kernel_size=2, stride=2)),
    ("k3s3p0", dict(kernel_size=3, stride=3)),
    ("k31_p10", dict(kernel_size=(3, 1), padding=(1, 0))),
    ("k13_p01", dict(kernel_size=(1, 3), padding=(0, 1))),
    ("k3p1_groups2", dict(kernel_size=3, padding=1, groups=2)),
    ("k3p1_reflect", dict(kernel_size=3, padding=1, padding_mode="reflect")),
    ("k5p2_reflect", dict(kernel_size=5, padding=2, padding_mode="reflect")),
    ("k3p1_replicate", dict(kernel_size=3, padding=1, padding_mode="replicate")),
    ("k3s2p1_replicate", dict(kernel_size=3, stride=2, padding=1, padding_mode="replicate")),
    ("k3p1_circular", dict(kernel_size=3, padding=1, padding_mode="circular")),
    ("k3p21_circular", dict(kernel_size=3, padding=(2, 1), padding_mode="circular")),
    ("k3_same", dict(kernel_size=3, padding="same")),
    ("k4_same_even", dict(kernel_size=4, padding="same")),
    ("k23_same_dilation2", dict(kernel_size=(2, 3), padding="same", dilation=2)),
    ("k4_same_reflect", dict(kernel_size=4, padding="same", padding_mode="reflect")),
    ("k3_valid", dict(kernel_size=3, padding="valid")),
    ("k3p1_no_bias", dict(kernel_size=3, padding=1, bias=False)),
]

# (name, kwargs) of nn.ConvTranspose2d(4, 6, **kwargs) cases
CONV_TRANSPOSE2D = [
    ("k2s2", dict(kernel_size=2, stride=2)),
    ("k4s2p1", dict(kernel_size=4, stride=2, padding=1)),
    ("k3s2p1_op1", dict(kernel_size=3, stride=2, padding=1, output_padding=1)),
    ("k3s1p1_dilation2", dict(kernel_size=3, padding=1, dilation=2)),
    (
        "k3s2p2_dilation2_op1",
        dict(kernel_size=3, stride=2, padding=2, dilation=2, output_padding=1),
    ),
    ("k3s1p1", dict(kernel_size=3, padding=1)),
    ("k3s3", dict(kernel_size=3, stride=3)),
    ("k1s2", dict(kernel_size=1, stride=2)),
    ("k4s2p1_groups2", dict(kernel_size=4, stride=2, padding=1, groups=2)),
    ("k4s2p1_no_bias", dict(kernel_size=4, stride=2, padding=1, bias=False)),
]


def _cases(family: str, world: int):
    """(name, build, input shape, wrapper class) for one family; every output height >= 4."""
    out = []
    if family == "conv2d":
        for (name, kw), h in ((c, h) for i, c in enumerate(CONV2D) for h in _heights(i)):
            out.append(
                (
                    f"{name}_h{h}",
                    lambda kw=kw: nn.Conv2d(4, 6, **kw),
                    (2, 4, h, 9),
                    DomainParallelConv2d,
                )
            )
    elif family == "conv_transpose2d":
        for (name, kw), h in ((c, h) for i, c in enumerate(CONV_TRANSPOSE2D) for h in _heights(i)):
            build = lambda kw=kw: nn.ConvTranspose2d(4, 6, **kw)  # noqa: E731
            out.append((f"{name}_h{h}", build, (2, 4, h, 7), DomainParallelConvTranspose2d))
        # k1 s3 p1: input row i writes output row 3i-1 only, so some ranks own rows no input
        # reaches (pure bias) and have an empty window while still sending their rows
        for h in (3, 4, 5):
            build = lambda: nn.ConvTranspose2d(4, 6, kernel_size=1, stride=3, padding=1)  # noqa: E731
            out.append(
                (f"k1s3p1_empty_window_h{h}", build, (2, 4, h, 5), DomainParallelConvTranspose2d)
            )
    elif family == "conv3d":
        cases3d = [
            ("k3p1", dict(kernel_size=3, padding=1), (16, 19)),
            (
                "pangu_patch_embed_k244_s244",
                dict(kernel_size=(2, 4, 4), stride=(2, 4, 4)),
                (16, 17, 19),
            ),
            ("k133_p011", dict(kernel_size=(1, 3, 3), padding=(0, 1, 1)), (13, 16)),
            ("k3s2p1", dict(kernel_size=3, stride=2, padding=1), (13, 16)),
            ("k3p1_circular", dict(kernel_size=3, padding=1, padding_mode="circular"), (13,)),
        ]
        for name, kw, heights in cases3d:
            for h in heights:
                build = lambda kw=kw: nn.Conv3d(3, 4, **kw)  # noqa: E731
                out.append((f"{name}_h{h}", build, (1, 3, 4, h, 8), DomainParallelConv3d))
    elif family == "conv_transpose3d":
        cases3d = [
            (
                "pangu_patch_recovery_k244_s244",
                dict(kernel_size=(2, 4, 4), stride=(2, 4, 4)),
                (4, 5, 7),
            ),
            ("k3s2p1_op1", dict(kernel_size=3, stride=2, padding=1, output_padding=1), (5, 8)),
            ("k3p1", dict(kernel_size=3, padding=1), (7,)),
        ]
        for name, kw, heights in cases3d:
            for h in heights:
                build = lambda kw=kw: nn.ConvTranspose3d(3, 4, **kw)  # noqa: E731
                out.append((f"{name}_h{h}", build, (1, 3, 2, h, 4), DomainParallelConvTranspose3d))
    elif family == "periodic":
        # heights 7: the last of 4 ranks owns one row and reflects across two ranks above
        for k, p in ((3, 1), (5, 2)):
            for h in (16, 13, 7):
                build = lambda k=k, p=p: PeriodicConv2d(4, 6, k, padding=p)  # noqa: E731
                out.append(
                    (f"periodic_k{k}p{p}_h{h}", build, (2, 4, h, 8), DomainParallelPeriodicConv2d)
                )
    elif family == "spectral_norm":
        for h in (13, 16):
            build = lambda: nn.utils.spectral_norm(nn.Conv2d(4, 6, 3, padding=1))  # noqa: E731
            out.append((f"spectral_conv2d_k3p1_h{h}", build, (2, 4, h, 6), DomainParallelConv2d))
            build = lambda: nn.utils.spectral_norm(nn.ConvTranspose2d(4, 6, 4, 2, 1))  # noqa: E731
            out.append(
                (
                    f"spectral_convT2d_k4s2p1_h{h}",
                    build,
                    (2, 4, h, 6),
                    DomainParallelConvTranspose2d,
                )
            )
    else:
        raise ValueError(family)
    return [c for c in out if c[2][-2] >= world]


def _matrix(family, world):
    """The family's cases for :func:`parity_matrix_worker`, each wrapped in its domain layer."""
    return [(name, b, shape, wrap_with(w)) for name, b, shape, w in _cases(family, world)]


@pytest.mark.parametrize("world", [2, 3, 4])
def test_conv2d_matrix_matches_single_process(world):
    results = run_on_ranks(parity_matrix_worker, world, _matrix("conv2d", world), torch.float64)
    assert_parity_matrix(results, min_cases=2 * len(CONV2D))


@pytest.mark.parametrize("world", [2, 3, 4])
def test_conv_transpose2d_matrix_matches_single_process(world):
    results = run_on_ranks(
        parity_matrix_worker, world, _matrix("conv_transpose2d", world), torch.float64
    )
    assert_parity_matrix(results, min_cases=2 * len(CONV_TRANSPOSE2D) + 2)


@pytest.mark.parametrize("world", [2, 3, 4])
def test_conv3d_and_pangu_patch_embedding_match_single_process(world):
    results = run_on_ranks(parity_matrix_worker, world, _matrix("conv3d", world), torch.float64)
    assert_parity_matrix(results, min_cases=10)


@pytest.mark.parametrize("world", [2, 3, 4])
def test_conv_transpose3d_and_pangu_patch_recovery_match_single_process(world):
    results = run_on_ranks(
        parity_matrix_worker, world, _matrix("conv_transpose3d", world), torch.float64
    )
    assert_parity_matrix(results, min_cases=6)


@pytest.mark.parametrize("world", [2, 3, 4])
def test_periodic_conv_reflects_at_the_poles_like_single_process(world):
    results = run_on_ranks(parity_matrix_worker, world, _matrix("periodic", world), torch.float64)
    assert_parity_matrix(results, min_cases=6)


def test_spectral_norm_conv_runs_its_pre_hook_and_matches_single_process():
    # training mode: the power iteration runs in both copies from the same state
    results = run_on_ranks(parity_matrix_worker, 3, _matrix("spectral_norm", 3), torch.float64)
    assert_parity_matrix(results, min_cases=4)
    assert any(k == "param:weight_orig" for k in results[0]["spectral_conv2d_k3p1_h13"])


def _float32_cases():
    cases = [
        (
            "conv2d_k3s1p1_h13",
            lambda: nn.Conv2d(8, 8, 3, padding=1),
            (2, 8, 13, 10),
            DomainParallelConv2d,
        ),
        (
            "conv2d_k3s2p1_reflect_h17",
            lambda: nn.Conv2d(8, 8, 3, 2, 1, padding_mode="reflect"),
            (2, 8, 17, 10),
            DomainParallelConv2d,
        ),
        (
            "convT2d_k4s2p1_h13",
            lambda: nn.ConvTranspose2d(8, 8, 4, 2, 1),
            (2, 8, 13, 10),
            DomainParallelConvTranspose2d,
        ),
        (
            "conv3d_k244_h17",
            lambda: nn.Conv3d(3, 8, (2, 4, 4), (2, 4, 4)),
            (1, 3, 4, 17, 8),
            DomainParallelConv3d,
        ),
        (
            "periodic_k3p1_h13",
            lambda: PeriodicConv2d(8, 8, 3, padding=1),
            (2, 8, 13, 10),
            DomainParallelPeriodicConv2d,
        ),
    ]
    return [(name, b, shape, wrap_with(w)) for name, b, shape, w in cases]


def test_float32_spot_checks_within_relative_tolerance():
    results = run_on_ranks(parity_matrix_worker, 3, _float32_cases(), torch.float32)
    assert_parity_matrix(results, torch.float32, min_cases=5)


def _converted_sequential_worker(rank, world):
    """The default converter on a small stack (the path the models take)."""
    torch.set_default_dtype(torch.float64)
    mgr = DomainParallelManager(world, world)

    def build():
        return nn.Sequential(
            nn.Conv2d(3, 6, 3, padding=1),
            nn.ReLU(),
            nn.Conv2d(6, 6, 3, stride=2, padding=1, padding_mode="reflect"),
            nn.Conv2d(6, 6, 1),
            nn.ConvTranspose2d(6, 4, 4, 2, 1),
            PeriodicConv2d(4, 2, 3, padding=1),
        )

    x = torch.randn(2, 3, 17, 8, generator=torch.Generator().manual_seed(0))
    return domain_parity_errors(build, x, mgr)


def test_converted_conv_stack_matches_single_process():
    for errors in run_on_ranks(_converted_sequential_worker, 3):
        assert_parity(errors)


def _too_few_rows_worker(rank, world):
    torch.set_default_dtype(torch.float64)
    mgr = DomainParallelManager(world, world)
    # a 5-row input shards over 4 ranks, but its stride-2 output has 3 rows: rank 3 owns none
    build = lambda: nn.Sequential(OrderedDict(down=nn.Conv2d(2, 2, 3, stride=2, padding=1)))  # noqa: E731
    x = torch.randn(1, 2, 5, 4, generator=torch.Generator().manual_seed(5))
    errors = domain_parity_errors(build, x, mgr)
    a, b = shard_range(5, world, rank)
    layer = DomainParallelConv2d(nn.Conv2d(2, 2, 3, stride=2, padding=1), manager=mgr)
    rows = layer(torch.zeros(1, 2, b - a, 4)).shape[-2]
    # the process group is still in step afterwards: nobody is left inside a collective
    t = torch.ones(1)
    torch.distributed.all_reduce(t)
    return errors, rows, float(t)


def test_output_height_smaller_than_domain_size_leaves_the_last_rank_empty_and_is_exact():
    results = run_on_ranks(_too_few_rows_worker, 4, timeout=60)
    assert [rows for _, rows, _ in results] == [1, 1, 1, 0]
    for errors, _, total in results:
        assert total == 4.0
        assert_parity(errors)


# --------------------------------------------------------------------------- wrapping, no processes
def _wrappers():
    return [
        (nn.Conv2d(4, 6, 3, padding=1), DomainParallelConv2d),
        (nn.Conv2d(4, 6, 3, padding=1, bias=False), DomainParallelConv2d),
        (nn.ConvTranspose2d(4, 6, 4, 2, 1), DomainParallelConvTranspose2d),
        (nn.Conv3d(3, 4, (2, 4, 4), (2, 4, 4)), DomainParallelConv3d),
        (nn.ConvTranspose3d(3, 4, (2, 4, 4), (2, 4, 4)), DomainParallelConvTranspose3d),
        (PeriodicConv2d(4, 6, 3, padding=1), DomainParallelPeriodicConv2d),
        (nn.utils.spectral_norm(nn.Conv2d(4, 6, 3, padding=1)), DomainParallelConv2d),
    ]


@pytest.mark.parametrize("index", range(7))
def test_state_dict_keys_and_tensors_are_identical_after_wrapping(index):
    module, wrapper = _wrappers()[index]
    before = module.state_dict()
    wrapped = wrapper(module, manager=object())
    after = wrapped.state_dict()
    assert list(after) == list(before)
    assert all(after[k] is before[k] or after[k].data_ptr() == before[k].data_ptr() for k in before)
    assert [n for n, _ in wrapped.named_parameters()] == [n for n, _ in module.named_parameters()]
    # loading a checkpoint of the plain module into the wrapper (and back) works unchanged
    wrapped.load_state_dict(before)
    module.load_state_dict(after)


def test_wrappers_reject_the_wrong_module_or_dim():
    with pytest.raises(TypeError, match="wraps Conv2d"):
        DomainParallelConv2d(nn.Conv3d(1, 1, 3))
    with pytest.raises(ValueError, match="not a spatial dim"):
        DomainParallelConv2d(nn.Conv2d(1, 1, 3), shard_dim=1)
    with pytest.raises(TypeError, match=r"\.conv \(nn\.Conv2d\) and \.padding"):
        DomainParallelPeriodicConv2d(nn.Conv2d(1, 1, 3))
    conv = nn.ConvTranspose2d(1, 1, 3)
    conv.padding_mode = "reflect"  # torch itself only allows zeros for transposed convs
    with pytest.raises(ValueError, match="padding_mode='zeros'"):
        DomainParallelConvTranspose2d(conv)
