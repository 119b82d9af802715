"""Random draws that do not depend on the layout (SPEC §0; domain/random_draws.py).

For a fixed seed set before the forward (as in one process), a converted model that draws
noise on its activations computes what one process computes: forward, input gradient and every
parameter gradient (float64 1e-10), at domain 2 (uneven rows) and on 2x2 tiles; and the members
of a K-member batch are the same under ensemble 1 and 2.  Without the draws installed the
shards draw their own numbers (the test shows the difference is real).
"""

from __future__ import annotations

import pytest
import torch
from torch import nn

from credit_parallel.domain.convert import convert_to_domain_parallel
from credit_parallel.domain.manager import DomainParallelManager, TiledDomainManager
from credit_parallel.domain.random_draws import (
    DrawLayout,
    LayoutIndependentDraws,
    install_layout_independent_draws,
    random_drawing_modules,
)
from credit_parallel.testing import assert_parity, domain_parity_errors, run_on_ranks

SEED = 11


class _NoisyNet(nn.Module):
    """conv -> dropout -> h + 0.1 * randn_like(h) + a latent style -> conv."""

    def __init__(self):
        super().__init__()
        self.conv1 = nn.Conv2d(2, 4, 3, padding=1)
        self.drop = nn.Dropout(0.3)
        self.style = nn.Linear(3, 4)
        self.conv2 = nn.Conv2d(4, 2, 3, padding=1)

    def forward(self, x):
        h = self.drop(self.conv1(x))
        latent = torch.randn(x.shape[0], 3, dtype=x.dtype)
        h = h + 0.1 * torch.randn_like(h) + self.style(latent)[:, :, None, None]
        return self.conv2(h)


class _Seeded(nn.Module):
    """``torch.manual_seed`` before the forward, as a one-process script does."""

    def __init__(self, model):
        super().__init__()
        self.model = model

    def forward(self, x):
        torch.manual_seed(SEED)
        return self.model(x)


def _crossformer_ensemble():
    from miles_credit import import_credit

    ensemble = import_credit("credit.models.wxformer.crossformer_ensemble")
    return ensemble.CrossFormerWithNoise(
        image_height=16,
        image_width=16,
        frames=1,
        channels=1,
        surface_channels=1,
        input_only_channels=0,
        levels=2,
        dim=(2, 4, 8, 16),
        depth=(1, 1, 1, 1),
        dim_head=2,
        global_window_size=(2, 2, 1, 1),
        local_window_size=(2, 2, 1, 1),
        cross_embed_kernel_sizes=((2, 4), (2, 4), (2, 4), (2, 4)),
        cross_embed_strides=(2, 2, 2, 2),
        use_spectral_norm=False,
        interp=False,
    )


def _manager(world, tiles):
    return TiledDomainManager(world, (2, 2)) if tiles else DomainParallelManager(world, world)


def _convert_with_draws(model, manager):
    model = convert_to_domain_parallel(model, manager)
    install_layout_independent_draws(model, DrawLayout(manager))
    return model


def _parity_worker(rank, world, which, tiles, install):
    torch.set_default_dtype(torch.float64)  # CrossFormerWithNoise draws in the default dtype
    if which == "noisy":
        build, x = (lambda: _Seeded(_NoisyNet()).double().train()), torch.randn(2, 2, 7, 6)
    else:
        build, x = (
            (lambda: _Seeded(_crossformer_ensemble()).double().train()),
            torch.randn(1, 3, 16, 16),
        )
    x = x.double()
    convert = _convert_with_draws if install else None
    return domain_parity_errors(build, x, _manager(world, tiles), convert=convert)


@pytest.mark.parametrize("tiles", [False, True], ids=["rows2", "tiles2x2"])
def test_dropout_and_randn_like_net_is_exact(tiles):
    world = 4 if tiles else 2
    for errors in run_on_ranks(_parity_worker, world, "noisy", tiles, True):
        assert_parity(errors)


def test_convert_to_domain_parallel_alone_installs_the_draws():
    """Never silently layout-dependent (SPEC §0): the converter itself installs the draws (each
    shard drawing its own numbers differed from one process by > 1e-2 here)."""
    for errors in run_on_ranks(_parity_worker, 2, "noisy", False, False):
        assert_parity(errors)


@pytest.mark.parametrize("tiles", [False, True], ids=["rows2", "tiles2x2"])
def test_crossformer_ensemble_is_exact(tiles):
    world = 4 if tiles else 2
    for errors in run_on_ranks(_parity_worker, world, "crossformer", tiles, True):
        assert_parity(errors)


def _members_worker(rank, world, members):
    """The K members' outputs under ensemble E = world (K/E members per rank), gathered."""
    import torch.distributed as dist

    torch.manual_seed(0)
    model = _NoisyNet().double().train()
    x = torch.randn(2, 2, 7, 6, dtype=torch.float64)  # two samples
    local = members // world
    batch = x.repeat_interleave(local, 0)  # this rank's K/E members of each sample
    install_layout_independent_draws(model, DrawLayout(None, rank, world, local))
    torch.manual_seed(SEED)
    out = model(batch).detach().view(2, local, 2, 7, 6)
    parts = [torch.empty_like(out) for _ in range(world)]
    dist.all_gather(parts, out)
    return torch.cat(parts, dim=1)


def test_members_are_the_same_under_ensemble_one_and_two():
    torch.manual_seed(0)
    model = _NoisyNet().double().train()
    x = torch.randn(2, 2, 7, 6, dtype=torch.float64)
    torch.manual_seed(SEED)
    one = model(x.repeat_interleave(4, 0)).detach().view(2, 4, 2, 7, 6)
    two = run_on_ranks(_members_worker, 2, 4)
    for out in two:
        assert (out - one).abs().max() <= 1e-12
    assert (one[:, 0] - one[:, 1]).abs().max() > 1e-2  # the members differ


def test_which_modules_draw():
    assert random_drawing_modules(_NoisyNet()) == ["", "drop"]
    assert random_drawing_modules(nn.Sequential(nn.Conv2d(1, 1, 1), nn.Dropout(0.0))) == []


def test_an_unsupported_draw_is_refused_naming_the_module():
    mode = LayoutIndependentDraws(DrawLayout(None, 0, 2, 1), where=lambda: "blocks.3 (Noise)")
    with mode, pytest.raises(ValueError, match=r"blocks\.3 \(Noise\).*randperm"):
        torch.randperm(4)
    with mode, pytest.raises(ValueError, match=r"batch 3, not 1 sample\(s\) x the 2 members"):
        LayoutIndependentDraws(DrawLayout(None, 0, 2, 2)).global_view(torch.randn, (3, 4))


def test_crossformer_ensemble_draws_noise_that_matters():
    """The parity above is not vacuous: two seeds give different outputs."""
    torch.set_default_dtype(torch.float64)
    try:
        torch.manual_seed(0)
        model = _crossformer_ensemble().train()
        x = torch.randn(1, 3, 16, 16)
        outs = []
        for seed in (1, 2):
            torch.manual_seed(seed)
            outs.append(model(x).detach())
    finally:
        torch.set_default_dtype(torch.float32)
    assert (outs[0] - outs[1]).abs().max() > 1e-3
    drawing = random_drawing_modules(model)
    assert drawing[0] == "" and "noise_inject1" in drawing  # the root's latent, the layers' pixels


def test_spherical_harmonic_noise_is_refused_under_domain_naming_the_module():
    inverse_sht = type("InverseRealSHT", (nn.Module,), {"forward": lambda self, x: x})
    inverse_sht.__module__ = "torch_harmonics.sht"  # as torch-harmonics defines it
    model = nn.Sequential(_NoisyNet(), inverse_sht())

    class _TwoRanks:
        domain_world_size = 2

    with pytest.raises(ValueError, match=r"^1 \(InverseRealSHT\): spherical-harmonic"):
        install_layout_independent_draws(model, DrawLayout(_TwoRanks()))


def _crossformer_dropout():
    """CREDIT's crossformer as the smoke ensemble config builds it: members differ only by the
    attention (and feed-forward) dropout."""
    from miles_credit import import_credit

    crossformer = import_credit("credit.models.crossformer")
    return crossformer.CrossFormer(
        image_height=32,
        image_width=32,
        frames=1,
        channels=1,
        surface_channels=1,
        input_only_channels=0,
        levels=2,
        dim=(2, 4, 8, 16),
        depth=(1, 1, 1, 1),
        dim_head=2,
        global_window_size=(2, 2, 1, 1),
        local_window_size=(2, 2, 1, 1),
        cross_embed_kernel_sizes=((2, 4), (2, 4), (2, 4), (2, 4)),
        cross_embed_strides=(2, 2, 2, 2),
        attn_dropout=0.1,
        ff_dropout=0.1,
        use_spectral_norm=False,
        interp=False,
    )


def _dropout_members_worker(rank, world, members):
    import torch.distributed as dist

    torch.set_default_dtype(torch.float64)
    torch.manual_seed(0)
    model = _crossformer_dropout().train()
    x = torch.randn(2, 3, 32, 32)
    local = members // world
    install_layout_independent_draws(model, DrawLayout(None, rank, world, local))
    torch.manual_seed(SEED)
    out = model(x.repeat_interleave(local, 0)).detach()
    out = out.view(2, local, *out.shape[1:])
    parts = [torch.empty_like(out) for _ in range(world)]
    dist.all_gather(parts, out)
    return torch.cat(parts, dim=1)


def test_attention_dropout_members_are_the_same_under_ensemble_one_and_two():
    torch.set_default_dtype(torch.float64)
    try:
        torch.manual_seed(0)
        model = _crossformer_dropout().train()
        x = torch.randn(2, 3, 32, 32)
        torch.manual_seed(SEED)
        one = model(x.repeat_interleave(4, 0)).detach()
    finally:
        torch.set_default_dtype(torch.float32)
    one = one.view(2, 4, *one.shape[1:])
    for out in run_on_ranks(_dropout_members_worker, 2, 4):
        assert (out - one).abs().max() <= 1e-12
    assert (one[:, 0] - one[:, 1]).abs().max() > 1e-3  # dropout makes the members differ


def _attention_dropout_worker(rank, world, tiles):
    torch.set_default_dtype(torch.float64)
    build = lambda: _Seeded(_crossformer_dropout()).train()  # noqa: E731
    x = torch.randn(1, 3, 32, 32)  # 32 rows: every level keeps rows on both ranks
    manager = _manager(world, tiles)
    if not tiles:
        return domain_parity_errors(build, x, manager, convert=_convert_with_draws)
    with pytest.raises(ValueError) as refused:  # at conversion, before any forward
        _convert_with_draws(build(), manager)
    return str(refused.value)


def test_attention_dropout_on_rows_is_exact():
    """CREDIT's crossformer with attn_dropout and ff_dropout 0.1 (the smoke ensemble config's
    source of member diversity) at domain 2: its attention runs on whole windows re-laid out
    over the ranks, each rank's windows a contiguous chunk of every sample's."""
    for errors in run_on_ranks(_attention_dropout_worker, 2, False):
        assert_parity(errors)


def test_attention_dropout_on_tiles_is_refused_naming_the_module():
    for message in run_on_ranks(_attention_dropout_worker, 4, True):
        assert message.startswith("model.layers.0.1.layers.0.0.dropout (Dropout): draws")
        assert "inside the attention module model.layers.0.1.layers.0.0" in message
