"""The SPEC as a checklist: names, signatures and the stated behaviours no other test file pins.

* §0-§6: every public name imports from the top-level package, with the parameter names,
  order, defaults and keyword names the SPEC writes (checked with ``inspect.signature``; extra
  implementation parameters are allowed only after the SPEC's and only with a default).
* §1/§2: the strict reading of the config block ("strings of decimal digits", exactly one of
  the three data modes, a null block is a missing block), ``dp_world_size`` and
  ``build_device_mesh`` validating the block before anything else, ``RankLayout`` details,
  a ("dp",) mesh of size 2 on a 2-rank gloo world with data "none" (``(None, {})`` only for one
  process with nothing active).
* §3: every layer and ``HaloExchange`` without ``manager=`` uses the process-wide manager
  (exact against one process), a duck-typed periodic conv is accepted, ``shard_batch`` always
  returns a new dict, ``shard_spatial``, inputs not in the balanced layout are an error on
  every rank (no hang, the group stays usable).
* §4: ``get_domain_manager`` / ``get_raw_model`` through ``apply_ddp`` and ``apply_fsdp2``.
* §5: the console script is declared, argparse usage errors are ONE line with exit status 2.
"""

from __future__ import annotations

import contextlib
import importlib.metadata
import inspect
import io

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

import credit_parallel
from credit_parallel import (
    DomainParallelConv2d,
    DomainParallelConv3d,
    DomainParallelConvTranspose2d,
    DomainParallelConvTranspose3d,
    DomainParallelGroupNorm,
    DomainParallelInterpolate,
    DomainParallelManager,
    DomainParallelPad,
    DomainParallelPeriodicConv2d,
    DomainParallelPixelShuffle,
    DomainParallelPixelUnshuffle,
    HaloExchange,
    RankLayout,
    apply_ddp,
    apply_fsdp2,
    build_device_mesh,
    convert_to_domain_parallel,
    data_parallel_coords,
    dp_world_size,
    gather_tensor,
    get_domain_manager,
    get_domain_parallel_manager,
    get_raw_model,
    initialize_domain_parallel,
    parse_parallelism_conf,
    shard_batch,
    shard_spatial,
    shard_tensor,
)
from credit_parallel.domain.manager import set_domain_parallel_manager
from credit_parallel.domain.rows import shard_range
from credit_parallel.models import PeriodicConv2d
from credit_parallel.testing import (
    assert_parity,
    domain_parity_errors,
    fake_process_group,
    run_on_ranks,
)

__all__: list[str] = []

REQUIRED = inspect.Parameter.empty

# --------------------------------------------------------------------------- §0-§6 names
# every public name the SPEC writes, in SPEC order
SPEC_NAMES = [
    "parse_parallelism_conf",
    "RankLayout",
    "dp_world_size",
    "build_device_mesh",
    "data_parallel_coords",
    "DomainParallelManager",
    "initialize_domain_parallel",
    "get_domain_parallel_manager",
    "HaloExchange",
    "DomainParallelConv2d",
    "DomainParallelConv3d",
    "DomainParallelConvTranspose2d",
    "DomainParallelConvTranspose3d",
    "DomainParallelGroupNorm",
    "DomainParallelInterpolate",
    "DomainParallelPeriodicConv2d",
    "convert_to_domain_parallel",
    "validate_sharding_constraints",
    "shard_tensor",
    "gather_tensor",
    "shard_batch",
    "apply_tensor_parallel",
    "apply_fsdp2",
    "apply_ddp",
    "get_domain_manager",
    "get_raw_model",
    "shard_spatial",
    "unpad_shard_interp",
    "sync_domain_gradients",
    "allreduce_grads_avg",
    "parallelize",
]


def test_every_spec_name_is_exported_by_the_top_level_package():
    namespace: dict = {}
    exec("from credit_parallel import *", namespace)  # noqa: S102 - the star import itself
    missing = [n for n in SPEC_NAMES if n not in credit_parallel.__all__ or n not in namespace]
    assert not missing, f"not exported: {missing}"
    for name in SPEC_NAMES:
        assert namespace[name] is getattr(credit_parallel, name)
    with pytest.raises(AttributeError, match="no attribute 'NotAName'"):
        credit_parallel.NotAName  # noqa: B018


# (name, [(parameter, default or REQUIRED), ...]) exactly as the SPEC writes them; for classes
# the parameters of the constructor.  `None` as the parameter list: no parameters at all.
SPEC_SIGNATURES = [
    ("parse_parallelism_conf", [("conf", REQUIRED)]),
    ("RankLayout", [("shape", REQUIRED), ("world_size", REQUIRED), ("dim_names", None)]),
    ("dp_world_size", [("parallelism_conf", REQUIRED), ("world_size", REQUIRED)]),
    ("build_device_mesh", [("parallelism_conf", REQUIRED), ("device", "cuda")]),
    ("data_parallel_coords", [("conf", REQUIRED)]),
    (
        "DomainParallelManager",
        [("world_size", REQUIRED), ("domain_parallel_size", REQUIRED), ("shard_dim", -2)],
    ),
    (
        "initialize_domain_parallel",
        [("world_size", REQUIRED), ("domain_parallel_size", REQUIRED), ("shard_dim", -2)],
    ),
    ("get_domain_parallel_manager", None),
    ("HaloExchange", [("halo_width", REQUIRED), ("dim", -2), ("manager", None)]),
    ("DomainParallelConv2d", [("conv", REQUIRED), ("shard_dim", -2)]),
    ("DomainParallelConv3d", [("conv", REQUIRED), ("shard_dim", 3)]),
    ("DomainParallelConvTranspose2d", [("conv", REQUIRED), ("shard_dim", -2)]),
    ("DomainParallelConvTranspose3d", [("conv", REQUIRED), ("shard_dim", 3)]),
    ("DomainParallelGroupNorm", [("norm", REQUIRED)]),
    ("DomainParallelPeriodicConv2d", [("periodic_conv", REQUIRED), ("shard_dim", -2)]),
    (
        "convert_to_domain_parallel",
        [
            ("model", REQUIRED),
            ("manager", REQUIRED),
            ("shard_dim", -2),
            ("custom_converters", None),
            ("allow_unsafe", False),
        ],
    ),
    (
        "validate_sharding_constraints",
        [("model", REQUIRED), ("local_h", REQUIRED), ("window_sizes", None)],
    ),
    ("shard_tensor", [("x", REQUIRED), ("dim", -2), ("manager", None)]),
    ("gather_tensor", [("x", REQUIRED), ("dim", -2), ("manager", None)]),
    # SPEC's spatial_dims_5d/_4d are named shard_dim_5d/_4d (issue 17); the old names stay
    # accepted as deprecated keywords (tests/test_domain_sharding.py)
    (
        "shard_batch",
        [("batch", REQUIRED), ("shard_dim_5d", -2), ("shard_dim_4d", -2), ("manager", None)],
    ),
    ("apply_tensor_parallel", [("model", REQUIRED), ("tp_mesh", REQUIRED)]),
    ("apply_fsdp2", [("model", REQUIRED), ("dp_mesh", REQUIRED), ("conf", REQUIRED)]),
    ("apply_ddp", [("model", REQUIRED), ("dp_mesh", REQUIRED)]),
    ("get_domain_manager", [("model", REQUIRED)]),
    ("get_raw_model", [("model", REQUIRED)]),
    ("shard_spatial", [("tensor", REQUIRED), ("manager", REQUIRED)]),
    (
        "unpad_shard_interp",
        [
            ("y_pred", REQUIRED),
            ("padding_opt", REQUIRED),
            ("manager", REQUIRED),
            ("image_h", REQUIRED),
            ("image_w", REQUIRED),
        ],
    ),
    ("sync_domain_gradients", [("model", REQUIRED), ("manager", REQUIRED), ("op", "avg")]),
    # "group (None = the default group)": a default of None is the natural reading
    ("allreduce_grads_avg", [("grads", REQUIRED), ("group", None)]),
    ("parallelize", [("model", REQUIRED), ("conf", REQUIRED)]),
]

_POSITIONAL = (inspect.Parameter.POSITIONAL_ONLY, inspect.Parameter.POSITIONAL_OR_KEYWORD)


def _check_signature(what: str, params: list, expected) -> None:
    if expected is None:
        assert params == [], f"{what} takes no parameters, got {params}"
        return
    got = [(p.name, p.default) for p in params[: len(expected)]]
    assert got == expected, f"{what}: SPEC {expected}, got {got}"
    for p in params[: len(expected)]:  # callable positionally AND by keyword, as written
        assert p.kind is inspect.Parameter.POSITIONAL_OR_KEYWORD, (what, p.name, p.kind)
    # whatever the implementation adds comes after and cannot be required
    for p in params[len(expected) :]:
        assert p.kind in (inspect.Parameter.VAR_KEYWORD, inspect.Parameter.VAR_POSITIONAL) or (
            p.default is not REQUIRED
        ), f"{what}: extra parameter {p.name!r} must have a default"


@pytest.mark.parametrize(("name", "expected"), SPEC_SIGNATURES, ids=[s[0] for s in SPEC_SIGNATURES])
def test_signature_matches_the_spec(name, expected):
    obj = getattr(credit_parallel, name)
    params = list(inspect.signature(obj).parameters.values())
    _check_signature(name, params, expected)


def test_interpolate_signature_size_mode_shard_dim_align_corners_or_scale_factor():
    params = inspect.signature(DomainParallelInterpolate).parameters
    assert list(params)[:4] == ["size", "mode", "shard_dim", "align_corners"]
    assert [params[n].default for n in ("mode", "shard_dim", "align_corners")] == [
        "bilinear",
        -2,
        None,
    ]
    # scale_factor= instead of size: both optional, by keyword
    assert params["size"].default is None and params["scale_factor"].default is None


LAYERS = [
    HaloExchange,
    DomainParallelConv2d,
    DomainParallelConv3d,
    DomainParallelConvTranspose2d,
    DomainParallelConvTranspose3d,
    DomainParallelGroupNorm,
    DomainParallelInterpolate,
    DomainParallelPeriodicConv2d,
    DomainParallelPixelShuffle,
    DomainParallelPixelUnshuffle,
    DomainParallelPad,
]


@pytest.mark.parametrize("layer", LAYERS, ids=[c.__name__ for c in LAYERS])
def test_every_layer_is_a_module_with_an_optional_manager_keyword(layer):
    assert issubclass(layer, nn.Module)
    manager = inspect.signature(layer).parameters["manager"]
    assert manager.default is None
    assert manager.kind in (inspect.Parameter.POSITIONAL_OR_KEYWORD, inspect.Parameter.KEYWORD_ONLY)


def test_method_signatures_static_and_class_methods():
    trim = inspect.getattr_static(HaloExchange, "trim")
    assert isinstance(trim, staticmethod)
    _check_signature(
        "HaloExchange.trim",
        list(inspect.signature(HaloExchange.trim).parameters.values()),
        [("x", REQUIRED), ("halo_before", REQUIRED), ("halo_after", REQUIRED), ("dim", -2)],
    )
    assert isinstance(
        inspect.getattr_static(DomainParallelManager, "from_device_mesh"), classmethod
    )
    first = list(inspect.signature(DomainParallelManager.from_device_mesh).parameters.values())
    _check_signature("DomainParallelManager.from_device_mesh", first[:1], [("mesh", REQUIRED)])
    assert list(inspect.signature(DomainParallelManager.neighbor_ranks).parameters) == ["self"]
    for method, names in (
        ("dim_index", ["self", "name"]),
        ("coords", ["self", "rank"]),
        ("rank_of", ["self", "coords"]),
        ("ranks_along_dim", ["self", "dim", "rank"]),
        ("groups_along_dim", ["self", "dim"]),
    ):
        assert list(inspect.signature(getattr(RankLayout, method)).parameters) == names, method


def test_documented_properties_are_read_only_properties():
    for name in (
        "domain_group",
        "data_parallel_group",
        "domain_rank",
        "domain_world_size",
        "dp_rank",
        "dp_world_size",
        "is_first_domain_rank",
        "is_last_domain_rank",
    ):
        prop = inspect.getattr_static(DomainParallelManager, name)
        assert isinstance(prop, property) and prop.fset is None, name
    lay = RankLayout((2, 3), 6)
    for name in ("shape", "dim_names", "ndim", "size"):
        prop = inspect.getattr_static(RankLayout, name)
        assert isinstance(prop, property), name
        with pytest.raises(AttributeError):
            setattr(lay, name, None)


def test_periodic_conv2d_signature_and_attributes():
    _check_signature(
        "PeriodicConv2d",
        list(inspect.signature(PeriodicConv2d).parameters.values()),
        [("dim_in", REQUIRED), ("dim_out", REQUIRED), ("kernel_size", REQUIRED), ("padding", 1)],
    )
    module = PeriodicConv2d(2, 3, 3)
    assert type(module.padding) is int and module.padding == 1
    assert type(module.conv) is nn.Conv2d and module.conv.padding == (0, 0)
    assert PeriodicConv2d(2, 3, 5, 2).padding == 2  # padding positional, as written


# --------------------------------------------------------------------------- §1 config
def _conf(**block):
    return {"trainer": {"parallelism": block}}


def test_parse_returns_a_plain_dict_of_str_and_int():
    parsed = parse_parallelism_conf(_conf(data="ddp", tensor="2", domain=3))
    assert parsed == {"data": "ddp", "tensor": 2, "domain": 3}
    assert [type(parsed[k]) for k in ("data", "tensor", "domain")] == [str, int, int]


@pytest.mark.parametrize(
    ("key", "value"),
    [
        ("tensor", " 2"),  # "strings of decimal digits": no spaces ...
        ("tensor", "2\n"),
        ("domain", "+2"),  # ... no sign ...
        ("domain", "\u0662"),  # ... and no non-ASCII digits (int() would accept ARABIC-INDIC 2)
        ("tensor", "2.0"),
        ("domain", False),
        ("data", "DDP"),  # exactly one of the three spellings
        ("data", " fsdp2"),
        ("data", None),
        ("data", 1),
    ],
)
def test_strict_values_are_refused_naming_key_and_value(key, value):
    with pytest.raises(ValueError) as info:
        parse_parallelism_conf(_conf(**{key: value}))
    assert f"trainer.parallelism.{key}" in str(info.value)
    assert repr(value) in str(info.value)


def test_a_null_parallelism_block_is_a_missing_block():
    # `parallelism:` with nothing under it loads as None
    with pytest.raises(ValueError, match="trainer.parallelism"):
        parse_parallelism_conf({"trainer": {"parallelism": None}})
    with pytest.raises(ValueError, match="trainer.parallelism"):
        dp_world_size(None, 4)


@pytest.mark.parametrize(
    ("block", "key"),
    [
        ({"tensor": 0}, "tensor"),
        ({"tensor": True}, "tensor"),
        ({"domain": 2.5}, "domain"),
        ({"domain": "x"}, "domain"),
        ({"pipeline": 2}, "pipeline"),
    ],
)
def test_dp_world_size_and_build_device_mesh_validate_the_block_first(block, key):
    with pytest.raises(ValueError, match=key):
        dp_world_size(block, 4)
    assert not dist.is_initialized()
    # a bad block is a ValueError even without a process group (not the RuntimeError)
    with pytest.raises(ValueError, match=key):
        build_device_mesh(block, device="cpu")


def test_data_parallel_coords_takes_the_full_config():
    with pytest.raises(ValueError, match="trainer"):
        data_parallel_coords({"data": "ddp"})  # a bare block is not a full config


# --------------------------------------------------------------------------- §2 layout and mesh
def test_rank_layout_without_names_and_by_index():
    lay = RankLayout([2, 3], 6)
    assert lay.shape == (2, 3) and lay.dim_names is None
    assert lay.coords(4) == (1, 1) and type(lay.coords(4)) is tuple
    assert lay.rank_of([1, 1]) == 4
    assert lay.groups_along_dim(0) == [[0, 3], [1, 4], [2, 5]]
    with pytest.raises(ValueError):
        lay.dim_index("dp")  # no names: every name is unknown
    with pytest.raises(ValueError):
        lay.ranks_along_dim(0, 6)  # rank out of range
    with pytest.raises(ValueError):
        lay.ranks_along_dim(0, -1)
    with pytest.raises(ValueError):
        lay.groups_along_dim(-1)  # negative dim
    assert type(RankLayout((2, 3), 6, ["dp", "tp"]).dim_names) is tuple  # a list comes back a tuple


def _nothing_active_worker(rank, world):
    mesh, submeshes = build_device_mesh({"data": "none", "tensor": "1", "domain": 1}, device="cpu")
    return (
        (tuple(mesh.shape), tuple(mesh.mesh_dim_names), sorted(submeshes)),
        dist.get_process_group_ranks(submeshes["dp"].get_group()),
        data_parallel_coords(_conf(data="none")),
    )


def test_data_none_on_a_2_rank_world_keeps_the_dp_axis_of_size_2():
    # SPEC §2: axes of size > 1 are kept, so dp = 2 is a mesh even with data "none";
    # (None, {}) only when every axis, dp included, has size 1
    assert run_on_ranks(_nothing_active_worker, 2) == [
        (((2,), ("dp",), ["dp"]), [0, 1], (0, 2)),
        (((2,), ("dp",), ["dp"]), [0, 1], (1, 2)),
    ]


# --------------------------------------------------------------------------- §3 process-wide manager
class LatLonConv(nn.Module):
    """Not named PeriodicConv2d: a module with `.conv` (padding 0) and `.padding` (int) that pads
    W circularly and H by reflection — "any module with those two attributes and that behaviour
    is accepted" by DomainParallelPeriodicConv2d."""

    def __init__(self):
        super().__init__()
        self.padding = 2
        self.conv = nn.Conv2d(3, 2, 5)

    def forward(self, x):
        p = self.padding
        x = F.pad(F.pad(x, (p, p, 0, 0), mode="circular"), (0, 0, p, p), mode="reflect")
        return self.conv(x)


def _no_manager(layer):
    """convert callback for domain_parity_errors that builds the layer WITHOUT manager=."""
    return lambda module, manager: layer(module)


def _process_wide_worker(rank, world):
    torch.set_default_dtype(torch.float64)
    set_domain_parallel_manager(None)
    mgr = initialize_domain_parallel(world, world)
    assert get_domain_parallel_manager() is mgr
    gen = torch.Generator().manual_seed(11)
    x13 = torch.randn(2, 4, 13, 6, generator=gen)
    x14 = torch.randn(2, 8, 14, 6, generator=gen)
    x5d = torch.randn(1, 2, 3, 13, 6, generator=gen)
    cases = {
        "conv_transpose2d": (
            lambda: nn.ConvTranspose2d(4, 3, 4, 2, 1),
            _no_manager(DomainParallelConvTranspose2d),
            x13,
            -2,
        ),
        "conv3d_dim3": (
            lambda: nn.Conv3d(2, 3, 3, padding=1),
            _no_manager(DomainParallelConv3d),
            x5d,
            3,
        ),
        "conv_transpose3d_dim3": (
            lambda: nn.ConvTranspose3d(2, 3, (1, 4, 3), (1, 2, 1), (0, 1, 1)),
            _no_manager(DomainParallelConvTranspose3d),
            x5d,
            3,
        ),
        "periodic": (
            lambda: PeriodicConv2d(4, 3, 3),
            _no_manager(DomainParallelPeriodicConv2d),
            x13,
            -2,
        ),
        "duck_typed_periodic": (
            LatLonConv,
            _no_manager(DomainParallelPeriodicConv2d),
            x13[:, :3],
            -2,
        ),
        "group_norm": (lambda: nn.GroupNorm(2, 4), _no_manager(DomainParallelGroupNorm), x13, -2),
        # size is the GLOBAL output size; an int size means (size, size) as in F.interpolate
        "interp_size": (
            lambda: nn.Upsample(size=(20, 9), mode="bilinear"),
            lambda m, _: DomainParallelInterpolate((20, 9)),
            x13,
            -2,
        ),
        "interp_int_size": (
            lambda: nn.Upsample(size=7, mode="nearest"),
            lambda m, _: DomainParallelInterpolate(7, "nearest"),
            x13,
            -2,
        ),
        "interp_scale_factor": (
            lambda: nn.Upsample(scale_factor=2, mode="bilinear", align_corners=True),
            lambda m, _: DomainParallelInterpolate(scale_factor=2, align_corners=True),
            x13,
            -2,
        ),
        "pixel_shuffle": (
            lambda: nn.PixelShuffle(2),
            _no_manager(DomainParallelPixelShuffle),
            x13,
            -2,
        ),
        "pixel_unshuffle": (
            lambda: nn.PixelUnshuffle(2),
            _no_manager(DomainParallelPixelUnshuffle),
            x14,
            -2,
        ),
        "reflection_pad": (
            lambda: nn.ReflectionPad2d((1, 0, 2, 3)),
            _no_manager(DomainParallelPad),
            x13,
            -2,
        ),
    }
    errors = {}
    for name, (build, convert, x, dim) in cases.items():
        mgr.__dict__.pop("_cp_gather_owner", None)
        errors[name] = domain_parity_errors(build, x, mgr, convert=convert, shard_dim=dim)
        assert_parity(errors[name])
    # HaloExchange(halo_width) without manager=: this rank's rows of the globe padded with
    # 2 zero rows at each pole
    a, b = shard_range(13, world, rank)
    local = shard_tensor(x13)
    window = HaloExchange(2)(local)
    expected = F.pad(x13, (0, 0, 2, 2))[..., a : b + 4, :]
    errors["halo_exchange"] = {"output": (float((window - expected).abs().max()), 1.0)}
    # shard_tensor / gather_tensor / shard_batch / shard_spatial without manager: the same one
    assert torch.equal(local, x13[..., a:b, :])
    assert torch.equal(gather_tensor(local), x13)
    assert torch.equal(shard_batch({"x": x13})["x"], local)
    assert torch.equal(shard_spatial(x5d, mgr), x5d[..., a:b, :])
    assert torch.equal(shard_spatial(x13, None), local)  # None: the process-wide manager
    set_domain_parallel_manager(None)
    return errors


def test_layers_without_manager_use_the_process_wide_one_and_match_single_process():
    for errors in run_on_ranks(_process_wide_worker, 3):
        assert len(errors) == 13
        for name, errs in errors.items():
            assert {"output", "input_grad"} <= set(errs) or name == "halo_exchange", name
            assert max(e for e, _ in errs.values()) <= 1e-10, (name, errs)


def test_shard_batch_returns_a_new_dict_even_when_it_is_an_identity():
    previous = get_domain_parallel_manager()
    set_domain_parallel_manager(None)
    try:
        x = torch.randn(1, 2, 5, 4)
        batch = {"x": x, "meta": "keep"}
        out = shard_batch(batch)
        assert out is not batch and set(out) == {"x", "meta"} and out["x"] is x
        out["y"] = 1
        assert "y" not in batch  # mutating the result leaves the caller's dict alone
        with fake_process_group(0, 2):
            domain_one = DomainParallelManager(2, 1)
            out = shard_batch(batch, manager=domain_one)
            assert out is not batch and out["x"] is x
            assert shard_spatial(x, domain_one) is x
    finally:
        set_domain_parallel_manager(previous)


class WeightStandardisedConv2d(nn.Conv2d):
    """A conv subclass with its own forward: wrapping it would drop that forward, keeping it
    would pad each shard's edges with zeros — silently wrong either way."""

    def forward(self, x):
        w = self.weight - self.weight.mean(dim=(1, 2, 3), keepdim=True)
        return F.conv2d(x, w, self.bias, self.stride, self.padding)


class RowLocalConv(nn.Conv2d):
    """Own forward, but a 1 x k kernel with no H padding: row-local, so it is left alone."""

    def forward(self, x):
        return super().forward(x) * 2.0


def test_conv_subclass_with_a_custom_forward_is_refused_unless_row_local_or_converted():
    model = nn.Sequential(
        nn.Conv2d(2, 2, 3, padding=1),
        nn.Sequential(WeightStandardisedConv2d(2, 2, 3, padding=1)),
        RowLocalConv(2, 2, (1, 3), padding=(0, 1)),
    )
    with pytest.raises(ValueError) as info:
        convert_to_domain_parallel(model, object())
    message = str(info.value)
    assert "1.0: WeightStandardisedConv2d overrides Conv2d.forward" in message
    assert "RowLocalConv" not in message and "custom_converters" in message
    # a custom converter (checked first) or allow_unsafe=True gets past it
    marker = nn.Identity()
    convert_to_domain_parallel(
        model, object(), custom_converters={WeightStandardisedConv2d: lambda m: marker}
    )
    assert model[1][0] is marker and type(model[0]) is DomainParallelConv2d
    assert type(model[2]) is RowLocalConv


def test_a_layer_that_cannot_be_made_exact_is_refused_naming_its_module_path():
    model = nn.Sequential(
        nn.Conv2d(1, 1, 3), nn.Sequential(nn.Upsample(scale_factor=2, mode="bicubic"))
    )
    with pytest.raises(ValueError) as info:
        convert_to_domain_parallel(model, object())
    message = str(info.value)
    assert "1.0 (Upsample)" in message and "'bicubic'" in message and "bilinear" in message


# --------------------------------------------------------------------------- §6 bad layouts
def _unbalanced_worker(rank, world):
    mgr = DomainParallelManager(world, world)
    conv = convert_to_domain_parallel(nn.Sequential(nn.Conv2d(1, 1, 3, padding=1)), mgr)
    mgr.begin_forward(("hand-sharded", rank))  # a token that even differs between ranks
    message = None
    try:
        conv(torch.zeros(1, 1, 3 if rank == 0 else 6, 4))  # 3 + 6 rows: balanced would be 5 + 4
    except ValueError as err:
        message = str(err)
    alive = torch.ones(1)
    dist.all_reduce(alive)  # nobody was left inside a collective
    return message, float(alive)


def test_inputs_not_in_the_balanced_layout_fail_on_every_rank_without_a_hang():
    for message, alive in run_on_ranks(_unbalanced_worker, 2, timeout=60):
        assert alive == 2.0
        assert message is not None, "a 3/6 split of 9 rows must be refused"
        assert "[3, 6]" in message and "balanced layout of 9 rows" in message
        assert "shard_tensor" in message


# --------------------------------------------------------------------------- §4 wrappers
def _wrapper_worker(rank, world):
    mgr = DomainParallelManager(world, world)
    found = {}
    for kind in ("ddp", "fsdp2"):
        model = convert_to_domain_parallel(nn.Sequential(nn.Conv2d(2, 2, 3, padding=1)), mgr)
        if kind == "ddp":
            wrapped = apply_ddp(model, None)
        else:
            wrapped = apply_fsdp2(model, None, {"trainer": {}})
        found[kind] = (
            get_domain_manager(wrapped) is mgr,
            get_raw_model(wrapped) is model,
            get_domain_manager(model) is mgr,
        )
    plain = nn.Linear(2, 2)
    found["plain"] = (get_domain_manager(plain) is None, get_raw_model(plain) is plain)
    found["plain_ddp"] = (get_domain_manager(apply_ddp(plain, None)) is None,)
    return found


def test_get_domain_manager_and_get_raw_model_see_through_ddp_and_fsdp2():
    for found in run_on_ranks(_wrapper_worker, 2):
        assert all(all(flags) for flags in found.values()), found


# --------------------------------------------------------------------------- §5 command line
def test_console_script_is_declared():
    dist_meta = importlib.metadata.distribution("credit-parallel")
    scripts = {ep.name: ep.value for ep in dist_meta.entry_points if ep.group == "console_scripts"}
    assert scripts.get("credit-parallel") == "credit_parallel.cli:main"
    assert dist_meta.metadata["Requires-Python"].replace(" ", "") == ">=3.11"


@pytest.mark.parametrize(
    "argv",
    [
        [],
        ["no-such-command"],
        ["plan", "--config", "demo"],  # --world-size missing
        ["plan", "--config", "demo", "--world-size", "two"],
        ["train", "--nproc", "2"],  # --config missing
        ["verify", "--config", "demo", "--nproc", "x"],
        ["sample-data", "--times", "many"],
        ["bench", "--no-such-flag"],
    ],
)
def test_usage_errors_exit_non_zero_with_one_line(argv):
    from credit_parallel import cli

    err = io.StringIO()
    with contextlib.redirect_stderr(err), pytest.raises(SystemExit) as info:
        cli.main(argv)
    assert info.value.code not in (0, None)
    lines = [line for line in err.getvalue().splitlines() if line.strip()]
    assert len(lines) == 1, lines
    assert "error" in lines[0]


def test_an_os_error_is_a_one_line_reason_too(tmp_path, capsys):
    from credit_parallel import cli

    blocker = tmp_path / "plain-file"
    blocker.write_text("not a directory")
    argv = ["sample-data", "--output", str(blocker / "s.zarr"), "--times", "3", "--nlat", "5"]
    assert cli.main(argv) != 0  # NotADirectoryError: an OSError, not a FileNotFoundError
    lines = [line for line in capsys.readouterr().err.splitlines() if line.strip()]
    assert len(lines) == 1 and "plain-file" in lines[0], lines
