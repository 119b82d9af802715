"""The geometry every domain layer answers (``domain/geometry.py``) and the converter's rule
registry: pure, no processes."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from credit_parallel.domain.convert import (
    DOMAIN_RULES,
    convert_to_domain_parallel,
    domain_rule_for,
    register_domain_rule,
)
from credit_parallel.domain.exchange.halo import HaloExchange
from credit_parallel.domain.geometry import (
    FILL,
    FORMS,
    domain_form_of,
    domain_kind_of,
    input_windows_of,
    is_domain_layer,
)
from credit_parallel.domain.manager import DomainParallelManager
from credit_parallel.domain.rows import shard_range
from credit_parallel.models import PeriodicConv2d


def _modules():
    """(plain module, global input shape, expected kind)."""
    return [
        (nn.Conv2d(2, 2, 3, padding=1), (1, 2, 13, 5), "conv"),
        (nn.Conv2d(2, 2, 4, stride=2, padding=1), (1, 2, 13, 5), "conv"),
        (nn.Conv3d(2, 2, 3, padding=1), (1, 2, 3, 13, 5), "conv"),
        (nn.ConvTranspose2d(2, 2, 4, stride=2, padding=1), (1, 2, 13, 5), "conv_transpose"),
        (PeriodicConv2d(2, 2, 3, padding=1), (1, 2, 13, 5), "periodic_conv"),
        (nn.GroupNorm(1, 2), (1, 2, 13, 5), "group_norm"),
        (nn.Upsample(scale_factor=2, mode="bilinear"), (1, 2, 13, 5), "interpolate"),
        (nn.Upsample(size=(7, 5), mode="nearest"), (1, 2, 13, 5), "interpolate"),
        (nn.PixelShuffle(2), (1, 8, 13, 5), "pixel_shuffle"),
        (nn.PixelUnshuffle(2), (1, 2, 14, 6), "pixel_unshuffle"),
        (nn.ReflectionPad2d((1, 1, 2, 1)), (1, 2, 13, 5), "pad"),
    ]


@pytest.mark.parametrize("index", range(len(_modules())))
def test_every_domain_layer_answers_its_geometry_like_the_plain_module(index):
    module, shape, kind = _modules()[index]
    mgr = DomainParallelManager.__new__(DomainParallelManager)  # never used: no forward
    layer = convert_to_domain_parallel(nn.Sequential(module), mgr)[0]
    assert is_domain_layer(layer) and domain_form_of(layer) in FORMS
    assert domain_kind_of(layer) == kind
    h = shape[-2]
    with torch.no_grad():
        out_h = module(torch.zeros(shape)).shape[-2]
    assert layer.output_height(h) == out_h
    for n in (1, 2, 3, 4, 20):  # 20 ranks: empty shards
        windows = input_windows_of(layer, h, n)
        if domain_form_of(layer) == "collective":
            assert windows is None
            continue
        assert len(windows) == n
        for r, window in enumerate(windows):
            assert all(g == FILL or 0 <= g < h for g in window)
            o0, o1 = shard_range(out_h, n, r)
            if o0 == o1:
                assert window == ()
        if n == 1 and kind in ("conv", "periodic_conv", "pad"):
            assert set(windows[0]) - {FILL} == set(range(h))


def test_halo_exchange_windows_are_the_shard_plus_its_halo():
    halo = HaloExchange((2, 1), mode="zeros")
    assert halo.domain_form == "halo" and halo.output_height(9) == 9
    assert halo.input_windows(9, 3) == (
        (FILL, FILL, 0, 1, 2, 3),
        (1, 2, 3, 4, 5, 6),
        (4, 5, 6, 7, 8, FILL),
    )


def test_plain_modules_are_not_domain_layers():
    assert not is_domain_layer(nn.Conv2d(1, 1, 3)) and domain_form_of(nn.SiLU()) is None
    assert domain_kind_of(nn.SiLU()) == "SiLU"


class _Blur(nn.Module):
    """A user's layer family: a fixed 3-row blur over H."""

    def forward(self, x):
        return x


class _DomainBlur(nn.Module):
    domain_form = "halo"
    domain_kind = "blur"

    def __init__(self, blur, manager):
        super().__init__()
        self.manager = manager

    def output_height(self, input_height):
        return input_height

    def input_windows(self, input_height, n):
        return tuple(tuple(range(max(0, a - 1), min(input_height, b + 1))) for a, b in (shard_range(input_height, n, r) for r in range(n)))  # fmt: skip


def test_a_layer_family_is_one_rule_registered_by_type_or_qualified_name():
    key = f"{__name__}._Blur"
    try:
        register_domain_rule(key, lambda m, mgr, d: _DomainBlur(m, mgr))
        model = nn.Sequential(_Blur(), nn.Conv2d(1, 1, 1))
        assert domain_rule_for(model[0]) is DOMAIN_RULES[key]
        converted = convert_to_domain_parallel(model, object())
        assert isinstance(converted[0], _DomainBlur) and is_domain_layer(converted[0])
        assert isinstance(converted[1], nn.Conv2d)  # 1x1: row-local, left alone
    finally:
        DOMAIN_RULES.pop(key, None)
    # the built-in rules are looked up along the MRO (a ZeroPad2d is a ConstantPad2d)
    assert domain_rule_for(nn.ZeroPad2d(1)) is DOMAIN_RULES[nn.ZeroPad2d]
    with pytest.raises(TypeError, match="module type or a qualified class name"):
        register_domain_rule(3, lambda *a: None)
