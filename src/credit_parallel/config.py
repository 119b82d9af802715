"""Configuration: the ``trainer.parallelism`` block and YAML loading.

The parallel degrees are parsed and validated in exactly one place (``parse_parallelism_block``);
every other module (mesh, composition, CLI) asks :class:`ParallelDims` instead of recomputing
world-size arithmetic.  Naming convention used throughout the package: an *axis* is a dimension
of the device mesh ("dp", "tp", "domain"); a *dim* is a dimension of a tensor.
"""

from __future__ import annotations

import enum
import os
import re
from dataclasses import dataclass
from typing import Any

import yaml

__all__ = [
    "DataMode",
    "MeshAxis",
    "ParallelDims",
    "load_config",
    "parse_parallelism_block",
    "parse_parallelism_conf",
]

_ALLOWED_KEYS = ("data", "tensor", "domain")
_DIGITS = re.compile(r"^[0-9]+$")


class DataMode(enum.StrEnum):
    FSDP2 = "fsdp2"
    DDP = "ddp"
    NONE = "none"


class MeshAxis(enum.StrEnum):
    DP = "dp"
    TP = "tp"
    DOMAIN = "domain"


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
    return {
        "data": str(data),
        "tensor": _parse_degree("tensor", block.get("tensor", 1)),
        "domain": _parse_degree("domain", block.get("domain", 1)),
    }


def parse_parallelism_conf(conf: Any) -> dict:
    """Parse ``conf["trainer"]["parallelism"]`` of a FULL config.

    Returns ``{"data", "tensor", "domain"}`` with defaults ``"none"``, 1, 1.  Raises
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


@dataclass(frozen=True)
class ParallelDims:
    """The parallel degrees of one run and the world-size arithmetic that follows from them."""

    data: str
    tp: int
    domain: int
    world_size: int

    def __post_init__(self):
        if self.world_size < 1:
            raise ValueError(f"world_size must be >= 1, got {self.world_size}")
        inner = self.tp * self.domain
        if self.world_size % inner != 0:
            raise ValueError(
                f"world size {self.world_size} is not divisible by tensor*domain = "
                f"{self.tp}*{self.domain} = {inner} (trainer.parallelism.tensor / .domain)"
            )

    @classmethod
    def from_block(cls, block: Any, world_size: int) -> ParallelDims:
        parsed = parse_parallelism_block(block)
        if isinstance(world_size, bool) or not isinstance(world_size, int):
            raise ValueError(f"world_size must be an int, got {world_size!r}")
        return cls(parsed["data"], parsed["tensor"], parsed["domain"], world_size)

    @property
    def dp(self) -> int:
        return self.world_size // (self.tp * self.domain)

    @property
    def mesh_axes(self) -> tuple[tuple[str, int], ...]:
        """(name, size) of every mesh axis kept: sizes > 1, plus "dp" whenever data != none."""
        if self.data == DataMode.NONE and self.tp == 1 and self.domain == 1:
            return ()  # nothing active: build_device_mesh returns (None, {}) (SPEC §2)
        axes = []
        if self.data != DataMode.NONE or self.dp > 1:
            axes.append((MeshAxis.DP.value, self.dp))
        if self.tp > 1:
            axes.append((MeshAxis.TP.value, self.tp))
        if self.domain > 1:
            axes.append((MeshAxis.DOMAIN.value, self.domain))
        return tuple(axes)

    @property
    def full_layout_shape(self) -> tuple[int, int, int]:
        return (self.dp, self.tp, self.domain)
