"""Lazy package exports (PEP 562): a package's public names resolved from their home modules on
first use, so that importing a package stays cheap and never imports the layers above it."""

from __future__ import annotations

import importlib
from collections.abc import Callable

__all__ = ["lazy_exports"]


def lazy_exports(
    package: str, exports: dict[str, str], namespace: dict, extra: tuple[str, ...] = ()
) -> tuple[Callable[[str], object], Callable[[], list[str]]]:
    """``(__getattr__, __dir__)`` for ``package`` whose public names map to home modules relative
    to it (``exports[name] = "sub.module"``); a resolved name is cached in ``namespace`` (the
    package's ``globals()``).  ``extra``: further names ``dir()`` lists (sub-packages)."""
    names = sorted(exports)

    def __getattr__(name: str):
        module = exports.get(name)
        if module is None:
            raise AttributeError(f"module {package!r} has no attribute {name!r}")
        value = getattr(importlib.import_module(f".{module}", package), name)
        namespace[name] = value
        return value

    def __dir__() -> list[str]:
        return names + list(extra)

    return __getattr__, __dir__
