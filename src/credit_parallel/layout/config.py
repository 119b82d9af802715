"""Configuration: the ``trainer.parallelism`` block, YAML loading, and the layout object.

The parallel degrees are parsed and validated in exactly one place (``parse_parallelism_block``).
:class:`ParallelDims`, built from that block and the world size, owns the layout: degrees, every
divisibility check, the :class:`~credit_parallel.layout.ranks.RankLayout`, "is the layout trivial", and
the DeviceMeshes (:class:`ParallelMesh`, with the flattened dp x domain axis FSDP2 shards over);
mesh, composition, the domain manager and the CLI ask it instead of recomputing.

Naming convention used throughout the package: an *axis* is a dimension of the device mesh
("dp", "tp", "domain", the flattened "dp_domain"); a *dim* is a dimension of a tensor.  The
degree of an axis is ``ParallelDims.dp`` / ``.tp`` / ``.domain``; code holding it elsewhere
calls it ``dp_size`` / ``tp_size`` / ``domain_size`` (beside ``dp_rank`` / ``domain_rank``).
``domain_parallel_size`` and ``domain_world_size`` are only the SPEC's public names of
``DomainParallelManager``.
"""

from __future__ import annotations

import enum
import os
import re
from dataclasses import dataclass, field
from typing import Any

import torch.distributed as dist
import yaml
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh

from .ranks import RankLayout

__all__ = [
    "DOMAIN_LAT",
    "DOMAIN_LON",
    "DP_DOMAIN",
    "ENSEMBLE",
    "all_ranks_joined",
    "DataMode",
    "domain_degrees",
    "parse_domain_option",
    "MeshAxis",
    "ParallelDims",
    "ParallelMesh",
    "has_process_group",
    "load_config",
    "parse_parallelism_block",
    "parse_parallelism_conf",
    "require_process_group",
]

_ALLOWED_KEYS = ("data", "tensor", "domain", "ensemble")
_DIGITS = re.compile(r"^[0-9]+$")


class DataMode(enum.StrEnum):
    FSDP2 = "fsdp2"
    DDP = "ddp"
    NONE = "none"


class MeshAxis(enum.StrEnum):
    DP = "dp"
    TP = "tp"
    DOMAIN = "domain"


ENSEMBLE = "ensemble"  # mesh axis of the ensemble members (SPEC §2), between "dp" and "tp"


DOMAIN_LAT = "domain_lat"  # mesh axes of a two-dimensional (lat x lon) domain (SPEC §3b)
DOMAIN_LON = "domain_lon"
_DOMAIN_KEYS = ("lat", "lon")


def _parse_degree(key: str, value: Any) -> int:
    """An integer >= 1 given as int or as a string of decimal digits; bool and float refused."""
    where = f"trainer.parallelism.{key}"
    if isinstance(value, bool):
        raise ValueError(f"{where} must be an integer >= 1, got the bool {value!r}")
    if isinstance(value, int):
        degree = value
    elif isinstance(value, str) and _DIGITS.fullmatch(value):
        # exactly "strings of decimal digits" (SPEC §1): no sign, space or non-ASCII digit
        degree = int(value)
    else:
        raise ValueError(
            f"{where} must be an integer >= 1 (or a string of decimal digits), "
            f"got {value!r} of type {type(value).__name__}"
        )
    if degree < 1:
        raise ValueError(f"{where} must be an integer >= 1, got {value!r}")
    return degree


def _parse_domain(value: Any) -> int | dict:
    """``trainer.parallelism.domain``: an int D (latitude only) or ``{lat: P, lon: Q}`` (SPEC
    §3b); returned as an int when Q == 1, else ``{"lat": P, "lon": Q}``."""
    if not isinstance(value, dict):
        return _parse_degree("domain", value)
    unknown = sorted(str(k) for k in value if k not in _DOMAIN_KEYS)
    if unknown:
        raise ValueError(
            f"trainer.parallelism.domain.{unknown[0]} is not a key of a two-dimensional domain; "
            f"allowed keys are {list(_DOMAIN_KEYS)} (e.g. domain: {{lat: 2, lon: 2}})"
        )
    for key in _DOMAIN_KEYS:
        if key not in value:
            raise ValueError(
                f"trainer.parallelism.domain.{key} is missing: a two-dimensional domain names "
                "both lat and lon (e.g. domain: {lat: 2, lon: 2})"
            )
    lat, lon = (_parse_degree(f"domain.{key}", value[key]) for key in _DOMAIN_KEYS)
    return lat if lon == 1 else {"lat": lat, "lon": lon}


def parse_domain_option(text: str) -> str | dict:
    """A command line's ``--domain``: ``"4"`` (latitude only, returned as given for
    :func:`parse_parallelism_block` to check) or ``"PxQ"`` / ``"lat=P,lon=Q"`` (a
    two-dimensional domain, returned as ``{"lat": "P", "lon": "Q"}``)."""
    text = str(text).strip()
    if "x" in text:
        lat, _, lon = text.partition("x")
        return {"lat": lat.strip(), "lon": lon.strip()}
    if "=" in text:
        out = {}
        for part in text.split(","):
            key, _, value = part.partition("=")
            out[key.strip()] = value.strip()
        return out
    return text


def domain_degrees(domain: Any) -> tuple[int, int]:
    """``(P, Q)`` of a parsed ``domain`` value: ``(D, 1)`` for an int D, ``(lat, lon)`` for the
    mapping :func:`parse_parallelism_block` returns (unvalidated values are passed through, for
    :meth:`ParallelDims.problems` to report)."""
    if isinstance(domain, dict):
        return domain.get("lat"), domain.get("lon")
    return domain, 1


def parse_parallelism_block(block: Any) -> dict:
    """Validate a ``trainer.parallelism`` block itself (not the full config)."""
    if not isinstance(block, dict):
        raise ValueError(
            f"trainer.parallelism must be a mapping with keys {_ALLOWED_KEYS}, "
            f"got {block!r} of type {type(block).__name__}"
        )
    unknown = sorted(str(k) for k in block if k not in _ALLOWED_KEYS)
    if unknown:
        raise ValueError(
            f"trainer.parallelism has unknown key(s) {unknown}; allowed keys are {list(_ALLOWED_KEYS)}"
        )
    data = block.get("data", "none")
    # exactly one of the three spellings (SPEC §1); "DDP", " ddp" or null are refused, not guessed
    if not isinstance(data, str) or data not in {m.value for m in DataMode}:
        raise ValueError(
            f"trainer.parallelism.data must be one of 'fsdp2', 'ddp', 'none', got {data!r}"
        )
    parsed = {
        "data": str(data),
        "tensor": _parse_degree("tensor", block.get("tensor", 1)),
        "domain": _parse_domain(block.get("domain", 1)),
    }
    ensemble = _parse_degree("ensemble", block.get("ensemble", 1))
    if ensemble > 1:  # SPEC §1: present only above 1, so E = 1 leaves the block unchanged
        parsed["ensemble"] = ensemble
    return parsed


def parse_parallelism_conf(conf: Any) -> dict:
    """Parse ``conf["trainer"]["parallelism"]`` of a FULL config.

    Returns ``{"data", "tensor", "domain"}`` with defaults ``"none"``, 1, 1; ``domain`` is an
    int, or ``{"lat": P, "lon": Q}`` for a two-dimensional domain with Q > 1 (SPEC §3b);
    ``"ensemble"`` too when the block sets it above 1 (SPEC §2).  Raises
    ``ValueError`` naming the key and the bad value for a missing block, unknown keys, a bad
    ``data`` mode, or degrees that are not integers >= 1.
    """
    if not isinstance(conf, dict):
        raise ValueError(f"config must be a mapping, got {type(conf).__name__}")
    trainer = conf.get("trainer")
    if not isinstance(trainer, dict):
        raise ValueError("config is missing the 'trainer' section (needed for trainer.parallelism)")
    if trainer.get("parallelism") is None:  # absent, or an empty `parallelism:` in YAML
        raise ValueError(
            "config is missing trainer.parallelism (e.g. {data: fsdp2, tensor: 1, domain: 1})"
        )
    return parse_parallelism_block(trainer["parallelism"])


def load_config(path: str | os.PathLike) -> dict:
    """Read a YAML config with ``yaml.safe_load``; clear errors for a missing file or bad YAML."""
    path = os.fspath(path)
    if not os.path.exists(path):
        raise FileNotFoundError(f"config file not found: {path}")
    if os.path.isdir(path):
        raise ValueError(f"config path is a directory, not a YAML file: {path}")
    try:
        with open(path, encoding="utf-8") as fh:
            conf = yaml.safe_load(fh)
    except yaml.YAMLError as exc:
        mark = getattr(exc, "problem_mark", None)
        where = f" at line {mark.line + 1}, column {mark.column + 1}" if mark is not None else ""
        raise ValueError(f"invalid YAML in {path}{where}: {getattr(exc, 'problem', exc)}") from None
    if conf is None:
        raise ValueError(f"config file is empty: {path}")
    if not isinstance(conf, dict):
        raise ValueError(
            f"config file {path} must contain a mapping at top level, got {type(conf).__name__}"
        )
    return conf


def has_process_group() -> bool:
    """Whether the default torch.distributed process group is initialised (the one check of it)."""
    return dist.is_available() and dist.is_initialized()


def require_process_group(what: str) -> None:
    """``RuntimeError`` naming ``what`` and the fix unless a process group is initialised."""
    if not has_process_group():
        raise RuntimeError(
            f"{what} needs an initialised torch.distributed process group; call "
            "torch.distributed.init_process_group(...) first (or launch with torchrun / "
            "`credit-parallel train --nproc N`)"
        )


def all_ranks_joined() -> None:
    """Barrier after creating process groups.  A one-rank group (a size-1 axis) is set up through
    the rendezvous store without waiting for any other rank, so without this a rank could run
    ahead, finish and take the store down (it lives on rank 0) while others still use it."""
    dist.barrier()


def _current_world_size(parsed: dict) -> int:
    """The size of the default process group; without one, a single process (1), which only a
    layout with tensor = domain = ensemble = 1 fits."""
    if has_process_group():
        return dist.get_world_size()
    lat, lon = domain_degrees(parsed["domain"])
    if parsed["tensor"] * lat * lon * parsed.get("ensemble", 1) > 1:
        require_process_group(f"trainer.parallelism {parsed}")
    return 1


def _is_int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _degree_items(tp: Any, domain: Any, ensemble: Any = 1) -> tuple[tuple[str, Any], ...]:
    """(key, value) of every degree to check: ensemble (when not 1), tensor, and domain or
    domain.lat / domain.lon."""
    items = () if ensemble == 1 else (("ensemble", ensemble),)
    if isinstance(domain, dict):
        lat, lon = domain_degrees(domain)
        return items + (("tensor", tp), ("domain.lat", lat), ("domain.lon", lon))
    return items + (("tensor", tp), ("domain", domain))


def _layout_problems(
    data: Any, tp: Any, domain: Any, world_size: Any, ensemble: Any = 1
) -> list[str]:
    """What makes the rank layout impossible, every problem at once.  ``domain``: an int, or
    ``{"lat": P, "lon": Q}`` (SPEC §3b); ``ensemble``: the E of SPEC §2."""
    problems = []
    if data not in {m.value for m in DataMode}:
        problems.append(
            f"trainer.parallelism.data must be one of 'fsdp2', 'ddp', 'none', got {data!r}"
        )
    degrees_ok = True
    items = _degree_items(tp, domain, ensemble)
    for key, value in items:
        if not _is_int(value) or value < 1:
            problems.append(f"trainer.parallelism.{key} must be an integer >= 1, got {value!r}")
            degrees_ok = False
    if not _is_int(world_size):
        problems.append(f"world_size must be an int, got {world_size!r}")
    elif world_size < 1:
        problems.append(f"world_size must be >= 1, got {world_size}")
    elif degrees_ok:
        inner = 1
        for _, value in items:
            inner *= value
        if world_size % inner:
            names = "*".join(key for key, _ in items)
            values = "*".join(str(value) for _, value in items)
            problems.append(
                f"world size {world_size} is not divisible by trainer.parallelism.{names} = "
                f"{values} = {inner}: use a world size that is a multiple of {inner}, or change "
                f"{'/'.join(key for key, _ in items)}"
            )
    return problems


def _support_problems(data: Any, tp: Any, ensemble: Any = 1) -> list[str]:
    """Combinations with a valid rank layout but no exact implementation."""
    problems = []
    if data == DataMode.DDP and _is_int(tp) and tp > 1:
        problems.append(
            "trainer.parallelism: data 'ddp' cannot be combined with tensor > 1 (DDP does not "
            "reduce tensor-parallel DTensor gradients); use data: fsdp2"
        )
    if _is_int(ensemble) and ensemble > 1 and data != DataMode.FSDP2:
        problems.append(
            f"trainer.parallelism.ensemble = {ensemble} needs data: fsdp2 (FSDP2 sums the "
            f"members' gradients over the ensemble axis); got data: {data!r}"
        )
    return problems


@dataclass(frozen=True)
class ParallelDims:
    """THE parallel layout of one run: degrees, world-size arithmetic, rank layout and meshes.

    Built once from ``trainer.parallelism`` and the world size (:meth:`from_conf` /
    :meth:`from_block`); every other module asks it instead of recomputing.  Global rank g has
    coordinates (dp, tp, domain) row-major, domain innermost (SPEC §2): :attr:`rank_layout`;
    with an ensemble axis (``ensemble`` E > 1) (dp, ensemble, tp, domain).

    ``domain`` may be given as ``{"lat": P, "lon": Q}`` (SPEC §3b); it is then stored as the
    domain SIZE P*Q with ``domain_lon`` = Q, so everything that spans the whole domain group
    (the flattened "domain" axis, FSDP2 over dp x domain) reads ``domain`` unchanged; the
    (dp, tp, lat, lon) layout is :attr:`tile_layout`.
    """

    data: str
    tp: int
    domain: int
    world_size: int
    ensemble: int = 1
    domain_lon: int = field(default=1, init=False)

    def __post_init__(self):
        problems = _layout_problems(self.data, self.tp, self.domain, self.world_size, self.ensemble)
        if problems:
            raise ValueError("; ".join(problems))
        lat, lon = domain_degrees(self.domain)
        object.__setattr__(self, "domain", lat * lon)
        object.__setattr__(self, "domain_lon", lon)

    @staticmethod
    def problems(data: Any, tp: Any, domain: Any, world_size: Any, ensemble: Any = 1) -> list[str]:
        """Every problem of the layout (``data``, tensor ``tp``, ``domain``) on ``world_size``
        ranks, one message each naming the key and the fix; empty when it can run.

        Both kinds at once: what makes the rank layout impossible (the constructor raises those)
        and combinations with a valid layout but no exact implementation
        (:meth:`check_supported` raises those).  The planner and preflight report this list.
        """
        problems = _layout_problems(data, tp, domain, world_size, ensemble)
        return problems + _support_problems(data, tp, ensemble)

    @classmethod
    def from_block(cls, block: Any, world_size: int | None = None) -> ParallelDims:
        """From a ``trainer.parallelism`` block; ``world_size=None``: the current process group's
        size (1 without one; ``RuntimeError`` then if tensor*domain > 1)."""
        parsed = parse_parallelism_block(block)
        if world_size is None:
            world_size = _current_world_size(parsed)
        return cls(
            parsed["data"],
            parsed["tensor"],
            parsed["domain"],
            world_size,
            parsed.get("ensemble", 1),
        )

    @classmethod
    def from_conf(cls, conf: Any, world_size: int | None = None) -> ParallelDims:
        """From a FULL config (``conf["trainer"]["parallelism"]``); see :meth:`from_block`."""
        parsed = parse_parallelism_conf(conf)
        if world_size is None:
            world_size = _current_world_size(parsed)
        return cls(
            parsed["data"],
            parsed["tensor"],
            parsed["domain"],
            world_size,
            parsed.get("ensemble", 1),
        )

    # ---------------------------------------------------------------- degrees and layout
    @property
    def dp(self) -> int:
        return self.world_size // (self.ensemble * self.tp * self.domain)

    @property
    def outer_axes(self) -> tuple[tuple[str, int], ...]:
        """(name, size) of the axes outside the domain: dp, ensemble (only when E > 1), tp."""
        dp = ((MeshAxis.DP.value, self.dp),)
        ens = ((ENSEMBLE, self.ensemble),) if self.ensemble > 1 else ()
        return dp + ens + ((MeshAxis.TP.value, self.tp),)

    @property
    def domain_lat(self) -> int:
        """P, the latitude degree of the domain (the whole domain when it is latitude only)."""
        return self.domain // self.domain_lon

    @property
    def domain_shape(self) -> tuple[int, int]:
        """``(P, Q)``: ``(domain, 1)`` for a latitude-only domain (SPEC §3b)."""
        return (self.domain_lat, self.domain_lon)

    @property
    def is_2d(self) -> bool:
        """Whether the domain is split in longitude too (Q > 1)."""
        return self.domain_lon > 1

    @property
    def full_layout_shape(self) -> tuple[int, ...]:
        """(dp, tp, domain), or (dp, ensemble, tp, domain) when E > 1."""
        return tuple(size for _, size in self.outer_axes) + (self.domain,)

    @property
    def layout_axis_names(self) -> tuple[str, ...]:
        """The names of :attr:`full_layout_shape`'s axes."""
        return tuple(name for name, _ in self.outer_axes) + (MeshAxis.DOMAIN.value,)

    @property
    def rank_layout(self) -> RankLayout:
        """The (dp, [ensemble,] tp, domain) layout of all ranks, size-1 axes included (ensemble
        only when E > 1); the domain coordinate of a two-dimensional domain is its flattened
        rank ``lat*Q + lon``."""
        return RankLayout(self.full_layout_shape, self.world_size, self.layout_axis_names)

    @property
    def tile_layout(self) -> RankLayout:
        """The (dp, [ensemble,] tp, domain_lat, domain_lon) layout of all ranks (SPEC §3b),
        size-1 axes included; row-major, longitude innermost (for Q = 1 the same order as
        :attr:`rank_layout`)."""
        shape = tuple(size for _, size in self.outer_axes) + (self.domain_lat, self.domain_lon)
        names = tuple(name for name, _ in self.outer_axes) + (DOMAIN_LAT, DOMAIN_LON)
        return RankLayout(shape, self.world_size, names)

    def coords(self, rank: int) -> dict[str, int]:
        """``{"dp": .., "tp": .., "domain": ..}`` of global ``rank`` (and ``"ensemble"`` when
        E > 1); with a two-dimensional domain also ``"domain_lat"`` and ``"domain_lon"``
        ("domain" is then ``lat*Q + lon``)."""
        out = dict(zip(self.layout_axis_names, self.rank_layout.coords(rank)))
        if self.is_2d:
            lat, lon = self.tile_layout.coords(rank)[-2:]
            out.update({DOMAIN_LAT: lat, DOMAIN_LON: lon})
        return out

    def ensemble_coord(self, rank: int) -> int:
        """The ensemble coordinate of global ``rank`` (0 when E = 1)."""
        return self.coords(rank).get(ENSEMBLE, 0)

    @property
    def mesh_axes(self) -> tuple[tuple[str, int], ...]:
        """(name, size) of every axis of the SPEC §2 mesh: sizes > 1, plus "dp" whenever
        data != none (even at dp size 1).  Empty only for one process with nothing active.
        A two-dimensional domain has the axes "domain_lat" and "domain_lon" (SPEC §3b)."""
        keep_dp = self.data != DataMode.NONE or self.dp > 1
        sizes = (
            (MeshAxis.DP.value, self.dp, keep_dp),
            (ENSEMBLE, self.ensemble, self.ensemble > 1),
        )
        sizes += ((MeshAxis.TP.value, self.tp, self.tp > 1),)
        if self.is_2d:
            lat, lon = self.domain_shape
            sizes += ((DOMAIN_LAT, lat, lat > 1), (DOMAIN_LON, lon, True))
        else:
            sizes += ((MeshAxis.DOMAIN.value, self.domain, self.domain > 1),)
        return tuple((name, size) for name, size, keep in sizes if keep)

    @property
    def is_trivial(self) -> bool:
        """No mesh at all: one process, ``data: none``, tensor = domain = 1.  Such a run needs
        no process group (the CLI runs it in-process)."""
        return not self.mesh_axes

    @property
    def parallelizes_model(self) -> bool:
        """Whether ``parallelize`` changes the model: a data wrapper, tensor or domain > 1.
        (``data: none`` on 8 ranks has a "dp" mesh but leaves the model alone.)"""
        return self.data != DataMode.NONE or self.tp > 1 or self.domain > 1

    @property
    def fsdp_over_domain(self) -> bool:
        """FSDP2 shards over the flattened dp x [ensemble x] domain axis (SPEC §4): fsdp2 with
        domain > 1 or ensemble > 1 (gradients summed over ensemble and domain, averaged over dp)."""
        return self.data == DataMode.FSDP2 and (self.domain > 1 or self.ensemble > 1)

    @property
    def fsdp_group_size(self) -> int:
        """Ranks of the group FSDP2 shards over (dp x ensemble x domain; SPEC §4), 0 when data
        is not fsdp2.  At 1 the library applies no ``fully_shard`` unless asked
        (``trainer.fsdp2_single_rank``)."""
        size = self.dp * self.ensemble * self.domain
        return size if self.data == DataMode.FSDP2 else 0

    def check_supported(self) -> None:
        """Refuse combinations that have a valid rank layout but no exact implementation."""
        problems = _support_problems(self.data, self.tp, self.ensemble)
        if problems:
            raise ValueError("; ".join(problems))

    # ---------------------------------------------------------------- meshes
    def build_mesh(self, device_type: str = "cuda") -> ParallelMesh:
        """Build every DeviceMesh of this layout over the default process group (collective:
        every rank must call it).  A trivial layout builds nothing and needs no process group."""
        if self.is_trivial:
            return ParallelMesh(self, None, None, {}, None)
        require_process_group(f"the layout {self} (a DeviceMesh)")
        if dist.get_world_size() != self.world_size:
            raise ValueError(
                f"ParallelDims was built for world size {self.world_size} but the process group "
                f"has {dist.get_world_size()} ranks"
            )
        if self.is_2d:
            return self._build_tile_mesh(device_type)
        # The root keeps the size-1 axes too: their groups are the one-rank groups a manager
        # needs (a data_parallel_group of one rank at dp = 1), created with the mesh, not beside.
        names = self.layout_axis_names
        root = init_device_mesh(device_type, self.full_layout_shape, mesh_dim_names=names)
        # DeviceMesh's rank order is row-major over the shape, which is RankLayout's order.
        rank = dist.get_rank()
        assert tuple(root.get_coordinate()) == self.rank_layout.coords(rank)
        kept = tuple(name for name, _ in self.mesh_axes)
        mesh = root if kept == names else root[kept if len(kept) > 1 else kept[0]]
        submeshes = {name: root[name] for name, size in self.mesh_axes if size > 1}
        dp_domain = None
        if self.fsdp_over_domain:
            dp_domain = root[self._fsdp_axes(MeshAxis.DOMAIN.value)]._flatten(DP_DOMAIN)
        all_ranks_joined()
        return ParallelMesh(self, root, mesh, submeshes, dp_domain)

    def _fsdp_axes(self, *domain_axes: str) -> tuple[str, ...]:
        """The root axes FSDP2's flattened group spans: dp, [ensemble,] and the domain axes."""
        ens = (ENSEMBLE,) if self.ensemble > 1 else ()
        return (MeshAxis.DP.value,) + ens + domain_axes

    def _build_tile_mesh(self, device_type: str) -> ParallelMesh:
        """The meshes of a two-dimensional domain (SPEC §3b): a (dp, tp, domain_lat,
        domain_lon) root, the flattened "domain" axis (P*Q, rank lat*Q + lon) and, for FSDP2,
        the flattened dp x lat x lon axis."""
        layout = self.tile_layout
        names = layout.dim_names
        root = init_device_mesh(device_type, layout.shape, mesh_dim_names=names)
        assert tuple(root.get_coordinate()) == layout.coords(dist.get_rank())
        domain = root[DOMAIN_LAT, DOMAIN_LON]._flatten(MeshAxis.DOMAIN.value)
        kept = tuple(name for name, _ in self.mesh_axes)
        mesh = root if kept == names else root[kept if len(kept) > 1 else kept[0]]
        submeshes = {name: root[name] for name, size in self.mesh_axes if size > 1}
        submeshes[DOMAIN_LAT] = root[DOMAIN_LAT]
        submeshes[DOMAIN_LON] = root[DOMAIN_LON]
        submeshes[MeshAxis.DOMAIN.value] = domain
        dp_domain = None
        if self.fsdp_over_domain:
            dp_domain = root[self._fsdp_axes(DOMAIN_LAT, DOMAIN_LON)]._flatten(DP_DOMAIN)
        all_ranks_joined()
        return ParallelMesh(self, root, mesh, submeshes, dp_domain)


DP_DOMAIN = "dp_domain"  # name of the flattened dp x domain mesh axis FSDP2 shards over


@dataclass(frozen=True)
class ParallelMesh:
    """The meshes of one :class:`ParallelDims` layout, built once by :meth:`ParallelDims.build_mesh`.

    ``mesh``/``submeshes`` are the SPEC §2 view (axes of size > 1, plus "dp" unless data is
    none); ``root`` has all three axes, size 1 included; ``dp_domain`` is the flattened
    dp x domain axis (only when FSDP2 shards over it).  All share ``root``, so FSDP2 can compose
    a dp_domain mesh with the tp mesh (2-D FSDP + TP).
    """

    dims: ParallelDims
    root: DeviceMesh | None
    mesh: DeviceMesh | None
    submeshes: dict[str, DeviceMesh]
    dp_domain: DeviceMesh | None

    def axis(self, name: str) -> DeviceMesh:
        """The 1-D mesh along ``name`` ("dp", "tp", "domain" — size 1 included —, "domain_lat" /
        "domain_lon" of a two-dimensional domain ("domain" is then their flattened axis), or
        "dp_domain"); ``ValueError`` for a trivial layout or an unknown/absent axis."""
        if name == DP_DOMAIN and self.dp_domain is not None:
            return self.dp_domain
        names = self.dims.layout_axis_names
        if self.dims.is_2d:
            if name == MeshAxis.DOMAIN.value:
                return self.submeshes[name]  # the flattened lat x lon axis
            names += (DOMAIN_LAT, DOMAIN_LON)
        if self.root is None or name not in names:
            raise ValueError(f"the layout {self.dims} has no mesh axis {name!r}")
        return self.root[name]

    @property
    def fsdp_mesh(self) -> DeviceMesh:
        """The 1-D mesh FSDP2 shards over: dp x domain when domain > 1, else dp."""
        return self.dp_domain if self.dp_domain is not None else self.axis(MeshAxis.DP.value)
