"""The parts of a CREDIT 2026.2 gen-2 config beside ``data`` and ``trainer``, read as ours.

miles-credit's gen-2 trainer builds its input pipeline from ``preblocks`` / ``postblocks``
(``credit.preblock`` registry: ``{phase: {name: {type, args}}}``) and reads its validation
split from ``validation_data`` (the ``data`` schema again, another date range).  Here:

* a block that says what credit-parallel does anyway is accepted: ``concat`` (the nested
  variables into one channels-first tensor), ``to_device``, ``reconstruct`` (the flat output
  split back per variable), and ``era5_normalizer``, whose ``mean_path`` / ``std_path``
  become ``data.mean_path`` / ``data.std_path`` (CREDIT's netCDF statistics, read by
  ``data/credit_stats.py``); ``bridgescaler_transform``, ``log_transform`` /
  ``exp_transform`` and ``sqrt_transform`` / ``square_transform`` become ``data.bridgescaler``
  (``credit_scaler_blocks.py``); every other block type (``fill_values``, ...) is refused by
  its full key;
* ``validation_data`` gives ``data.valid_time_slice``; its source must read the training
  stores with the training variables (credit-parallel validates on the training store):
  every differing key is named;
* ``data.source.<S>.dataset_type`` must be ``"local"`` (the zarr stores on disk); the cloud
  readers (``weatherbench2_era5``, ``arco_era5``) and computed sources (``tisr``) are refused
  naming the type;
* ``trainer.batches_per_epoch`` with ``epochs`` / ``start_epoch`` count the run's optimizer
  steps the way miles-credit's ``Trainer`` does (``total_steps`` is only the schedule's length).
"""

from __future__ import annotations

import glob
import math
import re
from collections.abc import Mapping

from .credit_scaler_blocks import SCALER_BLOCKS, finish_scaler_blocks, scaler_step

__all__ = [
    "BOOKKEEPING_SECTIONS",
    "as_glob",
    "store_key",
    "block_sections",
    "epoch_steps",
    "source_type_problem",
    "validation_section",
]

# top-level sections that only steer CREDIT's own rollout / metrics / job submission
BOOKKEEPING_SECTIONS = ("save_loc", "metrics", "inference", "predict", "pbs")

_LOCAL = "local"
_ACCEPTED_BLOCKS = {
    "concat": (),
    "to_device": ("device",),
    "reconstruct": ("detach", "in_key", "out_key"),
    "era5_normalizer": ("mean_path", "std_path"),
}
# data keys a validation block may leave different: CREDIT's dataset bookkeeping
_VALID_FREE = frozenset(
    {"start_datetime", "end_datetime", "one_shot", "lead_time_periods", "skip_periods"}
    | {"static_first", "save_loc", "source"}
)


# CREDIT's strftime codes and their digits (credit/datasets/gen_2/_utils.py _STRFTIME_TO_REGEX)
_CODE_DIGITS = {"%Y": 4, "%y": 2, "%m": 2, "%d": 2, "%H": 2, "%M": 2, "%S": 2, "%j": 3, "%f": 1}


def as_glob(path):
    """CREDIT's path template as a glob of the stores its gen-2 loader reads: each strftime
    code as its digits (``%Y`` -> ``[0-9][0-9][0-9][0-9]``, as CREDIT filters its glob by
    ``\\d{4}``), runs of ``*`` as one: ``ERA5_%Y.zarr`` reads ``ERA5_2020.zarr``, not the
    ``ERA5_2020_stats.zarr`` beside it."""
    if not isinstance(path, str):
        return path
    for code, digits in _CODE_DIGITS.items():
        path = path.replace(code, "[0-9]" * digits)
    return re.sub(r"\*+", "*", path)


def store_key(path):
    """What a path template names, for comparison: its shape with every code and run of ``*``
    as one ``*``, and the stores its glob finds now.  ``ERA5_%Y.zarr`` and ``ERA5_%Y*.zarr``
    compare equal while no other store matches the second (a stats store beside them does)."""
    if not isinstance(path, str):
        return path
    loose = re.sub(r"\*+", "*", re.sub(r"%[A-Za-z]", "*", path))
    return loose, tuple(sorted(glob.glob(as_glob(path))))


def _as_globs(source):
    """A ``source`` mapping with every group's ``path`` read as its glob (for comparison)."""
    if not isinstance(source, Mapping):
        return source
    out = {}
    for name, block in source.items():
        block = dict(block) if isinstance(block, Mapping) else block
        if isinstance(block, Mapping) and isinstance(block.get("variables"), Mapping):
            block["variables"] = {
                g: {**v, "path": store_key(v.get("path"))} if isinstance(v, Mapping) else v
                for g, v in block["variables"].items()
            }
        out[name] = block
    return out


def source_type_problem(where: str, block: Mapping) -> str | None:
    """The problem of ``<where>.dataset_type`` (None when absent or ``"local"``)."""
    kind = block.get("dataset_type")
    if kind is None or kind == _LOCAL:
        return None
    return (
        f"{where}.dataset_type = {kind!r}: credit-parallel reads local zarr stores "
        f"(dataset_type: {_LOCAL!r}); the {kind!r} reader (cloud store or computed field) "
        "is not available: write the fields to a local zarr store"
    )


def block_sections(conf: Mapping, data: dict, problems: list[str]) -> None:
    """Check ``preblocks`` / ``postblocks``; an ``era5_normalizer``'s statistics go to
    ``data.mean_path`` / ``data.std_path`` (refused when they differ from the data block's);
    the bridgescaler / log / exp blocks become ``data.bridgescaler`` (``credit_scaler_blocks``)."""
    chains: dict[str, list] = {"preblocks": [], "postblocks": []}
    for section in ("preblocks", "postblocks"):
        phases = conf.get(section)
        if phases is None:
            continue
        if not isinstance(phases, Mapping):
            problems.append(f"{section} must map a phase to its blocks, got {phases!r}")
            continue
        for phase, blocks in phases.items():
            if isinstance(blocks, Mapping) and "type" in blocks:  # a block without a phase
                blocks = {None: blocks}
            for name, block in (blocks or {}).items():
                where = f"{section}.{phase}" + ("" if name is None else f".{name}")
                block = block if isinstance(block, Mapping) else {}
                if block.get("type") in SCALER_BLOCKS:
                    step = scaler_step(
                        section, where, block["type"], block.get("args") or {}, problems
                    )
                    chains[section] += [step] if step is not None else []
                    continue
                _one_block(where, block, data, problems)
    sources = (conf.get("data") or {}).get("source")
    source = next(iter(sources)) if isinstance(sources, Mapping) and sources else "?"
    finish_scaler_blocks(data, source, chains["preblocks"], chains["postblocks"], problems)


def _one_block(where: str, block, data: dict, problems: list[str]) -> None:
    block = block if isinstance(block, Mapping) else {}
    kind = block.get("type")
    if kind not in _ACCEPTED_BLOCKS:
        problems.append(
            f"{where}.type = {kind!r}: credit-parallel normalises by a per-channel mean and "
            "std and concatenates the variables itself; the blocks it honours are "
            f"{sorted(_ACCEPTED_BLOCKS) + list(SCALER_BLOCKS)} (norm: era5_normalizer with "
            "mean_path / std_path, or bridgescaler_transform with its scaler file)"
        )
        return
    args = dict(block.get("args") or {})
    for key in sorted(set(args) - set(_ACCEPTED_BLOCKS[kind])):
        problems.append(f"{where}.args.{key} is not read by credit-parallel ({kind})")
    if kind == "reconstruct" and args.get("detach"):
        problems.append(f"{where}.args.detach: true cuts the gradient; set it to false")
    if kind != "era5_normalizer":
        return
    for key in ("mean_path", "std_path"):
        if key not in args:
            problems.append(f"{where}.args.{key}: the normaliser needs both statistics files")
        elif data.setdefault(key, args[key]) != args[key]:
            problems.append(
                f"{where}.args.{key} = {args[key]!r} differs from data.{key} = {data[key]!r}"
            )


def validation_section(conf: Mapping, data: Mapping, mapped: dict, problems: list[str]) -> None:
    """``validation_data``'s date range as ``mapped['valid_time_slice']``; its other keys
    must repeat the training ``data`` block (credit-parallel validates on the training
    stores and variables); every differing key is named."""
    valid = conf.get("validation_data")
    if not isinstance(valid, Mapping):
        return
    start, end = valid.get("start_datetime"), valid.get("end_datetime")
    if start is not None or end is not None:
        mapped["valid_time_slice"] = [start, end]
    for key in sorted(set(valid) - _VALID_FREE):
        if valid[key] != data.get(key):
            problems.append(
                f"validation_data.{key} = {valid[key]!r} differs from data.{key} = "
                f"{data.get(key)!r}: credit-parallel validates with the training data keys"
            )
    theirs, ours = _as_globs(valid.get("source")), _as_globs(data.get("source") or {})
    if "source" in valid and theirs != ours:
        names = sorted(set(theirs) | set(ours)) if isinstance(theirs, Mapping) else ["?"]
        for name in names:
            a = theirs.get(name) if isinstance(theirs, Mapping) else theirs
            b = ours.get(name)
            if a != b:
                problems.append(
                    f"validation_data.source.{name} differs from data.source.{name}: "
                    "credit-parallel validates on the training stores and variables (only "
                    "the date range may differ)"
                )


def epoch_steps(t: Mapping, per_epoch: bool = False) -> int | None:
    """Optimizer steps of a CREDIT run as miles-credit's gen-2 ``Trainer`` counts them
    (``trainers/base_trainer.py``, ``trainer_gen2.py``): epochs ``start_epoch`` up to ``epochs``
    (``num_epoch`` of them per job, then a requeue: the run is all of them), each
    ``batches_per_epoch`` batches with an optimizer step every ``grad_accum_every`` batches and
    at the epoch's last batch; ``per_epoch``: the steps of one epoch.  None when
    ``batches_per_epoch`` is 0 (CREDIT then runs the whole dataset per epoch).  CREDIT also caps
    ``batches_per_epoch`` at the loader's length, which is not known here: a run whose epoch is
    longer than its data keeps cycling the data instead."""
    batches = int(t.get("batches_per_epoch") or 0)
    if batches <= 0:
        return None
    accum = max(int(t.get("grad_accum_every") or 1), 1)
    steps = math.ceil(batches / accum)
    if per_epoch:
        return steps
    start = int(t.get("start_epoch") or 0)
    return max(int(t.get("epochs", 1)) - start, 0) * steps
