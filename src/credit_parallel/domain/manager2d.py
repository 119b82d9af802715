"""Two-dimensional (latitude x longitude) domains: the manager of one rank's tile (SPEC §3b).

The domain rank (lat, lon) = ``lat*Q + lon`` owns the balanced rows of its latitude shard
(``rows.shard_range`` over P) and the balanced columns of its longitude shard (the same rule over
Q, applied to W, the last dim).  :class:`TiledDomainManager` is a
:class:`~credit_parallel.domain.manager.DomainParallelManager` whose own group is the FLATTENED
domain group (P x Q ranks, in domain rank order): what spans the whole domain (norm statistics,
the domain gradient sum, FSDP2 over dp x domain) uses it unchanged.  What works along one axis
asks one of its two axis views:

* :attr:`TiledDomainManager.lat` — a manager over the ranks of this rank's longitude column
  (same lon, lat = 0 .. P-1): rows move between these (north / south);
* :attr:`TiledDomainManager.lon` — a manager over the ranks of this rank's latitude band (same
  lat, lon = 0 .. Q-1): columns move between these (west / east, periodic).

Each view is a full DomainParallelManager of its axis (its own group, ranks, global-length cache),
so the whole 1-D machinery (``rows.plan_exchange``, ``exchange.exchange_planned``, the shard /
gather collectives) runs along either axis without a second implementation.  The manager's own
``global_length`` REFUSES: a layer that asks the flattened group for its height is a 1-D layer
that does not know tiles, and would be silently wrong (its rows are not the balanced layout over
P x Q ranks); the error names the layer.
"""

from __future__ import annotations

import weakref

import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh

from ..layout.config import DOMAIN_LAT, DOMAIN_LON, all_ranks_joined, require_process_group
from .manager import (
    TILED_MANAGER,
    DomainParallelManager,
    _axis_mesh,
    _mesh_device_type,
    set_domain_parallel_manager,
)
from .traced_heights import HeightTable

__all__ = [
    "TiledDomainManager",
    "domain_shape_of",
    "initialize_tiled_domain_parallel",
    "is_tiled",
    "tiles_unsupported",
]


def is_tiled(manager) -> bool:
    """Whether ``manager`` splits longitude too (a :class:`TiledDomainManager`)."""
    return bool(getattr(manager, "is_tiled", False))


def domain_shape_of(manager) -> tuple[int, int]:
    """``(P, Q)`` of ``manager`` (``(1, 1)`` for None)."""
    if manager is None:
        return (1, 1)
    return tuple(manager.domain_shape)


def _axis_view(parent: DomainParallelManager, group, ranks: list[int]) -> DomainParallelManager:
    """A DomainParallelManager over ``ranks`` (one axis of ``parent``'s tiles), sharing the
    parent's data-parallel group and settings, with its own group and global-length caches.

    Built from the parent's state rather than through ``__init__`` (which builds meshes): every
    attribute is the parent's, except the group, the ranks, and every container (the caches and
    the :class:`HeightTable` a compiled forward reads), which start empty so that the two axes
    never share a learned length: a layer's height lives in the latitude view's, its width in
    the longitude view's."""
    view = object.__new__(DomainParallelManager)
    for key, value in vars(parent).items():
        if isinstance(value, HeightTable):
            value = HeightTable()
        elif isinstance(value, weakref.WeakKeyDictionary):
            value = weakref.WeakKeyDictionary()
        elif isinstance(value, (dict, set)):
            value = type(value)()
        vars(view)[key] = value
    rank = dist.get_rank()
    view._domain_group = group if len(ranks) > 1 else None
    view._domain_ranks = list(ranks)
    view._domain_rank = ranks.index(rank)
    return view


class TiledDomainManager(DomainParallelManager):
    """The domain-parallel context of one rank's (lat, lon) tile; see the module docstring.

    Built from the mesh of ``build_device_mesh`` (:meth:`from_tile_mesh`, what
    ``DomainParallelManager.from_device_mesh`` does for a mesh with a "domain_lon" axis), or from
    ``(world_size, (P, Q))``, which builds a ("dp", "domain_lat", "domain_lon") mesh of its own.
    """

    is_tiled = True

    def __init__(
        self,
        world_size: int,
        domain_shape: tuple[int, int],
        shard_dim: int = -2,
        *,
        mesh: DeviceMesh | None = None,
    ):
        lat, lon = _check_shape(domain_shape)
        require_process_group("TiledDomainManager")
        if mesh is None:
            if not isinstance(world_size, int) or world_size % (lat * lon):
                raise ValueError(
                    f"world_size {world_size!r} is not divisible by the domain {lat} x {lon}"
                )
            mesh = init_device_mesh(
                _mesh_device_type(),
                (world_size // (lat * lon), lat, lon),
                mesh_dim_names=("dp", DOMAIN_LAT, DOMAIN_LON),
            )
            all_ranks_joined()
        lat_mesh, lon_mesh = _axis_mesh(mesh, DOMAIN_LAT), _axis_mesh(mesh, DOMAIN_LON)
        if lat_mesh is None or lon_mesh is None:
            raise ValueError(
                f"TiledDomainManager needs a mesh with {DOMAIN_LAT!r} and {DOMAIN_LON!r} axes, "
                f"got {mesh}"
            )
        if (lat_mesh.size(), lon_mesh.size()) != (lat, lon):
            raise ValueError(
                f"domain_shape {(lat, lon)} does not match the mesh's {DOMAIN_LAT} x "
                f"{DOMAIN_LON} = {lat_mesh.size()} x {lon_mesh.size()}"
            )
        # the flattened lat-major axis (the one ParallelDims.build_mesh made, when it did)
        flat = mesh._get_root_mesh()[DOMAIN_LAT, DOMAIN_LON]._flatten("domain")
        super().__init__(world_size, lat * lon, shard_dim, mesh=flat)
        lat_ranks = dist.get_process_group_ranks(lat_mesh.get_group())
        lon_ranks = dist.get_process_group_ranks(lon_mesh.get_group())
        self._shape = (lat, lon)
        self._lat = _axis_view(self, lat_mesh.get_group(), lat_ranks)
        self._lon = _axis_view(self, lon_mesh.get_group(), lon_ranks)
        expected = self._lat.domain_rank * lon + self._lon.domain_rank
        if self.domain_rank != expected:  # the flattened axis is lat-major (SPEC §3b)
            raise RuntimeError(
                f"the flattened domain rank {self.domain_rank} is not lat*Q + lon = {expected}"
            )

    @classmethod
    def from_tile_mesh(cls, mesh: DeviceMesh, shard_dim: int = -2) -> TiledDomainManager:
        """From a mesh (or a submesh of one) with "domain_lat" and "domain_lon" axes and the
        flattened "domain" axis on its root (``ParallelDims.build_mesh``)."""
        require_process_group("TiledDomainManager.from_tile_mesh")
        lat_mesh, lon_mesh = _axis_mesh(mesh, DOMAIN_LAT), _axis_mesh(mesh, DOMAIN_LON)
        shape = (lat_mesh.size() if lat_mesh is not None else 1, lon_mesh.size())
        return cls(dist.get_world_size(), shape, shard_dim, mesh=mesh)

    # ------------------------------------------------------------------ the tile
    @property
    def domain_shape(self) -> tuple[int, int]:
        return self._shape

    @property
    def domain_coords(self) -> tuple[int, int]:
        return (self._lat.domain_rank, self._lon.domain_rank)

    @property
    def lat(self) -> DomainParallelManager:
        """The manager along latitude: the P ranks of this rank's longitude column."""
        return self._lat

    @property
    def lon(self) -> DomainParallelManager:
        """The manager along longitude: the Q ranks of this rank's latitude band."""
        return self._lon

    @property
    def strips(self) -> DomainParallelManager:
        """A 1-D manager over the FLATTENED domain group (P x Q ranks, domain rank order): the
        latitude strips a module not exact on tiles runs on (``tiles_relayout.py``); its own
        global-length cache, so its 1-D layers learn their heights as on a 1-D domain."""
        view = self.__dict__.get("_strips")
        if view is None:
            view = self._strips = _axis_view(self, self.domain_group, list(self.domain_ranks))
        return view

    @property
    def lat_group(self):
        """The process group of :attr:`lat` (None when P = 1)."""
        return self._lat.domain_group

    @property
    def lon_group(self):
        """The process group of :attr:`lon` (Q > 1 ranks)."""
        return self._lon.domain_group

    @property
    def is_first_domain_rank(self) -> bool:
        """On the north edge (lat == 0)."""
        return self._lat.is_first_domain_rank

    @property
    def is_last_domain_rank(self) -> bool:
        """On the south edge (lat == P - 1)."""
        return self._lat.is_last_domain_rank

    def neighbor_ranks(self) -> tuple[int | None, int | None]:
        """(north, south) global ranks: the LATITUDE neighbours (SPEC §3b); None at the poles."""
        return self._lat.neighbor_ranks()

    def lon_neighbor_ranks(self) -> tuple[int, int]:
        """(west, east) global ranks, periodic in longitude (both this rank when Q = 1; the
        same rank when Q = 2)."""
        ranks, r = self._lon.domain_ranks, self._lon.domain_rank
        q = len(ranks)
        return ranks[(r - 1) % q], ranks[(r + 1) % q]

    # ------------------------------------------------------------------ global lengths
    def begin_forward(self, token) -> None:
        super().begin_forward(token)
        self._lat.begin_forward(token)
        self._lon.begin_forward(token)
        if "_strips" in self.__dict__:
            self._strips.begin_forward(token)

    def global_height(self, owner, local_rows: int) -> int:
        """The global height of the tile ``owner`` (a layer) was handed: its latitude column's
        rows, learned and cached as ``DomainParallelManager.global_length`` does."""
        return self._lat.global_length(owner, local_rows)

    def global_width(self, owner, local_columns: int) -> int:
        """The global width of the tile ``owner`` was handed, over its latitude band (cached
        and noted in the longitude view's own caches: a layer's height and width never share
        an entry; under ``torch.compile`` read from the widths noted at trace time,
        ``traced_heights.py``)."""
        return self._lon.global_length(owner, local_columns)

    def global_length(self, owner, local_length: int, *args, **kwargs) -> int:
        """Refused: see the module docstring.  Tile-aware code asks :attr:`lat` / :attr:`lon`."""
        raise ValueError(tiles_unsupported(owner))

    def __repr__(self) -> str:
        lat, lon = self.domain_coords
        return (
            f"TiledDomainManager(tile=({lat}, {lon}) of {self._shape[0]} x {self._shape[1]}, "
            f"dp_rank={self.dp_rank}/{self.dp_world_size}, domain_ranks={self._domain_ranks})"
        )


TILED_MANAGER[:] = [TiledDomainManager]  # DomainParallelManager.from_device_mesh builds it


def initialize_tiled_domain_parallel(
    world_size: int, domain_shape: tuple[int, int], shard_dim: int = -2
) -> TiledDomainManager:
    """Create the process-wide manager of a ``domain_shape`` = (P, Q) domain and return it."""
    manager = TiledDomainManager(world_size, domain_shape, shard_dim)
    set_domain_parallel_manager(manager)
    return manager


def tiles_unsupported(owner, path: str | None = None) -> str:
    """The refusal of a layer that is not exact on lat x lon tiles (yet)."""
    name = type(owner).__name__
    where = f"{path} ({name})" if path else name
    return (
        f"{where}: two-dimensional (lat x lon) domains do not support this layer yet; use "
        "trainer.parallelism.domain as an int (latitude only), or replace the layer"
    )


def _check_shape(shape) -> tuple[int, int]:
    if isinstance(shape, dict):
        shape = (shape.get("lat"), shape.get("lon"))
    if not isinstance(shape, (tuple, list)) or len(shape) != 2:
        raise ValueError(f"domain_shape must be (lat, lon), got {shape!r}")
    for key, value in zip(("lat", "lon"), shape):
        if isinstance(value, bool) or not isinstance(value, int) or value < 1:
            raise ValueError(f"domain_shape {key} must be an integer >= 1, got {value!r}")
    return int(shape[0]), int(shape[1])
