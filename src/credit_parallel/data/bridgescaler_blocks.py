"""CREDIT's ``bridgescaler_transform`` / ``log_transform`` / ``sqrt_transform`` preblocks and
their postblock twins (``bridgescaler_transform`` with ``method: inverse_transform``,
``exp_transform``, ``square_transform``), run through the ``bridgescaler`` package itself.

miles-credit 2026.2 (``credit/preblock/scaler.py``, ``credit/postblock/scaler.py``) keeps a
sample as ``{data_type: {source: {var_key: (B, levels, T, H, W)}}}`` with ``var_key`` =
``"<source>/<group>/<3d|2d>/<name>"`` and applies ``bridgescaler.scale_var_dict`` with the
scaler dict ``load_scaler_dict(scaler_path)[data_type]`` to the variables its ``variables``
list selects (``[]``: all; a partial path: every variable beneath it), ``spatial_variables``
flattened to ``(B, H * W)`` first (one statistic per grid point).  Here a sample is
credit-parallel's flat channel layout (``data/dataset.py``: ``x``, ``y``, ``forcing``); each
variable's channels are viewed as CREDIT's ``(1, levels, 1, rows, W)`` tensor and handed to the
same ``scale_var_dict`` with the same scaler objects, so every element is computed by the
same operations as in CREDIT (bitwise: the transforms are per point).  A rank holding some
rows (or a lat x lon tile) passes its grid points' GLOBAL flat indices as the tensor's
``variable_names`` for a spatial variable: bridgescaler's own column selection picks their
statistics, so the transform is exact under any layout.

* :class:`ScalerBlocks` (``data.bridgescaler``, written by ``layout/credit_gen2_blocks.py``):
  the ordered preblock chain (``pre``) and postblock chain (``post``).
* :meth:`ScalerBlocks.sample_transform` for the dataset (raw float32 in, the model's units out:
  the input scaler on ``x`` / ``forcing``, the target scaler on ``y``, as CREDIT's preblock).
* :meth:`ScalerBlocks.physical` for the loss and the forecast: a prediction (or the target
  twin) in the model's units back to physical units per variable (CREDIT's postblocks
  ``y_processed`` / ``y_target_processed``), differentiable;
* :meth:`ScalerBlocks.model_units` for the forecast: a composed input, one step's forcing or a
  climatology through the preblock chain.
* :func:`check_scaler`: a missing ``scaler_path`` and a zero variance of a listed variable are
  refused naming the key / the variable (CREDIT falls back to fitting a new scaler, and divides
  by the variance without an epsilon).
"""

from __future__ import annotations

import math
import warnings
from collections.abc import Mapping
from dataclasses import dataclass

import torch

from ..layout.credit_scaler_blocks import LOG_BASES, load_scaler, scalers_of, select_keys, var_key

__all__ = ["SampleLayout", "ScalerBlocks", "VarSlot"]

_TORCH_LOG = {"e": torch.log, "2": torch.log2, "10": torch.log10}


@dataclass(frozen=True)
class VarSlot:
    """One variable of a flat channel layout: its CREDIT key and channels ``[start, start+width)``."""

    key: str
    start: int
    width: int


def _log_or_exp(kind: str, base: str, x: torch.Tensor, eps: float, log_eps: float):
    """CREDIT's ``LogTransform`` (``log_base(x + eps) - log_base(eps)``) or its inverse
    ``ExpTransform`` (``base ** (y + log_base(eps)) - eps``), in their operation order."""
    if kind == "log_transform":
        return _TORCH_LOG[base](x + eps) - log_eps
    y = x + log_eps
    if base == "e":
        return torch.exp(y) - eps
    if base == "2":
        return torch.exp2(y) - eps
    return torch.pow(10.0, y) - eps


class ScalerBlocks:
    """The pre- and postblock chains of ``data.bridgescaler`` (see the module docstring).

    ``spec``: ``{"source": "ERA5", "pre": [step, ...], "post": [step, ...]}``, each step
    ``{"type": "bridgescaler_transform", "scaler_path", "method", "variables",
    "spatial_variables", "data_types"}`` (``where``: its config key, for errors) or ``{"type": "log_transform" | "exp_transform", "variables", "base",
    "eps", "data_types"}`` in the order of the config's blocks.
    """

    def __init__(self, spec: Mapping):
        self.source = str(spec["source"])
        self.pre = [dict(s) for s in spec.get("pre") or ()]
        self.post = [dict(s) for s in spec.get("post") or ()]
        self._scalers: dict[str, Mapping] = {}
        for step in self.pre + self.post:
            if (
                step["type"] == "bridgescaler_transform"
                and step["scaler_path"] not in self._scalers
            ):
                self._scalers[step["scaler_path"]] = load_scaler(
                    step["scaler_path"], step.get("where", "scaler_path")
                )

    # ------------------------------------------------------------------ tensors of one chain
    def _run(self, chain, tensors: dict, data_type: str, keys_present, geometry) -> dict:
        """``tensors`` ``{key: (B, L, T, h, w)}`` through ``chain`` as CREDIT's blocks do."""
        from bridgescaler import scale_var_dict

        for step in chain:
            types = step.get("data_types")
            if types is not None and data_type not in types:
                continue
            selected = [k for k in select_keys(step.get("variables"), keys_present) if k in tensors]
            if not selected:
                continue
            if step["type"] in ("sqrt_transform", "square_transform"):
                op = torch.sqrt if step["type"] == "sqrt_transform" else torch.square
                for k in selected:
                    tensors[k] = op(tensors[k])
                continue
            if step["type"] in ("log_transform", "exp_transform"):
                base, eps = str(step.get("base", "e")), float(step.get("eps", 1e-8))
                log_eps = LOG_BASES[base](eps)
                for k in selected:
                    tensors[k] = _log_or_exp(step["type"], base, tensors[k], eps, log_eps)
                continue
            scaler = self._scalers[step["scaler_path"]]
            table = scalers_of(scaler, data_type, self.source, step.get("where", "scaler_path"))
            wanted = step.get("spatial_variables")
            spatial = set(select_keys(wanted, keys_present)) if wanted else set()
            shapes = {}
            nested = {}
            for k in selected:
                t = tensors[k]
                if k in spatial:
                    shapes[k] = t.shape
                    t = t.reshape(t.shape[0], -1)
                    t.variable_names = geometry.flat_indices()
                nested[k] = t
            method = step["method"]
            with warnings.catch_warnings():
                warnings.filterwarnings("ignore", message="Input data lacks variable names")
                out = scale_var_dict({self.source: nested}, {self.source: table}, method, selected)
            for k in selected:
                v = out[self.source][k]
                tensors[k] = v.reshape(shapes[k]) if k in shapes else v
        return tensors

    # ------------------------------------------------------------------ the dataset's samples
    def sample_transform(self, sample: dict, layout) -> dict:
        """A raw float32 sample (``x``, ``y``, ``forcing``: ``(C, rows, W)``) in the model's
        units: CREDIT's preblock chain, the input scalers on ``x`` / ``forcing``, the target
        ones on ``y``.  ``layout``: :class:`SampleLayout` of the dataset."""
        out = dict(sample)
        for name, data_type, slots in layout.tensors(sample):
            out[name] = self._flat(out[name], data_type, slots, self.pre, layout)
        return out

    def _flat(self, flat: torch.Tensor, data_type, slots, chain, layout) -> torch.Tensor:
        """``flat`` ``(..., C, h, w)``: each slot's channels (one variable at one time step) as
        CREDIT's ``(B, levels, 1, h, w)`` tensor (the leading dims folded into B) through
        ``chain``; the slots cover every channel, in order."""
        batch_shape, grid = flat.shape[:-3], flat.shape[-2:]
        b = math.prod(batch_shape)
        keys = layout.keys_of(data_type)
        parts = []
        for s in slots:
            t = flat[..., s.start : s.start + s.width, :, :].reshape(b, s.width, 1, *grid)
            t = self._run(chain, {s.key: t}, data_type, keys, layout)[s.key]
            parts.append(t.reshape(*batch_shape, s.width, *grid))
        return torch.cat(parts, dim=-3)

    def model_units(self, flat: torch.Tensor, data_type: str, slots, layout) -> torch.Tensor:
        """``flat`` ``(..., C, h, w)`` (raw, its channels the variables of ``slots``) in the
        model's units: the preblock chain as on ``data_type`` (``input``: a composed input or
        one step's forcing; ``target``: the output channels, e.g. a climatology)."""
        return self._flat(flat, data_type, slots, self.pre, layout)

    # ------------------------------------------------------------------ the loss
    def physical(self, output: torch.Tensor, layout) -> dict:
        """One forecast step's output ``(B, C_out_step, h, w)`` (a prediction, or the target in
        the model's units) in physical units: ``{var_key: (B, levels, 1, h, w)}`` through the
        postblock chain (CREDIT's ``y_processed`` / ``y_target_processed``), differentiable."""
        grid = output.shape[-2:]
        tensors = {
            s.key: output[:, s.start : s.start + s.width].reshape(
                output.shape[0], s.width, 1, *grid
            )
            for s in layout.output_slots
        }
        return self._run(self.post, tensors, "target", list(tensors), layout)


class SampleLayout:
    """Where each CREDIT variable sits in a dataset's flat ``x`` / ``y`` / ``forcing`` and the
    global flat indices of its grid points (for spatial scalers)."""

    def __init__(self, dataset, source: str):
        ds = dataset
        upper = set(ds.upper_air_variables)
        n_levels = len(ds.levels) if ds.upper_air_variables else 0
        progn = [
            (var_key(source, "prognostic", n in upper, n), n_levels if n in upper else 1)
            for n in list(ds.upper_air_variables) + list(ds.surface_variables)
        ]
        diag = [(var_key(source, "diagnostic", False, n), 1) for n in ds.diagnostic_variables]
        forcing = [(var_key(source, "dynamic_forcing", False, n), 1) for n in ds.forcing_variables]
        static = [(var_key(source, "static", False, n), 1) for n in ds.static_variables]
        self.input_slots = _slots(progn * ds.history_len + forcing + static)
        self.output_slots = _slots(progn + diag)
        self.target_slots = _slots((progn + diag) * ds.forecast_len)
        self.forcing_slots = _slots(forcing * max(ds.forecast_len - 1, 0))
        self._input_keys = [k for k, _ in progn + forcing + static]
        self._target_keys = [k for k, _ in progn + diag]
        height, width = ds.grid_shape
        rows = ds.rows or (0, height)
        cols = ds.columns or (0, width)
        self._flat = [r * width + c for r in range(*rows) for c in range(*cols)]

    def keys_of(self, data_type: str) -> list[str]:
        return self._input_keys if data_type == "input" else self._target_keys

    def flat_indices(self) -> list[int]:
        return list(self._flat)

    def tensors(self, sample: dict):
        yield "x", "input", self.input_slots
        yield "y", "target", self.target_slots
        if "forcing" in sample and self.forcing_slots:
            yield "forcing", "input", self.forcing_slots


def _slots(pairs) -> list[VarSlot]:
    out, at = [], 0
    for key, width in pairs:
        out.append(VarSlot(key, at, width))
        at += width
    return out
