"""Preflight checks of a whole run: layout, model and data, before any model is built.

A job on hundreds of ranks must fail in its first seconds, with every problem listed at once,
each naming the config key (or module path) and what would fix it.  :func:`validate_run` collects:

1. the ``trainer``, ``data`` and ``model`` sections (:mod:`credit_parallel.layout.run_config`);
2. the layout against the world size and the model against the layout — everything
   :func:`credit_parallel.planner.make_plan` finds without a process: world size divisible by
   tensor x domain, rows per domain rank at every resolution level, layers that cannot be made
   exact, unsafe modules under domain parallelism, ``validate_sharding_constraints``, tensor
   parallel targets (type, kernel, divisibility, fused projections declared);
3. the data against the model: variables and levels present in the store (the dataset
   constructor's own errors), the model's input and output shapes against one sample (channels,
   levels, grid height and width), and enough samples per data-parallel rank for one batch.

:func:`check_run` raises ONE ``ValueError`` listing all of them, or returns the run config and
the layout it parsed (each parsed once; the trainer uses them instead of parsing again).  Both
are pure functions of the config, the world size and the dataset: every rank reaches the same
verdict without a collective, so a rejected run stops on all ranks together instead of leaving
some waiting in a collective.
"""

from __future__ import annotations

import copy
from types import MappingProxyType

import torch

from ..layout.config import ParallelDims, parse_parallelism_conf
from ..layout.credit_gen2 import credit_gen2_conf
from ..layout.run_config import DEFAULT_DIST_TIMEOUT_S, RunConfig, parse_sections, trainer_option

__all__ = ["DEFAULT_DIST_TIMEOUT_S", "check_run", "dist_timeout_s", "validate_run"]

_DATA_KEYS = "data.upper_air_variables / data.surface_variables / data.levels / data.history_len"


def dist_timeout_s(conf: dict) -> float:
    """``trainer.dist_timeout_s`` as seconds (default :data:`DEFAULT_DIST_TIMEOUT_S`).

    ``ValueError`` naming the key unless it is a finite number > 0 (bool refused).
    """
    return trainer_option(conf, "dist_timeout_s")


# --------------------------------------------------------------------------- the data
def _build_dataset(conf: dict):
    """The training dataset as the trainer builds it, reading metadata only (no cache)."""
    from ..data.dataset import dataset_from_conf

    return dataset_from_conf(conf, "train", cache_limit_bytes=0)


def _sample_shapes(dataset) -> tuple[list[tuple[int, ...]], list[tuple[int, ...]], list[str]]:
    """(input shapes, per-forecast-step target shapes, input names) of one sample."""
    sample = dataset[0]
    if "x" in sample:
        names = ["x"]
        ins = [tuple(sample["x"].shape)]
        outs = [tuple(sample["y"].shape)]
    elif "x_upper" in sample:
        names = ["x_upper", "x_surface"]
        ins = [tuple(sample["x_upper"].shape), tuple(sample["x_surface"].shape)]
        outs = [tuple(sample["y_upper"].shape), tuple(sample["y_surface"].shape)]
    else:
        raise ValueError(
            f"dataset samples have keys {sorted(sample)}; expected 'x'/'y' (4-D models) or "
            "'x_upper'/'x_surface'/'y_upper'/'y_surface' (data.as_5d: true)"
        )
    steps = int(getattr(dataset, "forecast_len", 1) or 1)
    per_step = [(s[0] // steps, *s[1:]) for s in outs]
    return ins, per_step, names


def _model_keys(conf_model: dict, n_inputs: int) -> list[dict[str, str]]:
    """Which ``model.*`` key governs each dim (channels, levels, H, W) of each input."""
    if n_inputs == 2:
        return [
            {"C": "model.upper_channels", "Z": "model.levels"},
            {"C": "model.surface_channels"},
        ]
    return [{"C": "model.in_channels"}]


def _target_split(dataset, channels: int) -> str:
    """`` (P prognostic + D diagnostic)`` for a target step with diagnostic channels, else ''."""
    n_diag = int(getattr(dataset, "n_diagnostic", 0) or 0)
    if not n_diag:
        return ""
    return f" ({channels - n_diag} prognostic + {n_diag} diagnostic: data.diagnostic_variables)"


def _output_fix(conf_model: dict, key: str, channels: int, dataset, last: bool) -> str:
    """What to set so that the model outputs ``channels`` channels per forecast step (``last``:
    the model's last output, the one that carries the diagnostic channels)."""
    if "out_channels" in conf_model:
        return f"set model.out_channels: {channels}"
    n_diag = int(getattr(dataset, "n_diagnostic", 0) or 0)
    if last and (n_diag or "output_only_channels" in conf_model or "channels" in conf_model):
        # CREDIT's models (channels x levels + surface_channels prognostic) and Pangu3D
        # (surface_channels) predict output_only_channels more
        return f"set model.output_only_channels: {n_diag} (the diagnostic channels)"
    return f"set {key}: {channels} (the channels of one time step)"


def _data_vs_model(
    conf: dict, dataset, sample, model_shapes, meta_model, violations: list[str]
) -> None:
    conf_model = conf.get("model") or {}
    data_shapes, target_shapes, names = sample
    history = getattr(dataset, "history_len", None)
    per_step = getattr(dataset, "channels_per_step", None)
    how = (
        f" (history_len {history} x {per_step} channels per time step)"
        if history is not None and per_step is not None
        else ""
    )
    if len(model_shapes) != len(data_shapes):
        violations.append(
            f"model.type {conf_model.get('type')!r} takes {len(model_shapes)} input(s) but the "
            f"data gives {len(data_shapes)} ({', '.join(names)}); set data.as_5d: "
            f"{str(len(model_shapes) == 2).lower()} or choose a model of the other kind"
        )
        return
    keys = _model_keys(conf_model, len(model_shapes))
    mismatched = _input_mismatches(names, keys, model_shapes, data_shapes, how, violations)
    out_channels = conf_model.get("out_channels")
    if mismatched and isinstance(out_channels, int) and len(target_shapes) == 1:
        # the meta forward needs matching inputs; the declared output width is still checked
        if out_channels != target_shapes[0][0]:
            violations.append(
                f"model.out_channels = {out_channels} but one forecast step of the target has "
                f"{target_shapes[0][0]} channels{_target_split(dataset, target_shapes[0][0])}: "
                f"set model.out_channels: {target_shapes[0][0]}"
            )
        return
    if mismatched or meta_model is None:
        return
    _output_mismatches(
        conf_model, dataset, keys, meta_model, model_shapes, target_shapes, violations
    )


def _input_mismatches(names, keys, model_shapes, data_shapes, how: str, violations: list) -> bool:
    """Each model input's dims, channels, levels and grid against the data's; whether any
    differs (then the meta forward of :func:`_output_mismatches` cannot run)."""
    mismatched = False
    for name, key, want, got in zip(names, keys, model_shapes, data_shapes):
        if len(want) != len(got):
            violations.append(
                f"the model's input {name} has {len(want)} dims per sample {want} but the data "
                f"gives {len(got)} {got}"
            )
            mismatched = True
            continue
        if want[0] != got[0]:
            mismatched = True
            violations.append(
                f"{key['C']} = {want[0]} but the data gives {got[0]} input channels in {name}"
                f"{how}: set {key['C']}: {got[0]}, or change {_DATA_KEYS}"
            )
        if len(want) == 4 and want[1] != got[1]:
            mismatched = True
            violations.append(
                f"{key.get('Z', 'model.levels')} = {want[1]} but the data has {got[1]} levels: "
                f"set {key.get('Z', 'model.levels')}: {got[1]} or change data.levels"
            )
        for axis, key_name, w, g in (
            ("latitude", "model.image_height", want[-2], got[-2]),
            ("longitude", "model.image_width", want[-1], got[-1]),
        ):
            if w != g:
                mismatched = True
                violations.append(
                    f"{key_name} = {w} but the data grid has {g} {axis} points: set "
                    f"{key_name}: {g} (the grid of data.path)"
                )
    return mismatched


def _output_mismatches(
    conf_model, dataset, keys, meta_model, model_shapes, target_shapes, violations: list
) -> None:
    """The model's outputs (one forward on meta tensors) against one forecast step of the
    target."""
    try:
        dtype = next((p.dtype for p in meta_model.parameters()), torch.get_default_dtype())
        inputs = [torch.empty((1, *s), device="meta", dtype=dtype) for s in model_shapes]
        with torch.no_grad():
            out = meta_model(*inputs)
    except Exception as err:  # noqa: BLE001 - the planner already reports untraceable models
        violations.append(f"the model cannot run on the data's input shapes: {err}")
        return
    outs = [tuple(t.shape[1:]) for t in (out if isinstance(out, (tuple, list)) else (out,))]
    out_keys = (
        ["model.out_channels"]
        if len(outs) == 1 and "out_channels" in conf_model
        else [k["C"] for k in keys]
    )
    if len(outs) != len(target_shapes):
        violations.append(
            f"the model returns {len(outs)} output(s) but the data has {len(target_shapes)} "
            "target(s) per forecast step"
        )
        return
    for i, (key, want, got) in enumerate(zip(out_keys, outs, target_shapes)):
        last = i + 1 == len(outs)
        split = _target_split(dataset, got[0]) if last else ""  # the last output carries them
        if want != got:
            violations.append(
                f"the model's output per sample {want} does not match one forecast step of the "
                f"target {got}{split}: "
                f"{_output_fix(conf_model, key, got[0], dataset, last)} so that the loss covers every "
                "output channel and the autoregressive rollout can feed predictions back"
            )


# --------------------------------------------------------------------------- the run
def _parse_layout(conf: dict, world_size: int, violations: list[str]):
    """(the parsed ``trainer.parallelism`` block, its ParallelDims on ``world_size`` ranks); None
    for what does not parse.  Layout problems are reported by the planner (or the caller)."""
    try:
        block = parse_parallelism_conf(conf)
    except ValueError as err:
        violations.append(str(err))
        return None, None
    try:
        dims = ParallelDims(
            block["data"], block["tensor"], block["domain"], world_size, block.get("ensemble", 1)
        )
    except (ValueError, TypeError):
        dims = None  # ParallelDims.problems names why
    return block, dims


def _validate(conf: dict, world_size: int, dataset, model):
    """(violations, the RunConfig or None, the ParallelDims or None): every section and the
    layout parsed once."""
    from ..planner import build_meta_model, make_plan, model_input_shapes
    from .ema import ema_tracker_class
    from .ensemble_conf import ensemble_problems

    if not isinstance(conf, dict):
        return [f"config must be a mapping, got {type(conf).__name__}"], None, None
    try:  # a CREDIT gen-2 config, read as credit-parallel's keys (layout/credit_gen2.py)
        conf = credit_gen2_conf(conf)
    except ValueError as err:
        return [str(err)], None, None

    # 1. the trainer, data and model sections and the layout block, every bad key at once
    tc, dc, mc, violations = parse_sections(conf)
    block, dims = _parse_layout(conf, world_size, violations)
    if tc is not None and tc.use_ema:  # miles-credit's EMATracker must import (train/ema.py)
        try:
            ema_tracker_class()
        except ValueError as err:
            violations.append(str(err))

    # 2. the data (its own errors name the missing variables / levels)
    if dataset is None and conf.get("data") is not None:
        try:
            dataset = _build_dataset(conf)
        except (ValueError, FileNotFoundError) as err:
            violations.append(str(err))
    sample = None
    if dataset is not None:
        try:
            sample = _sample_shapes(dataset)
        except (ValueError, IndexError, KeyError, TypeError) as err:
            violations.append(f"data: cannot read a sample: {err}")

    # 3. layout and model: the planner finds everything without a process; when the model
    # cannot be built, the layout is still checked on its own
    plan = meta_model = None
    try:
        if model is not None:
            meta_model = copy.deepcopy(model).to("meta")
        else:
            meta_model, _ = build_meta_model(conf)
    except (ValueError, TypeError) as err:
        violations.append(str(err))
    if meta_model is not None and block is not None:
        shapes = None
        if model is not None and sample is not None:
            try:
                model_input_shapes(meta_model)
            except ValueError:
                shapes = sample[0]  # a model outside the registry: the data defines its inputs
        try:
            plan = make_plan(
                conf,
                world_size,
                model=meta_model,
                input_shapes=shapes,
                parallelism=block,
                dims=dims,
                trainer=tc,
            )
            violations.extend(plan.violations)
        except (ValueError, TypeError) as err:
            violations.append(str(err))
    elif block is not None:
        violations.extend(
            ParallelDims.problems(
                block["data"],
                block["tensor"],
                block["domain"],
                world_size,
                block.get("ensemble", 1),
            )
        )

    if tc is not None:  # the ensemble keys (train/ensemble_conf.py)
        ens = block.get("ensemble", 1) if block is not None else 1
        violations.extend(ensemble_problems(conf, tc.ensemble_size, ens, meta_model))

    # 4. the data against the model and the layout
    if sample is not None and plan is not None:
        _data_vs_model(conf, dataset, sample, plan.input_shapes, meta_model, violations)
        if tc is not None and plan.dp >= 1:
            per_rank = len(dataset) // plan.dp  # the sampler drops the remainder
            if per_rank < tc.batch_size:
                violations.append(
                    f"trainer.batch_size = {tc.batch_size} but each of the {plan.dp} "
                    f"data-parallel ranks gets only {per_rank} of the {len(dataset)} "
                    "samples: lower trainer.batch_size or widen data.time_slice"
                )
    run_config = None
    if not violations:
        run_config = RunConfig(MappingProxyType(block), tc, dc, mc)
    return violations, run_config, dims


def validate_run(conf: dict, world_size: int, dataset=None, *, model=None) -> list[str]:
    """Every violation of running ``conf`` on ``world_size`` ranks, empty when the run is fine.

    ``dataset``: the training dataset (anything with ERA5Dataset's sample keys and
    ``forecast_len``); ``None`` builds it from ``conf["data"]`` reading only metadata, or skips
    the data checks when the config has no ``data`` section.  ``model``: a model to check instead
    of building ``conf["model"]`` (it is copied to the meta device, never modified); when its
    input shapes cannot be read from its attributes, the data's are used.  No process group is
    needed or used.
    """
    return _validate(conf, world_size, dataset, model)[0]


def check_run(
    conf: dict, world_size: int, dataset=None, *, model=None
) -> tuple[RunConfig, ParallelDims]:
    """Raise one ``ValueError`` listing every violation found by :func:`validate_run`; else
    return the run config and the layout, parsed once, for the caller to use."""
    violations, run_config, dims = _validate(conf, world_size, dataset, model)
    if violations:
        listing = "\n".join(f"  - {v}" for v in violations)
        raise ValueError(
            f"the run cannot start on {world_size} rank(s): {len(violations)} problem(s) "
            f"in the configuration:\n{listing}"
        )
    return run_config, dims
