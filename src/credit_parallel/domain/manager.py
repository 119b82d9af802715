"""DomainParallelManager: the process groups of domain parallelism and global-height bookkeeping.

Domain groups are runs of consecutive global ranks (domain is the innermost mesh axis, SPEC §2).
The manager also answers the one question every layer has: the GLOBAL height of the tensor it
was handed.  A local height alone does not determine it (5 local rows on rank 0 of 2 can be a
global 9 or 10), so the answer is learned once per (layer, call, input token) with a tiny
all_gather and cached under a key every rank shares: the global shapes registered by
``shard_tensor``/``shard_batch`` for the current forward, plus the call's position within it.
All ranks therefore miss the cache together and never deadlock on a collective only some take.
"""

from __future__ import annotations

import weakref
from dataclasses import dataclass, field

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh

from ..layout.compat import all_gather_single
from ..layout.config import all_ranks_joined, require_process_group
from .traced_heights import HeightTable, traced_height

__all__ = [
    "DomainParallelManager",
    "get_domain_parallel_manager",
    "require_manager",
    "initialize_domain_parallel",
    "set_domain_parallel_manager",
]

_MANAGER = None
# [the manager class of lat x lon domains]: manager2d.TiledDomainManager registers itself here
# (it builds on this module); the domain package imports manager2d, so it is always registered
TILED_MANAGER: list = []


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
            return TILED_MANAGER[0].from_tile_mesh(mesh, shard_dim)  # manager2d registers it
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

    @property
    def is_first_domain_rank(self) -> bool:
        return self._domain_rank == 0

    @property
    def is_last_domain_rank(self) -> bool:
        return self._domain_rank == self.domain_world_size - 1

    # two-dimensional domains (SPEC §3b; manager2d.TiledDomainManager) answer these too
    is_tiled = False

    @property
    def domain_shape(self) -> tuple[int, int]:
        """``(P, Q)``: ``(domain size, 1)`` for a latitude-only domain."""
        return (self.domain_world_size, 1)

    @property
    def domain_coords(self) -> tuple[int, int]:
        """``(lat, lon)`` of this rank's tile: ``(domain_rank, 0)`` for a latitude-only domain."""
        return (self.domain_rank, 0)

    def neighbor_ranks(self) -> tuple[int | None, int | None]:
        """(previous, next) global ranks along the domain (north, south); None at the edges."""
        r = self._domain_rank
        prev = self._domain_ranks[r - 1] if r > 0 else None
        nxt = self._domain_ranks[r + 1] if r + 1 < self.domain_world_size else None
        return prev, nxt

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
        shard_batch); layers key their cached global heights by it."""
        self._token = token
        self._epoch += 1

    def global_length(self, owner, local_length: int, *, cached: bool = True) -> int:
        """The global length along the shard dim of the tensor ``owner`` (a layer) was handed.

        Cached per (registered token, call index of ``owner`` in this forward); on a miss, one
        all_gather of the local lengths on the domain group (every rank misses together).  The
        cache assumes the owner sees the same heights whenever the token repeats (a layer inside
        a model whose forward depends only on the input shapes).  ``cached=False`` always asks
        the group: for owners such as ``gather_tensor`` that are handed unrelated tensors
        (different models, different layers' outputs) under the same token.
        """
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
        return (
            f"DomainParallelManager(domain_rank={self.domain_rank}/{self.domain_world_size}, "
            f"dp_rank={self.dp_rank}/{self.dp_world_size}, domain_ranks={self._domain_ranks})"
        )


def initialize_domain_parallel(world_size: int, domain_parallel_size: int, shard_dim: int = -2):
    """Create the process-wide manager and return it."""
    global _MANAGER
    _MANAGER = DomainParallelManager(world_size, domain_parallel_size, shard_dim)
    return _MANAGER


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
