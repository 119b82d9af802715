"""convert_to_domain_parallel on lat x lon tiles (SPEC §3b): models of the layers exact on tiles
(convolutions of every geometry, PeriodicConv2d, transposed convolutions, GroupNorm over the
whole P x Q group) match one process; everything else is REFUSED naming the module."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from credit_parallel.domain.convert import convert_to_domain_parallel
from credit_parallel.domain.layers.conv import DomainParallelConv2d
from credit_parallel.domain.layers.norm import DomainParallelGroupNorm
from credit_parallel.domain.manager import TiledDomainManager
from credit_parallel.models import PeriodicConv2d
from credit_parallel.planner.make import tile_refusals_of_model
from credit_parallel.testing import domain_parity_errors, fake_process_group, run_on_ranks


class _Net(nn.Module):
    """conv -> GroupNorm -> SiLU -> periodic conv -> lon-only conv -> strided conv -> transposed."""

    def __init__(self):
        super().__init__()
        self.body = nn.Sequential(
            nn.Conv2d(3, 8, 3, padding=1, padding_mode="circular"),
            nn.GroupNorm(2, 8),
            nn.SiLU(),
            PeriodicConv2d(8, 8, 3, padding=1),
            nn.GroupNorm(4, 8, affine=False),
            nn.Conv2d(8, 8, (1, 3), padding=(0, 1)),
            nn.ZeroPad2d((1, 1, 0, 0)),
            nn.Conv2d(8, 8, (1, 3)),
            nn.Conv2d(8, 6, 3, stride=2, padding=1),
            nn.ConvTranspose2d(6, 4, 2, stride=2),
            nn.Conv2d(4, 2, 1),
        )

    def forward(self, x):
        return self.body(x)


def _model_worker(rank, world, shape, grid):
    m = TiledDomainManager(world, shape)
    torch.manual_seed(3)
    x = torch.randn(2, 3, *grid, dtype=torch.float64)
    errors = domain_parity_errors(lambda: _Net().double(), x, m)
    converted = convert_to_domain_parallel(_Net().double(), m)
    kinds = [type(mod).__name__ for mod in converted.body]
    return errors, kinds


@pytest.mark.parametrize("shape, grid", [((2, 2), (10, 12)), ((1, 2), (9, 11)), ((3, 2), (12, 10))])
def test_converted_model_exact_on_tiles(shape, grid):
    for errors, kinds in run_on_ranks(_model_worker, shape[0] * shape[1], shape, grid):
        for key, (err, ref) in errors.items():
            assert err <= 1e-10 and ref > 0, (shape, key, err, ref)
        # the (1, 3) conv is row-local but reaches other columns: converted on tiles
        assert kinds[5] == "DomainParallelConv2d" and kinds[1] == "DomainParallelGroupNorm"
        assert kinds[6] == "DomainParallelPad"  # pads longitude only: converted on tiles
        assert kinds[2] == "SiLU" and kinds[10] == "Conv2d"


class _RowLocal(nn.Module):
    _domain_local = True

    def forward(self, x):
        return x.flip(-1)  # row-local, but mixes columns


class _TileLocal(nn.Module):
    _domain_local = True
    _tile_local = True

    def forward(self, x):
        return x * 2


class _Pool(nn.Module):
    def forward(self, x):
        return x


_Pool.__name__ = "MyPool"


@pytest.mark.parametrize(
    "module, path, words",
    [
        (nn.ConstantPad3d(1, 0.5), "1", "ConstantPad3d pads longitude"),
        # (a bare nn.MultiheadAttention runs on the tile's tokens: test_domain2d_fusion.py)
    ],
)
def test_modules_not_exact_on_tiles_are_refused_naming_them(module, path, words):
    model = nn.Sequential(nn.Conv2d(4, 4, 3, padding=1), module, _TileLocal())
    with fake_process_group(0, 4):
        m = TiledDomainManager(4, (2, 2))
        with pytest.raises(ValueError) as err:
            convert_to_domain_parallel(model, m)
    text = str(err.value)
    assert f"{path}: " in text and words in text, text
    assert "two-dimensional (lat x lon) domains do not support it yet" in text
    assert "0: " not in text and "2: " not in text  # the conv and the tile-local module pass
    # the planner reports the same module without a process group
    planned = dict(tile_refusals_of_model(model))
    assert path in planned and words.split(" (")[0].split(" ")[0] in planned[path]


def test_gather_policy_and_1d_refusals_on_tiles():
    model = nn.Sequential(nn.Conv2d(4, 4, 3, padding=1), nn.MaxPool2d(2))
    with fake_process_group(1, 4):
        m = TiledDomainManager(4, (2, 2))
        with pytest.raises(ValueError, match="MaxPool2d mixes rows"):
            convert_to_domain_parallel(model, m)
        # the gather policy runs on latitude strips (tiles_relayout.py; exact:
        # tests/test_domain2d_relayout.py), with the gather warning
        with pytest.warns(UserWarning, match="nonlocal_policy='gather': 1"):
            converted = convert_to_domain_parallel(model, m, nonlocal_policy="gather")
        assert type(converted[1]).__name__ == "TileStripRelayout"
        assert type(converted[1].wrapped).__name__ == "DomainGatherModule"
        # a layer not exact on tiles built by hand refuses at its first call, naming itself
        from credit_parallel.domain.exchange.halo import HaloExchange

        with pytest.raises(ValueError, match="HaloExchange: two-dimensional"):
            HaloExchange(1, manager=m)(torch.zeros(1, 1, 4, 4))


PADS = [
    nn.ZeroPad2d((1, 2, 3, 0)),
    nn.ZeroPad2d((1, 1, 0, 0)),
    nn.ConstantPad2d((2, 0, 1, 1), 1.5),
    nn.ReflectionPad2d(2),
    nn.ReplicationPad2d((2, 1, 1, 2)),
    nn.CircularPad2d((2, 1, 1, 1)),
    nn.CircularPad2d((0, -1, -1, 2)),
]


def _pad_worker(rank, world, shape):
    from credit_parallel.domain.layers.padding import DomainParallelPad

    m = TiledDomainManager(world, shape)
    torch.manual_seed(2)
    x = torch.randn(1, 2, 7, 9, dtype=torch.float64)
    out = []
    for pad in PADS:
        errors = domain_parity_errors(
            lambda pad=pad: pad, x, m, convert=lambda mod, mgr: DomainParallelPad(mod, manager=mgr)
        )
        out.append(errors)
    return out


@pytest.mark.parametrize("shape", [(2, 2), (1, 3), (2, 1)])
def test_padding_modules_exact_on_tiles(shape):
    for result in run_on_ranks(_pad_worker, shape[0] * shape[1], shape):
        for pad, errors in zip(PADS, result):
            for key, (err, ref) in errors.items():
                assert err <= 1e-12 and ref > 0, (shape, pad, key, err)


SHUFFLES = [
    (nn.PixelShuffle(2), (1, 8, 5, 7)),
    (nn.PixelShuffle(3), (1, 9, 3, 4)),
    (nn.PixelUnshuffle(2), (1, 2, 8, 10)),
]


def _shuffle_worker(rank, world, shape):
    from credit_parallel.domain.layers.pixel_shuffle import (
        DomainParallelPixelShuffle,
        DomainParallelPixelUnshuffle,
    )

    m = TiledDomainManager(world, shape)
    out = []
    for module, in_shape in SHUFFLES:
        torch.manual_seed(2)
        x = torch.randn(in_shape, dtype=torch.float64)
        wrap = (
            DomainParallelPixelShuffle
            if isinstance(module, nn.PixelShuffle)
            else DomainParallelPixelUnshuffle
        )
        errors = domain_parity_errors(
            lambda module=module: module,
            x,
            m,
            convert=lambda mod, mgr, wrap=wrap: wrap(mod, manager=mgr),
        )
        out.append(errors)
    return out


@pytest.mark.parametrize("shape", [(2, 2), (1, 3), (3, 2)])
def test_pixel_shuffle_exact_on_tiles(shape):
    for result in run_on_ranks(_shuffle_worker, shape[0] * shape[1], shape):
        for (module, _), errors in zip(SHUFFLES, result):
            for key, (err, ref) in errors.items():
                assert err <= 1e-12 and ref > 0, (shape, module, key, err)


RESAMPLES = [
    nn.Upsample(scale_factor=2, mode="bilinear"),
    nn.Upsample(scale_factor=2, mode="nearest"),
    nn.Upsample(size=(11, 6), mode="bilinear", align_corners=True),
    nn.Upsample(size=(4, 5), mode="bilinear"),
    nn.Upsample(scale_factor=(1.5, 0.75), mode="nearest"),
]


def _resample_worker(rank, world, shape):
    from credit_parallel.domain.rules import _upsample_rule

    m = TiledDomainManager(world, shape)
    torch.manual_seed(4)
    x = torch.randn(1, 2, 7, 9, dtype=torch.float64)
    return [
        domain_parity_errors(
            lambda module=module: module,
            x,
            m,
            convert=lambda mod, mgr: _upsample_rule(mod, mgr, -2),
        )
        for module in RESAMPLES
    ]


@pytest.mark.parametrize("shape", [(2, 2), (1, 3), (3, 2)])
def test_interpolation_exact_on_tiles(shape):
    for result in run_on_ranks(_resample_worker, shape[0] * shape[1], shape):
        for module, errors in zip(RESAMPLES, result):
            for key, (err, ref) in errors.items():
                assert err <= 1e-12 and ref > 0, (shape, module, key, err)


def test_tile_exact_layers_declare_it():
    assert DomainParallelConv2d.tile_exact and DomainParallelGroupNorm.tile_exact
    assert tile_refusals_of_model(_Net()) == []


# --------------------------------------------------------------------------- parallelize
@pytest.mark.parametrize(
    "world, block",
    [
        (4, {"data": "fsdp2", "domain": {"lat": 2, "lon": 2}}),  # dp 1 x 2 x 2
        (4, {"data": "fsdp2", "domain": {"lat": 1, "lon": 2}}),  # dp 2 x 1 x 2
    ],
)
def test_parallelize_trains_on_tiles_like_one_process(world, block):
    """The whole recipe on a lat x lon domain: the tile manager from the mesh, the conversion,
    FSDP2 over the flattened dp x lat x lon axis, AdamW steps on uneven rows (H = 13
    over 2) — losses and parameters equal one process."""
    from test_fsdp_domain import TOL, _reference_losses, _train_worker

    ref_losses, ref_params = _reference_losses()
    for res in run_on_ranks(_train_worker, world, block, timeout=300):
        for a, b in zip(res["losses"], ref_losses):
            assert abs(a - b) <= TOL * abs(b), (res["losses"], ref_losses)
        for name, ref in ref_params.items():
            assert float((res["params"][name] - ref).abs().max()) <= TOL, name
        assert res["meshes"] == {("dp_domain",)}
        assert res["memory"]["state"] == 2 * res["memory"]["param_local"]


# --------------------------------------------------------------------------- the bundled U-Net
def _unet_worker(rank, world, shape, hw):
    from credit_parallel.models import UNet

    m = TiledDomainManager(world, shape)
    torch.manual_seed(5)
    x = torch.randn(1, 3, *hw, dtype=torch.float64)
    return domain_parity_errors(lambda: UNet(3, 2, *hw, base_channels=4).double(), x, m)


@pytest.mark.parametrize("shape, hw", [((2, 2), (17, 20)), ((1, 3), (11, 19)), ((3, 2), (19, 14))])
def test_bundled_unet_exact_on_tiles(shape, hw):
    """The bundled U-Net (periodic convs, GroupNorm, strided convs, bilinear upsampling to the
    global skip sizes) on uneven tiles, converted by convert_to_domain_parallel."""
    for errors in run_on_ranks(_unet_worker, shape[0] * shape[1], shape, hw, timeout=300):
        for key, (err, ref) in errors.items():
            assert err <= 1e-10 and ref > 0, (shape, key, err, ref)


@pytest.mark.parametrize("module", [_RowLocal()])
def test_modules_exact_on_strips_run_there_on_tiles(module):
    """Row-local modules and attention are exact on 1-D latitude strips: on tiles the converter
    puts them in a relayout to strips (``tiles_relayout.py``; exactness in
    ``tests/test_domain2d_relayout.py``), and ``plan`` no longer reports them."""
    model = nn.Sequential(nn.Conv2d(4, 4, 3, padding=1), module, _TileLocal())
    assert not tile_refusals_of_model(model)
    with fake_process_group(0, 4):
        m = TiledDomainManager(4, (2, 2))
        converted = convert_to_domain_parallel(model, m)
    assert type(converted[1]).__name__ == "TileStripRelayout"
    assert converted[1].wrapped is module or converted[1].wrapped.wrapped is module


# --------------------------------------------------------------------------- verify
def test_verify_passes_on_tiles_for_the_bundled_unet():
    """``verify_layout`` (the command ``credit-parallel verify``) on lat x lon tiles: the loss
    of a tile is normalised by the global height AND width; float64 and float32 pass."""
    from test_verify_models import UNET, _assert_all_pass, _verify_cases

    f64, f32 = torch.float64, torch.float32
    cases = [
        (UNET, {"data": "fsdp2", "domain": {"lat": 2, "lon": 2}}, f64),
        (UNET, {"domain": {"lat": 2, "lon": 2}}, f32),
    ]
    _assert_all_pass(run_on_ranks(_verify_cases, 4, cases, timeout=300), 4)
    cases = [(UNET, {"data": "ddp", "domain": {"lat": 1, "lon": 2}}, f64)]
    _assert_all_pass(run_on_ranks(_verify_cases, 4, cases, timeout=300), 4)
