"""CREDIT's bridgescaler / log pre- and postblocks and its ``loss.type: base``, read as
credit-parallel's keys (``data.bridgescaler``, the ``loss`` section), checked before any rank
starts.

miles-credit 2026.2's gen-2 template (``config/gen_2/examples/example-v2026.2.yml``)
normalises with ``bridgescaler_transform`` preblocks (a bridgescaler JSON fitted by ``credit
preprocess``), inverts them in its postblocks on the prediction (``y_processed``) and on the
target twin (``y_target_processed``), and scores each variable in physical units
(``credit/losses/base.py``).  :func:`scaler_step` reads one such block (``log_transform`` /
``exp_transform`` too) into a step of ``data.bridgescaler`` (run by
``data/bridgescaler_blocks.py``); :func:`finish_scaler_blocks` checks the chains as a whole and
the scaler file against the variables they select; :func:`base_loss_section` checks
``loss.args``.  What cannot be honoured is a problem naming its key:

* a ``scaler_path`` that does not exist (CREDIT's preblock silently starts fitting a new scaler
  there and fails later), a scaler file without a scaler for a selected variable, and a standard
  scaler whose variance is zero for a selected variable (CREDIT divides by its square root with
  no epsilon), naming the variable;
* a postblock chain on ``y_target_processed`` that is not the prediction's chain (the loss
  compares the two in the same units), a method other than ``transform`` (preblocks) /
  ``inverse_transform`` (postblocks), the bridgescaler blocks beside ``era5_normalizer``.

The helpers :func:`var_key`, :func:`select_keys`, :func:`load_scaler`, :func:`check_scaler` are
CREDIT's naming and selection rules, shared with the data layer.
"""

from __future__ import annotations

import math
import os
import warnings
from collections.abc import Mapping, Sequence

from .extras import require

__all__ = [
    "LOG_BASES",
    "base_loss_section",
    "check_scaler",
    "finish_scaler_blocks",
    "load_scaler",
    "scaler_step",
    "scalers_of",
    "select_keys",
    "var_key",
]

SCALER_BLOCKS = (
    "bridgescaler_transform",
    "log_transform",
    "exp_transform",
    "sqrt_transform",
    "square_transform",
)
LOG_BASES = {"e": math.log, "2": math.log2, "10": math.log10}
_ARGS = {
    ("preblocks", "bridgescaler_transform"): (
        "scaler_path",
        "variables",
        "method",
        "scaler_type",
        "scaler_params",
        "data_types",
        "spatial_variables",
    ),
    ("postblocks", "bridgescaler_transform"): (
        "scaler_path",
        "variables",
        "method",
        "key",
        "spatial_variables",
    ),
    ("preblocks", "log_transform"): ("variables", "data_types", "base", "eps"),
    ("postblocks", "exp_transform"): ("variables", "eps", "base", "key"),
    # credit/preblock/sqrt.py SqrtTransform (y = sqrt(x)), credit/postblock/square.py
    # SquareTransform (x = y ** 2)
    ("preblocks", "sqrt_transform"): ("variables", "data_types"),
    ("postblocks", "square_transform"): ("variables", "key"),
}
_METHOD = {"preblocks": "transform", "postblocks": "inverse_transform"}
_TARGET_TWIN = "y_target_processed"
# loss.args of CREDIT's BaseLoss (credit/losses/base.py)
_LOSS_ARGS = (
    "training_loss",
    "base_loss_parameters",
    "validation_loss",
    "validation_loss_parameters",
    "base_loss_overrides",
    "var_weighting",
    "scaler_path",
    "variable_weights",
    "normalize_weights",
    "include_computed_diagnostics",
    "use_latitude_weights",
    "latitude_weights",
)
VAR_WEIGHTING = ("inverse_variance", "manual", "learnable", "none")


def var_key(source: str, group: str, upper: bool, name: str) -> str:
    """CREDIT's variable key: ``"ERA5/prognostic/3d/temperature"``."""
    return f"{source}/{group}/{'3d' if upper else '2d'}/{name}"


def select_keys(selection, keys: Sequence[str]) -> list[str]:
    """CREDIT's ``_parse_variable_selection``: an empty selection (or None) selects every key, an
    entry selects the key it names and every key beneath it (``"ERA5/prognostic"``).  As in
    CREDIT a string is iterated: its characters select nothing (see :func:`scaler_step`)."""
    if not selection:
        return list(keys)
    out = []
    for entry in selection:
        for key in keys:
            if (key == entry or key.startswith(entry + "/")) and key not in out:
                out.append(key)
    return out


def load_scaler(path: str, where: str):
    """``bridgescaler.load_scaler_dict`` of ``path`` ($VARS expanded); a missing file is an error
    naming ``where`` (the config key)."""
    path = os.path.expandvars(str(path))
    if not os.path.exists(path):
        raise ValueError(
            f"{where} = {path!r} does not exist; CREDIT's preblock would start fitting a new "
            "scaler there (`credit preprocess`): fit it first and point the key at the JSON file"
        )
    # the optional extra credit-parallel[credit]: named before any rank starts when absent
    return require("bridgescaler", where).load_scaler_dict(path)


def scalers_of(scaler: Mapping, data_type: str, source: str, where: str) -> Mapping:
    """``scaler[data_type][source]``, or an error naming what the file holds."""
    try:
        return scaler[data_type][source]
    except (KeyError, TypeError):
        have = sorted(scaler) if isinstance(scaler, Mapping) else type(scaler).__name__
        raise ValueError(
            f"{where}: the scaler file has no '{data_type}' / '{source}' scalers (it holds {have})"
        ) from None


def _variance(obj):
    var = getattr(obj, "var_x_", None)
    if var is None:
        return None
    import numpy as np

    if hasattr(var, "numpy") and not isinstance(var, np.ndarray):
        var = var.numpy(force=True)  # a torch tensor, on whichever device it lives
    return np.asarray(var, dtype=float).ravel()


def check_scaler(scaler: Mapping, source: str, wanted: Mapping[str, Sequence[str]], where: str):
    """Every key of ``wanted[data_type]`` has a scaler in ``scaler[data_type][source]`` and, for a
    standard scaler, a positive variance in each channel: else ONE error naming the variables."""
    missing, zero = [], []
    for data_type, keys in wanted.items():
        have = scalers_of(scaler, data_type, source, where)
        for key in keys:
            if key not in have:
                missing.append(f"{data_type}/{key}")
                continue
            var = _variance(have[key])
            if var is not None and not bool((var > 0).all()):
                zero.append(key)
    if missing:
        raise ValueError(f"{where}: the scaler file has no scaler for {', '.join(missing)}")
    if zero:
        raise ValueError(
            f"{where}: the scaler's variance is zero for {', '.join(dict.fromkeys(zero))}; "
            "CREDIT divides by its square root (no epsilon): refit the scaler or leave the "
            "variable out of the block's `variables`"
        )


def data_keys(data: Mapping, source: str) -> dict[str, list[str]]:
    """The CREDIT keys of the mapped data block's variables per data type (input, target)."""
    upper = list(data.get("upper_air_variables") or ())
    surface = list(data.get("surface_variables") or ())
    progn = [var_key(source, "prognostic", True, n) for n in upper]
    progn += [var_key(source, "prognostic", False, n) for n in surface]
    diag = [var_key(source, "diagnostic", False, n) for n in data.get("diagnostic_variables") or ()]
    forcing = data.get("dynamic_forcing_variables") or ()
    static = data.get("static_variables") or ()
    return {
        "input": progn
        + [var_key(source, "dynamic_forcing", False, n) for n in forcing]
        + [var_key(source, "static", False, n) for n in static],
        "target": progn + diag,
    }


def scaler_step(section: str, where: str, kind: str, args: Mapping, problems: list) -> dict | None:
    """One bridgescaler / log / exp block as a step of ``data.bridgescaler`` (None if refused)."""
    allowed = _ARGS.get((section, kind))
    if allowed is None:
        other = "postblocks" if section == "preblocks" else "preblocks"
        problems.append(f"{where}.type = {kind!r} is a block of {other}, not of {section}")
        return None
    args = dict(args)
    for key in sorted(set(args) - set(allowed)):
        problems.append(f"{where}.args.{key} is not read by credit-parallel ({kind})")
    step = {"type": kind, "where": where, "variables": args.get("variables") or []}
    if isinstance(step["variables"], str):
        warnings.warn(
            f"{where}.args.variables = {step['variables']!r} is a string: CREDIT's variable "
            "selection iterates its characters and selects no variable, so the block changes "
            "nothing (here as in CREDIT); write a list to select the variable",
            UserWarning,
            stacklevel=2,
        )
    if kind == "bridgescaler_transform":
        if not args.get("scaler_path"):
            problems.append(f"{where}.args.scaler_path: the block needs its scaler file")
            return None
        method = args.get("method", _METHOD[section])
        if method != _METHOD[section]:
            problems.append(
                f"{where}.args.method = {method!r}: a {section[:-1]}'s scaler runs "
                f"{_METHOD[section]!r} here"
            )
        step.update(
            scaler_path=os.path.expandvars(str(args["scaler_path"])),
            method=method,
            spatial_variables=list(args.get("spatial_variables") or []),
        )
    elif kind in ("log_transform", "exp_transform"):
        base = str(args.get("base", "e"))
        if base not in LOG_BASES:
            problems.append(f"{where}.args.base = {base!r}: CREDIT's bases are {sorted(LOG_BASES)}")
        step.update(base=base, eps=float(args.get("eps", 1e-8)))
    if section == "preblocks" and args.get("data_types") is not None:
        step["data_types"] = list(args["data_types"])
    if section == "postblocks":
        step["key"] = args.get("key", "y_processed")
    return step


def _same_chain(a: list, b: list) -> bool:
    strip = ("where", "key")
    return [{k: v for k, v in s.items() if k not in strip} for s in a] == [
        {k: v for k, v in s.items() if k not in strip} for s in b
    ]


def finish_scaler_blocks(data: dict, source: str, pre: list, post: list, problems: list) -> None:
    """``data["bridgescaler"]`` from the collected steps, checked against the scaler files and
    the data block's variables (every problem named, none raised)."""
    if not pre and not post:
        return
    predicted = [s for s in post if s["key"] == "y_processed"]
    twin = [s for s in post if s["key"] == _TARGET_TWIN]
    for s in post:
        if s["key"] not in ("y_processed", _TARGET_TWIN):
            problems.append(
                f"{s['where']}.args.key = {s['key']!r}: credit-parallel's loss reads "
                f"'y_processed' and '{_TARGET_TWIN}'"
            )
    if twin and not _same_chain(predicted, twin):
        problems.append(
            f"postblocks: the chain on '{_TARGET_TWIN}' ({[s['where'] for s in twin]}) is not the "
            f"chain on 'y_processed' ({[s['where'] for s in predicted]}): the loss compares the "
            "prediction and the target in the same units; give both the same blocks"
        )
    if data.get("mean_path") is not None:
        problems.append(
            "preblocks: bridgescaler_transform / log_transform beside era5_normalizer (or "
            "data.mean_path): normalise with one of them"
        )
    keys = data_keys(data, source)
    loaded: dict = {}
    for step in pre + predicted:
        if step["type"] != "bridgescaler_transform":
            continue
        where = f"{step['where']}.args.scaler_path"
        try:
            if step["scaler_path"] not in loaded:
                loaded[step["scaler_path"]] = load_scaler(step["scaler_path"], where)
            pool = list(dict.fromkeys(keys["input"] + keys["target"]))
            chosen = select_keys(step["variables"], pool)
            types = step.get("data_types") or (["input", "target"] if step in pre else ["target"])
            wanted = {t: [k for k in keys[t] if k in chosen] for t in types}
            check_scaler(loaded[step["scaler_path"]], source, wanted, where)
        except ValueError as err:
            problems.append(str(err))
    data["bridgescaler"] = {"source": source, "pre": pre, "post": predicted}


def base_loss_section(loss: Mapping, data: Mapping, source: str, problems: list) -> dict:
    """``loss: {type: base, args}`` checked (CREDIT's ``BaseLoss`` keys), as the trainer reads it."""
    args = dict(loss.get("args") or {})
    for key in sorted(set(loss) - {"type", "args"}):
        problems.append(f"loss.{key} is not read with loss.type: base (its keys go in loss.args)")
    for key in sorted(set(args) - set(_LOSS_ARGS)):
        problems.append(f"loss.args.{key} is not a key of CREDIT's BaseLoss")
    mode = args.get("var_weighting", "inverse_variance")
    if mode not in VAR_WEIGHTING:
        problems.append(f"loss.args.var_weighting = {mode!r}: one of {list(VAR_WEIGHTING)}")
    if mode in ("inverse_variance", "learnable"):
        if not args.get("scaler_path"):
            problems.append(f"loss.args.scaler_path is required for var_weighting: {mode}")
        else:
            try:
                scaler = load_scaler(args["scaler_path"], "loss.args.scaler_path")
                wanted = {"target": data_keys(data, source)["target"]}
                check_scaler(scaler, source, wanted, "loss.args.scaler_path")
            except ValueError as err:
                problems.append(str(err))
    if args.get("use_latitude_weights"):
        path = args.get("latitude_weights")
        if not path:
            problems.append(
                "loss.args.latitude_weights (a path) is required with use_latitude_weights"
            )
        elif not os.path.exists(os.path.expandvars(str(path))):
            problems.append(f"loss.args.latitude_weights = {path!r} does not exist")
    return {"type": "base", "args": args, "source": source}
