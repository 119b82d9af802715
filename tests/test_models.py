"""Tests of the reference models: shapes, gradients, periodic padding, declarations, registry."""

from __future__ import annotations

import copy

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from credit_parallel.domain.guard import FunctionalCallGuard
from credit_parallel.models import (
    MODEL_TYPES,
    CrossFormer,
    Pangu3D,
    PeriodicConv2d,
    SwinNet,
    UNet,
    WindowAttention,
    build_model,
)
from credit_parallel.models.layers import ChannelLayerNorm, ChannelsLastFeedForward

DTYPE = torch.float64


def _unet(h=33, w=64):
    return UNet(8, 8, h, w, base_channels=8)


def _crossformer(h=32, w=64):
    return CrossFormer(8, 8, h, w)


def _pangu(z=4, h=32, w=64):
    return Pangu3D(4, 3, z, h, w)


def _swin(h=32, w=64):
    return SwinNet(8, 8, h, w, dim=16, depth=2, dim_head=4, window_size=4)


def _inputs(model, batch=2):
    """Random inputs of the grid the model was built for."""
    if isinstance(model, Pangu3D):
        h, w = model.image_height, model.image_width
        return (
            torch.randn(batch, model.upper_channels, model.levels, h, w, dtype=DTYPE),
            torch.randn(batch, model.surface_channels, h, w, dtype=DTYPE),
        )
    return (
        torch.randn(batch, model.in_channels, model.image_height, model.image_width, dtype=DTYPE),
    )


def _outputs(model, inputs):
    out = model(*inputs)
    return out if isinstance(out, tuple) else (out,)


ALL_MODELS = {"unet": _unet, "crossformer": _crossformer, "pangu": _pangu, "swin": _swin}


def _build(name):
    torch.manual_seed(0)
    return ALL_MODELS[name]().to(DTYPE)


# --------------------------------------------------------------------------------------------
# PeriodicConv2d


def _reference_periodic_conv(module: PeriodicConv2d, x: torch.Tensor) -> torch.Tensor:
    p = module.padding
    padded = F.pad(x, (p, p, 0, 0), mode="circular")
    padded = F.pad(padded, (0, 0, p, p), mode="reflect")
    return F.conv2d(padded, module.conv.weight, module.conv.bias)


@pytest.mark.parametrize(
    ("kernel", "padding", "h", "w"), [(3, 1, 9, 12), (5, 2, 7, 10), (1, 0, 5, 6)]
)
def test_periodic_conv2d_matches_torch_circular_w_reflect_h_reference(kernel, padding, h, w):
    torch.manual_seed(1)
    module = PeriodicConv2d(3, 4, kernel, padding=padding).to(DTYPE)
    x = torch.randn(2, 3, h, w, dtype=DTYPE)
    out = module(x)
    assert out.shape == (2, 4, h, w)
    assert module.conv.padding == (0, 0)
    assert isinstance(module.padding, int) and module.padding == padding
    torch.testing.assert_close(out, _reference_periodic_conv(module, x), rtol=0, atol=1e-12)


def test_periodic_conv2d_pad_reflects_rows_at_poles_and_wraps_columns():
    x = torch.arange(5 * 6, dtype=DTYPE).reshape(1, 1, 5, 6)
    for p in (1, 2):
        padded = PeriodicConv2d(1, 1, 2 * p + 1, padding=p).pad(x)
        assert padded.shape == (1, 1, 5 + 2 * p, 6 + 2 * p)
        inner = padded[..., p:-p]
        # Reflect at the poles: padded row p-1-j is input row 1+j (the pole row is not repeated).
        for j in range(p):
            assert torch.equal(inner[0, 0, p - 1 - j], x[0, 0, 1 + j])
            assert torch.equal(inner[0, 0, p + 5 + j], x[0, 0, 5 - 2 - j])
        # Circular in longitude: the columns before 0 are the last ones, and vice versa.
        rows = padded[0, 0, p:-p]
        assert torch.equal(rows[:, :p], x[0, 0, :, -p:])
        assert torch.equal(rows[:, -p:], x[0, 0, :, :p])
    # The p=1 case spelt out: row 0 of the padded input equals input row 1.
    padded = PeriodicConv2d(1, 1, 3, padding=1).pad(x)
    assert torch.equal(padded[0, 0, 0, 1:-1], x[0, 0, 1])
    assert padded[0, 0, 0, 0] == x[0, 0, 1, -1]


def test_periodic_conv2d_commutes_with_longitude_roll():
    torch.manual_seed(2)
    module = PeriodicConv2d(2, 3, 3, padding=1).to(DTYPE)
    x = torch.randn(1, 2, 7, 10, dtype=DTYPE)
    rolled = module(torch.roll(x, 3, dims=-1))
    torch.testing.assert_close(rolled, torch.roll(module(x), 3, dims=-1), rtol=0, atol=1e-12)


@pytest.mark.parametrize("padding", [-1, 1.0, True])
def test_periodic_conv2d_rejects_bad_padding(padding):
    with pytest.raises(ValueError, match="padding"):
        PeriodicConv2d(1, 1, 3, padding=padding)


# --------------------------------------------------------------------------------------------
# Shapes, gradients, determinism


@pytest.mark.parametrize(("h", "w"), [(33, 64), (17, 32), (19, 36)])
def test_unet_output_shape_and_global_upsample_targets(h, w):
    torch.manual_seed(0)
    model = _unet(h, w).to(DTYPE)
    out = model(torch.randn(2, 8, h, w, dtype=DTYPE))
    assert out.shape == (2, 8, h, w)
    h1, w1 = (h + 1) // 2, (w + 1) // 2
    sizes = [tuple(m.size) for m in model.modules() if isinstance(m, nn.Upsample)]
    assert sizes == [(h1, w1), (h, w)]


def test_unet_33x64_levels_are_33_17_9():
    assert [hw[0] for hw in _unet().level_sizes] == [33, 17, 9]


@pytest.mark.parametrize(("h", "w"), [(32, 64), (16, 48)])
def test_crossformer_output_shape_and_sharding_attributes(h, w):
    torch.manual_seed(0)
    model = _crossformer(h, w).to(DTYPE)
    assert model(torch.randn(2, 8, h, w, dtype=DTYPE)).shape == (2, 8, h, w)
    assert model.window_sizes == [4, 4]
    assert model.level_strides == [2, 4]


@pytest.mark.parametrize(("z", "h", "w"), [(4, 32, 64), (6, 12, 20)])
def test_pangu_output_shapes(z, h, w):
    torch.manual_seed(0)
    model = _pangu(z, h, w).to(DTYPE)
    upper, surface = model(
        torch.randn(2, 4, z, h, w, dtype=DTYPE), torch.randn(2, 3, h, w, dtype=DTYPE)
    )
    assert upper.shape == (2, 4, z, h, w)
    assert surface.shape == (2, 3, h, w)


@pytest.mark.parametrize("name", sorted(ALL_MODELS))
def test_gradients_reach_every_parameter_and_the_input(name):
    model = _build(name)
    inputs = [t.requires_grad_() for t in _inputs(model)]
    loss = sum((out * torch.randn_like(out)).sum() for out in _outputs(model, inputs))
    loss.backward()
    for pname, param in model.named_parameters():
        assert param.grad is not None, f"{name}: no gradient for {pname}"
        assert param.grad.abs().max() > 0, f"{name}: zero gradient for {pname}"
    for t in inputs:
        assert t.grad is not None and t.grad.abs().max() > 0


@pytest.mark.parametrize("name", sorted(ALL_MODELS))
def test_same_seed_builds_same_model_and_outputs(name):
    a, b = _build(name), _build(name)
    for (ka, va), (kb, vb) in zip(a.state_dict().items(), b.state_dict().items()):
        assert ka == kb and torch.equal(va, vb)
    torch.manual_seed(5)
    inputs = _inputs(a)
    for oa, ob in zip(_outputs(a, inputs), _outputs(b, inputs)):
        assert torch.equal(oa, ob)


def test_different_seeds_build_different_weights():
    torch.manual_seed(0)
    a = _unet()
    torch.manual_seed(1)
    b = _unet()
    assert not torch.equal(a.stem.conv.weight, b.stem.conv.weight)


# --------------------------------------------------------------------------------------------
# Window attention


def _masked_full_attention(module: WindowAttention, x: torch.Tensor) -> torch.Tensor:
    """Attention over all pixels with a mask allowing only pairs in the same window."""
    b, c, h, w = x.shape
    ws, d = module.window_size, module.dim_head
    heads = c // d
    q, k, v = module.to_qkv(x).chunk(3, dim=1)
    q, k, v = (t.reshape(b, heads, d, h * w).transpose(-2, -1) for t in (q, k, v))
    rows = torch.arange(h).repeat_interleave(w)
    cols = torch.arange(w).repeat(h)
    col_group = cols % (w // ws) if module.long_range else cols // ws
    row_group = rows % (h // ws) if module.long_range else rows // ws
    window = row_group * w + col_group
    allowed = window[:, None] == window[None, :]
    scores = (q @ k.transpose(-2, -1)) * d**-0.5
    scores = scores.masked_fill(~allowed, float("-inf"))
    out = (torch.softmax(scores, dim=-1) @ v).transpose(-2, -1).reshape(b, c, h, w)
    return module.to_out(out)


@pytest.mark.parametrize("long_range", [False, True])
def test_window_attention_matches_masked_full_attention(long_range):
    torch.manual_seed(3)
    module = WindowAttention(16, 4, 2, long_range=long_range).to(DTYPE)
    x = torch.randn(2, 16, 6, 8, dtype=DTYPE)
    torch.testing.assert_close(module(x), _masked_full_attention(module, x), rtol=0, atol=1e-12)


def test_window_attention_heads_follow_projection_width_like_tensor_parallel_ranks():
    """Two 'ranks', each holding half the heads of q, k, v and of to_out's input, sum to the whole."""
    torch.manual_seed(4)
    dim, dim_head, tp = 16, 4, 2
    full = WindowAttention(dim, dim_head, 2).to(DTYPE)
    x = torch.randn(1, dim, 4, 8, dtype=DTYPE)
    local = dim // tp
    total = torch.zeros_like(full(x))
    for rank in range(tp):
        part = copy.deepcopy(full)
        rows = torch.cat(
            [torch.arange(rank * local, (rank + 1) * local) + j * dim for j in range(3)]
        )
        part.to_qkv = nn.Conv2d(dim, 3 * local, 1, bias=False).to(DTYPE)
        part.to_qkv.weight.data.copy_(full.to_qkv.weight[rows])
        part.to_out = nn.Conv2d(local, dim, 1, bias=rank == 0).to(DTYPE)
        part.to_out.weight.data.copy_(full.to_out.weight[:, rank * local : (rank + 1) * local])
        if rank == 0:
            part.to_out.bias.data.copy_(full.to_out.bias)
        total += part(x)
    torch.testing.assert_close(total, full(x), rtol=0, atol=1e-12)


def test_window_attention_rejects_local_height_not_multiple_of_window():
    module = WindowAttention(8, 4, 4)
    with pytest.raises(ValueError, match="window_size=4"):
        module(torch.randn(1, 8, 6, 8))


# --------------------------------------------------------------------------------------------
# Declarations the parallel layers rely on


def _split_dim_and_step(module: nn.Module, x: torch.Tensor) -> tuple[int, int]:
    h_dim = 3 if x.dim() == 5 else 2
    step = module.window_size if isinstance(module, WindowAttention) else 1
    return h_dim, step


@pytest.mark.parametrize(
    "name", ["crossformer", "pangu"]
)  # the U-Net has no custom forward to trust
def test_domain_local_modules_really_compute_rows_from_their_own_shard(name):
    """Every `_domain_local` module gives the same result on two row blocks as on the whole."""
    model = _build(name)
    captured = []
    hooks = [
        m.register_forward_hook(lambda mod, args, out: captured.append((mod, args[0], out)))
        for m in model.modules()
        if getattr(type(m), "_domain_local", False)
    ]
    with torch.no_grad():
        _outputs(model, _inputs(model))
        for hook in hooks:
            hook.remove()
        assert captured, f"{name} has no _domain_local module to check"
        kinds = set()
        for module, x, out in captured:
            h_dim, step = _split_dim_and_step(module, x)
            h = x.shape[h_dim]
            cut = (h // 2) // step * step
            assert 0 < cut < h
            top, bottom = x.split([cut, h - cut], dim=h_dim)
            pieces = torch.cat([module(top), module(bottom)], dim=h_dim)
            torch.testing.assert_close(pieces, out, rtol=0, atol=1e-12)
            kinds.add(type(module))
    expected = {  # WindowAttention is not row-local: tests/test_domain_attention.py covers it
        "crossformer": {ChannelLayerNorm},
        "pangu": {ChannelsLastFeedForward},
    }[name]
    assert expected <= kinds


_UNSAFE = (
    nn.modules.batchnorm._BatchNorm,
    nn.modules.pooling._MaxPoolNd,
    nn.modules.pooling._AvgPoolNd,
    nn.modules.pooling._AdaptiveAvgPoolNd,
    nn.modules.pooling._AdaptiveMaxPoolNd,
    nn.MultiheadAttention,
)


@pytest.mark.parametrize("name", sorted(ALL_MODELS))
def test_no_unsafe_modules_and_attention_classes_declare_their_domain_structure(name):
    model = _build(name)
    for path, module in model.named_modules():
        assert not isinstance(module, _UNSAFE), f"{name}.{path} is {type(module).__name__}"
        cls_name = type(module).__name__
        if any(word in cls_name for word in ("Attention", "Pool", "BatchNorm")):
            declared = getattr(module, "_domain_local", None) is True or (
                getattr(module, "_domain_attention", None) is not None
            )
            assert declared, f"{name}.{path}"


def _as_list(paths):
    return [paths] if isinstance(paths, str) else list(paths)


def _check_tp_layer(where: str, layer: nn.Module) -> tuple[int, int]:
    """(in, out) width of a layer tensor parallelism supports; asserts it is one."""
    if isinstance(layer, nn.Linear):
        return layer.in_features, layer.out_features
    assert isinstance(layer, nn.Conv2d), f"{where} is {type(layer).__name__}"
    assert layer.kernel_size == (1, 1), where
    assert layer.stride == (1, 1) and layer.padding == (0, 0) and layer.groups == 1, where
    assert layer.dilation == (1, 1), where
    return layer.in_channels, layer.out_channels


@pytest.mark.parametrize("name", sorted(ALL_MODELS))
def test_tensor_parallel_declarations_point_at_supported_layers(name):
    """Every _tp_col/_tp_row path exists and is a Linear or 1x1 Conv2d; widths pair up and split
    into whole heads for tp sizes 2 and 4 at the default sizes."""
    model = _build(name)
    n_plans = 0
    for path, module in model.named_modules():
        cols = _as_list(getattr(module, "_tp_col", []))
        rows = _as_list(getattr(module, "_tp_row", []))
        if not cols and not rows:
            continue
        n_plans += 1
        assert len(cols) == len(rows) == 1, f"{path}: one column and one row layer expected"
        _, col_out = _check_tp_layer(f"{path}.{cols[0]}", module.get_submodule(cols[0]))
        row_in, _ = _check_tp_layer(f"{path}.{rows[0]}", module.get_submodule(rows[0]))
        fused = getattr(module, "_tp_fused", {})
        factor = 1
        for fused_path, n in fused.items():
            assert fused_path in cols, f"{path}: fused {fused_path} is not a column layer"
            factor = n
        assert col_out == factor * row_in, f"{path}: column output does not feed the row layer"
        head_dim = getattr(module, "_tp_head_dim", 1)
        assert isinstance(head_dim, int) and head_dim >= 1
        for tp in (2, 4):
            assert row_in % (head_dim * tp) == 0, f"{path}: {row_in} channels for tp={tp}"
    assert n_plans > 0, f"{name} opts nothing into tensor parallelism"


@pytest.mark.parametrize("name", sorted(ALL_MODELS))
def test_every_model_declares_fsdp2_units(name):
    model = _build(name)
    units = [m for m in model.modules() if getattr(m, "_fsdp2_shard", False)]
    assert len(units) >= 2


@pytest.mark.parametrize("name", sorted(ALL_MODELS))
def test_model_forwards_make_no_functional_calls_over_h_outside_replaced_modules(name):
    """The functional-call guard on every bundled model's forward (inputs marked as latitude
    shards): only modules the converter replaces whole (PeriodicConv2d, nn.Upsample, attention
    declaring ``_domain_attention``) may pad, resample or roll over H."""
    model = _build(name)
    inputs = _inputs(model)
    with FunctionalCallGuard(model) as guard:
        guard.mark(*inputs)
        _outputs(model, inputs)
    replaced = {
        p
        for p, m in model.named_modules()
        if isinstance(m, (PeriodicConv2d, nn.Upsample))
        or getattr(m, "_domain_attention", None) is not None
    }
    stray = [str(f) for f in guard.findings if f.path not in replaced]
    assert stray == [], stray


# --------------------------------------------------------------------------------------------
# Registry and argument errors


def test_build_model_from_config_dict_matches_direct_construction():
    conf = {
        "type": "unet",
        "in_channels": 8,
        "out_channels": 8,
        "image_height": 33,
        "image_width": 64,
        "base_channels": 8,
        "channel_mults": [1, 2, 2],
    }
    torch.manual_seed(0)
    built = build_model(conf)
    torch.manual_seed(0)
    direct = _unet()
    assert isinstance(built, UNet)
    for va, vb in zip(built.state_dict().values(), direct.state_dict().values()):
        assert torch.equal(va, vb)
    assert conf["type"] == "unet"  # the config is not mutated
    assert set(MODEL_TYPES) == {"unet", "crossformer", "pangu", "swin"}
    assert isinstance(
        build_model(
            {
                "type": "CrossFormer",
                "in_channels": 2,
                "out_channels": 2,
                "image_height": 16,
                "image_width": 16,
            }
        ),
        CrossFormer,
    )
    assert isinstance(
        build_model(
            {
                "type": "pangu",
                "upper_channels": 2,
                "surface_channels": 1,
                "levels": 2,
                "image_height": 8,
                "image_width": 8,
            }
        ),
        Pangu3D,
    )


@pytest.mark.parametrize(
    ("conf", "match"),
    [
        ({"type": "transformer"}, r"model\.type='transformer'.*crossformer, pangu, swin, unet"),
        ({"in_channels": 1}, r"model\.type is missing"),
        ({"type": 3}, r"model\.type=3"),
        (
            {
                "type": "unet",
                "in_channels": 1,
                "out_channels": 1,
                "image_height": 8,
                "image_width": 8,
                "bogus": 1,
            },
            r"model\.bogus",
        ),
        (
            {"type": "unet", "in_channels": 1, "out_channels": 1, "image_height": 8},
            r"model\.image_width is required",
        ),
        (
            {
                "type": "unet",
                "in_channels": 1,
                "out_channels": 1,
                "image_height": 8,
                "image_width": 8,
                "norm_groups": 3,
            },
            r"norm_groups=3",
        ),
        (
            {
                "type": "unet",
                "in_channels": 1,
                "out_channels": 1,
                "image_height": 8,
                "image_width": 8,
                "channel_mults": "12",
            },
            r"channel_mults",
        ),
        (
            {
                "type": "crossformer",
                "in_channels": 1,
                "out_channels": 1,
                "image_height": 30,
                "image_width": 32,
            },
            r"image_height=30",
        ),
        (
            {
                "type": "crossformer",
                "in_channels": 1,
                "out_channels": 1,
                "image_height": 32,
                "image_width": 32,
                "embed_kernels": [[2, 3], [2, 4]],
            },
            r"embed_kernels\[0\]",
        ),
        (
            {
                "type": "crossformer",
                "in_channels": 1,
                "out_channels": 1,
                "image_height": 32,
                "image_width": 32,
                "window_sizes": [4, 3],
            },
            r"window_sizes\[1\]=3",
        ),
        (
            {
                "type": "crossformer",
                "in_channels": 1,
                "out_channels": 1,
                "image_height": 32,
                "image_width": 32,
                "dim_head": 12,
            },
            r"dim_head=12",
        ),
        (
            {
                "type": "pangu",
                "upper_channels": 1,
                "surface_channels": 1,
                "levels": 3,
                "image_height": 8,
                "image_width": 8,
            },
            r"levels=3",
        ),
        (
            {
                "type": "pangu",
                "upper_channels": 1,
                "surface_channels": 1,
                "levels": 2,
                "image_height": 6,
                "image_width": 8,
            },
            r"image_height=6",
        ),
    ],
)
def test_build_model_errors_name_the_key(conf, match):
    with pytest.raises(ValueError, match=match):
        build_model(conf)


def test_build_model_rejects_non_dict():
    with pytest.raises(TypeError, match="dict"):
        build_model(["unet"])


def test_forward_rejects_wrong_width_or_channels_with_the_built_grid_in_the_message():
    model = _unet(17, 32)
    with pytest.raises(ValueError, match="17 x 32"):
        model(torch.randn(1, 8, 17, 30))
    with pytest.raises(ValueError, match="upper"):
        _pangu(4, 8, 8)(torch.randn(1, 4, 2, 8, 8), torch.randn(1, 3, 8, 8))
