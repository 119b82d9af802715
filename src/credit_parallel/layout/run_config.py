"""The typed run configuration: every ``trainer.*``, ``data.*`` and ``model.*`` key, parsed and
validated in one place.  A CREDIT gen-2 config (``data.source``) is first read as these keys by
:func:`credit_parallel.layout.credit_gen2.credit_gen2_conf`.

``RunConfig.from_conf(conf)`` turns the YAML mapping into frozen dataclasses; every error is a
``ValueError`` naming the key and the bad value.  The parallelism block itself is parsed by
:func:`credit_parallel.layout.config.parse_parallelism_conf` and carried here as-is.  Code that needs a
single key before the whole section can be validated (the launcher's ``trainer.dist_timeout_s``,
the FSDP wrapper's ``trainer.amp``, the planner's ``trainer.batch_size``) asks
:func:`trainer_option`, which applies the same parser as the dataclass.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from types import MappingProxyType
from typing import Any

from .credit_gen2 import credit_gen2_conf

__all__ = [
    "DEFAULT_DIST_TIMEOUT_S",
    "DataConfig",
    "ModelConfig",
    "RunConfig",
    "TrainerConfig",
    "config_problems",
    "parse_sections",
    "trainer_option",
]

# Long enough for a first step that compiles kernels or loads a large shard, short enough that a
# dead rank does not hold a few hundred GPUs for the scheduler's hours-long wall time.
DEFAULT_DIST_TIMEOUT_S = 600.0


# --------------------------------------------------------------------------- value parsers
def _number(section: str, key: str, kind: type, minimum: float) -> Callable[[Any], Any]:
    def parse(value):
        if (
            isinstance(value, bool)
            or not isinstance(value, (int, float))
            or not math.isfinite(value)
            or (kind is int and not float(value).is_integer())
        ):
            raise ValueError(
                f"{section}.{key} must be a {kind.__name__} >= {minimum}, got {value!r}"
            )
        if value < minimum:
            raise ValueError(f"{section}.{key} must be >= {minimum}, got {value!r}")
        return kind(value)

    return parse


def _optional_number(section: str, key: str, kind: type, minimum: float) -> Callable[[Any], Any]:
    number = _number(section, key, kind, minimum)
    return lambda value: None if value is None else number(value)


def _flag(section: str, key: str) -> Callable[[Any], bool]:
    def parse(value):
        if not isinstance(value, bool):
            raise ValueError(
                f"{section}.{key} must be true or false, got {value!r} of type {type(value).__name__}"
            )
        return value

    return parse


def _flag_or_auto(section: str, key: str) -> Callable[[Any], bool | str]:
    def parse(value):
        if isinstance(value, bool) or value == "auto":
            return value
        raise ValueError(f"{section}.{key} must be true, false or 'auto', got {value!r}")

    return parse


def _choice(section: str, key: str, choices: tuple[str, ...]) -> Callable[[Any], str]:
    def parse(value):
        if value not in choices:
            shown = " or ".join(repr(c) for c in choices)
            raise ValueError(f"{section}.{key} must be {shown}, got {value!r}")
        return value

    return parse


def _halo_chains(value):
    if value is True:
        return "auto"
    if value is False or value == "auto" or (type(value) is int and value >= 2):
        return value
    raise ValueError(
        "trainer.domain_halo_chains must be false, true / 'auto' or a chain length >= 2, "
        f"got {value!r}"
    )


def _seconds(value):
    if (
        isinstance(value, bool)
        or not isinstance(value, (int, float))
        or not math.isfinite(value)
        or value <= 0
    ):
        raise ValueError(
            f"trainer.dist_timeout_s must be a number of seconds > 0, got {value!r} "
            f"(default {DEFAULT_DIST_TIMEOUT_S:g})"
        )
    return float(value)


def _signals(value):
    import signal

    names = [value] if isinstance(value, str) else value
    if (
        not isinstance(names, (list, tuple))
        or not all(
            isinstance(n, str)
            and isinstance(getattr(signal, n, None), signal.Signals)
            and n.startswith("SIG")
            and not n.startswith("SIG_")
            for n in names
        )
        or {"SIGKILL", "SIGSTOP"} & set(names)
    ):
        raise ValueError(
            "trainer.stop_signals must be a list of signal names (SIGTERM, SIGUSR1, SIGINT, "
            f"...; not SIGKILL or SIGSTOP), got {value!r}"
        )
    return tuple(names)


def _decay(value):
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not 0 <= value <= 1:
        raise ValueError(f"trainer.ema_decay must be a number in [0, 1], got {value!r}")
    return float(value)


def _mapping_with_keys(key: str, required: tuple[str, ...]) -> Callable[[Any], dict | None]:
    """``trainer.<key>``: None, or a mapping holding at least ``required`` (a plain dict)."""

    def parse(value):
        if value is None:
            return None
        if not isinstance(value, Mapping) or any(k not in value for k in required):
            raise ValueError(
                f"trainer.{key} must be a mapping with the keys {list(required)}, got {value!r}"
            )
        return dict(value)

    return parse


def _optional_path(section: str, key: str) -> Callable[[Any], str | None]:
    def parse(value):
        if value is None:
            return None
        if not isinstance(value, str) or not value:
            raise ValueError(f"{section}.{key} must be a path (a string), got {value!r}")
        return value

    return parse


def _store_paths(key: str) -> Callable[[Any], Any]:
    """``data.<key>``: one zarr store (or file), a glob, or a list of them and globs (one time
    axis, ``data/multistore.py``)."""

    def parse(value):
        if isinstance(value, (list, tuple)):
            if not value or not all(isinstance(v, str) and v for v in value):
                raise ValueError(
                    f"data.{key} must be a path, a glob or a list of paths, got {value!r}"
                )
            return tuple(value)
        return _optional_path("data", key)(value)

    return parse


def _strings(section: str, key: str) -> Callable[[Any], tuple]:
    def parse(value):
        if not isinstance(value, (list, tuple)) or not all(isinstance(v, str) for v in value):
            raise ValueError(f"{section}.{key} must be a list of names, got {value!r}")
        return tuple(value)

    return parse


def _optional_mapping(section: str, key: str) -> Callable[[Any], Mapping | None]:
    def parse(value):
        if value is not None and not isinstance(value, Mapping):
            raise ValueError(f"{section}.{key} must be a mapping, got {value!r}")
        return value

    return parse


def _optional_name(key: str) -> Callable[[Any], str | None]:
    def parse(value):
        if value is not None and (not isinstance(value, str) or not value):
            raise ValueError(f"data.{key} must be a name (a string), got {value!r}")
        return value

    return parse


def _levels(value):
    if not isinstance(value, (list, tuple)) or not all(
        isinstance(v, (int, float)) and not isinstance(v, bool) for v in value
    ):
        raise ValueError(f"data.levels must be a list of pressure levels, got {value!r}")
    return tuple(value)


def _time_slice(key: str) -> Callable[[Any], Any]:
    def parse(value):
        if value is None or isinstance(value, str):
            return value
        if (
            isinstance(value, (list, tuple))
            and len(value) in (2, 3)
            and all(
                v is None or (isinstance(v, (int, str)) and not isinstance(v, bool)) for v in value
            )
        ):
            return tuple(value)
        raise ValueError(f"data.{key} must be [start, stop] (indices or dates), got {value!r}")

    return parse


# (default, parser) per key; the dataclass fields below carry the same names and defaults
_TRAINER_KEYS: dict[str, tuple[Any, Callable]] = {
    "steps": (100, _number("trainer", "steps", int, 1)),
    # the learning-rate schedule's length (CREDIT's scheduler.total_steps); None: ``steps``
    "schedule_steps": (None, _optional_number("trainer", "schedule_steps", int, 1)),
    # CREDIT's own scheduler class, called: {"scheduler": CREDIT's trainer.scheduler block,
    # "steps_per_epoch", "batches_per_epoch", "grad_accum"} (train/schedule.py); None: the
    # linear warmup + cosine schedule below
    "credit_scheduler": (None, _optional_mapping("trainer", "credit_scheduler")),
    # CREDIT's num_epoch: {"num_epoch", "steps_per_epoch"}: one job trains that many epochs
    # from the one it starts in, then saves and stops (train/schedule.py job_end_step)
    "job_epochs": (None, _optional_mapping("trainer", "job_epochs")),
    # resume from a CREDIT checkpoint: {"checkpoint": .../checkpoint.pt, "load_optimizer",
    # "load_scheduler"} (CREDIT's load_weights; train/credit_resume.py)
    "credit_resume": (None, _mapping_with_keys("credit_resume", ("checkpoint",))),
    "batch_size": (2, _number("trainer", "batch_size", int, 1)),
    # K members of each sample, trained on a CRPS loss (train/crps.py, docs/ensembles.md)
    "ensemble_size": (1, _number("trainer", "ensemble_size", int, 1)),
    "grad_accum": (1, _number("trainer", "grad_accum", int, 1)),
    "lr": (1e-3, _number("trainer", "lr", float, 0)),
    "weight_decay": (0.0, _number("trainer", "weight_decay", float, 0)),
    "warmup_steps": (0, _number("trainer", "warmup_steps", int, 0)),
    "min_lr_ratio": (0.1, _number("trainer", "min_lr_ratio", float, 0)),
    "grad_clip": (1.0, _number("trainer", "grad_clip", float, 0)),
    "seed": (0, _number("trainer", "seed", int, 0)),
    "amp": (False, _flag("trainer", "amp")),
    "nonfinite": ("stop", _choice("trainer", "nonfinite", ("stop", "skip"))),
    "validate_every": (0, _number("trainer", "validate_every", int, 0)),
    "val_batches": (2, _number("trainer", "val_batches", int, 1)),
    "checkpoint_every": (0, _number("trainer", "checkpoint_every", int, 0)),
    # the last step's checkpoint is written at the end of every run unless this is false
    "final_checkpoint": (True, _flag("trainer", "final_checkpoint")),
    # saves staged into host buffers and written behind the step loop (train/async_save.py)
    "checkpoint_async": (True, _flag("trainer", "checkpoint_async")),
    # a save that fails (a full disk, a permission): stop the run, or go on without it
    "checkpoint_on_error": (
        "stop",
        _choice("trainer", "checkpoint_on_error", ("stop", "continue")),
    ),
    "checkpoint_keep": (3, _number("trainer", "checkpoint_keep", int, 1)),
    # signals that stop every rank at the same step boundary with a checkpoint (preemption)
    "stop_signals": (("SIGTERM", "SIGUSR1", "SIGINT"), _signals),
    "dtype": ("float32", _choice("trainer", "dtype", ("float32", "float64"))),
    "activation_checkpoint": (False, _flag("trainer", "activation_checkpoint")),
    # 0: every _fsdp2_shard block is its own FSDP2 unit (SPEC §4); N > 0 merges smaller ones
    "fsdp2_min_unit_params": (0, _number("trainer", "fsdp2_min_unit_params", int, 0)),
    # SPEC §4: a one-rank shard group gets no fully_shard unless this keeps FSDP2 there
    "fsdp2_single_rank": (False, _flag("trainer", "fsdp2_single_rank")),
    # opt-in: explicit forward/backward prefetch of the next FSDP2 unit, the last unit not
    # resharded after forward (fsdp.set_unit_prefetch)
    "fsdp2_prefetch": (False, _flag("trainer", "fsdp2_prefetch")),
    # torch.compile per block after domain conversion / TP, before FSDP2 (credit_parallel.compile)
    "compile": (False, _flag("trainer", "compile")),
    "dist_timeout_s": (DEFAULT_DIST_TIMEOUT_S, _seconds),
    "save_dir": (None, _optional_path("trainer", "save_dir")),
    # true: the newest checkpoint in save_dir; auto: the same, or a fresh start (train/resume.py)
    "resume": (False, _flag_or_auto("trainer", "resume")),
    "log_every": (1, _number("trainer", "log_every", int, 1)),
    # modules domain parallelism cannot shard: refuse them, or run them on the gathered globe
    "domain_nonlocal_policy": (
        "raise",
        _choice("trainer", "domain_nonlocal_policy", ("raise", "gather")),
    ),
    # opt-in: one exchange feeds a chain of stencil layers (domain/layers/halo_chain.py):
    # false, true / "auto" (the cost model cuts the chains) or a chain length k >= 2
    "domain_halo_chains": (False, _halo_chains),
    # opt-in debug mode: raise at the first functional call over H on a sharded activation
    "domain_guard": (False, _flag("trainer", "domain_guard")),
    # a moving average of the weights (miles-credit's EMATracker, train/ema.py): updated after
    # every optimizer step, validated on, checkpointed; the decay is CREDIT's maximum decay
    "use_ema": (False, _flag("trainer", "use_ema")),
    "ema_decay": (0.9999, _decay),
}
# CREDIT spells the per-rank batch ``train_batch_size``; it is accepted as that same key
_TRAINER_ALIASES = {"train_batch_size": "batch_size"}

_DATA_KEYS: dict[str, tuple[Any, Callable]] = {
    # a zarr store, a glob of stores ("/data/ERA5_*.zarr": one per year) or a list of them,
    # read as ONE time axis (data/multistore.py)
    "path": (None, _store_paths("path")),
    # the static variables' own store (dims latitude, longitude); default: data.path
    "static_path": (None, _optional_path("data", "static_path")),
    # the dynamic forcing variables' own files (netCDF or zarr, a glob or list; CREDIT's second
    # store beside the data stores), read by time label (data/forcing_files.py)
    "forcing_path": (None, _store_paths("forcing_path")),
    "upper_air_variables": ((), _strings("data", "upper_air_variables")),
    "surface_variables": ((), _strings("data", "surface_variables")),
    # output-only 2-D channels (CREDIT's diagnostic group): in the target after the prognostic
    # ones, never an input; the model outputs prognostic + diagnostic channels
    "diagnostic_variables": ((), _strings("data", "diagnostic_variables")),
    # input-only channels: the forcing at each input time, and time-invariant fields
    "dynamic_forcing_variables": ((), _strings("data", "dynamic_forcing_variables")),
    "static_variables": ((), _strings("data", "static_variables")),
    "levels": (None, _levels),
    # the store's level dimension (default: the first of level / pressure_level / plev / ...)
    "level_coord": (None, _optional_name("level_coord")),
    # the time between samples ("6h"): the store's spacing or a multiple of it (subsampled)
    "timestep": (None, _optional_name("timestep")),
    "history_len": (1, _number("data", "history_len", int, 1)),
    "forecast_len": (1, _number("data", "forecast_len", int, 1)),
    "normalize": (True, _flag("data", "normalize")),
    "stats_path": (None, _optional_path("data", "stats_path")),
    # CREDIT's netCDF statistics (scaler_type std_new), instead of stats_path
    # (data/credit_stats.py)
    "mean_path": (None, _optional_path("data", "mean_path")),
    "std_path": (None, _optional_path("data", "std_path")),
    # CREDIT's bridgescaler_transform / log_transform blocks (layout/credit_gen2_blocks.py
    # writes it; data/bridgescaler_blocks.py runs it): {source, pre: [...], post: [...]}
    "bridgescaler": (None, _optional_mapping("data", "bridgescaler")),
    "as_5d": (False, _flag("data", "as_5d")),
    "time_slice": (None, _time_slice("time_slice")),
    "valid_time_slice": (None, _time_slice("valid_time_slice")),
    "num_workers": (2, _number("data", "num_workers", int, 0)),
    "prefetch_factor": (2, _number("data", "prefetch_factor", int, 1)),
    "device_prefetch": (1, _number("data", "device_prefetch", int, 0)),  # batches copied ahead
    # None: the dataset's own default (data.dataset.DEFAULT_CACHE_LIMIT_BYTES, 1 GiB)
    "cache_limit_bytes": (None, _optional_number("data", "cache_limit_bytes", int, 0)),
    # the chunk reader (data/chunk_reader.py): auto = tensorstore when it can read the store
    "reader": ("auto", _choice("data", "reader", ("auto", "tensorstore", "zarr"))),
}


def _section(conf: Mapping, name: str) -> dict:
    section = conf.get(name) if isinstance(conf, Mapping) else None
    if section is None:
        return {}
    if not isinstance(section, Mapping):
        raise ValueError(f"{name} must be a mapping, got {section!r}")
    return dict(section)


def _trainer_section(conf: Mapping) -> dict:
    t = _section(conf, "trainer")
    for alias, key in _TRAINER_ALIASES.items():
        if alias in t:
            if key in t:
                raise ValueError(
                    f"trainer.{alias} and trainer.{key} are the same setting; give only one"
                )
            t[key] = t.pop(alias)
    return t


def trainer_option(conf: Mapping, key: str):
    """One ``trainer.*`` value, parsed as :class:`TrainerConfig` parses it (default when absent)."""
    default, parse = _TRAINER_KEYS[key]
    t = _trainer_section(conf)
    return parse(t[key]) if key in t else default


def _parse(section: str, values: dict, table: dict, extra: frozenset = frozenset()) -> dict:
    """Every key of ``values`` parsed by ``table``; ONE ``ValueError`` listing every bad key."""
    problems = []
    unknown = sorted(set(values) - set(table) - extra)
    if unknown:
        known = sorted(set(table) | extra)
        problems.append(f"{section} has unknown key(s) {unknown}; known keys: {known}")
    parsed = {}
    for key, (default, parse) in table.items():
        try:
            parsed[key] = parse(values[key]) if key in values else default
        except ValueError as err:
            problems.append(str(err))
    if problems:
        raise ValueError("; ".join(problems)) if len(problems) == 1 else _Problems(problems)
    return parsed


class _Problems(ValueError):
    """Several problems of one section; ``problems`` lists them one by one."""

    def __init__(self, problems: list[str]):
        super().__init__("; ".join(problems))
        self.problems = problems


def parse_sections(
    conf: Mapping,
) -> tuple[TrainerConfig | None, DataConfig | None, ModelConfig | None, list[str]]:
    """The ``trainer``, ``data`` and ``model`` sections, each parsed once, and every problem of
    them (one message per key); a section with a problem is None.  Preflight builds the
    :class:`RunConfig` from these, so a run's config is parsed once."""
    problems: list[str] = []
    parsed = []
    try:
        conf = credit_gen2_conf(conf)
    except ValueError as err:
        return None, None, None, [str(err)]
    for parse in (TrainerConfig.from_conf, DataConfig.from_conf, ModelConfig.from_conf):
        try:
            parsed.append(parse(conf))
        except _Problems as err:
            problems.extend(err.problems)
            parsed.append(None)
        except ValueError as err:
            problems.append(str(err))
            parsed.append(None)
    return parsed[0], parsed[1], parsed[2], problems


def config_problems(conf: Mapping) -> list[str]:
    """Every problem of the ``trainer``, ``data`` and ``model`` sections (empty when fine),
    one message per key, for reports that list everything at once."""
    return parse_sections(conf)[3]


@dataclass(frozen=True)
class TrainerConfig:
    """The ``trainer`` section (``trainer.parallelism`` lives in :class:`RunConfig`)."""

    steps: int = 100
    schedule_steps: int | None = None
    credit_scheduler: dict | None = None
    job_epochs: dict | None = None
    credit_resume: dict | None = None
    batch_size: int = 2
    ensemble_size: int = 1
    grad_accum: int = 1
    lr: float = 1e-3
    weight_decay: float = 0.0
    warmup_steps: int = 0
    min_lr_ratio: float = 0.1
    grad_clip: float = 1.0
    seed: int = 0
    amp: bool = False
    nonfinite: str = "stop"
    validate_every: int = 0
    val_batches: int = 2
    checkpoint_every: int = 0
    final_checkpoint: bool = True
    checkpoint_async: bool = True
    checkpoint_on_error: str = "stop"
    checkpoint_keep: int = 3
    stop_signals: tuple = ("SIGTERM", "SIGUSR1", "SIGINT")
    dtype: str = "float32"
    activation_checkpoint: bool = False
    fsdp2_min_unit_params: int = 0
    fsdp2_single_rank: bool = False
    fsdp2_prefetch: bool = False
    compile: bool = False
    dist_timeout_s: float = DEFAULT_DIST_TIMEOUT_S
    save_dir: str | None = None
    resume: bool | str = False
    log_every: int = 1
    domain_nonlocal_policy: str = "raise"
    domain_halo_chains: bool | str | int = False
    domain_guard: bool = False
    use_ema: bool = False
    ema_decay: float = 0.9999

    @classmethod
    def from_conf(cls, conf: Mapping) -> TrainerConfig:
        values = _parse(
            "trainer", _trainer_section(conf), _TRAINER_KEYS, frozenset({"parallelism"})
        )
        return cls(**values)


@dataclass(frozen=True)
class DataConfig:
    """The ``data`` section: the ERA5-layout store and the sample window."""

    path: str | tuple | None = None
    static_path: str | None = None
    forcing_path: str | tuple | None = None
    upper_air_variables: tuple = ()
    surface_variables: tuple = ()
    diagnostic_variables: tuple = ()
    dynamic_forcing_variables: tuple = ()
    static_variables: tuple = ()
    levels: tuple | None = None
    level_coord: str | None = None
    timestep: str | None = None
    history_len: int = 1
    forecast_len: int = 1
    normalize: bool = True
    stats_path: str | None = None
    mean_path: str | None = None
    std_path: str | None = None
    bridgescaler: Mapping | None = None
    as_5d: bool = False
    time_slice: Any = None
    valid_time_slice: Any = None
    num_workers: int = 2
    prefetch_factor: int = 2
    device_prefetch: int = 1
    cache_limit_bytes: int | None = None
    reader: str = "auto"

    @classmethod
    def from_conf(cls, conf: Mapping) -> DataConfig:
        return cls(**_parse("data", _section(conf, "data"), _DATA_KEYS))


@dataclass(frozen=True)
class ModelConfig:
    """The ``model`` section: ``type`` and the constructor's keyword arguments, which the model
    registry (:func:`credit_parallel.models.build_model`) checks against the constructor."""

    type: str | None = None
    options: Mapping = field(default_factory=lambda: MappingProxyType({}))

    @classmethod
    def from_conf(cls, conf: Mapping) -> ModelConfig:
        m = _section(conf, "model")
        model_type = m.pop("type", None)
        if model_type is not None and not isinstance(model_type, str):
            raise ValueError(f"model.type must be a model name (a string), got {model_type!r}")
        return cls(model_type, MappingProxyType(m))

    def as_dict(self) -> dict:
        """The ``model:`` block again, for :func:`credit_parallel.models.build_model`."""
        return {"type": self.type, **self.options}


@dataclass(frozen=True)
class RunConfig:
    """Everything a run is configured with; built once, read everywhere."""

    parallelism: Mapping
    trainer: TrainerConfig
    data: DataConfig
    model: ModelConfig

    @classmethod
    def from_conf(cls, conf: Mapping) -> RunConfig:
        from .config import parse_parallelism_conf

        if not isinstance(conf, Mapping):
            raise ValueError(f"config must be a mapping, got {type(conf).__name__}")
        conf = credit_gen2_conf(conf)
        return cls(
            MappingProxyType(parse_parallelism_conf(conf)),
            TrainerConfig.from_conf(conf),
            DataConfig.from_conf(conf),
            ModelConfig.from_conf(conf),
        )
