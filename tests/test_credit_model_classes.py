"""Every miles-credit 2026.2 model class under domain parallelism: exact, or refused for a reason
that holds for the class (docs/credit.md's table of model classes names the test of each row).

``crossformer-diffusion`` (``CrossFormerDiffusion``): its forward takes the diffusion time ``t``
(one per sample: the time embedding is computed whole on every rank) and the conditioning input
``x_cond`` (a grid field, sharded like ``x``); its padding and its interpolation to the global
image size are the CrossFormer family's.  It casts ``t`` to float32 itself, so it runs in float32
only and is compared at the float32 tolerances (relative 1e-5 output and input gradients, 1e-4
parameter gradients against the largest).  The regional ``wrf`` / ``dscale`` models are refused
by name whatever their ``interp`` and padding.
"""

from __future__ import annotations

import copy

import pytest
import torch

from credit_parallel import (
    convert_to_domain_parallel,
    gather_tensor,
    shard_tensor,
    sync_domain_gradients,
)
from credit_parallel.domain.convert import plan_conversion
from credit_parallel.domain.manager import DomainParallelManager, TiledDomainManager
from credit_parallel.testing import run_on_ranks
from miles_credit import import_credit

EARTH = {"activate": True, "mode": "earth", "pad_lat": [8, 8], "pad_lon": [8, 8]}


def _diffusion(interp=True, padding=None, size=None, patch=1):
    m = import_credit("credit.models.wxformer.crossformer_diffusion")
    extra = {} if padding is None else {"padding_conf": padding}
    net = m.CrossFormerDiffusion(
        image_height=48,
        image_width=32,
        patch_height=patch,
        patch_width=patch,
        frames=1,
        channels=1,
        surface_channels=1,
        input_only_channels=1,
        output_only_channels=0,
        levels=2,
        dim=(4, 8, 16, 32),
        depth=(1, 1, 1, 1),
        dim_head=4,
        global_window_size=(2, 2, 1, 1),
        local_window_size=(2, 2, 1, 1),
        cross_embed_kernel_sizes=((2, 4),) * 4,
        cross_embed_strides=(2, 2, 2, 2),
        use_spectral_norm=True,
        interp=interp,
        diffusion=True,  # the noisy target's channels beside the condition's
        condition=True,
        **extra,
    )
    if size is not None:  # the stored global size the forward interpolates to
        net.image_height, net.image_width = size
    return net


def _relative(a, b):
    return ((a - b).abs().max() / b.abs().max()).item()


def _diffusion_worker(rank, world, shape, kwargs):
    mgr = TiledDomainManager(world, shape) if shape else DomainParallelManager(world, world)
    torch.manual_seed(0)
    ref = _diffusion(**kwargs)
    par = convert_to_domain_parallel(copy.deepcopy(ref), mgr)
    g = torch.Generator().manual_seed(1)
    x = torch.randn(2, 3, 1, 48, 32, generator=g)  # the noisy prognostic + surface channels
    cond = torch.randn(2, 4, 1, 48, 32, generator=g)  # the conditioning input's channels
    t = torch.tensor([3.0, 7.0])
    x_ref, cond_ref = x.clone().requires_grad_(), cond.clone().requires_grad_()
    y = ref(x_ref, t, x_cond=cond_ref)
    weights = torch.randn(y.shape, generator=g)
    (y * weights).sum().backward()
    x_local = shard_tensor(x, -2, mgr).detach().requires_grad_()
    cond_local = shard_tensor(cond, -2, mgr).detach().requires_grad_()
    y_local = par(x_local, t, x_cond=cond_local)
    (y_local * shard_tensor(weights, -2, mgr)).sum().backward()
    sync_domain_gradients(par, mgr, op="sum")
    errors = {
        "output": _relative(gather_tensor(y_local.detach(), -2, mgr), y),
        "x_grad": _relative(gather_tensor(x_local.grad, -2, mgr), x_ref.grad),
        "x_cond_grad": _relative(gather_tensor(cond_local.grad, -2, mgr), cond_ref.grad),
    }
    reference = dict(ref.named_parameters())
    pairs = [(p.grad, reference[n].grad) for n, p in par.named_parameters()]
    assert all((a is None) == (b is None) for a, b in pairs)
    pairs = [(a, b) for a, b in pairs if b is not None]
    largest = max(b.abs().max().item() for _, b in pairs)
    errors["param_grads"] = max((a - b).abs().max().item() for a, b in pairs) / largest
    time_mlp = reference["time_to_emb.0.weight_orig"].grad
    return errors, type(par).__name__, len(pairs), float(time_mlp.abs().max())


@pytest.mark.parametrize(
    "shape, kwargs, wrapper",
    [
        (None, {"size": (37, 29)}, "DomainInterpModel"),
        ((2, 2), {"interp": False, "padding": EARTH}, "DomainPaddedModel"),
    ],
    ids=["domain2_interp", "tiles2x2_earth_padding"],
)
def test_crossformer_diffusion_matches_one_process_with_time_and_condition(shape, kwargs, wrapper):
    world = 4 if shape else 2
    for errors, name, n_grads, time_grad in run_on_ranks(_diffusion_worker, world, shape, kwargs):
        assert name == wrapper and n_grads > 60 and time_grad > 0
        for key, err in errors.items():
            assert err <= (1e-4 if key == "param_grads" else 1e-5), (key, err)


def _wrf(interp):
    m = import_credit("credit.models.swin_wrf")
    inside = {
        "image_height": 16, "patch_height": 2, "image_width": 16, "patch_width": 2, "levels": 2,
        "frames": 1, "frame_patch_size": 1, "channels": 1, "surface_channels": 1,
        "input_only_channels": 0, "output_only_channels": 0, "dim": 8,
    }  # fmt: skip
    outside = {**inside, "image_height": 32, "image_width": 32, "patch_height": 4, "patch_width": 4}
    return m.WRFTransformer(
        inside, outside, num_groups=2, num_heads=2, depth=2, window_size=2, interp=interp,
        use_spectral_norm=False,
    )  # fmt: skip


def _dscale(interp):
    m = import_credit("credit.models.dscale_wrf")
    return m.DscaleTransformer(
        image_height=16, image_width=16, patch_height=2, patch_width=2, total_input_channels=3,
        total_target_channels=3, frames=1, frame_patch_size=1, dim=8, num_groups=2,
        num_heads=2, depth=2, window_size=2, interp=interp, use_spectral_norm=False,
    )  # fmt: skip


@pytest.mark.parametrize("build", [_wrf, _dscale], ids=["wrf", "dscale"])
@pytest.mark.parametrize("interp", [True, False])
def test_regional_models_are_refused_by_name_whatever_their_interp(build, interp):
    """The refusal names the class, the global-grid reshapes and crop, and the regional grid;
    ``interp: false`` (which CREDIT's interpolation adapter would have let through) too."""
    with pytest.raises(ValueError) as refused:
        plan_conversion(build(interp), None)
    message = str(refused.value)
    assert "<root>" in message and "regional" in message and "domain: 1" in message
    assert "patches_resolution" in message and "no periodic longitude" in message


def test_crossformer_diffusion_with_patches_is_refused_by_name():
    with pytest.raises(ValueError, match=r"CrossFormerDiffusion with patch_height .* 2 / 2"):
        plan_conversion(_diffusion(patch=2), None)


def _ensemble(interp):
    ensemble = import_credit("credit.models.wxformer.crossformer_ensemble")
    return ensemble.CrossFormerWithNoise(
        image_height=32, image_width=32, frames=1, channels=1, surface_channels=1,
        input_only_channels=0, levels=2, dim=(2, 4, 8, 16), depth=(1, 1, 1, 1), dim_head=2,
        global_window_size=(2, 2, 1, 1), local_window_size=(2, 2, 1, 1),
        cross_embed_kernel_sizes=((2, 4),) * 4, cross_embed_strides=(2, 2, 2, 2),
        use_spectral_norm=False, interp=interp,
    )  # fmt: skip


def test_crossformer_with_noise_converts_without_interp_and_is_refused_with_it():
    """Its pixel noise is drawn layout-independently (domain/random_draws.py; exactness in
    tests/test_random_draws.py); with ``interp: true`` its interpolation to the global size is
    not one the interpolation adapter knows: refused naming the model and the key."""
    plan = plan_conversion(_ensemble(False), None, errors="record")
    assert not plan.unsafe, plan.unsafe
    with pytest.raises(ValueError, match=r"<root> \(CrossFormerWithNoise\).*model.interp: true"):
        plan_conversion(_ensemble(True), None)


def test_the_graph_model_is_refused_by_its_class_name():
    """``credit.models.graph`` imports torch_geometric (not installed here): the rule is by
    qualified class name, checked on a class of that name."""
    graph = type("GraphResTransfGRU", (torch.nn.Module,), {"__module__": "credit.models.graph"})
    with pytest.raises(ValueError, match=r"<root> \(GraphResTransfGRU\).*graph edges"):
        plan_conversion(graph(), None)


def _debugger_worker(rank, world):
    from credit_parallel.testing import domain_parity_errors

    m = import_credit("credit.models.debugger_model")

    def build():
        return m.DebuggerModel(frames=1, channels=1, levels=2, surface_channels=1,
                               input_only_channels=1, image_height=9, image_width=8).double()  # fmt: skip

    x = torch.randn(2, 4, 1, 9, 8, dtype=torch.float64, generator=torch.Generator().manual_seed(0))
    return domain_parity_errors(build, x, DomainParallelManager(world, world))


def test_the_debugger_model_is_exact_at_domain_2():
    for key, (err, ref) in run_on_ranks(_debugger_worker, 2)[0].items():
        assert err <= 1e-10 and ref > 0, (key, err, ref)
