"""RankLayout: row-major index math of an n-dimensional rank grid (no process group needed).

The last dim varies fastest.  ``build_device_mesh`` and ``data_parallel_coords`` both use this
class, so the layout arithmetic of the whole package lives here.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

__all__ = ["RankLayout"]


def _is_int(value) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


class RankLayout:
    """A row-major grid of ``prod(shape)`` ranks with optional dim names."""

    def __init__(
        self, shape: Sequence[int], world_size: int, dim_names: Sequence[str] | None = None
    ):
        shape = tuple(shape)
        if len(shape) == 0:
            raise ValueError("RankLayout shape must have at least one dim, got ()")
        for i, s in enumerate(shape):
            if not _is_int(s) or s < 1:
                raise ValueError(f"RankLayout shape[{i}] must be an integer >= 1, got {s!r}")
        if not _is_int(world_size) or math.prod(shape) != world_size:
            raise ValueError(
                f"RankLayout shape {shape} has {math.prod(shape)} ranks but world_size is {world_size!r}"
            )
        if dim_names is not None:
            dim_names = tuple(dim_names)
            if len(dim_names) != len(shape):
                raise ValueError(
                    f"RankLayout got {len(dim_names)} dim names {dim_names} for {len(shape)} dims"
                )
            if len(set(dim_names)) != len(dim_names):
                raise ValueError(f"RankLayout dim names must be unique, got {dim_names}")
        self._shape = shape
        self._names = dim_names
        # stride of dim i = product of the sizes of the dims after it (row-major)
        strides = [1] * len(shape)
        for i in range(len(shape) - 2, -1, -1):
            strides[i] = strides[i + 1] * shape[i + 1]
        self._strides = tuple(strides)

    @property
    def shape(self) -> tuple[int, ...]:
        return self._shape

    @property
    def dim_names(self) -> tuple[str, ...] | None:
        return self._names

    @property
    def ndim(self) -> int:
        return len(self._shape)

    @property
    def size(self) -> int:
        return math.prod(self._shape)

    def __repr__(self) -> str:
        return f"RankLayout(shape={self._shape}, dim_names={self._names})"

    def dim_index(self, name) -> int:
        if self._names is None or name not in self._names:
            raise ValueError(f"unknown mesh dim name {name!r}; dims are {self._names}")
        return self._names.index(name)

    def _dim(self, dim) -> int:
        if isinstance(dim, str):
            return self.dim_index(dim)
        if not _is_int(dim) or not 0 <= dim < self.ndim:
            raise ValueError(f"dim must be a name or an index in [0, {self.ndim}), got {dim!r}")
        return dim

    def _check_rank(self, rank) -> None:
        if not _is_int(rank) or not 0 <= rank < self.size:
            raise ValueError(f"rank must be an integer in [0, {self.size}), got {rank!r}")

    def coords(self, rank: int) -> tuple[int, ...]:
        self._check_rank(rank)
        return tuple((rank // st) % n for st, n in zip(self._strides, self._shape))

    def rank_of(self, coords: Sequence[int]) -> int:
        coords = tuple(coords)
        if len(coords) != self.ndim:
            raise ValueError(f"expected {self.ndim} coords, got {coords}")
        for i, (c, n) in enumerate(zip(coords, self._shape)):
            if not _is_int(c) or not 0 <= c < n:
                raise ValueError(f"coord {i} must be an integer in [0, {n}), got {c!r}")
        return sum(c * st for c, st in zip(coords, self._strides))

    def ranks_along_dim(self, dim, rank: int) -> list[int]:
        """The ranks that share every coordinate of ``rank`` except along ``dim``, in order."""
        d = self._dim(dim)
        base = list(self.coords(rank))
        out = []
        for i in range(self._shape[d]):
            base[d] = i
            out.append(self.rank_of(base))
        return out

    def groups_along_dim(self, dim) -> list[list[int]]:
        """All groups of ranks along ``dim``; together they partition the ranks."""
        d = self._dim(dim)
        groups = []
        for rank in range(self.size):
            if self.coords(rank)[d] == 0:
                groups.append(self.ranks_along_dim(d, rank))
        return groups
