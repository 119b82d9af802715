"""Reading the tensor-parallel declarations a model makes: ``_tp_col`` / ``_tp_row`` (dotted
paths) and CREDIT 2026.2's per-instance ``_tp_plan = {"to_q": "colwise", ...}``, through any
domain-parallel wrapper (``domain/wrap.py``), so that every entry point of
``tensor_parallel.py`` sees the same targets."""

from __future__ import annotations

import torch.nn as nn

COLUMN = "col"
ROW = "row"


def _join(prefix: str, rel: str) -> str:
    return f"{prefix}.{rel}" if prefix else rel


def _where(name: str) -> str:
    return repr(name) if name else "<root>"


def _declared_paths(module: nn.Module, attr: str, name: str) -> list[str]:
    value = getattr(module, attr, None)
    if value is None:
        return []
    items = [value] if isinstance(value, str) else value
    if not isinstance(items, (list, tuple)) or not all(
        isinstance(p, str) and p.strip() for p in items
    ):
        raise TypeError(
            f"{attr} of module {_where(name)} ({type(module).__name__}) must be a dotted path "
            f"or a list/tuple of dotted paths, got {value!r}"
        )
    return list(items)


# CREDIT 2026.2's plan values (miles-credit's _tp_plan) -> our roles
_PLAN_STYLES = {"colwise": COLUMN, "rowwise": ROW}


def _declarer(module: nn.Module) -> nn.Module:
    """The module whose class and attributes hold the declarations: inside a domain-parallel
    wrapper (``domain/wrap.py``: it shares the wrapped module's children, not its attributes;
    CREDIT sets ``_tp_plan`` per instance) the wrapped module."""
    while "wrapped" in module.__dict__:
        module = module.__dict__["wrapped"]
    return module


def _declared_roles(module: nn.Module, name: str) -> tuple[list[str], list[str]]:
    """(column paths, row paths) a module declares, from ``_tp_col`` / ``_tp_row`` and from
    CREDIT's ``_tp_plan = {"to_q": "colwise", ..., "to_out": "rowwise"}``: both spellings of
    the one plan, read here only, so every entry point sees the same targets."""
    module = _declarer(module)
    cols = _declared_paths(module, "_tp_col", name)
    rows = _declared_paths(module, "_tp_row", name)
    plan = getattr(module, "_tp_plan", None) or {}
    if not isinstance(plan, dict) or any(v not in _PLAN_STYLES for v in plan.values()):
        raise TypeError(
            f"_tp_plan of module {_where(name)} ({type(module).__name__}) must map dotted paths "
            f"to 'colwise' or 'rowwise', got {plan!r}"
        )
    for rel, style in plan.items():
        (cols if _PLAN_STYLES[style] == COLUMN else rows).append(rel)
    return list(dict.fromkeys(cols)), list(dict.fromkeys(rows))
