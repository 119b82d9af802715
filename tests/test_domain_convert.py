"""convert_to_domain_parallel and validate_sharding_constraints.

Structure (no processes; conversion only stores the manager): which modules are replaced and
which are left alone, state_dict keys unchanged, custom converters first and not descended into,
refusal of modules that would be silently wrong under latitude sharding in ONE error listing
every path, ``allow_unsafe`` and ``_domain_local`` declarations, idempotence; then the warnings
of ``validate_sharding_constraints``; and a whole converted model (3x3 convs, GroupNorm, strided
conv, ReflectionPad2d, ConvTranspose2d, nn.Upsample to a global size, a skip connection via
``torch.cat``) matching the single-process model on 2 and 3 ranks with an uneven height.
"""

from __future__ import annotations

import warnings

import pytest
import torch
from torch import nn

from credit_parallel.domain.convert import (
    convert_to_domain_parallel,
    validate_sharding_constraints,
)
from credit_parallel.domain.layers.conv import (
    DomainParallelConv2d,
    DomainParallelConv3d,
    DomainParallelConvTranspose2d,
    DomainParallelPeriodicConv2d,
)
from credit_parallel.domain.manager import DomainParallelManager
from credit_parallel.models import PeriodicConv2d
from credit_parallel.testing import assert_parity, domain_parity_errors, run_on_ranks

__all__: list[str] = []

MANAGER = object()  # conversion stores the manager; nothing here communicates


class _Block(nn.Module):
    def __init__(self):
        super().__init__()
        self.conv = nn.Conv2d(4, 4, 3, padding=1)
        self.point = nn.Conv2d(4, 4, 1)
        self.act = nn.GELU()

    def forward(self, x):
        return self.point(self.act(self.conv(x)))


def _model():
    return nn.Sequential(
        nn.Conv2d(2, 4, 3, padding=1),  # 0: wrapped
        nn.Conv2d(4, 4, 1),  # 1: row-local, left alone
        nn.Conv2d(4, 4, 1, stride=2),  # 2: strided 1x1, wrapped
        nn.Conv2d(4, 4, (1, 3), padding=(0, 1)),  # 3: row-local along H, left alone
        _Block(),  # 4: descended into
        nn.ConvTranspose2d(4, 4, 2, 2),  # 5: wrapped
        nn.Conv3d(4, 4, 1),  # 6: row-local, left alone
        nn.Conv3d(4, 4, 3, padding=1),  # 7: wrapped
        PeriodicConv2d(4, 4, 3, padding=1),  # 8: wrapped as a whole
        nn.ReLU(),  # 9
        nn.Linear(4, 4),  # 10: acts on W only
        nn.Dropout(0.1),  # 11
        nn.LayerNorm(4),  # 12: over the last dim only
    )


def test_convert_replaces_exactly_the_modules_that_need_neighbouring_rows():
    model = _model()
    out = convert_to_domain_parallel(model, MANAGER)
    assert out is model
    kinds = [type(m) for m in model]
    assert kinds[0] is DomainParallelConv2d
    assert kinds[1] is nn.Conv2d
    assert kinds[2] is DomainParallelConv2d
    assert kinds[3] is nn.Conv2d
    assert type(model[4]) is _Block
    assert type(model[4].conv) is DomainParallelConv2d and type(model[4].point) is nn.Conv2d
    assert kinds[5] is DomainParallelConvTranspose2d
    assert kinds[6] is nn.Conv3d
    assert kinds[7] is DomainParallelConv3d
    assert kinds[8] is DomainParallelPeriodicConv2d
    assert kinds[9:] == [nn.ReLU, nn.Linear, nn.Dropout, nn.LayerNorm]
    assert model._domain_manager is MANAGER
    assert model[0].manager is MANAGER


def test_plan_conversion_decides_without_replacing_and_apply_gives_the_converted_model():
    from credit_parallel.domain.convert import apply_conversion_plan, plan_conversion

    model = nn.Sequential(
        nn.ZeroPad2d((0, 0, 1, 1)),
        nn.Conv2d(2, 2, 3),
        nn.Conv2d(2, 2, 1),
        nn.ModuleList([nn.Conv2d(2, 2, 3, padding=1), nn.Conv2d(2, 2, 5, padding=2)]),
    )
    before = [type(m) for m in model.modules()]
    plan = plan_conversion(model, None)  # no manager, no process group: decisions only
    assert [type(m) for m in model.modules()] == before
    assert [(m.path, m.stage, m.form) for m in plan.modules] == [
        ("0", "rule", "halo"),
        ("1", "rule", "halo"),
        ("3.0", "rule", "halo"),
        ("3.1", "rule", "halo"),
    ]
    assert [(f.pad_path, f.conv_path) for f in plan.pad_conv] == [("0", "1")]
    assert [g.paths for g in plan.shared_inputs] == [("3.0", "3.1")]
    text = str(plan)
    assert "1: rule Conv2d -> DomainParallelConv2d [halo]" in text
    assert "fuse pad 0 into conv 1" in text and "share one input exchange: 3.0, 3.1" in text
    out = apply_conversion_plan(model, plan)
    assert out is model and model[1].module_path == "1"
    assert model[1].fused_pad is model[0] and model[0].fused_into is model[1]
    assert model[3][0].shared_input is model[3][1].shared_input is not None
    assert type(model[2]) is nn.Conv2d


def test_layer_options_are_given_at_construction_and_replaced_only_by_configure():
    from credit_parallel.domain.options import LayerOptions

    layer = DomainParallelConv2d(nn.Conv2d(1, 1, 3), options=LayerOptions(split_halo=False))
    assert layer.split_halo is False and layer.overlap is None
    with pytest.raises(AttributeError):
        layer.overlap = True  # read-only: options change through configure
    first = layer.options
    assert layer.configure(overlap=True) is layer
    assert layer.overlap is True and layer.split_halo is False and first.overlap is None
    with pytest.raises(TypeError, match="unknown option"):
        layer.configure(overlapp=True)
    with pytest.raises(TypeError, match="split_halo"):
        layer.configure(split_halo=1)


def test_convert_replaces_norm_resampling_and_padding_over_h():
    from credit_parallel.domain.layers.norm import DomainParallelGroupNorm
    from credit_parallel.domain.layers.padding import DomainParallelPad
    from credit_parallel.domain.layers.resample import (
        DomainParallelInterpolate,
        DomainParallelPixelShuffle,
        DomainParallelPixelUnshuffle,
    )

    model = nn.Sequential(
        nn.GroupNorm(2, 4),
        nn.Upsample(size=(8, 8), mode="bilinear"),
        nn.Upsample(scale_factor=2, mode="nearest"),
        nn.ReflectionPad2d(1),
        nn.ZeroPad2d((1, 1, 0, 0)),  # longitude only: row-local
        nn.CircularPad2d((0, 0, 1, 2)),
        nn.PixelShuffle(2),
        nn.PixelUnshuffle(2),
    )
    convert_to_domain_parallel(model, MANAGER)
    assert type(model[0]) is DomainParallelGroupNorm
    assert type(model[1]) is DomainParallelInterpolate and model[1].size == (8, 8)
    assert type(model[2]) is DomainParallelInterpolate and model[2].mode == "nearest"
    assert type(model[3]) is DomainParallelPad
    assert type(model[4]) is nn.ZeroPad2d
    assert type(model[5]) is DomainParallelPad
    assert type(model[6]) is DomainParallelPixelShuffle
    assert type(model[7]) is DomainParallelPixelUnshuffle


def test_state_dict_keys_and_tensors_survive_conversion():
    model = _model()
    model.add_module("norm", nn.GroupNorm(2, 4))
    model.add_module("sn", nn.utils.spectral_norm(nn.Conv2d(4, 4, 3, padding=1)))
    before = model.state_dict()
    convert_to_domain_parallel(model, MANAGER)
    after = model.state_dict()
    assert list(after) == list(before)
    for key in before:
        assert after[key].data_ptr() == before[key].data_ptr(), key
    assert type(model.sn) is DomainParallelConv2d
    # a plain checkpoint loads strictly into the converted model
    model.load_state_dict(before, strict=True)


def test_a_bare_layer_is_converted_as_the_root():
    conv = nn.Conv2d(2, 2, 3, padding=1)
    out = convert_to_domain_parallel(conv, MANAGER)
    assert type(out) is DomainParallelConv2d and out.wrapped is conv


class _Marker(nn.Module):
    def __init__(self, inner):
        super().__init__()
        self.inner = inner


class _Container(nn.Module):
    def __init__(self):
        super().__init__()
        self.bn = nn.BatchNorm2d(4)  # unsafe, but the container's converter handles it
        self.conv = nn.Conv2d(4, 4, 3, padding=1)


def test_custom_converters_take_precedence_and_their_children_are_not_visited():
    model = nn.Sequential(nn.Conv2d(2, 4, 3, padding=1), _Container(), nn.Conv2d(4, 4, 1))
    seen = []

    def convert_conv(module):
        seen.append(module)
        return _Marker(module)

    def keep_container(module):
        seen.append(module)
        return module  # kept as is: still not descended into

    convert_to_domain_parallel(
        model, MANAGER, custom_converters={nn.Conv2d: convert_conv, _Container: keep_container}
    )
    # the custom rule wins over the built-in one, also for the row-local 1x1 conv
    assert type(model[0]) is _Marker and type(model[2]) is _Marker
    assert type(model[1]) is _Container
    assert type(model[1].conv) is nn.Conv2d  # not visited: neither converted nor refused
    assert len(seen) == 3


def test_custom_converters_must_map_types_to_callables():
    with pytest.raises(TypeError, match="custom_converters"):
        convert_to_domain_parallel(nn.Conv2d(1, 1, 3), MANAGER, custom_converters={"Conv2d": 1})
    with pytest.raises(ValueError, match="needs a DomainParallelManager"):
        convert_to_domain_parallel(nn.Conv2d(1, 1, 3), None)


class MyAttention(nn.Module):
    """A custom class whose name says it mixes positions, with no declaration."""

    def __init__(self):
        super().__init__()
        self.proj = nn.Linear(4, 4)


class _Global(nn.Module):
    _domain_local = False

    def __init__(self):
        super().__init__()
        self.conv = nn.Conv2d(4, 4, 3, padding=1)


class WindowAttention(nn.Module):
    """Declared row-local (windows never cross a shard boundary): kept and not descended into."""

    _domain_local = True

    def __init__(self):
        super().__init__()
        self.mix = nn.Conv2d(4, 4, 3, padding=1)  # would be wrapped if visited
        self.pool = nn.MaxPool2d(2)  # would be refused if visited


def _unsafe_model():
    return nn.Sequential(
        nn.Conv2d(2, 4, 3, padding=1),
        nn.BatchNorm2d(4),
        nn.Sequential(nn.MaxPool2d(2), nn.ReLU()),
        nn.AdaptiveAvgPool2d(1),
        nn.LocalResponseNorm(2),  # (nn.MultiheadAttention is converted now: test_token_attention)
        nn.Flatten(),
        MyAttention(),
        _Global(),
        WindowAttention(),
    )


UNSAFE_PATHS = ["1", "2.0", "3", "4", "5", "6", "7"]


def test_unsafe_modules_are_refused_in_one_error_listing_every_path():
    model = _unsafe_model()
    with pytest.raises(ValueError) as info:
        convert_to_domain_parallel(model, MANAGER)
    message = str(info.value)
    lines = [
        line.strip() for line in message.splitlines() if ": " in line and line.startswith("  ")
    ]
    assert [line.split(":")[0] for line in lines] == UNSAFE_PATHS
    for word in ("BatchNorm2d", "MaxPool2d", "AdaptiveAvgPool2d", "LocalResponseNorm", "Flatten"):
        assert word in message
    assert "MyAttention" in message and "_domain_local = False" in message
    assert "allow_unsafe=True" in message and "_domain_local = True" in message
    assert "WindowAttention" not in message and "8" not in [p.split(":")[0] for p in lines]


def test_allow_unsafe_warns_with_every_path_and_converts_the_rest():
    model = _unsafe_model()
    with pytest.warns(UserWarning) as record:
        convert_to_domain_parallel(model, MANAGER, allow_unsafe=True)
    message = "\n".join(str(w.message) for w in record)
    for path in UNSAFE_PATHS:
        assert f"\n  {path}: " in message
    assert type(model[0]) is DomainParallelConv2d
    assert type(model[1]) is nn.BatchNorm2d  # kept, as asked
    assert type(model[7].conv) is nn.Conv2d  # a refused module is not descended into
    # declared row-local: kept whole, its children untouched
    assert type(model[8]) is WindowAttention
    assert type(model[8].mix) is nn.Conv2d and type(model[8].pool) is nn.MaxPool2d


def test_class_name_words_count_as_non_local_unless_declared():
    class SpatialPool(nn.Module):
        pass

    class FancyBatchNormish(nn.Module):
        pass

    class LocalPool(nn.Module):
        _domain_local = True

    model = nn.Sequential(SpatialPool(), FancyBatchNormish(), LocalPool())
    with pytest.raises(ValueError, match=r"(?s)0: SpatialPool.*1: FancyBatchNormish") as info:
        convert_to_domain_parallel(model, MANAGER)
    assert "LocalPool" not in str(info.value)


def test_converting_twice_is_idempotent():
    model = _model()
    convert_to_domain_parallel(model, MANAGER)
    modules = list(model.modules())
    keys = list(model.state_dict())
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        convert_to_domain_parallel(model, MANAGER)
    assert list(model.modules()) == modules  # same objects, nothing wrapped twice
    assert all(m is n for m, n in zip(model.modules(), modules))
    assert list(model.state_dict()) == keys


# --------------------------------------------------------------------------- sharding constraints
def test_validate_sharding_constraints_with_explicit_window_sizes():
    model = nn.Conv2d(1, 1, 1)
    assert validate_sharding_constraints(model, 16, window_sizes=[4, 4]) == []
    assert validate_sharding_constraints(model, 16) == []  # nothing to check
    warnings_out = validate_sharding_constraints(model, 12, window_sizes=[8, (3, 5)])
    assert warnings_out == [
        "level 0: local height 12 (= 12 / 1) is not divisible by the window size 8; "
        "windows would cross shard boundaries",
    ]
    assert validate_sharding_constraints(model, 12, window_sizes=6) == []
    out = validate_sharding_constraints(model, 15, window_sizes=[5, 5])
    assert out == ["level 1: local height 15 is not divisible by the downsampling factor 2"]
    with pytest.raises(ValueError, match="local_h"):
        validate_sharding_constraints(model, 0, window_sizes=[4])


def test_validate_sharding_constraints_reads_the_model_attributes():
    class Encoder(nn.Module):
        window_sizes = (5, 5, 3)
        level_strides = (2, 4, 8)

    model = nn.Sequential(nn.Conv2d(1, 1, 1), Encoder())
    assert validate_sharding_constraints(model, 40) == [
        "level 2: local height 5 (= 40 / 8) is not divisible by the window size 3; "
        "windows would cross shard boundaries",
    ]
    assert validate_sharding_constraints(model, 20) == [
        "level 2: local height 20 is not divisible by the downsampling factor 8",
    ]
    assert validate_sharding_constraints(model, 120) == []

    class Short(nn.Module):
        window_sizes = (4, 4)
        level_strides = (1,)

    with pytest.raises(ValueError, match=r"level_strides \[1\] has fewer levels"):
        validate_sharding_constraints(Short(), 8)


# --------------------------------------------------------------------------- a whole model
class _MixedNet(nn.Module):
    """Encoder-decoder touching every converted family, with a skip connection (cat)."""

    def __init__(self, h: int, w: int):
        super().__init__()
        self.pad = nn.ReflectionPad2d(1)
        self.stem = nn.Conv2d(3, 8, 3)  # valid conv after the reflect padding
        self.norm = nn.GroupNorm(2, 8)
        self.act = nn.SiLU()
        self.down = nn.Conv2d(8, 8, 3, stride=2, padding=1)
        self.mid = nn.Conv2d(8, 8, 3, padding=1, padding_mode="circular")
        self.up = nn.ConvTranspose2d(8, 8, 4, 2, 1)  # 2 * ceil(h / 2) rows
        self.resize = nn.Upsample(size=(h, w), mode="bilinear")  # back to the GLOBAL size
        self.point = nn.Conv2d(16, 8, 1)
        self.head = nn.Conv2d(8, 2, 3, padding=1)

    def forward(self, x):
        skip = self.act(self.norm(self.stem(self.pad(x))))
        y = self.act(self.mid(self.down(skip)))
        y = self.resize(self.up(y))
        return self.head(self.act(self.point(torch.cat([skip, y], dim=1))))


def _whole_model_worker(rank, world, h, dtype):
    torch.set_default_dtype(dtype)
    mgr = DomainParallelManager(world, world)
    x = torch.randn(2, 3, h, 10, generator=torch.Generator().manual_seed(h))
    errors = domain_parity_errors(lambda: _MixedNet(h, 10), x, mgr)
    model = convert_to_domain_parallel(_MixedNet(h, 10), mgr)
    return errors, sorted({type(m).__name__ for m in model.modules()})


@pytest.mark.parametrize(("world", "h"), [(2, 13), (3, 13), (3, 17)])
def test_whole_converted_model_matches_single_process(world, h):
    results = run_on_ranks(_whole_model_worker, world, h, torch.float64)
    for errors, kinds in results:
        assert_parity(errors)
        assert len(errors) == 2 + len(list(_MixedNet(h, 10).parameters()))
        for kind in (
            "DomainParallelPad",
            "DomainParallelGroupNorm",
            "DomainParallelConv2d",
            "DomainParallelConvTranspose2d",
            "DomainParallelInterpolate",
        ):
            assert kind in kinds


def test_whole_converted_model_float32():
    for errors, _ in run_on_ranks(_whole_model_worker, 3, 13, torch.float32):
        assert_parity(errors, torch.float32)


def test_walk_domain_modules_returns_the_root_or_its_custom_replacement():
    from credit_parallel.domain.convert import walk_domain_modules

    seen = []

    def candidate(parent, name, path, module):
        seen.append(path)
        return False

    model = nn.Sequential(nn.Conv2d(2, 2, 3, padding=1), nn.ReLU())
    assert walk_domain_modules(model, candidate) is model
    assert seen == ["<root>", "0", "1"]
    replacement = nn.Identity()
    root = walk_domain_modules(model, candidate, custom={nn.Sequential: lambda m: replacement})
    assert root is replacement and seen == ["<root>", "0", "1"]
