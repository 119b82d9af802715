"""The CREDIT drop-in gaps of issue 27, against miles-credit 2026.2's own classes and config:
``unpad_shard_interp`` with CREDIT's ``TensorPadding``, tensor parallelism on a CrossFormer built
with its default spectral norm, and ``plan`` on CREDIT's 0.25-degree example config (the model
block prepared by CREDIT's own parser).  (``halo_width`` before a forward against CREDIT's conv
classes: tests/test_halo_views.py.)"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from credit_examples import wxformer_era5_025deg
from credit_parallel import DomainParallelManager, gather_tensor, shard_tensor, unpad_shard_interp
from credit_parallel.testing import assert_parity, domain_parity_errors, run_on_ranks
from miles_credit import import_credit


# --------------------------------------------------------------------------- TensorPadding
def _tensor_padding(pad_lat, pad_lon, mode="earth"):
    return import_credit("credit.boundary_padding").TensorPadding(
        mode=mode, pad_lat=pad_lat, pad_lon=pad_lon
    )


class _UnpadWithCreditPadding(nn.Module):
    """Reference (manager None): CREDIT's own ``TensorPadding.unpad`` of the global tensor, then
    a bilinear resize of every (H, W) plane; the domain copy calls ``unpad_shard_interp`` with the
    same ``TensorPadding`` on its shard."""

    def __init__(self, padding, image_h, image_w):
        super().__init__()
        self.padding, self.image_h, self.image_w, self.manager = padding, image_h, image_w, None

    def forward(self, y):
        if self.manager is not None:
            return unpad_shard_interp(y, self.padding, self.manager, self.image_h, self.image_w)
        y = self.padding.unpad(y)
        if tuple(y.shape[-2:]) != (self.image_h, self.image_w):
            lead = y.shape[:-2]
            y = F.interpolate(
                y.reshape(lead[0], -1, *y.shape[-2:]),
                size=(self.image_h, self.image_w),
                mode="bilinear",
            )
            y = y.reshape(*lead, self.image_h, self.image_w)
        return y


def _set_manager(module, mgr):
    module.manager = mgr
    return module


class _Pads:  # any object with pad_NS / pad_WE
    pad_NS, pad_WE = [2, 3], [1, 2]


def _tensor_padding_worker(rank, world):
    torch.set_default_dtype(torch.float64)
    mgr = DomainParallelManager(world, world)
    gen = torch.Generator().manual_seed(5)
    errors, equal = {}, []
    cases = [
        # (padding, y shape (padded), image_h, image_w): 4-D and CREDIT's 5-D (B, C, T, H, W)
        (_tensor_padding((2, 3), (1, 2)), (2, 3, 18, 12), 13, 9),  # strip only, uneven 13
        (_tensor_padding([1, 1], [2, 2], "mirror"), (1, 2, 1, 15, 10), 13, 6),  # 5-D, strip only
        (_tensor_padding((3, 2), (0, 0)), (1, 2, 2, 19, 8), 11, 10),  # 5-D, strip + resize
        (_tensor_padding((0, 0), (2, 2)), (2, 2, 14, 12), 14, 8),  # longitude only
    ]
    for i, (pad, shape, ih, iw) in enumerate(cases):
        y = torch.randn(*shape, generator=gen)
        errs = domain_parity_errors(
            lambda pad=pad, ih=ih, iw=iw: _UnpadWithCreditPadding(pad, ih, iw),
            y,
            mgr,
            convert=_set_manager,
        )
        errors.update({f"case{i}/{k}": v for k, v in errs.items()})
        # the same result as the dict form, bitwise, and the gathered result has CREDIT's shape
        mgr.begin_forward(("tp-pad", i))
        local = shard_tensor(y, -2, mgr)
        via_object = unpad_shard_interp(local, pad, mgr, ih, iw)
        as_dict = {"pad_lat": tuple(pad.pad_NS), "pad_lon": tuple(pad.pad_WE)}
        via_dict = unpad_shard_interp(local, as_dict, mgr, ih, iw)
        full = gather_tensor(via_object, -2, mgr)
        equal.append((torch.equal(via_object, via_dict), tuple(full.shape)))
    mgr.begin_forward(("tp-pad", "plain"))
    y = torch.randn(1, 2, 17, 11, generator=gen)
    local = unpad_shard_interp(shard_tensor(y, -2, mgr), _Pads(), mgr, 12, 8)
    plain = torch.equal(local, shard_tensor(y[..., 2:14, 1:9], -2, mgr, register=False))
    return errors, equal, plain


@pytest.mark.parametrize("world", [2, 3])
def test_unpad_shard_interp_takes_credits_tensor_padding(world):
    for errors, equal, plain in run_on_ranks(_tensor_padding_worker, world):
        assert len(errors) >= 8
        assert_parity(errors, torch.float64)
        assert equal == [
            (True, (2, 3, 13, 9)),
            (True, (1, 2, 1, 13, 6)),
            (True, (1, 2, 2, 11, 10)),
            (True, (2, 2, 14, 8)),
        ]
        assert plain


def test_unpad_shard_interp_one_process_tensor_padding_is_credits_unpad():
    pad = _tensor_padding((2, 1), (3, 3))
    y = torch.randn(1, 4, 1, 12, 20, dtype=torch.float64)
    assert torch.equal(unpad_shard_interp(y, pad, None, 9, 14), pad.unpad(y))


def test_unpad_shard_interp_names_what_it_accepts():
    with pytest.raises(ValueError, match="pad_NS/pad_WE"):
        unpad_shard_interp(torch.zeros(1, 1, 4, 4), object(), None, 4, 4)
    bad = _tensor_padding((1, -1), (0, 0))
    with pytest.raises(ValueError, match="pad_NS"):
        unpad_shard_interp(torch.zeros(1, 1, 4, 4), bad, None, 4, 4)


# --------------------------------------------------------------------------- spectral norm x tp
def _spectral_crossformer():
    """miles-credit's CrossFormer U-Net of the wxformer_next family (``nextgen_wxformer``: the
    CrossFormer blocks with Linear projections that declare ``_tp_plan``), small, with its default
    ``use_spectral_norm=True``: the hook form on every Linear / Conv2d of its encoder, bottleneck
    and decoder, the tp-split projections included."""
    m = import_credit("credit.models.wxformer.wxformer_next")
    torch.manual_seed(0)
    net = m.NextGenWXFormer(
        image_height=32,
        image_width=32,
        frames=1,
        channels=1,
        surface_channels=1,
        input_only_channels=0,
        output_only_channels=0,
        levels=2,
        dim=(8, 16, 32, 64),
        depth=(1, 1, 1, 1),
        dim_head=4,
        global_window_size=(2, 1, 1, 1),
        local_window_size=2,
        cross_embed_kernel_sizes=((2, 4),) * 4,
        cross_embed_strides=(2, 2, 2, 2),
        col_attn_heads=1,
        num_spectral_nodes=4,
    )
    assert net.use_spectral_norm
    return net.double()


def _spectral_buffers(model):
    return {n: b.clone() for n, b in model.named_buffers() if n.endswith(("weight_u", "weight_v"))}


def _spectral_tp_worker(rank, world):
    import copy

    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import DTensor

    from credit_parallel import apply_native_tensor_parallel

    tp_mesh = init_device_mesh("cpu", (world,), mesh_dim_names=("tp",))
    model = _spectral_crossformer()
    reference = copy.deepcopy(model)
    initial = _spectral_buffers(model)
    keys = list(model.state_dict())
    apply_native_tensor_parallel(model, tp_mesh)  # CREDIT's name, as its trainer calls it
    split = sorted(n for n, p in model.named_parameters() if isinstance(p, DTensor))
    gen = torch.Generator().manual_seed(3)
    errors = {}
    for step in range(2):  # training mode: the power iteration updates u / v in both forwards
        x = torch.randn(1, 3, 1, 32, 32, generator=gen, dtype=torch.float64)
        xr, xp = x.clone().requires_grad_(), x.clone().requires_grad_()
        out_ref, out = reference(xr), model(xp)
        g = torch.randn(out_ref.shape, generator=gen, dtype=torch.float64)
        out_ref.backward(g)
        out.backward(g)
        errors[f"{step}/output"] = (out - out_ref).abs().max().item()
        errors[f"{step}/input_grad"] = (xp.grad - xr.grad).abs().max().item()
    ref_params = dict(reference.named_parameters())
    for name, p in model.named_parameters():
        grad, ref = p.grad, ref_params[name].grad
        if grad is None or ref is None:  # unused by this forward (both sides alike)
            errors[f"grad:{name}"] = 0.0 if grad is ref else float("inf")
            continue
        grad = grad.full_tensor() if isinstance(grad, DTensor) else grad
        errors[f"grad:{name}"] = (grad - ref).abs().max().item()
    trained, ref_buffers = _spectral_buffers(model), _spectral_buffers(reference)
    for name, b in trained.items():
        errors[f"buffer:{name}"] = (b - ref_buffers[name]).abs().max().item()
    moved = max((b - initial[n]).abs().max().item() for n, b in trained.items())
    # eval mode: no power iteration, the same sigma from the trained u / v
    model.eval()
    reference.eval()
    with torch.no_grad():
        x = torch.randn(1, 3, 1, 32, 32, generator=gen, dtype=torch.float64)
        errors["eval/output"] = (model(x) - reference(x)).abs().max().item()
    after_eval = _spectral_buffers(model)
    still = max((b - trained[n]).abs().max().item() for n, b in after_eval.items())
    return errors, split, list(model.state_dict()) == keys, moved, still


def test_credit_crossformer_with_spectral_norm_under_tp2_matches_one_process():
    """Exact, not replicated: the norm of each whole weight from its tp shards, the power
    iteration as in one process (forward, input and every parameter gradient, u / v, in training
    and eval mode)."""
    for errors, split, same_keys, moved, still in run_on_ranks(_spectral_tp_worker, 2):
        # every attention / feed-forward projection is split (weight_orig as a DTensor)
        for name in ("to_q", "to_k", "to_v", "to_out", "layers.1", "layers.4"):
            assert len([n for n in split if n.endswith(f".{name}.weight_orig")]) == 8, split
        assert same_keys
        assert len(errors) > 100
        bad = {k: v for k, v in errors.items() if not v <= 1e-10}
        assert not bad, bad
        assert moved > 1e-6 and still == 0.0  # training mode updates u / v, eval mode does not


class _FusedSpectralBlock(nn.Module):
    """A fused q|k|v column Linear, a column 1x1 conv and a row Linear, spectral-normed."""

    _tp_col = ["qkv", "conv"]
    _tp_row = "out"
    _tp_fused = {"qkv": 3}

    def __init__(self, form):
        super().__init__()
        sn = _SPECTRAL_FORMS[form]
        self.qkv = sn(nn.Linear(6, 12))
        self.conv = sn(nn.Conv2d(6, 4, 1))
        self.out = sn(nn.Linear(4, 6, bias=True))

    def forward(self, x):  # x: (B, 6, H, W)
        q, k, v = self.qkv(x.movedim(1, -1)).chunk(3, dim=-1)
        h = q * k + v + self.conv(x).movedim(1, -1)
        return self.out(torch.tanh(h)).movedim(-1, 1)


_SPECTRAL_FORMS = {
    "hook": torch.nn.utils.spectral_norm,
    "parametrize": torch.nn.utils.parametrizations.spectral_norm,
}


def _vectors(model):
    return {n: b.clone() for n, b in model.named_buffers() if n.endswith(("_u", "_v"))}


def _grads_and_vectors(model, reference, DTensor):
    errors = {}
    ref_params = dict(reference.named_parameters())
    for name, p in model.named_parameters():
        grad = p.grad.full_tensor() if isinstance(p.grad, DTensor) else p.grad
        errors[f"grad:{name}"] = (grad - ref_params[name].grad).abs().max().item()
    ref_vectors = _vectors(reference)
    for name, b in _vectors(model).items():
        errors[f"vector:{name}"] = (b - ref_vectors[name]).abs().max().item()
    return errors


def _spectral_forms_worker(rank, world, form):
    import copy

    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import DTensor

    from credit_parallel import TpColLinear, TpRowLinear, apply_tensor_parallel

    torch.set_default_dtype(torch.float64)
    tp_mesh = init_device_mesh("cpu", (world,), mesh_dim_names=("tp",))
    torch.manual_seed(1)
    model = _FusedSpectralBlock(form)
    reference, keys = copy.deepcopy(model), list(model.state_dict())
    apply_tensor_parallel(model, tp_mesh)
    gen = torch.Generator().manual_seed(4)
    errors = {}
    for step in range(3):
        x = torch.randn(2, 6, 3, 5, generator=gen)
        xr, xp = x.clone().requires_grad_(), x.clone().requires_grad_()
        out_ref, out = reference(xr), model(xp)
        g = torch.randn(out_ref.shape, generator=gen)
        out_ref.backward(g)
        out.backward(g)
        errors[f"{step}/output"] = (out - out_ref).abs().max().item()
        errors[f"{step}/input_grad"] = (xp.grad - xr.grad).abs().max().item()
    errors.update(_grads_and_vectors(model, reference, DTensor))
    # the normalised weight exists only inside the forward (no stale or crashing .weight)
    same_keys = list(model.state_dict()) == keys and not any(
        hasattr(layer, "weight") for layer in (model.qkv, model.conv, model.out)
    )
    # CREDIT's TpColLinear / TpRowLinear built from (layer, tp_group), a separate module each
    torch.manual_seed(2)
    first, second = _SPECTRAL_FORMS[form](nn.Linear(5, 8)), _SPECTRAL_FORMS[form](nn.Linear(8, 3))
    ref_pair = nn.Sequential(copy.deepcopy(first), copy.deepcopy(second))
    group = tp_mesh.get_group()
    pair = nn.Sequential(TpColLinear(first, group), TpRowLinear(second, group))
    for step in range(2):
        x = torch.randn(4, 5, generator=gen)
        xr, xp = x.clone().requires_grad_(), x.clone().requires_grad_()
        out_ref, out = ref_pair(xr), pair(xp)
        out_ref.sum().backward()
        out.sum().backward()
        errors[f"tp_modules/{step}/output"] = (out - out_ref).abs().max().item()
        errors[f"tp_modules/{step}/input_grad"] = (xp.grad - xr.grad).abs().max().item()
    errors.update(
        {f"tp_modules/{k}": v for k, v in _grads_and_vectors(pair, ref_pair, DTensor).items()}
    )
    return errors, same_keys, sorted(pair.state_dict()) == sorted(ref_pair.state_dict())


@pytest.mark.parametrize("form", ["hook", "parametrize"])
@pytest.mark.parametrize("world", [2])
def test_both_spectral_norm_forms_under_tp_are_exact(form, world):
    """torch's hook form (CREDIT's) and parametrize form on a fused q|k|v Linear, a 1x1 conv and a
    row Linear under apply_tensor_parallel, and on CREDIT's TpColLinear / TpRowLinear: forward,
    input and parameter gradients and u / v after three training steps as in one process."""
    for errors, same_keys, same_tp_keys in run_on_ranks(_spectral_forms_worker, world, form):
        assert same_keys and same_tp_keys
        n_vectors = len([k for k in errors if "vector:" in k])
        assert n_vectors == 10, errors  # u and v of the 3 + 2 spectral-normed layers
        bad = {k: v for k, v in errors.items() if not v <= 1e-10}
        assert not bad, bad


# --------------------------------------------------------------------------- CREDIT's example config
def _era5_025deg_conf():
    """miles-credit's ``config/gen_2/examples/wxformer_era5_025deg_6hr.yml`` as written
    (``tests/credit_examples.py``; ``credit-parallel plan`` reads its model block and
    ``trainer.parallelism``: the 0.25-degree CrossFormer with earth padding, interpolation,
    spectral norm and its active tracer-fixer post block), shrunk in width and depth only (the
    721 x 1440 grid, the cross-embed kernels and windows are the example's), at fsdp2 x domain 8."""
    conf = wxformer_era5_025deg()
    conf["trainer"]["parallelism"] = {"data": "fsdp2", "tensor": 1, "domain": 8}
    conf["model"].update(
        dim=[32, 64, 128, 256],  # the example: [128, 256, 512, 1024]
        depth=[1, 1, 2, 1],  # the example: [2, 2, 8, 2]
    )
    return conf


def test_credit_025deg_example_config_with_its_post_block_plans_on_32_ranks():
    from credit_parallel.planner import format_plan, make_plan

    crossformer = import_credit("credit.models.crossformer")
    conf = _era5_025deg_conf()
    # what stopped `plan` before: miles-credit's loader on the block as written
    load_model = import_credit("credit.models").load_model
    with pytest.raises(KeyError, match="tracer_inds"):
        load_model({"model": conf["model"]})
    with pytest.warns(UserWarning, match=r"model\.post_conf \(active\).*train_gen2"):
        plan = make_plan(conf, 32)
    # its interpolation to the global size and its earth padding, as written, are exact at
    # domain 8 (credit_interp.DomainInterpModel, tensor_padding's stand-in): it plans
    assert plan.model_class == "CrossFormer" and not plan.violations, plan.violations
    # interpolation off, the earth padding as written: it plans
    conf["model"].update(interp=False)
    with pytest.warns(UserWarning, match=r"model\.post_conf \(active\).*train_gen2"):
        plan = make_plan(conf, 32)
    assert plan.model_class == "CrossFormer" and not plan.violations, plan.violations
    # with both off (windows that tile the unpadded stages 360 / 180 / 90 / 45), it plans
    conf["model"].update(interp=False, padding_conf={"activate": False})
    conf["model"].update(global_window_size=[5, 5, 5, 1], local_window_size=5)
    with pytest.warns(UserWarning, match=r"model\.post_conf \(active\).*train_gen2"):
        plan = make_plan(conf, 32)
    assert plan.model_class == "CrossFormer" and not plan.violations, plan.violations
    assert (plan.dp, plan.tp, plan.domain) == (4, 1, 8)
    # the model CREDIT's gen-2 trainer builds: its loader on the block without post_conf
    block = {k: v for k, v in conf["model"].items() if k != "post_conf"}
    torch.manual_seed(0)
    theirs = load_model({"model": block})
    assert isinstance(theirs, crossformer.CrossFormer)
    assert plan.parameter_count == sum(p.numel() for p in theirs.parameters())
    assert plan.input_shapes == ((60, 721, 1440),)  # 4 x 13 + 4 + 4 input channels
    # 721 rows over 8 domain ranks, then the stages' heights
    assert dict(plan.levels)[721] == (91, 90, 90, 90, 90, 90, 90, 90)
    text = format_plan(plan)
    assert "world size 32" in text and "[0:91) of 721" in text and "0 violated" in text


def test_credit_block_with_post_conf_builds_the_model_credits_gen2_trainer_trains():
    """``verify`` and ``train`` build the model through the same ``build_model``: with the post
    block in the config the model is the one without it (same keys, same function)."""
    from credit_parallel.models import build_model

    import_credit("credit.models.crossformer")
    block = {
        "type": "crossformer",
        "image_height": 32,
        "image_width": 64,
        "frames": 1,
        "channels": 3,
        "surface_channels": 2,
        "input_only_channels": 0,
        "output_only_channels": 0,
        "levels": 2,
        "dim": [4, 8, 16, 32],
        "depth": [1, 1, 1, 1],
        "dim_head": 4,
        "global_window_size": [2, 2, 2, 1],
        "local_window_size": 2,
        "cross_embed_kernel_sizes": [[2, 4], [2, 4], [2, 4], [2, 4]],
        "cross_embed_strides": [2, 2, 2, 2],
        "interp": False,
    }
    post = {"activate": True, "tracer_fixer": {"activate": True, "tracer_name": ["Q"]}}
    torch.manual_seed(0)
    with pytest.warns(UserWarning, match="post_conf"):
        with_post = build_model({**block, "post_conf": post}).double()
    torch.manual_seed(0)
    plain = build_model(dict(block)).double()
    assert list(with_post.state_dict()) == list(plain.state_dict())
    assert not with_post.use_post_block
    x = torch.randn(1, 8, 32, 64, dtype=torch.float64)
    assert torch.equal(with_post(x), plain(x))


def _spectral_fsdp2_worker(rank, world, form):
    import copy

    from torch.distributed.fsdp import fully_shard
    from torch.distributed.tensor import DTensor

    from credit_parallel import apply_tensor_parallel, build_device_mesh

    torch.set_default_dtype(torch.float64)
    _, sub = build_device_mesh({"data": "fsdp2", "tensor": 2, "domain": 1}, device="cpu")
    torch.manual_seed(1)
    model = _FusedSpectralBlock(form)
    reference = copy.deepcopy(model)
    initial = _vectors(reference)
    apply_tensor_parallel(model, sub["tp"])
    fully_shard(model, mesh=sub["dp"])

    def batch(dp_rank):
        gen = torch.Generator().manual_seed(300 + dp_rank)
        return torch.randn(2, 6, 3, 5, generator=gen), torch.randn(2, 6, 3, 5, generator=gen)

    x, g = batch(sub["dp"].get_local_rank())
    xp = x.clone().requires_grad_()
    out = model(xp)
    out.backward(g)
    # one training forward per batch from the same u / v (as each dp rank ran one); FSDP2
    # averages the gradients over dp
    errors = {}
    for dp_rank in range(2):
        for name, buf in reference.named_buffers():
            if name in initial:
                buf.copy_(initial[name])
        xr, gr = batch(dp_rank)
        xr.requires_grad_()
        out_ref = reference(xr)
        (out_ref * gr / 2).sum().backward()
        if dp_rank == sub["dp"].get_local_rank():
            errors["output"] = (out - out_ref).abs().max().item()
            errors["input_grad"] = (xp.grad - 2 * xr.grad).abs().max().item()
    ref_params = dict(reference.named_parameters())
    for name, p in model.named_parameters():
        grad = p.grad.full_tensor() if isinstance(p.grad, DTensor) else p.grad
        errors[f"grad:{name}"] = (grad - ref_params[name].grad).abs().max().item()
    ref_vectors = _vectors(reference)
    for name, b in _vectors(model).items():
        errors[f"vector:{name}"] = (b - ref_vectors[name]).abs().max().item()
    return errors


@pytest.mark.parametrize("form", ["hook", "parametrize"])
def test_spectral_norm_under_fsdp2_over_dp_on_top_of_tp_matches_one_process(form):
    for errors in run_on_ranks(_spectral_fsdp2_worker, 4, form):
        assert len([k for k in errors if k.startswith("vector:")]) == 6, errors
        assert len([k for k in errors if k.startswith("grad:")]) == 6, errors
        bad = {k: v for k, v in errors.items() if not v <= 1e-10}
        assert not bad, bad


def _spectral_meta_build_worker(rank, world, form):
    from torch.distributed.tensor import DTensor

    from credit_parallel.train.model_init import build_parallel_model

    torch.set_default_dtype(torch.float64)
    conf = {"trainer": {"parallelism": {"data": "none", "tensor": 2, "domain": 1}}}
    model = build_parallel_model(lambda: _FusedSpectralBlock(form), conf, device="cpu", seed=1)
    torch.manual_seed(1)
    reference = _FusedSpectralBlock(form)
    state = dict(reference.named_parameters()) | dict(reference.named_buffers())
    errors = {}
    for name, t in (*model.named_parameters(), *model.named_buffers()):
        full = t.full_tensor() if isinstance(t, DTensor) else t
        errors[name] = (full - state[name]).abs().max().item()
    x = torch.randn(2, 6, 3, 5, generator=torch.Generator().manual_seed(5))
    errors["output"] = (model(x) - reference(x)).abs().max().item()
    return errors, sorted(errors) == sorted([*state, "output"])


@pytest.mark.parametrize("form", ["hook", "parametrize"])
def test_spectral_normed_model_built_on_meta_and_split_over_tp_starts_as_one_process(form):
    """build_parallel_model (meta build, tp 2, materialised sharded): the original weights and u /
    v bitwise those of the one-process build, the first forward within 1e-10."""
    for errors, same_names in run_on_ranks(_spectral_meta_build_worker, 2, form):
        assert same_names, errors
        output = errors.pop("output")
        assert output <= 1e-10 and all(v == 0.0 for v in errors.values()), errors


def _spectral_dcp_save_worker(rank, world, form, path):
    import torch.distributed.checkpoint as dcp
    from torch.distributed.device_mesh import init_device_mesh

    from credit_parallel import apply_tensor_parallel

    torch.set_default_dtype(torch.float64)
    torch.manual_seed(1)
    model = _FusedSpectralBlock(form)
    apply_tensor_parallel(model, init_device_mesh("cpu", (world,), mesh_dim_names=("tp",)))
    model(torch.randn(2, 6, 3, 5, generator=torch.Generator().manual_seed(6)))  # u / v move
    dcp.save(model.state_dict(), checkpoint_id=path)


@pytest.mark.parametrize("form", ["hook", "parametrize"])
def test_spectral_normed_tp_checkpoint_loads_into_the_one_process_model(form, tmp_path):
    """The form's keys and full shapes: a DCP checkpoint written at tp 2 after a training
    forward loads into the unsharded model, equal to the one-process model after that forward."""
    import torch.distributed.checkpoint as dcp

    path = str(tmp_path / "ckpt")
    run_on_ranks(_spectral_dcp_save_worker, 2, form, path)
    default = torch.get_default_dtype()
    torch.set_default_dtype(torch.float64)  # built as the ranks built it
    try:
        torch.manual_seed(1)
        reference = _FusedSpectralBlock(form)
        reference(torch.randn(2, 6, 3, 5, generator=torch.Generator().manual_seed(6)))
    finally:
        torch.set_default_dtype(default)
    expected = reference.state_dict()
    loaded = {k: torch.zeros_like(v) for k, v in expected.items()}
    dcp.load(loaded, checkpoint_id=path, no_dist=True)
    assert len(expected) == 12  # weight, bias, u and v of each of the 3 layers
    for key, value in expected.items():
        assert (loaded[key] - value).abs().max().item() <= 1e-12, key
    assert any(k.endswith(("weight_orig", "original")) for k in expected)


def test_a_tp_weight_computed_by_another_hook_is_refused_by_name():
    """torch.nn.utils.weight_norm (hook form) or a non-spectral parametrization on a tp target:
    refused when the plan is built (no process group), naming the path, never a crash inside
    torch on the first forward."""
    from credit_parallel.parallel.tensor_parallel import build_tensor_parallel_plan

    class Block(nn.Module):
        _tp_col, _tp_row = "up", "down"

        def __init__(self, up, down):
            super().__init__()
            self.up, self.down = up, down

    hooked = Block(nn.Linear(4, 8), torch.nn.utils.weight_norm(nn.Linear(8, 4)))
    with pytest.raises(ValueError, match=r"'down'.*not a parameter.*WeightNorm"):
        build_tensor_parallel_plan(hooked, 2)
    weight_norm = torch.nn.utils.parametrizations.weight_norm
    parametrized = Block(weight_norm(nn.Linear(4, 8)), nn.Linear(8, 4))
    with pytest.raises(ValueError, match=r"'up'.*parametrizations \['_WeightNorm'\]"):
        build_tensor_parallel_plan(parametrized, 2)
    spectral = torch.nn.utils.parametrizations.spectral_norm
    assert set(
        build_tensor_parallel_plan(Block(spectral(nn.Linear(4, 8)), nn.Linear(8, 4)), 2)
    ) == {
        "up",
        "down",
    }


def _verify_example_worker(rank, world, conf):
    import warnings

    from credit_parallel.tools.verify import judge, verify_layout

    with warnings.catch_warnings():
        warnings.simplefilter("ignore", UserWarning)  # the post_conf note, asserted elsewhere
        rows = verify_layout(conf, dtype=torch.float64, batch_size=1)
    return judge(rows, torch.float64)


def test_credit_example_config_verifies_with_its_own_data_and_trainer_blocks():
    """``verify`` on the example's gen-2 blocks as written (``data.source``, ``trainer.type``,
    spectral norm, the active post block), the model shrunk to a 32 x 64 grid: with no store
    the library reads, the batch takes the shapes the CREDIT model declares."""
    import_credit("credit.models.crossformer")
    conf = _era5_025deg_conf()
    conf["trainer"]["parallelism"] = {"data": "none", "tensor": 1, "domain": 2}
    conf["model"].update(
        image_height=32,
        image_width=64,
        levels=2,
        channels=3,
        surface_channels=2,
        input_only_channels=0,
        output_only_channels=0,
        dim=[4, 8, 16, 32],
        depth=[1, 1, 1, 1],
        dim_head=4,
        global_window_size=[2, 2, 2, 1],
        local_window_size=2,
        cross_embed_kernel_sizes=[[2, 4], [2, 4], [2, 4], [2, 4]],
        interp=False,
        padding_conf={"activate": False},
    )
    conf["model"]["post_conf"]["tracer_fixer"]["tracer_name"] = ["specific_total_water"]
    rows = run_on_ranks(_verify_example_worker, 2, conf, timeout=300)[0]
    assert len(rows) > 10 and all(r[-1] == "PASS" for r in rows), [
        r for r in rows if r[-1] != "PASS"
    ]


# nextgen_wxformer x domain: exact, tests/test_credit_nextgen.py


# --------------------------------------------------------------------------- legacy wxformer x tp
def _legacy_wxformer_attention():
    crossformer = import_credit("credit.models.wxformer.crossformer")
    torch.manual_seed(0)
    return crossformer.Attention(16, "short", 2, dim_head=4)


def test_legacy_wxformer_fused_qkv_is_refused_and_the_message_suggests_only_exact_ways():
    """CREDIT's legacy wxformer Attention splits q|k|v into heads by its stored ``self.heads``:
    no ``_tp_fused`` declaration would make a split ``to_qkv`` exact, so the refusal must not
    suggest one, with or without a declaration."""
    from credit_parallel.parallel.tensor_parallel import build_tensor_parallel_plan

    attn = _legacy_wxformer_attention()
    assert attn.heads == 4 and attn._tp_col == "to_qkv"
    for declared in (None, {"to_qkv": 3}):
        if declared is not None:
            attn._tp_fused = declared
        with pytest.raises(ValueError) as refused:
            build_tensor_parallel_plan(attn, 2)
        message = str(refused.value)
        assert "'to_qkv'" in message and "legacy wxformer Attention" in message
        assert "self.heads" in message and "nextgen_wxformer" in message
        assert "tensor: 1" in message and "declare _tp_fused" not in message


class _UndeclaredFused(nn.Module):
    """Not CREDIT's: a module whose ``to_qkv`` is declared without ``_tp_fused``."""

    _tp_col = "to_qkv"

    def __init__(self):
        super().__init__()
        self.to_qkv = nn.Linear(8, 24)


def test_undeclared_fused_message_states_when_a_tp_fused_entry_is_exact():
    from credit_parallel.parallel.tensor_parallel import build_tensor_parallel_plan

    with pytest.raises(ValueError) as refused:
        build_tensor_parallel_plan(_UndeclaredFused(), 2)
    message = str(refused.value)
    assert "{'to_qkv': 3}" in message
    # the condition under which the declaration is exact, and the legacy wxformer excluded
    assert "exact only when" in message and "heads = width // head_dim" in message
    assert "stored heads attribute" in message and "legacy wxformer" in message
    assert "declare _tp_fused" not in message
