"""Modules not exact on lat x lon tiles run on latitude strips (``domain/tiles_relayout.py``):
two all-to-alls around the module's 1-D replacement.  Every model here matches one process
(float64, forward, input gradient and every parameter gradient, <= 1e-10) on uneven tiles."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from credit_parallel.domain.convert import convert_to_domain_parallel
from credit_parallel.domain.exchange.traffic import record_exchange_stats
from credit_parallel.domain.layers.gather import DomainGatherModule
from credit_parallel.domain.manager import TiledDomainManager
from credit_parallel.domain.rows import shard_range
from credit_parallel.domain.tiles_relayout import (
    TileStripRelayout,
    move_blocks,
    moved_elements,
    strip_rects,
    tile_rects,
)
from credit_parallel.models import CrossFormer, SwinNet
from credit_parallel.planner.make import tile_refusals_of_model
from credit_parallel.testing import domain_parity_errors, run_on_ranks
from miles_credit import import_credit

TOL = 1e-10


def _assert_exact(errors, what, *, every_gradient_nonzero=True):
    """Every error <= TOL; the output, the input gradient and (``every_gradient_nonzero``)
    every parameter gradient nonzero in the reference, else at least one parameter's (CREDIT's
    CrossFormer has parameters its forward does not reach)."""
    for key, (err, ref) in errors.items():
        assert err <= TOL, (what, key, err, ref)
    assert errors["output"][1] > 0 and errors["input_grad"][1] > 0, what
    nonzero = [key for key, (_, ref) in errors.items() if key.startswith("param:") and ref > 0]
    expected = len(errors) - 2 if every_gradient_nonzero else 1
    assert len(nonzero) >= expected, (what, len(nonzero), expected)


def _forms(model) -> list[str]:
    """Class names in the converted tree, wrapped layers included (a wrapper shares its
    module's children but does not register the module itself)."""
    names = set()
    for m in model.modules():
        while m is not None:
            names.add(type(m).__name__)
            m = m.__dict__.get("wrapped")
    return sorted(names)


# --------------------------------------------------------------------------- the move
def test_moved_elements_are_the_tile_elements_other_strips_hold():
    # 7 x 10 on 2 x 2 tiles (rows 4 / 3, columns 5 / 5) -> strips of 2 / 2 / 2 / 1 rows
    tiles, strips = tile_rects(7, 10, (2, 2)), strip_rects(7, 10, 4)
    assert tiles[1] == ((0, 4), (5, 10)) and strips[3] == ((6, 7), (0, 10))
    # tile 0 (rows 0-3, columns 0-4) keeps rows 0-1, sends rows 2-3 to strip 1; tile 2 (rows
    # 4-6) keeps rows 4-5 and sends row 6 to strip 3
    assert moved_elements(tiles, strips) == [10, 10, 5, 10]
    # strip 3 (row 6) keeps columns 5-9 (tile 3's) and sends columns 0-4 to tile 2
    assert moved_elements(strips, tiles) == [10, 10, 10, 5]
    # every element sent once each way: the totals agree
    assert sum(moved_elements(tiles, strips)) == sum(moved_elements(strips, tiles))


def _move_worker(rank, world, shape, hw):
    m = TiledDomainManager(world, shape)
    h, w = hw
    torch.manual_seed(0)
    x = torch.randn(2, 3, h, w, dtype=torch.float64)
    (r0, r1), (c0, c1) = tile_rects(h, w, shape)[m.domain_rank]
    tile = x[..., r0:r1, c0:c1].clone().requires_grad_()
    tiles, strips = tile_rects(h, w, shape), strip_rects(h, w, world)
    with record_exchange_stats() as stats:
        strip = move_blocks(tile, tiles, strips, -2, -1, m.strips)
        (strip * strip).sum().backward()
    a, b = shard_range(h, world, m.domain_rank)
    # the path torch.compile takes: one credit_parallel::all_to_all (run eagerly here)
    import credit_parallel.domain.attention.sequence  # noqa: F401  (its eager implementation)
    from credit_parallel.domain.tiles_relayout import _move_traced

    tile2 = tile.detach().clone().requires_grad_()
    traced = _move_traced(tile2, tiles, strips, 2, 3, m.strips)
    (traced * traced).sum().backward()
    assert torch.equal(traced, strip) and torch.equal(tile2.grad, tile.grad)
    return (
        (strip - x[..., a:b, :]).abs().max().item(),
        (tile.grad - 2 * tile.detach()).abs().max().item(),
        stats.by_direction["forward"],
        stats.by_direction["backward"],
        moved_elements(tiles, strips)[m.domain_rank] * 2 * 3 * 8,
        moved_elements(strips, tiles)[m.domain_rank] * 2 * 3 * 8,
    )


@pytest.mark.parametrize("shape, hw", [((2, 2), (7, 10)), ((1, 3), (5, 8)), ((3, 2), (11, 7))])
def test_tiles_to_strips_and_back_is_exact_and_counts_its_bytes(shape, hw):
    for out, grad, fwd, bwd, sent, returned in run_on_ranks(
        _move_worker, shape[0] * shape[1], shape, hw
    ):
        assert out == 0 and grad == 0
        assert fwd == sent and bwd == returned  # the tile elements that move, each way


# --------------------------------------------------------------------------- models
def _bundled_worker(rank, world, shape, kind, hw):
    m = TiledDomainManager(world, shape)
    h, w = hw
    torch.manual_seed(0)
    if kind == "crossformer":

        def build():
            return CrossFormer(
                3, 2, h, w, dims=(8, 8), depths=(2, 2), dim_head=4, window_sizes=(2, 2)
            ).double()
    else:

        def build():
            return SwinNet(
                3, 2, h, w, dim=8, depth=2, dim_head=4, window_size=4, mlp_ratio=2, norm_groups=2
            ).double()

    x = torch.randn(2, 3, h, w, dtype=torch.float64)
    errors = domain_parity_errors(build, x, m)
    converted = convert_to_domain_parallel(build(), m)
    assert list(converted.state_dict()) == list(build().state_dict())  # names unchanged
    return errors, _forms(converted)


@pytest.mark.parametrize(
    "shape, kind, hw",
    [
        ((2, 2), "crossformer", (24, 16)),  # level 0: 12 x 8 over 2 x 2 tiles
        ((1, 3), "crossformer", (16, 16)),  # 8 columns over 3: 3 / 3 / 2
        ((3, 2), "crossformer", (40, 8)),  # 20 rows: 7 / 7 / 6
        ((2, 2), "swin", (24, 8)),  # shifted windows across the tile corners
        ((3, 2), "swin", (40, 8)),
    ],
)
def test_bundled_attention_models_exact_on_tiles(shape, kind, hw):
    for errors, forms in run_on_ranks(_bundled_worker, shape[0] * shape[1], shape, kind, hw):
        _assert_exact(errors, (shape, kind))
        assert "TileStripRelayout" in forms and "DomainRowGroupAttention" in forms


def _credit_crossformer(width=32, padding=None):
    """1 column per tile at the deepest level (W / 16 columns over Q tiles: no empty tile)."""
    extra = {} if padding is None else {"padding_conf": padding}
    return (
        import_credit("credit.models.crossformer")
        .CrossFormer(
            **extra,
            image_height=48,
            image_width=width,
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
        .double()
    )


def _credit_worker(rank, world, shape, width):
    m = TiledDomainManager(world, shape)
    torch.manual_seed(0)
    x = torch.randn(1, 3, 1, 48, width, dtype=torch.float64)
    return domain_parity_errors(lambda: _credit_crossformer(width), x, m)


@pytest.mark.parametrize("shape, width", [((2, 2), 32), ((1, 3), 48)])
def test_miles_credit_crossformer_exact_on_tiles(shape, width):
    """Short and long-distance window attention at every level; the deepest level has 3 rows
    on 4 strips at (2, 2) (one strip empty)."""
    for errors in run_on_ranks(_credit_worker, shape[0] * shape[1], shape, width):
        _assert_exact(errors, shape, every_gradient_nonzero=False)
    assert not tile_refusals_of_model(_credit_crossformer())  # plan: no longer refused


def _padded_worker(rank, world, shape, mode):
    from credit_parallel.domain.manager import DomainParallelManager

    m = TiledDomainManager(world, shape) if shape else DomainParallelManager(world, world)
    torch.manual_seed(0)
    x = torch.randn(1, 3, 1, 48, 32, dtype=torch.float64)
    padding = {"activate": True, "mode": mode, "pad_lat": [5, 11], "pad_lon": [8, 8]}
    errors = domain_parity_errors(lambda: _credit_crossformer(32, padding), x, m)
    return errors, _forms(convert_to_domain_parallel(_credit_crossformer(32, padding), m))


@pytest.mark.parametrize(
    "shape, world, mode", [((2, 2), 4, "earth"), (None, 2, "earth"), ((1, 3), 3, "mirror")]
)
def test_miles_credit_crossformer_with_boundary_padding_exact(shape, world, mode):
    """CREDIT's ``TensorPadding`` in the CrossFormer's forward (``padding_conf``): "earth" rows
    beyond the poles are the pole rows rolled by 180 degrees (other longitude tiles), 5 rows
    above and 11 below, 8 columns each side; on tiles the padding moves tiles to strips and
    back; on latitude shards (``shape`` None) it is one row exchange (before
    ``adapters/tensor_padding.py`` the padding ran on each shard: silently wrong)."""
    for errors, forms in run_on_ranks(_padded_worker, world, shape, mode):
        _assert_exact(errors, (shape, mode), every_gradient_nonzero=False)
        assert "DomainPaddedModel" in forms


def _gather_worker(rank, world, shape):
    m = TiledDomainManager(world, shape)
    torch.manual_seed(0)
    x = torch.randn(2, 3, 7, 10, dtype=torch.float64)

    def build():
        # the pools mix rows and columns: refused on any domain, run on the whole globe under
        # the gather policy (on tiles: inside a relayout to strips)
        return nn.Sequential(
            nn.Conv2d(3, 4, 3, padding=1),
            nn.MaxPool2d(3, stride=1, padding=1),
            nn.Conv2d(4, 4, 3, padding=1),
            nn.AvgPool2d(3, stride=1, padding=1),
        ).double()

    def convert(model, mgr):
        return convert_to_domain_parallel(model, mgr, nonlocal_policy="gather")

    with pytest.warns(UserWarning, match="gather"):
        errors = domain_parity_errors(build, x, m, convert=convert)
    return errors


@pytest.mark.parametrize("shape", [(2, 2), (3, 2)])
def test_gather_policy_exact_on_tiles(shape):
    for errors in run_on_ranks(_gather_worker, shape[0] * shape[1], shape):
        _assert_exact(errors, shape)


def test_relayout_refuses_other_tile_arguments_and_non_tile_managers():
    wrapper = TileStripRelayout(nn.Identity(), manager=object())
    with pytest.raises(ValueError, match="needs a lat x lon tile manager"):
        wrapper(torch.zeros(1, 1, 4, 4))


def _fuxi_worker(rank, world, shape, padding):
    from test_fuxi import WIDTH, fuxi

    m = TiledDomainManager(world, shape)
    torch.manual_seed(1)
    x = torch.randn(1, 2, 2, 32, WIDTH, dtype=torch.float64)
    errors = domain_parity_errors(lambda: fuxi(32, 2, padding_conf=padding), x, m)
    return errors, _forms(convert_to_domain_parallel(fuxi(32, 2, padding_conf=padding), m))


@pytest.mark.parametrize("shape, mode", [((2, 2), "earth"), ((1, 3), "mirror")])
def test_miles_credit_fuxi_with_its_boundary_padding_exact_on_tiles(shape, mode):
    """CREDIT's FuXi (Swin-V2 blocks, the u-transformer) with its ``TensorPadding`` ("earth":
    the rows beyond a pole are the pole rows rolled by 180 degrees of longitude, which live on
    other longitude tiles): the whole model runs on latitude strips."""
    padding = {"activate": True, "mode": mode, "pad_lat": [4, 4], "pad_lon": [4, 4]}
    for errors, forms in run_on_ranks(_fuxi_worker, shape[0] * shape[1], shape, padding):
        _assert_exact(errors, (shape, mode), every_gradient_nonzero=False)
        assert {"TileStripRelayout", "DomainFuxi", "DomainSwinBlock"} <= set(forms)


class _LonPad(nn.Module):
    """Pads longitude only (2 west, 1 east): reaches other columns on tiles."""

    def forward(self, x):
        return torch.nn.functional.pad(x, (2, 1, 0, 0)) * 3


def _counted_worker(rank, world, shape):
    from credit_parallel.planner.tiles import tile_layer_plan

    m = TiledDomainManager(world, shape)
    h, w = 9, 7
    torch.manual_seed(0)
    x = torch.randn(2, 3, h, w, dtype=torch.float64)
    # the planner sees the 1-D replacement the strips run (here the gather policy's, whose
    # all-gather is a collective: record_exchange_stats counts the two all-to-alls only)
    inner = DomainGatherModule(_LonPad(), manager=m.strips)
    layer = TileStripRelayout(inner, manager=m)
    (r0, r1), (c0, c1) = tile_rects(h, w, shape)[m.domain_rank]
    tile = x[..., r0:r1, c0:c1].clone().requires_grad_()
    with record_exchange_stats() as stats:
        y = layer(tile)
        y.sum().backward()
    plan = tile_layer_plan("pad", inner, (1, 3, h, w), (1, 3, h, w + 3), shape)
    lat, lon = m.domain_coords
    ref = torch.nn.functional.pad(x, (2, 1, 0, 0)) * 3
    (a0, a1), (b0, b1) = tile_rects(h, w + 3, shape)[m.domain_rank]
    return (
        (y - ref[..., a0:a1, b0:b1]).abs().max().item(),
        (tile.grad - 3).abs().max().item(),
        (stats.by_direction["forward"], stats.by_direction["backward"], stats.messages),
        (
            plan.strips_sent[m.domain_rank] * 2 * 8,
            plan.strips_returned[m.domain_rank] * 2 * 8,
            sum(plan.messages(lat, lon)),
        ),
        plan.sent_elements(lat, lon) * 2 * 8,
    )


@pytest.mark.parametrize("shape", [(2, 2), (1, 3), (3, 2)])
def test_planned_relayout_bytes_and_messages_equal_the_counted(shape):
    for out, grad, counted, planned, step in run_on_ranks(
        _counted_worker, shape[0] * shape[1], shape
    ):
        assert out == 0 and grad == 0
        assert counted == planned and step == planned[0] + planned[1]


def _tokens_worker(rank, world, shape, kind):
    from test_timm_swin import PermutedStage, _randomise
    from test_token_attention import SdpaAttention

    m = TiledDomainManager(world, shape)
    torch.manual_seed(0)
    if kind == "tokens":
        # attention over all H*W tokens (sequence parallel on the strips), 3x3 qkv conv inside

        def build():
            torch.manual_seed(0)
            return nn.Sequential(
                nn.Conv2d(3, 6, 3, padding=1),
                SdpaAttention(6, 2, kernel=3),
                nn.Conv2d(6, 2, 3, padding=1),
            ).double()

        x = torch.randn(2, 3, 7, 6, dtype=torch.float64)
    else:
        # timm's Swin-V2 stage (plain and shifted windows of 2 x 4) between B,C,H,W convs

        def build():
            torch.manual_seed(0)
            return _randomise(PermutedStage(14, 8, 2)).double()

        x = torch.randn(1, 2, 14, 8, dtype=torch.float64)
    errors = domain_parity_errors(build, x, m)
    return errors, _forms(convert_to_domain_parallel(build(), m))


@pytest.mark.parametrize(
    "shape, kind, form",
    [
        ((2, 2), "tokens", "DomainTokenAttention"),
        ((2, 2), "swin", "DomainSwinBlock"),
        ((1, 3), "swin", "DomainSwinBlock"),
    ],
)
def test_token_attention_and_swin_blocks_exact_on_tiles(shape, kind, form):
    for errors, forms in run_on_ranks(_tokens_worker, shape[0] * shape[1], shape, kind):
        _assert_exact(errors, (shape, kind))
        assert {"TileStripRelayout", form} <= set(forms), forms
