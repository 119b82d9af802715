"""miles-credit's gen-2 config schema read as credit-parallel's keys, before the one parser.

A CREDIT 2026.2 gen-2 config (``config/gen_2/examples/*.yml``) describes its data as
``data.source.<NAME>.variables.{prognostic, diagnostic, dynamic_forcing, static}`` with
``vars_3D`` / ``vars_2D`` lists and a ``path`` per group (the ``diagnostic`` group becomes
``data.diagnostic_variables``: output-only 2-D fields), and its trainer in CREDIT's names
(``learning_rate``, ``grad_accum_every``, ``thread_workers``, ``use_scheduler``, ...).
:func:`credit_gen2_conf` returns the same run in credit-parallel's keys, which
:mod:`credit_parallel.layout.run_config` then parses like any other config.  The flat variable
lists come from miles-credit's own ``inject_flat_var_keys`` (what CREDIT's ``train_gen2.py``
calls before building the model).  The time-dependent groups' ``path`` (a zarr store, or a
glob of stores split along time such as CREDIT's ``ERA5_plevel_6h_*.zarr``) becomes
``data.path``, a dynamic forcing group's own files ``data.forcing_path``, a static group's own
store ``data.static_path``, and ``data.mean_path`` /
``data.std_path`` (CREDIT's netCDF statistics) are read as they are (``data/multistore.py``,
``data/credit_stats.py``).  Every key that cannot be honoured is reported by its full
path in ONE ``ValueError``; keys that only steer CREDIT's bookkeeping (tensorboard, backup
weights, validation batch sizes, ``save_loc``, ``inference``, ``pbs``, ...) are dropped with one
warning naming them.  ``dataset_type``, ``validation_data``, ``preblocks`` / ``postblocks`` and
the epoch count are read in :mod:`credit_parallel.layout.credit_gen2_blocks`; CREDIT's
bridgescaler blocks and ``loss.type: base`` (kept as the ``loss`` section for the trainer) in
:mod:`credit_parallel.layout.credit_scaler_blocks`.
"""

from __future__ import annotations

import copy
import warnings
from collections.abc import Mapping

from .credit_gen2_blocks import (
    BOOKKEEPING_SECTIONS,
    as_glob,
    block_sections,
    epoch_steps,
    source_type_problem,
    store_key,
    validation_section,
)
from .credit_resume import credit_resume_keys
from .credit_scaler_blocks import base_loss_section
from .extras import require

# CREDIT's schedulers (credit/scheduler.py: update_on_batch, update_on_epoch), called
PER_BATCH = ("cosine-annealing-restarts", "linear-warmup-cosine")
PER_EPOCH = ("lambda", "plateau", "cosine-annealing")

__all__ = ["credit_gen2_conf", "is_credit_gen2"]

# data-level keys CREDIT's gen-2 dataset (credit.datasets.gen_2) does not read either, or that
# do not change what is computed here
_DATA_IGNORED = ("static_first", "one_shot", "lead_time_periods", "skip_periods", "save_loc")
_SOURCE_KEYS = ("level_coord", "levels", "variables", "history_len", "dataset_type")
_GROUPS = ("prognostic", "diagnostic", "dynamic_forcing", "static")

# trainer keys: CREDIT's name -> ours; dropped bookkeeping; flags honoured only when off
_TRAINER_RENAMED = {"learning_rate": "lr", "grad_accum_every": "grad_accum"}
_TRAINER_TO_DATA = {"thread_workers": "num_workers", "prefetch_factor": "prefetch_factor"}
_TRAINER_DROPPED = (
    "type",
    "mode",
    "use_tensorboard",
    "save_backup_weights",
    "save_best_weights",
    "skip_validation",
    "training_metric",  # read by a plateau schedule (_schedule), else CREDIT's bookkeeping
    "training_metric_direction",
    "stopping_patience",
    "valid_batch_size",
    "valid_thread_workers",
    "valid_batches_per_epoch",
    "update_learning_rate",  # read with load_weights (credit_resume.py), else nothing to reset
    "save_metric_vars",
)
_TRAINER_OFF_ONLY = {"cpu_offload": "parameters stay on the device"}
_GEN2_TRAINER_TYPES = ("era5-gen2", "gen2")
_LOSS_AS_OURS = {
    "training_loss": "mse",
    "use_power_loss": False,
    "use_spectral_loss": False,
    "use_latitude_weights": True,
    "use_variable_weights": False,
}


def is_credit_gen2(conf) -> bool:
    """True for a config whose ``data`` is CREDIT's gen-2 schema (``data.source``)."""
    data = conf.get("data") if isinstance(conf, Mapping) else None
    return isinstance(data, Mapping) and "source" in data


def _inject_flat_var_keys(data: dict) -> dict:
    """miles-credit's ``inject_flat_var_keys`` on a copy: ``variables``, ``surface_variables``,
    ``diagnostic_variables`` as CREDIT's gen-2 trainer derives them."""
    require("cftime", "data.source (CREDIT's gen-2 data schema)")
    try:
        from credit.trainers.utils import inject_flat_var_keys
    except ImportError as err:
        raise ValueError(
            "data.source: CREDIT's gen-2 data schema is read with miles-credit's own "
            f"inject_flat_var_keys (credit.trainers.utils), which cannot be imported ({err}); "
            "install miles-credit 2026.2 with its dependencies, or write the data block in "
            "credit-parallel's keys (data.path, data.upper_air_variables, ...)"
        ) from err
    conf = {"data": {k: v for k, v in copy.deepcopy(data).items() if k != "variables"}}
    inject_flat_var_keys(conf)
    return conf["data"]


def _source(data: dict, problems: list[str]) -> tuple[str, dict]:
    sources = data["source"]
    if not isinstance(sources, Mapping) or not sources:
        problems.append(f"data.source must map a source name to its block, got {sources!r}")
        return "", {}
    if len(sources) > 1:
        problems.append(
            f"data.source has {len(sources)} sources {sorted(sources)}; credit-parallel reads "
            "one zarr store: keep one source"
        )
    name, block = next(iter(sources.items()))
    block = dict(block) if isinstance(block, Mapping) else {}
    for key in sorted(set(block) - set(_SOURCE_KEYS)):
        problems.append(f"data.source.{name}.{key} is not read by credit-parallel")
    problem = source_type_problem(f"data.source.{name}", block)
    if problem:
        problems.append(problem)
    block.pop("dataset_type", None)
    return name, dict(block)


def _groups(name: str, block: dict, flat: dict, problems: list[str]) -> dict:
    """Our variable keys and the one store path, from the source's variable groups."""
    variables = block.get("variables") or {}
    out = {
        "upper_air_variables": list(flat.get("variables") or []),
        "surface_variables": list(flat.get("surface_variables") or []),
    }
    where = f"data.source.{name}.variables"
    for group in sorted(set(variables) - set(_GROUPS)):
        problems.append(f"{where}.{group} is not a gen-2 variable group ({', '.join(_GROUPS)})")
    for group, key in (
        ("diagnostic", "diagnostic_variables"),
        ("dynamic_forcing", "dynamic_forcing_variables"),
        ("static", "static_variables"),
    ):
        spec = variables.get(group) or {}
        if spec.get("vars_3D"):
            problems.append(
                f"{where}.{group}.vars_3D {spec['vars_3D']}: only 2-D {group} fields are read"
            )
        out[key] = list(spec.get("vars_2D") or [])
    # CREDIT's own flat list (inject_flat_var_keys: vars_3D then vars_2D, 3-D refused above):
    # the output-only channels, after the prognostic ones in the target
    out["diagnostic_variables"] = list(flat.get("diagnostic_variables") or [])
    _paths(where, variables, flat, out, problems)
    return out


def _paths(where: str, variables: Mapping, flat: dict, out: dict, problems: list[str]) -> None:
    """``data.path`` (a store or a glob of stores, one per year: one time axis) from the
    time-dependent groups, ``data.forcing_path`` when the dynamic forcing group names files of
    its own (CREDIT's netCDF solar files beside the zarr stores), ``data.static_path`` from the
    static group when it names another store; CREDIT's strftime codes in a path
    (``era5_%Y.zarr``) read as their digits, as CREDIT's gen-2 dataset globs and filters them
    (``as_glob``); groups compared by ``store_key``."""
    paths = {g: (variables.get(g) or {}).get("path") for g in _GROUPS if variables.get(g)}
    timed = {g: p for g, p in paths.items() if g != "static" and p is not None}
    keys = {g: store_key(p) for g, p in timed.items()}  # %Y and %Y*: the same stores
    data_keys = [k for g, k in keys.items() if g != "dynamic_forcing"] or list(keys.values())
    distinct = list(dict.fromkeys(data_keys))
    if not distinct:
        problems.append(f"{where}.<group>.path: no store path given")
    elif len(distinct) > 1:
        listing = ", ".join(
            f"{where}.{g}.path = {p!r}" for g, p in timed.items() if g != "dynamic_forcing"
        )
        problems.append(
            f"the variable groups name {len(distinct)} stores ({listing}); "
            "credit-parallel reads the prognostic and diagnostic variables from ONE zarr store "
            "(or one glob of stores split along time; the dynamic forcing may have its own): "
            "write them into one"
        )
    if distinct:
        out["path"] = as_glob(next(p for g, p in timed.items() if keys[g] == distinct[0]))
    forcing = timed.get("dynamic_forcing")
    if forcing is not None and distinct and keys["dynamic_forcing"] not in distinct:
        out["forcing_path"] = as_glob(forcing)  # read by time label (data/forcing_files.py)
    static = paths.get("static")
    if static is not None and store_key(static) not in distinct and out.get("static_variables"):
        out["static_path"] = as_glob(static)
    if static is not None and not distinct and out.get("static_variables"):
        problems.append(f"{where}.static.path: the static store needs the data store beside it")


def _data_section(conf: Mapping, problems: list[str]) -> dict:
    data = dict(conf["data"])
    name, block = _source(data, problems)
    flat = _inject_flat_var_keys({"source": {name: block}}) if name else {}
    out = _groups(name, block, flat, problems) if name else {}
    if "levels" in block:
        out["levels"] = block["levels"]
    if "level_coord" in block:
        out["level_coord"] = block["level_coord"]
    if "history_len" in block:
        out["history_len"] = block["history_len"]
    start, end = data.get("start_datetime"), data.get("end_datetime")
    if start is not None or end is not None:
        out["time_slice"] = [start, end]
    validation_section(conf, data, out, problems)
    scaler = data.get("scaler_type")
    if scaler is not None and scaler not in ("std_new", "std"):
        problems.append(
            f"data.scaler_type = {scaler!r}: credit-parallel normalises by a per-channel mean "
            "and std (CREDIT's 'std_new'); choose that or normalise the store yourself"
        )
    for key in ("mean_path", "std_path"):  # CREDIT's netCDF statistics (data/credit_stats.py)
        if data.get(key) is not None:
            out[key] = data[key]
    taken = {"source", "start_datetime", "end_datetime", "scaler_type", "mean_path", "std_path"}
    for key, value in data.items():
        if key not in taken | set(_DATA_IGNORED):
            out.setdefault(key, value)  # history_len, timestep, ours, or unknown: parser names it
    return out


def _schedule(t: dict, out: dict, problems: list[str]) -> None:
    """``trainer.scheduler``: every scheduler of CREDIT's ``credit/scheduler.py`` as
    ``credit_scheduler``: CREDIT's own class, called, stepped where CREDIT's trainer steps it
    (``train/schedule.py``); ``linear-warmup-cosine``'s ``total_steps`` is also kept as
    ``schedule_steps`` (the schedule's length, said beside the run's count)."""
    if t.pop("use_scheduler", False) is not True:
        t.pop("scheduler", None)
        return
    sched = dict(t.pop("scheduler", None) or {})
    kind = sched.get("scheduler_type")
    if kind not in PER_BATCH + PER_EPOCH:
        problems.append(
            f"trainer.scheduler.scheduler_type = {kind!r}: CREDIT's schedulers are "
            f"{', '.join(map(repr, PER_BATCH + PER_EPOCH))} (credit/scheduler.py); choose one "
            "or set trainer.use_scheduler: false"
        )
        return
    accum = out.get("grad_accum", 1)
    per_epoch = epoch_steps({**t, "grad_accum_every": accum}, per_epoch=True)
    if kind in PER_EPOCH and per_epoch is None:
        problems.append(
            f"trainer.scheduler.scheduler_type = {kind!r} steps once per epoch: it needs "
            "trainer.batches_per_epoch > 0 (the epoch's length)"
        )
        return
    if kind == "plateau":
        metric = t.get("training_metric", "train_loss" if t.get("skip_validation") else None)
        if metric != "train_loss":
            problems.append(
                "trainer.scheduler.scheduler_type = 'plateau' steps on CREDIT's "
                f"training_metric ({metric or 'valid_loss'!r} without skip_validation: true); "
                "credit-parallel validates every trainer.validate_every steps, not per epoch: "
                "set trainer.skip_validation: true (or training_metric: train_loss) to step "
                "it on the epoch's training loss"
            )
            return
    if kind == "linear-warmup-cosine" and "total_steps" in sched:
        out["schedule_steps"] = sched["total_steps"]
    batches = int(t.get("batches_per_epoch") or 0) or None
    out["credit_scheduler"] = {
        "scheduler": sched,
        "steps_per_epoch": per_epoch,
        "batches_per_epoch": batches,
        "grad_accum": accum,
    }


def _job_epochs(t: dict, out: dict, notes: list[str]) -> None:
    """CREDIT's ``num_epoch`` (the epochs one job runs from ``start_epoch``) as
    ``job_epochs``; with ``batches_per_epoch: 0`` an epoch's length is not counted here, so
    one job trains the whole run (said in one line)."""
    num = t.get("num_epoch")
    if num is None:
        return
    per_epoch = epoch_steps({**t, "grad_accum_every": out.get("grad_accum", 1)}, per_epoch=True)
    if per_epoch is None:
        notes.append(
            f"CREDIT gen-2 config: trainer.num_epoch = {num} with batches_per_epoch: 0 (the "
            "whole dataset per epoch): one job trains the whole run"
        )
        return
    out["job_epochs"] = {"num_epoch": int(num), "steps_per_epoch": per_epoch}


def _run_length(t: dict, out: dict, problems: list[str], notes: list[str]) -> None:
    """``trainer.steps`` as CREDIT counts a run: (``epochs`` - ``start_epoch``) epochs of
    ``batches_per_epoch`` batches (``epoch_steps``); the schedule's ``total_steps`` is only its
    length, and a disagreement is said in one line.  With ``batches_per_epoch: 0`` (the whole
    dataset per epoch, not counted here) ``total_steps`` stays the run length."""
    counted = epoch_steps({**t, "grad_accum_every": out.get("grad_accum", 1)})
    keys = ("batches_per_epoch", "num_epoch", "epochs", "start_epoch")
    epochs = [t.pop(k) for k in keys if k in t]
    if "steps" in out or "steps" in t:
        return  # credit-parallel's own key wins
    total = out.get("schedule_steps")
    if counted is not None:
        out["steps"] = counted
        if total is not None and total != counted:
            notes.append(
                f"CREDIT gen-2 config: trains {counted} optimizer steps as CREDIT counts them "
                "((epochs - start_epoch) x batches_per_epoch / grad_accum_every); "
                f"trainer.scheduler.total_steps = {total} is only the learning-rate schedule's "
                "length"
            )
    elif total is not None:
        out["steps"] = total
    elif epochs:
        problems.append(
            "trainer.batches_per_epoch / num_epoch / epochs: credit-parallel counts optimizer "
            "steps; set trainer.steps (or trainer.scheduler.total_steps)"
        )


def _trainer_section(
    conf: Mapping, data: dict, problems: list[str], dropped: list[str], notes=None
) -> dict:
    notes = [] if notes is None else notes  # one-line notes (the run length), warned once
    t = dict(conf.get("trainer") or {})
    kind = t.get("type")
    if kind is not None and kind not in _GEN2_TRAINER_TYPES:
        problems.append(
            f"trainer.type = {kind!r}: credit-parallel's trainer is CREDIT's gen-2 trainer "
            f"({', '.join(_GEN2_TRAINER_TYPES)})"
        )
    out = {}
    for theirs, ours in _TRAINER_RENAMED.items():
        if theirs in t:
            out[ours] = t.pop(theirs)
    for theirs, ours in _TRAINER_TO_DATA.items():
        if theirs in t:
            data.setdefault(ours, t.pop(theirs))
    for key, why in _TRAINER_OFF_ONLY.items():
        if t.pop(key, False):
            problems.append(f"trainer.{key}: true is not supported ({why}); set it to false")
    credit_resume_keys(conf, t, out, problems)  # load_weights, reload_epoch -> start_epoch
    norm = t.pop("grad_max_norm", None)
    if norm == "dynamic":
        # CREDIT clips to the global norm itself: a factor norm / (norm + 1e-6), i.e. none
        out["grad_clip"] = 0.0
    elif norm is not None:
        out["grad_clip"] = norm
    _schedule(t, out, problems)
    _job_epochs(t, out, notes)
    _run_length(t, out, problems, notes)
    dropped.extend(f"trainer.{k}" for k in _TRAINER_DROPPED if t.pop(k, None) is not None)
    if "seed" not in t and "seed" in conf:
        out["seed"] = conf["seed"]
    return {**t, **out}


def _loss_section(conf: Mapping, data: dict, problems: list[str]) -> dict | None:
    """``loss.type: base`` (CREDIT's per-variable loss: ``train/credit_loss.py``) checked and
    kept for the trainer; else the flat keys must say the latitude-weighted MSE."""
    loss = conf.get("loss") or {}
    if loss.get("type") == "base":
        source = next(iter(conf["data"]["source"]), "?")
        return base_loss_section(loss, data, source, problems)
    if loss.get("type") is not None:
        problems.append(
            f"loss.type = {loss['type']!r}: credit-parallel trains on CREDIT's 'base' loss "
            "(per variable in physical units, loss.args) or the latitude-weighted MSE of the "
            "normalised channels (the flat loss keys: training_loss: mse, "
            "use_latitude_weights: true)"
        )
        return None
    for key, ours in _LOSS_AS_OURS.items():
        if key in loss and loss[key] != ours:
            problems.append(
                f"loss.{key} = {loss[key]!r}: credit-parallel trains on the latitude-weighted "
                f"MSE (loss.{key}: {ours!r})"
            )
    return None


def credit_gen2_conf(conf):
    """``conf`` in credit-parallel's keys when its ``data`` is CREDIT's gen-2 schema (a new
    mapping; the model block and ``trainer.parallelism`` as they are), else ``conf`` itself.
    Raises ONE ``ValueError`` naming every key that cannot be honoured."""
    if not is_credit_gen2(conf):
        return conf
    problems: list[str] = []
    dropped: list[str] = []
    notes: list[str] = []
    data = _data_section(conf, problems)
    trainer = _trainer_section(conf, data, problems, dropped, notes)
    block_sections(conf, data, problems)
    loss = _loss_section(conf, data, problems)
    dropped.extend(k for k in BOOKKEEPING_SECTIONS if k in conf)
    if problems:
        listing = "\n".join(f"  - {p}" for p in problems)
        raise ValueError(
            f"CREDIT gen-2 config: {len(problems)} key(s) cannot be honoured:\n{listing}"
        )
    for note in notes:
        warnings.warn(note, UserWarning, stacklevel=2)
    if dropped:
        warnings.warn(
            f"CREDIT gen-2 config: {', '.join(dropped)} only steer CREDIT's own bookkeeping "
            "and are ignored",
            UserWarning,
            stacklevel=2,
        )
    taken = ("data", "trainer", "loss", "seed", "validation_data", "preblocks", "postblocks")
    out = {k: v for k, v in conf.items() if k not in taken + BOOKKEEPING_SECTIONS}
    out = {**out, "data": data, "trainer": trainer}
    return out if loss is None else {**out, "loss": loss}
