"""miles-credit's FuXi (``credit.models.fuxi.Fuxi``, the real class, a test dependency imported
through tests/miles_credit.py) under latitude sharding: converted by the default
``convert_to_domain_parallel``, it computes the single-process function — output, input
gradient and every parameter gradient summed over the domain ranks, float64, max abs error
<= 1e-10 — with its state_dict keys unchanged, at domain 2 and 3, even and uneven latent
layouts, with the u-transformer's latitude padding (top and bottom) and with ``interp=True``;
the configurations that cannot be exact are refused at conversion, naming the module."""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
from torch import nn

from credit_parallel import (
    convert_to_domain_parallel,
    get_domain_manager,
    get_raw_model,
    parallelize,
    shard_batch,
    sync_domain_gradients,
)
from credit_parallel.domain.adapters.fuxi import DomainFuxi, fuxi_geometry, pair_layout
from credit_parallel.domain.adapters.stand_ins import tensor_padding_rows, tensor_unpadding_rows
from credit_parallel.domain.adapters.swin import DomainSwinBlock
from credit_parallel.domain.guard import FunctionalCallGuard
from credit_parallel.domain.manager import DomainParallelManager
from credit_parallel.domain.rows import shard_range
from credit_parallel.testing import domain_parity_errors, run_on_ranks
from miles_credit import import_credit

TOL = 1e-10
WIDTH = 32


def fuxi(height: int, window: int = 2, *, spectral: bool = False, interp: bool = False, **extra):
    """A small FuXi (dim 8, depth 2, patch 4 x 4, 2 frames) on a ``height`` x 32 grid, float64,
    every parameter moved off its init.  Moving them matters for the padded rows: they enter
    the first Swin block as zero tokens, whose query is then ``q_bias`` — zero at init — and
    F.normalize of a zero vector has the gradient 1/eps = 1e12 (q_bias's gradient is ~1e12
    on one process too, its own rounding ~1e-3).  The model is built with float64 as the
    default dtype: with spectral norm, timm's attention reads the ``qkv.weight`` spectral norm
    set at construction (it calls F.linear, not the module), which ``.double()`` leaves
    float32."""
    torch.manual_seed(0)
    module = import_credit("credit.models.fuxi")
    previous = torch.get_default_dtype()
    torch.set_default_dtype(torch.float64)
    try:
        net = module.Fuxi(
            image_height=height,
            patch_height=4,
            image_width=WIDTH,
            patch_width=4,
            levels=1,
            frames=2,
            frame_patch_size=2,
            dim=8,
            num_groups=2,
            channels=1,
            surface_channels=1,
            num_heads=2,
            depth=2,
            window_size=window,
            use_spectral_norm=spectral,
            interp=interp,
            **extra,
        )
    finally:
        torch.set_default_dtype(previous)
    net = net.double()
    with torch.no_grad():
        for p in net.parameters():
            p.add_(0.2 * torch.randn_like(p))
    return net


def _parity(rank, world, height, window, spectral, interp, padding_conf):
    torch.manual_seed(1)  # the same global input on every rank
    x = torch.randn(1, 2, 2, height, WIDTH, dtype=torch.float64)
    manager = DomainParallelManager(world, world)
    extra = {"spectral": spectral, "padding_conf": padding_conf}
    errors = domain_parity_errors(lambda: fuxi(height, window, interp=interp, **extra), x, manager)
    keys = sorted(fuxi(height, window, **extra).state_dict())
    converted = convert_to_domain_parallel(fuxi(height, window, **extra), manager)
    kinds = {type(converted).__name__} | {
        type(m).__name__ for m in converted.modules() if isinstance(m, DomainSwinBlock)
    }
    return errors, keys == sorted(converted.state_dict()), kinds


def assert_fuxi_exact(world, height, window=2, *, spectral=False, interp=False, padding=None):
    for errors, same_keys, kinds in run_on_ranks(
        _parity, world, height, window, spectral, interp, padding, timeout=60
    ):
        bad = {k: e for k, (e, _) in errors.items() if e > TOL}
        assert not bad, bad
        assert "input_grad" in errors and sum(k.startswith("param:") for k in errors) >= 40
        assert same_keys
        assert kinds == {"DomainFuxi", "DomainSwinBlock"}


# h=32: 8 latent rows, 4 after the down block, no latitude padding; at domain 3 the latent
# shards are 3/3/2 and the u-transformer's output 3/3/2 rows: re-laid out as whole pairs 4/2/2
@pytest.mark.parametrize("domain", [2, 3])
def test_fuxi_h32_window2_exact(domain):
    assert_fuxi_exact(domain, 32)


# h=40: 5 rows after the down block; window 2 pads one row at the bottom (the case that hung:
# every rank cropped its own last row), window 4 pads one at the top and two at the bottom
@pytest.mark.parametrize("domain,window", [(2, 2), (3, 2), (2, 4), (3, 4)])
def test_fuxi_h40_latitude_padding_cropped_at_the_poles_exact(domain, window):
    assert_fuxi_exact(domain, 40, window)


def test_fuxi_h48_domain3_even_latent_shards_exact():
    assert_fuxi_exact(3, 48)


def test_fuxi_h16_domain3_rank_without_latent_rows_exact():
    # 4 latent rows, 2 after the down block: the third rank holds none there
    assert_fuxi_exact(3, 16)


def test_fuxi_default_spectral_norm_h32_domain3_exact():
    assert_fuxi_exact(3, 32, spectral=True)


def test_fuxi_interp_h44_output_48_rows_resampled_to_44_domain3_exact():
    # 11 latent rows -> 6 -> 12 -> 48 output rows; F.interpolate back to 44 (window 4 pads the
    # 6 rows to 8: one at each pole)
    assert_fuxi_exact(3, 44, 4, spectral=True, interp=True)


def test_fuxi_interp_same_size_h32_domain2_exact():
    assert_fuxi_exact(2, 32, interp=True)


# padding_conf: CREDIT's TensorPadding pads the input (32 -> 40 rows, 32 -> 40 columns) in
# FuXi's forward and crops the output back; "earth" fills the rows beyond each pole with the
# rows next to it flipped and rolled by half the width, "mirror" reflects
@pytest.mark.parametrize("domain,mode", [(3, "earth"), (2, "mirror")])
def test_fuxi_padding_conf_h32_padded_to_40_exact(domain, mode):
    conf = {"activate": True, "mode": mode, "pad_lat": [4, 4], "pad_lon": [4, 4]}
    assert_fuxi_exact(domain, 32, padding=conf)


def test_fuxi_earth_padding_3_above_5_below_window4_spectral_interp_domain3_exact():
    conf = {"activate": True, "mode": "earth", "pad_lat": [3, 5], "pad_lon": [0, 0]}
    assert_fuxi_exact(3, 32, 4, spectral=True, interp=True, padding=conf)


# ---------------------------------------------------------------------------- pure geometry
def test_fuxi_geometry_h40_window4_rows_after_each_stage():
    net = fuxi(40, 4)
    g = fuxi_geometry(net, 40)
    assert (g.latent, g.down, g.padded, g.up, g.out) == (10, 5, 8, 10, 40)
    assert net.u_transformer.padding[2:] == (1, 2)
    # the balanced share of the 5 unpadded rows, inside the padded grid (one row above)
    assert g.crop_windows(1, 3) == ((1, 2), (3, 4), (5,))


def test_pair_layout_10_rows_3_ranks_whole_pairs_and_output_rows():
    assert pair_layout(10, 3) == ((0, 1, 2, 3), (4, 5, 6, 7), (8, 9))
    assert pair_layout(4, 3, 4) == (tuple(range(8)), tuple(range(8, 16)), ())


@pytest.mark.parametrize(
    "mode,top,bottom", [("earth", 3, 5), ("earth", 2, 0), ("mirror", 4, 4), ("earth", 0, 0)]
)
def test_tensor_padding_rows_match_credit_tensor_padding(mode, top, bottom):
    """The row maps against the real class on a grid whose values name their row and column:
    pad, then unpad of the padded grid (its rows renumbered)."""
    padder = import_credit("credit.boundary_padding").TensorPadding(
        mode=mode, pad_lat=[top, bottom], pad_lon=[0, 0]
    )
    height, width = 7, 6
    grid = (100 * torch.arange(height)[:, None] + torch.arange(width)).double()
    padded = padder.pad(grid.expand(1, 1, 1, height, width))[0, 0, 0]
    sources, rolled = tensor_padding_rows(mode, height, top, bottom)
    expected = grid[list(sources)]
    flags = torch.tensor(rolled)[:, None]
    assert torch.equal(padded, torch.where(flags, expected.roll(width // 2, -1), expected))
    numbered = torch.arange(len(sources)).double()[:, None].expand(-1, width)
    kept = padder.unpad(numbered.expand(1, 1, 1, -1, -1))[0, 0, 0][:, 0]
    assert kept.tolist() == list(tensor_unpadding_rows(mode, len(sources), top, bottom))


def test_fuxi_geometry_other_height_than_built_for_raises():
    with pytest.raises(ValueError, match="gives 9 latent rows but the model was built for 8"):
        fuxi_geometry(fuxi(32), 36)


# ---------------------------------------------------------------------------- refusals
def _convert(rank, world, build, shard_dim=-2):
    manager = DomainParallelManager(world, world)
    try:
        convert_to_domain_parallel(build(), manager, shard_dim=shard_dim)
    except ValueError as err:
        return str(err)
    return None


def _refusal(build, shard_dim=-2) -> str:
    messages = run_on_ranks(_convert, 2, build, shard_dim, timeout=60)
    assert messages[0] is not None and len(set(messages)) == 1
    return messages[0]


def _unknown_padding_mode_fuxi():
    conf = {"activate": True, "mode": "zeros", "pad_lat": [4, 4], "pad_lon": [4, 4]}
    return fuxi(32, padding_conf=conf)


def test_fuxi_padding_conf_unknown_mode_refused_at_conversion_naming_the_model():
    message = _refusal(_unknown_padding_mode_fuxi)
    assert "<root> (Fuxi)" in message and "padding_conf.mode 'zeros'" in message


def _post_block_fuxi():
    net = fuxi(32)
    net.use_post_block = True  # what post_conf={"activate": True, ...} sets
    return net


def test_fuxi_post_block_refused_at_conversion_naming_the_model():
    message = _refusal(_post_block_fuxi)
    assert "<root> (Fuxi)" in message and "post_conf.activate" in message


class GlobalMeanRemoval(nn.Module):
    """A post block standing in for CREDIT's (whose fixers sum over the globe): takes FuXi's
    {"y_pred", "x"} and removes the global mean of every output field."""

    def forward(self, d):
        return d["y_pred"] - d["y_pred"].mean(dim=(-2, -1), keepdim=True)


def _post_block_fuxi_runnable():
    net = _post_block_fuxi()
    net.postblock = GlobalMeanRemoval()
    return net


def _gather_parity(rank, world):
    torch.manual_seed(1)
    x = torch.randn(1, 2, 2, 32, WIDTH, dtype=torch.float64)
    manager = DomainParallelManager(world, world)

    def convert(model, mgr):
        with pytest.warns(UserWarning, match=r"<root> \(Fuxi: post_conf.activate"):
            return convert_to_domain_parallel(model, mgr, nonlocal_policy="gather")

    errors = domain_parity_errors(_post_block_fuxi_runnable, x, manager, convert=convert)
    converted = convert(_post_block_fuxi_runnable(), manager)
    return errors, type(converted).__name__


def test_fuxi_post_block_with_gather_policy_runs_on_the_globe_exact():
    for errors, kind in run_on_ranks(_gather_parity, 3, timeout=60):
        assert kind == "DomainGatherModule"
        assert max(e for e, _ in errors.values()) <= TOL and "input_grad" in errors


class Holder(nn.Module):
    def __init__(self):
        super().__init__()
        self.model = fuxi(32)
        # what use_noise=True sets (miles-credit 2026.2.0 cannot build its noise layer:
        # StochasticDecompositionLayer takes no ``scheduler``)
        self.model.u_transformer.use_noise = True


def test_fuxi_use_noise_refused_at_conversion_naming_its_path():
    message = _refusal(Holder)
    assert "model (Fuxi)" in message and "use_noise" in message


def test_fuxi_shard_dim_other_than_latitude_refused():
    message = _refusal(lambda: fuxi(32), shard_dim=-1)
    assert "<root> (Fuxi)" in message and "shard_dim -2" in message


def _forward_other_height(rank, world):
    manager = DomainParallelManager(world, world)
    net = convert_to_domain_parallel(fuxi(32), manager)
    a, b = shard_range(36, world, rank)
    try:
        net(torch.randn(1, 2, 2, b - a, WIDTH, dtype=torch.float64))
    except ValueError as err:
        return str(err)
    return None


def test_fuxi_input_height_other_than_built_for_raises_on_every_rank_no_hang():
    messages = run_on_ranks(_forward_other_height, 2, timeout=60)
    assert all(m is not None and "<root> (Fuxi)" in m and "9 latent rows" in m for m in messages)


# ---------------------------------------------------------------------------- guard
def _guarded_forward(rank, world):
    manager = DomainParallelManager(world, world)
    net = convert_to_domain_parallel(fuxi(44, 4, interp=True), manager)
    assert isinstance(net, DomainFuxi)
    a, b = shard_range(44, world, rank)
    x = torch.randn(1, 2, 2, 44, WIDTH, dtype=torch.float64)[..., a:b, :].clone()
    with FunctionalCallGuard(net) as guard:
        guard.mark(x)
        y = net(x)
    return [str(f) for f in guard.findings], tuple(y.shape)


def test_converted_fuxi_functional_calls_pass_the_guard():
    for findings, shape in run_on_ranks(_guarded_forward, 2, timeout=60):
        assert findings == []
        assert shape == (1, 2, 1, 22, WIDTH)


# ---------------------------------------------------------------------------- restoring
def _grid_state(net) -> tuple:
    ut = net.u_transformer
    return (
        list(net.cube_embedding.patches_resolution),
        tuple(net.input_resolution),
        tuple(ut.padding),
        net.use_interp,
        len(ut._forward_hooks) + len(ut.layer._forward_hooks),
    )


def _forward_then_failing_forward(rank, world):
    manager = DomainParallelManager(world, world)
    net = convert_to_domain_parallel(fuxi(40, 4, interp=True), manager)
    before = _grid_state(net.wrapped)
    a, b = shard_range(40, world, rank)
    net(torch.randn(1, 2, 2, b - a, WIDTH, dtype=torch.float64))
    after_forward = _grid_state(net.wrapped)
    # 3 input channels for a model of 2: fails inside FuXi's forward (its Conv3d), every rank
    with pytest.raises(RuntimeError, match="channels"):
        net(torch.randn(1, 3, 2, b - a, WIDTH, dtype=torch.float64))
    return before, after_forward, _grid_state(net.wrapped)


def test_fuxi_global_grid_attributes_and_hooks_restored_after_forward_and_error():
    for before, after_forward, after_error in run_on_ranks(
        _forward_then_failing_forward, 2, timeout=60
    ):
        assert before == ([1, 10, 8], (5, 4), (0, 0, 1, 2), True, 0)
        assert after_forward == before and after_error == before


# ---------------------------------------------------------------------------- with FSDP2
STEPS = 2


def _fuxi_batch(height: int):
    g = torch.Generator().manual_seed(3)
    x = torch.randn(2, 2, 2, height, WIDTH, generator=g, dtype=torch.float64)
    return x, torch.randn(2, 2, 1, height, WIDTH, generator=g, dtype=torch.float64)


def _fuxi_reference(height: int, window: int):
    model = fuxi(height, window)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    x, y = _fuxi_batch(height)
    losses = []
    for _ in range(STEPS):
        opt.zero_grad()
        loss = ((model(x) - y) ** 2).mean()
        loss.backward()
        opt.step()
        losses.append(float(loss.detach()))
    return losses, {n: p.detach() for n, p in model.named_parameters()}


def _fuxi_fsdp2_worker(rank, world, height, window):
    torch.set_default_dtype(torch.float64)
    conf = {"trainer": {"parallelism": {"data": "fsdp2", "tensor": 1, "domain": world}}}
    model = parallelize(fuxi(height, window), conf)
    manager = get_domain_manager(model)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    x, y = _fuxi_batch(height)
    local = shard_batch({"x": x, "y": y}, manager=manager)
    losses = []
    for _ in range(STEPS):
        opt.zero_grad()
        loss = ((model(local["x"]) - local["y"]) ** 2).sum() / y.numel()
        loss.backward()
        sync_domain_gradients(model, manager, op="sum")
        opt.step()
        total = loss.detach().clone()
        dist.all_reduce(total, group=manager.domain_group)
        losses.append(float(total))
    raw = get_raw_model(model)
    assert isinstance(raw, DomainFuxi)
    return losses, {n: p.detach().full_tensor() for n, p in raw.named_parameters()}


def test_fuxi_parallelize_fsdp2_domain3_h40_window4_trains_like_single_process():
    ref_losses, ref_params = _fuxi_reference(40, 4)
    for losses, params in run_on_ranks(_fuxi_fsdp2_worker, 3, 40, 4, timeout=120):
        assert max(abs(a - b) for a, b in zip(losses, ref_losses)) <= TOL
        assert params.keys() == ref_params.keys()
        assert max(float((params[n] - p).abs().max()) for n, p in ref_params.items()) <= TOL


# ---------------------------------------------------------------------------- the plan
def test_planner_reads_the_converters_plan_fuxi_adapter_included():
    from credit_parallel.planner.trace import conversion_plan, plan_targets

    plan = conversion_plan(fuxi(32))  # the converter's own decisions, manager None
    first = plan.modules[0]
    assert (first.path, first.stage, type(first.replacement)) == ("<root>", "adapter", DomainFuxi)
    swin = [m.path for m in plan.modules if isinstance(m.replacement, DomainSwinBlock)]
    assert swin == ["u_transformer.layer.blocks.0", "u_transformer.layer.blocks.1"]
    # the adapter is no layer of its own: its layers are traced one by one
    assert [t[0] for t in plan_targets(plan)] == [m.path for m in plan.modules[1:]]
    refused = conversion_plan(_post_block_fuxi()).errors
    assert [m.path for m in refused] == ["<root>"] and "post_conf.activate" in str(refused[0])
