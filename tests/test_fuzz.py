"""Property-based tests (hypothesis) over random configs, layouts and world sizes.

The contract under fuzzing: the library either accepts the input and then works (the layout
arithmetic is consistent, the mesh builds with the predicted axes, the planned model runs), or
raises ``ValueError`` whose message names the offending key — never another exception type,
never a hang.  Meshes are built under torch's in-process "fake" backend, so world sizes up to 64
cost no process.
"""

from __future__ import annotations

import math
import os

import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from credit_parallel.layout.config import (
    DataMode,
    ParallelDims,
    parse_parallelism_block,
    parse_parallelism_conf,
)
from credit_parallel.layout.mesh import build_device_mesh, dp_world_size, full_rank_layout
from credit_parallel.layout.ranks import RankLayout
from credit_parallel.models import build_model
from credit_parallel.planner import make_plan
from credit_parallel.testing import fake_process_group
from credit_parallel.train.preflight import validate_run

__all__: list[str] = []

# CI runs a fixed, modest sample (derandomized: the same examples every run); a deeper hunt:
# CP_FUZZ_EXAMPLES=2000 pytest tests/test_fuzz.py (random examples, the slow tests get 1/5)
_DEEP = int(os.environ.get("CP_FUZZ_EXAMPLES", "0"))
FUZZ = settings(
    max_examples=_DEEP or 60,
    deadline=None,
    suppress_health_check=[HealthCheck.too_slow],
    derandomize=not _DEEP,
    database=None,
)
SLOW_FUZZ = settings(FUZZ, max_examples=max(1, _DEEP // 5) if _DEEP else 15)

# values a YAML file can put anywhere: the right kinds, near misses, and nonsense
junk = st.one_of(
    st.none(),
    st.booleans(),
    st.integers(-3, 12),
    st.floats(allow_nan=True, allow_infinity=True, width=32),
    st.sampled_from(["2", " 3 ", "0", "-1", "two", "", "1.5", "fsdp2", "ddp", "none", "FSDP2"]),
    st.lists(st.integers(0, 3), max_size=2),
    st.dictionaries(st.sampled_from(["a", "data"]), st.integers(0, 2), max_size=1),
)


def mostly(valid, bad=junk, one_in: int = 6):
    """``valid`` values, and ``bad`` ones about once in ``one_in`` draws."""
    return st.integers(0, one_in - 1).flatmap(lambda k: bad if k == 0 else valid)


degree = mostly(st.one_of(st.integers(1, 4), st.sampled_from(["1", "2", "4"])))
data_mode = mostly(st.sampled_from(["fsdp2", "ddp", "none", "DDP", " none "]))


@st.composite
def parallelism_blocks(draw):
    block = {}
    for key, values in (("data", data_mode), ("tensor", degree), ("domain", degree)):
        if draw(st.booleans()) or draw(st.booleans()):
            block[key] = draw(values)
    if draw(st.integers(0, 9)) == 0:
        block[draw(st.sampled_from(["pipeline", "Tensor", "dp", "context"]))] = draw(junk)
    return draw(st.one_of(st.just(block), junk)) if draw(st.integers(0, 7)) == 0 else block


@st.composite
def full_configs(draw):
    choice = draw(st.integers(0, 15))
    if choice == 0:
        return draw(junk)
    if choice == 1:
        return {"trainer": draw(junk)}
    if choice == 2:
        return {"model": {}}
    return {"trainer": {"parallelism": draw(parallelism_blocks())}}


world_sizes = st.one_of(st.integers(1, 64), st.integers(-2, 0), st.booleans())

NAMES_A_KEY = ("trainer", "config", "world", "tensor", "domain", "data")


def _names_a_key(err: ValueError) -> None:
    message = str(err)
    assert any(k in message for k in NAMES_A_KEY), f"message names no key: {message}"


# --------------------------------------------------------------------------- config
@FUZZ
@given(full_configs())
def test_parse_parallelism_conf_accepts_a_valid_block_or_names_the_key(conf):
    try:
        block = parse_parallelism_conf(conf)
    except ValueError as err:
        _names_a_key(err)
        return
    assert block["data"] in {m.value for m in DataMode}
    for key in ("tensor", "domain"):
        assert type(block[key]) is int and block[key] >= 1
    raw = conf["trainer"]["parallelism"] or {}
    for key in ("tensor", "domain"):  # what was given is what is returned
        if key in raw:
            assert block[key] == int(str(raw[key]).strip())


@FUZZ
@given(parallelism_blocks(), world_sizes)
def test_dp_world_size_and_parallel_dims_agree_or_name_the_key(block, world):
    try:
        dp = dp_world_size(block, world)
    except ValueError as err:
        _names_a_key(err)
        try:
            ParallelDims.from_block(block, world)
        except ValueError:
            return
        raise AssertionError("dp_world_size refused what ParallelDims accepts") from None
    dims = ParallelDims.from_block(block, world)
    assert dp == dims.dp >= 1
    assert dp * dims.tp * dims.domain == world
    axes = dict(dims.mesh_axes)
    assert math.prod(axes.values()) == world
    assert ("dp" in axes) == (dims.data != "none" or dp > 1)
    assert all(size > 1 for name, size in axes.items() if name != "dp")


@FUZZ
@given(parallelism_blocks(), st.data())
def test_an_accepted_layout_builds_the_predicted_mesh_on_a_fake_process_group(block, data):
    try:
        parsed = parse_parallelism_block(block)
    except ValueError as err:
        _names_a_key(err)
        return
    inner = parsed["tensor"] * parsed["domain"]  # mostly a world size that fits the layout
    world = data.draw(mostly(st.integers(1, 4).map(lambda k: k * inner), st.integers(1, 16), 4))
    try:
        dims = ParallelDims.from_block(block, world)
    except ValueError as err:
        assert world % inner, f"{world} ranks fit {inner} but were refused: {err}"
        _names_a_key(err)
        return
    rank = data.draw(st.integers(0, world - 1), label="rank")
    # SPEC 2: axes of size > 1 in (dp, tp, domain) order, plus "dp" whenever data != "none";
    # no mesh at all only when no axis is kept (one process, data "none")
    sizes = {"dp": dims.dp, "tp": dims.tp, "domain": dims.domain}
    expected = [(n, s) for n, s in sizes.items() if s > 1 or (n == "dp" and dims.data != "none")]
    with fake_process_group(rank, world):
        mesh, submeshes = build_device_mesh(block, device="cpu")
        if not expected:
            assert mesh is None and submeshes == {}
            return
        assert tuple(mesh.mesh_dim_names) == tuple(n for n, _ in expected)
        assert tuple(mesh.shape) == tuple(s for _, s in expected)
        full = dict(zip(("dp", "tp", "domain"), full_rank_layout(dims).coords(rank)))
        for name in mesh.mesh_dim_names:
            assert mesh[name].get_local_rank() == full[name]
        assert set(submeshes) == {n for n, s in expected if s > 1}


# --------------------------------------------------------------------------- rank layout
shape_dims = st.one_of(st.integers(1, 4), st.integers(-1, 0), st.booleans())


@FUZZ
@given(
    st.lists(shape_dims, max_size=4),
    st.one_of(st.integers(0, 70), st.booleans()),
    st.one_of(st.none(), st.lists(st.sampled_from(["dp", "tp", "domain", "cp"]), max_size=4)),
)
def test_rank_layout_is_a_bijection_or_names_the_problem(shape, world, names):
    try:
        layout = RankLayout(shape, world, names)
    except ValueError as err:
        assert any(k in str(err) for k in ("shape", "world_size", "dim names")), str(err)
        return
    assert layout.size == world == math.prod(shape)
    seen = set()
    for rank in range(world):
        coords = layout.coords(rank)
        assert layout.rank_of(coords) == rank
        seen.add(coords)
    assert len(seen) == world
    for dim in range(layout.ndim):
        groups = layout.groups_along_dim(dim)
        assert sorted(r for g in groups for r in g) == list(range(world))
        assert all(len(g) == shape[dim] for g in groups)
    for bad in (-1, world, True):
        try:
            layout.coords(bad)
        except ValueError as err:
            assert "rank" in str(err)
        else:
            raise AssertionError(f"coords({bad!r}) accepted")


# --------------------------------------------------------------------------- planning and validation
@st.composite
def unet_runs(draw):
    groups = draw(st.sampled_from([1, 2, 4]))
    levels = draw(st.integers(1, 3))
    model = {
        "type": "unet",
        "in_channels": draw(st.integers(1, 3)),
        "out_channels": draw(st.integers(1, 3)),
        # a height too small for the levels now and then
        "image_height": draw(mostly(st.integers(2**levels, 24), st.integers(-1, 3))),
        "image_width": draw(st.integers(1, 12)),
        "base_channels": groups * draw(st.integers(1, 3)),
        "channel_mults": draw(st.lists(st.integers(1, 3), min_size=levels, max_size=levels)),
        "norm_groups": groups,
        "mlp_ratio": draw(st.integers(1, 3)),
    }
    if draw(st.integers(0, 9)) == 0:
        model[draw(st.sampled_from(["type", "base_channels", "norm_groups", "depth"]))] = draw(junk)
    block = {
        "data": draw(st.sampled_from(["none", "ddp", "fsdp2"])),
        "tensor": draw(st.integers(1, 4)),
        "domain": draw(st.integers(1, 8)),
    }
    world = block["tensor"] * block["domain"] * draw(st.integers(1, 2))
    if draw(st.integers(0, 5)) == 0:
        world += draw(st.integers(-world, 3))
    trainer = {"parallelism": block}
    if draw(st.integers(0, 5)) == 0:
        trainer[draw(st.sampled_from(["batch_size", "amp", "dist_timeout_s", "nonfinite"]))] = draw(
            junk
        )
    return {"model": model, "trainer": trainer}, world


@SLOW_FUZZ
@given(unet_runs())
def test_make_plan_accepts_and_the_model_runs_or_a_value_error_names_the_key(run):
    conf, world = run
    try:
        plan = make_plan(conf, world)
    except ValueError as err:
        assert any(k in str(err) for k in ("model", "world", "trainer")), str(err)
        return
    assert all(isinstance(v, str) and v for v in plan.violations)
    n = plan.domain
    if plan.ok:
        # every level in the balanced layout, empty shards included (SPEC §3)
        assert all(sum(sizes) == h and len(sizes) == n for h, sizes in plan.levels)
        assert plan.dims is not None and plan.dp * plan.tp * n == world
        torch.manual_seed(0)
        model = build_model(conf["model"])  # the accepted model really runs on its grid
        x = torch.randn(1, *plan.input_shapes[0])
        with torch.no_grad():
            y = model(x)
        assert y.shape[-2:] == x.shape[-2:]


@SLOW_FUZZ
@given(unet_runs())
def test_validate_run_collects_problems_and_never_raises(run):
    conf, world = run
    problems = validate_run(conf, world)
    assert isinstance(problems, list)
    assert all(isinstance(p, str) and p for p in problems)
    if not problems:  # what validate_run accepts, the planner accepts too
        assert make_plan(conf, world).ok
