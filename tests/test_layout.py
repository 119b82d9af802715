import math

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from credit_parallel import RankLayout

shapes = st.lists(st.integers(1, 5), min_size=1, max_size=4).map(tuple)


@settings(max_examples=200, deadline=None)
@given(shapes)
def test_coords_rank_roundtrip_is_row_major(shape):
    n = math.prod(shape)
    lay = RankLayout(shape, n)
    seen = set()
    for r in range(n):
        c = lay.coords(r)
        assert lay.rank_of(c) == r
        # row-major, last dim fastest
        expect = 0
        for ci, si in zip(c, shape):
            expect = expect * si + ci
        assert expect == r
        seen.add(c)
    assert len(seen) == n


@settings(max_examples=200, deadline=None)
@given(shapes, st.data())
def test_groups_along_dim_partition_ranks(shape, data):
    n = math.prod(shape)
    lay = RankLayout(shape, n, [f"d{i}" for i in range(len(shape))])
    dim = data.draw(st.integers(0, len(shape) - 1))
    by_name = lay.groups_along_dim(f"d{dim}")
    groups = lay.groups_along_dim(dim)
    assert by_name == groups
    assert sorted(r for g in groups for r in g) == list(range(n))
    assert len(groups) == n // shape[dim]
    for g in groups:
        assert len(g) == shape[dim]
        coords = [lay.coords(r) for r in g]
        assert [c[dim] for c in coords] == list(range(shape[dim]))
        for c in coords:  # all other coordinates shared
            assert c[:dim] + c[dim + 1 :] == coords[0][:dim] + coords[0][dim + 1 :]
        for r in g:
            assert lay.ranks_along_dim(dim, r) == g


def test_properties_and_names():
    lay = RankLayout((2, 3, 4), 24, ("dp", "tp", "domain"))
    assert lay.shape == (2, 3, 4) and lay.ndim == 3 and lay.size == 24
    assert lay.dim_names == ("dp", "tp", "domain")
    assert lay.dim_index("tp") == 1
    assert lay.coords(23) == (1, 2, 3)
    assert lay.ranks_along_dim("domain", 5) == [4, 5, 6, 7]
    with pytest.raises(AttributeError):
        lay.shape = (1,)


@pytest.mark.parametrize(
    "args",
    [((), 1, None), ((0, 2), 0, None), ((2, 2), 5, None), ((2, 2), 4, ("a",)), ((-1,), -1, None)],
)
def test_construction_errors(args):
    with pytest.raises(ValueError):
        RankLayout(*args)


def test_out_of_range_errors():
    lay = RankLayout((2, 3), 6, ("a", "b"))
    for bad in (-1, 6, 1.0, True):
        with pytest.raises(ValueError):
            lay.coords(bad)
    with pytest.raises(ValueError):
        lay.rank_of((2, 0))
    with pytest.raises(ValueError):
        lay.rank_of((0, -1))
    with pytest.raises(ValueError):
        lay.rank_of((0,))
    with pytest.raises(ValueError, match="'c'"):
        lay.dim_index("c")
    with pytest.raises(ValueError):
        lay.groups_along_dim(2)
    with pytest.raises(ValueError):
        lay.ranks_along_dim(-1, 0)
