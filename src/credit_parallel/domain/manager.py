"""DomainParallelManager: the process groups of domain parallelism and global-length bookkeeping.

One manager for every domain: a domain is P x Q tiles (SPEC §3b), a latitude-only domain the
P x 1 case.  Domain groups are runs of consecutive global ranks (domain is the innermost mesh
axis, SPEC §2); the domain rank (lat, lon) = ``lat*Q + lon`` owns the balanced rows of its
latitude shard (``rows.shard_range`` over P) and the balanced columns of its longitude shard
(the same rule over Q, applied to W, the last dim).  The manager's own group is the FLATTENED
domain group (P x Q ranks, in domain rank order): what spans the whole domain (norm statistics,
the domain gradient sum, FSDP2 over dp x domain) uses it.  What works along one axis asks one of
its two axis views, each a full manager of its axis (own group, ranks and caches), so the 1-D
machinery runs along either axis without a second implementation:

* :attr:`DomainParallelManager.lat` — the P ranks of this rank's longitude column (rows move
  between these, north / south).  At Q = 1 it is the manager itself: no second object, no
  extra message;
* :attr:`DomainParallelManager.lon` — the Q ranks of this rank's latitude band (columns move
  between these, west / east, periodic).  At Q = 1 a trivial one-rank view (no group, nothing
  to exchange).

The manager also answers the one question every layer has: the GLOBAL height of the tensor it
was handed.  A local height alone does not determine it (5 local rows on rank 0 of 2 can be a
global 9 or 10), so the answer is learned once per (layer, call, input token) with a tiny
all_gather and cached under a key every rank shares: the global shapes registered by
``shard_tensor``/``shard_batch`` for the current forward, plus the call's position within it.
All ranks therefore miss the cache together and never deadlock on a collective only some take.
On a Q > 1 domain :meth:`~DomainParallelManager.global_length` REFUSES (a layer that asks the
flattened group for its height does not know tiles, and would be silently wrong): tile-aware
code asks :meth:`~DomainParallelManager.global_height` / ``global_width`` (the axis views).
:class:`TiledDomainManager` is this manager built for a (P, Q) shape (``tiles_unsupported``
names a layer the tile path does not take).
"""

from __future__ import annotations

import weakref
from dataclasses import dataclass, field

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh

from ..layout.compat import all_gather_single
from ..layout.config import DOMAIN_LAT, DOMAIN_LON, all_ranks_joined, require_process_group
from .traced_heights import HeightTable, traced_height

__all__ = [
    "DomainParallelManager",
    "TiledDomainManager",
    "domain_shape_of",
    "get_domain_parallel_manager",
    "initialize_domain_parallel",
    "initialize_tiled_domain_parallel",
    "is_tiled",
    "require_manager",
    "set_domain_parallel_manager",
    "tiles_unsupported",
]

_MANAGER = None


def _axis_mesh(mesh: DeviceMesh, name: str) -> DeviceMesh | None:
    """The 1-D mesh along axis ``name`` of ``mesh``, or of its root mesh (where the size-1 axes
    that SPEC §2 leaves out of ``mesh`` live), else None."""
    for candidate in (mesh, mesh._get_root_mesh()):
        if name in tuple(candidate.mesh_dim_names or ()):
            return candidate[name]
    return None


def _mesh_device_type() -> str:
    return "cuda" if "nccl" in str(dist.get_backend()) else "cpu"


@dataclass
class _HeightCache:
    """One layer's learned global heights: ``cache[(token, call index)] = (local, global)``;
    ``calls`` counts the layer's calls in the forward numbered ``epoch``."""

    epoch: int | None = None
    calls: int = 0
    cache: dict = field(default_factory=dict)


class DomainParallelManager:
    """Domain-parallel context of this rank: the domain and data-parallel groups of a mesh.

    Built from a DeviceMesh (:meth:`from_device_mesh`, what ``parallelize`` does) or, as in the
    seed, from ``(world_size, domain_parallel_size)``, which builds a ("dp", "domain") mesh of
    its own; either way the groups are the mesh's, never a second set.  ``domain_group`` is None
    when the domain has one rank (nothing to exchange); ``data_parallel_group`` is always a group,
    of this one rank when dp has size 1.
    """

    def __init__(
        self,
        world_size: int,
        domain_parallel_size: int,
        shard_dim: int = -2,
        *,
        mesh: DeviceMesh | None = None,
    ):
        for name, v in (("world_size", world_size), ("domain_parallel_size", domain_parallel_size)):
            if isinstance(v, bool) or not isinstance(v, int) or v < 1:
                raise ValueError(f"{name} must be an integer >= 1, got {v!r}")
        if world_size % domain_parallel_size:
            raise ValueError(
                f"world_size {world_size} is not divisible by domain_parallel_size {domain_parallel_size}"
            )
        require_process_group("DomainParallelManager")
        if dist.get_world_size() != world_size:
            raise ValueError(
                f"world_size {world_size} does not match the process group size {dist.get_world_size()}"
            )
        if mesh is None:
            # the seed's layout: consecutive ranks form a domain group (domain innermost)
            mesh = init_device_mesh(
                _mesh_device_type(),
                (world_size // domain_parallel_size, domain_parallel_size),
                mesh_dim_names=("dp", "domain"),
            )
            all_ranks_joined()
        domain_mesh, dp_mesh = _axis_mesh(mesh, "domain"), _axis_mesh(mesh, "dp")
        rank = dist.get_rank()
        if domain_mesh is not None and domain_mesh.size() > 1:
            self._domain_group = domain_mesh.get_group()
            self._domain_ranks = dist.get_process_group_ranks(self._domain_group)
        else:
            self._domain_group, self._domain_ranks = None, [rank]
        if len(self._domain_ranks) != domain_parallel_size:
            raise ValueError(
                f"domain_parallel_size {domain_parallel_size} does not match the mesh's domain "
                f"axis of size {len(self._domain_ranks)}"
            )
        if dp_mesh is not None:
            self._dp_group = dp_mesh.get_group()
        else:
            # a hand-built mesh with no "dp" axis anywhere: dp has size 1, and a group of this
            # one rank needs no other rank to take part
            self._dp_group = dist.new_group([rank], use_local_synchronization=True)
        self._dp_ranks = dist.get_process_group_ranks(self._dp_group)
        self.world_size = world_size
        self.data_parallel_size = len(self._dp_ranks)
        self.shard_dim = shard_dim
        self._epoch = 0
        self._token = None
        # per layer (weakly held): its global heights learned in earlier forwards
        self._heights: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()
        # the heights a compiled forward reads (traced_heights.py), and what token attention
        # noted per owner (attention/token_core.py): state of the library, not of the modules
        self.height_table = HeightTable()
        self.token_counts_noted: dict = {}
        self._rank = rank
        self._domain_rank = self._domain_ranks.index(rank)
        self._dp_rank = self._dp_ranks.index(rank)
        # the tile: P x 1 here (TiledDomainManager sets P x Q and its axis views)
        self._shape = (len(self._domain_ranks), 1)
        self._lat, self._lon = self, None  # lon: the trivial view, built when asked

    @classmethod
    def from_device_mesh(cls, mesh: DeviceMesh, shard_dim: int = -2) -> DomainParallelManager:
        """Build from the mesh of ``build_device_mesh`` (its "domain" and "dp" axes; axes of size
        1 that the mesh leaves out are taken from its root), so the groups are the mesh's own
        and agree with it also when tensor > 1."""
        require_process_group("DomainParallelManager.from_device_mesh")
        if not isinstance(mesh, DeviceMesh):
            raise TypeError(
                f"from_device_mesh needs a DeviceMesh (from build_device_mesh), got {mesh!r}"
            )
        if _axis_mesh(mesh, "domain_lon") is not None:  # a lat x lon domain (SPEC §3b)
            return TiledDomainManager.from_tile_mesh(mesh, shard_dim)
        domain_mesh = _axis_mesh(mesh, "domain")
        domain_size = domain_mesh.size() if domain_mesh is not None else 1
        return cls(dist.get_world_size(), domain_size, shard_dim, mesh=mesh)

    # ------------------------------------------------------------------ groups and ranks
    @property
    def domain_group(self):
        return self._domain_group

    @property
    def data_parallel_group(self):
        return self._dp_group

    @property
    def domain_rank(self) -> int:
        return self._domain_rank

    @property
    def domain_world_size(self) -> int:
        return len(self._domain_ranks)

    @property
    def domain_parallel_size(self) -> int:
        """The seed's attribute name (``credit.domain_parallel``) for :attr:`domain_world_size`;
        CREDIT's own helpers (e.g. ``credit.parallel.gather_spatial``) read it."""
        return self.domain_world_size

    @property
    def domain_ranks(self) -> list[int]:
        """Global ranks of this rank's domain group, in domain order."""
        return list(self._domain_ranks)

    @property
    def dp_rank(self) -> int:
        return self._dp_rank

    @property
    def dp_world_size(self) -> int:
        return len(self._dp_ranks)

    # ------------------------------------------------------------------ the tile and its axes
    # whether the layers take the tile path (a manager built as a TiledDomainManager)
    is_tiled = False

    @property
    def domain_shape(self) -> tuple[int, int]:
        """``(P, Q)``: ``(domain size, 1)`` for a latitude-only domain."""
        return self._shape

    @property
    def domain_coords(self) -> tuple[int, int]:
        """``(lat, lon)`` of this rank's tile: ``(domain_rank, 0)`` for a latitude-only domain."""
        return (self._lat._domain_rank, self.lon._domain_rank)

    @property
    def lat(self) -> DomainParallelManager:
        """The manager along latitude: the P ranks of this rank's longitude column (this
        manager itself at Q = 1)."""
        return self._lat

    @property
    def lon(self) -> DomainParallelManager:
        """The manager along longitude: the Q ranks of this rank's latitude band (at Q = 1 a
        one-rank view: no group, nothing to exchange)."""
        if self._lon is None:
            self._lon = _axis_view(self, None, [self._rank])
        return self._lon

    @property
    def strips(self) -> DomainParallelManager:
        """A 1-D manager over the FLATTENED domain group (P x Q ranks, domain rank order): the
        latitude strips a module not exact on tiles runs on (``tiles_relayout.py``); its own
        global-length cache, so its 1-D layers learn their heights as on a 1-D domain (at
        Q = 1: this manager)."""
        if self._lat is self:
            return self
        view = self.__dict__.get("_strips")
        if view is None:
            view = self._strips = _axis_view(self, self.domain_group, list(self.domain_ranks))
        return view

    @property
    def lat_group(self):
        """The process group of :attr:`lat` (None when P = 1)."""
        return self._lat._domain_group

    @property
    def lon_group(self):
        """The process group of :attr:`lon` (None when Q = 1)."""
        return self.lon._domain_group

    @property
    def is_first_domain_rank(self) -> bool:
        """On the north edge (lat == 0)."""
        return self._lat._domain_rank == 0

    @property
    def is_last_domain_rank(self) -> bool:
        """On the south edge (lat == P - 1)."""
        return self._lat._domain_rank == len(self._lat._domain_ranks) - 1

    def neighbor_ranks(self) -> tuple[int | None, int | None]:
        """(north, south) global ranks: the LATITUDE neighbours (SPEC §3b); None at the poles."""
        ranks, r = self._lat._domain_ranks, self._lat._domain_rank
        prev = ranks[r - 1] if r > 0 else None
        nxt = ranks[r + 1] if r + 1 < len(ranks) else None
        return prev, nxt

    def lon_neighbor_ranks(self) -> tuple[int, int]:
        """(west, east) global ranks, periodic in longitude (both this rank when Q = 1; the
        same rank when Q = 2)."""
        ranks, r = self.lon._domain_ranks, self.lon._domain_rank
        q = len(ranks)
        return ranks[(r - 1) % q], ranks[(r + 1) % q]

    @property
    def device(self) -> torch.device:
        """Device for communication buffers: CUDA under NCCL, else CPU."""
        group = self._domain_group
        backend = dist.get_backend(group) if dist.is_initialized() else "gloo"
        if "nccl" in str(backend):
            return torch.device("cuda", torch.cuda.current_device())
        return torch.device("cpu")

    # ------------------------------------------------------------------ global heights
    def begin_forward(self, token) -> None:
        """Register the global input shape(s) of the coming forward (done by shard_tensor /
        shard_batch); layers key their cached global heights by it (the axis views too)."""
        self._token = token
        self._epoch += 1
        for view in (self._lat, self._lon, self.__dict__.get("_strips")):
            if view is not None and view is not self:
                view.begin_forward(token)

    def global_height(self, owner, local_rows: int) -> int:
        """The global height of the tile ``owner`` (a layer) was handed: its latitude column's
        rows, learned and cached as :meth:`global_length` does."""
        return self._lat.global_length(owner, local_rows)

    def global_width(self, owner, local_columns: int) -> int:
        """The global width of the tile ``owner`` was handed, over its latitude band (cached
        and noted in the longitude view's own caches: a layer's height and width never share
        an entry; under ``torch.compile`` read from the widths noted at trace time,
        ``traced_heights.py``); the local width at Q = 1."""
        return self.lon.global_length(owner, local_columns)

    def global_length(self, owner, local_length: int, *, cached: bool = True) -> int:
        """The global length along the shard dim of the tensor ``owner`` (a layer) was handed.

        Cached per (registered token, call index of ``owner`` in this forward); on a miss, one
        all_gather of the local lengths on the domain group (every rank misses together).  The
        cache assumes the owner sees the same heights whenever the token repeats (a layer inside
        a model whose forward depends only on the input shapes).  ``cached=False`` always asks
        the group: for owners such as ``gather_tensor`` that are handed unrelated tensors
        (different models, different layers' outputs) under the same token.  Refused on a
        Q > 1 domain (module docstring).
        """
        if self._shape[1] > 1:
            raise ValueError(tiles_unsupported(owner))
        if self.domain_world_size == 1:
            return local_length
        if torch.compiler.is_compiling():
            return self._traced_length(owner, local_length)
        if self._token is None or not cached:
            return self._remember(owner, local_length, self._gather_length(owner, local_length))
        state = self._heights.get(owner)
        if state is None:
            state = self._heights[owner] = _HeightCache()
        if state.epoch != self._epoch:
            state.epoch, state.calls = self._epoch, 0
        key = (self._token, state.calls)
        state.calls += 1
        hit = state.cache.get(key)
        if hit is not None:
            if hit[0] != local_length:
                raise RuntimeError(
                    f"{type(owner).__name__}: local height {local_length} differs from the "
                    f"{hit[0]} seen at the same call for the same input shape; the forward's "
                    "control flow changed between steps (call manager.begin_forward(None) to "
                    "disable height caching)"
                )
            return hit[1]
        length = self._gather_length(owner, local_length)
        if len(state.cache) > 256:
            state.cache.clear()
        state.cache[key] = (local_length, length)
        return self._remember(owner, local_length, length)

    def _remember(self, owner, local_length: int, length: int) -> int:
        """Note in :attr:`height_table` (the manager's, never on ``owner``) that ``owner`` was
        called at global ``length`` under this forward's token, for :meth:`_traced_length`."""
        self.height_table.note(owner, self._token, length)
        return length

    def _traced_length(self, owner, local_length: int) -> int:
        """The global length under ``torch.compile``, derived at trace time without asking the
        group: the height noted for ``owner`` under this forward's token by the trace-time probe
        of the whole model (``traced_heights.py``) or by an eager call (``compile_blocks``)."""
        # int(): a height Dynamo holds as a symbol is specialised (guarded) to its value
        return traced_height(self, id(owner), self._token, int(local_length))

    def _gather_length(self, owner, local_length: int) -> int:
        from .rows import shard_sizes

        sizes = torch.zeros(self.domain_world_size, dtype=torch.int64, device=self.device)
        mine = torch.tensor([local_length], dtype=torch.int64, device=self.device)
        all_gather_single(sizes, mine, group=self._domain_group)
        sizes = [int(v) for v in sizes.tolist()]
        total = sum(sizes)
        if tuple(sizes) != shard_sizes(total, self.domain_world_size):
            raise ValueError(
                f"{type(owner).__name__}: local heights {sizes} across the domain ranks are not "
                f"the balanced layout of {total} rows {list(shard_sizes(total, self.domain_world_size))}; "
                "shard inputs with credit_parallel.shard_tensor / shard_batch"
            )
        return total

    def __deepcopy__(self, memo):
        # process groups cannot be copied; a copied model keeps talking through the same groups
        return self

    def __repr__(self) -> str:
        if self.is_tiled:
            (lat, lon), (p, q) = self.domain_coords, self._shape
            return (
                f"{type(self).__name__}(tile=({lat}, {lon}) of {p} x {q}, "
                f"dp_rank={self.dp_rank}/{self.dp_world_size}, domain_ranks={self._domain_ranks})"
            )
        return (
            f"DomainParallelManager(domain_rank={self.domain_rank}/{self.domain_world_size}, "
            f"dp_rank={self.dp_rank}/{self.dp_world_size}, domain_ranks={self._domain_ranks})"
        )


def _axis_view(parent: DomainParallelManager, group, ranks: list[int]) -> DomainParallelManager:
    """A P x 1 manager over ``ranks`` (one axis of ``parent``'s tiles), sharing the parent's
    data-parallel group and settings, with its own group and global-length caches.

    Built from the parent's state rather than through ``__init__`` (which builds meshes): every
    attribute is the parent's, except the group, the ranks, the tile (its own axis) and every
    container (the caches and the :class:`HeightTable` a compiled forward reads), which start
    empty so that the two axes never share a learned length: a layer's height lives in the
    latitude view's, its width in the longitude view's."""
    view = object.__new__(DomainParallelManager)
    for key, value in vars(parent).items():
        if key == "_strips":
            continue
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
    view._shape = (len(ranks), 1)
    view._lat, view._lon = view, None
    return view


class TiledDomainManager(DomainParallelManager):
    """The manager of a ``domain_shape`` = (P, Q) domain: its flattened group and the two axis
    views (module docstring); the layers take the tile path under it (``is_tiled``).

    Built from the mesh of ``build_device_mesh`` (:meth:`from_tile_mesh`, what
    :meth:`DomainParallelManager.from_device_mesh` does for a mesh with a "domain_lon" axis), or
    from ``(world_size, (P, Q))``, which builds a ("dp", "domain_lat", "domain_lon") mesh of its
    own.
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
        self._shape = (lat, lon)
        for axis, sub in (("_lat", lat_mesh), ("_lon", lon_mesh)):
            group = sub.get_group()
            vars(self)[axis] = _axis_view(self, group, dist.get_process_group_ranks(group))
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


def is_tiled(manager) -> bool:
    """Whether ``manager`` takes the tile path (a :class:`TiledDomainManager`)."""
    return bool(getattr(manager, "is_tiled", False))


def domain_shape_of(manager) -> tuple[int, int]:
    """``(P, Q)`` of ``manager`` (``(1, 1)`` for None)."""
    if manager is None:
        return (1, 1)
    return tuple(manager.domain_shape)


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


def initialize_domain_parallel(world_size: int, domain_parallel_size: int, shard_dim: int = -2):
    """Create the process-wide manager and return it."""
    global _MANAGER
    _MANAGER = DomainParallelManager(world_size, domain_parallel_size, shard_dim)
    return _MANAGER


def initialize_tiled_domain_parallel(
    world_size: int, domain_shape: tuple[int, int], shard_dim: int = -2
) -> TiledDomainManager:
    """Create the process-wide manager of a ``domain_shape`` = (P, Q) domain and return it."""
    manager = TiledDomainManager(world_size, domain_shape, shard_dim)
    set_domain_parallel_manager(manager)
    return manager


def set_domain_parallel_manager(manager) -> None:
    global _MANAGER
    _MANAGER = manager


def get_domain_parallel_manager():
    """The process-wide manager, or None."""
    return _MANAGER


def resolve_manager(manager, what: str):
    """``manager`` or the process-wide one; a clear error when there is neither.

    Only at the public boundary (SPEC §3: a layer built without ``manager=`` uses the
    process-wide manager, resolved at its forward): the manager it returns is passed explicitly
    below, where :func:`require_manager` refuses None."""
    mgr = manager if manager is not None else _MANAGER
    if mgr is None:
        raise RuntimeError(
            f"{what}: no DomainParallelManager given and none initialised; pass manager= or call "
            "initialize_domain_parallel(...)"
        )
    return mgr


def require_manager(manager, what: str):
    """``manager``, which an internal call must be given: no fall-back to the process-wide
    manager below the public boundary (:func:`resolve_manager`); ``ValueError`` naming ``what``."""
    if manager is None:
        raise ValueError(
            f"{what}: needs a DomainParallelManager (got None); internal calls take the manager "
            "their layer resolved (resolve_manager), they never fall back to the process-wide one"
        )
    return manager
