"""Lazy package exports (PEP 562), and the old module paths of moved modules.

:func:`lazy_exports`: a package's public names resolved from their home modules on first use,
so that importing a package stays cheap and never imports the layers above it.

:func:`alias_moved_modules`: a module that moved to a package keeps its old import path for
one release: ``import credit_parallel.layout.mesh`` gives the module ``credit_parallel.layout.mesh``
(the same object, so patching either patches both) with a ``DeprecationWarning`` naming where it
went.
"""

from __future__ import annotations

import importlib
import importlib.abc
import importlib.util
import sys
import warnings
from collections.abc import Callable

__all__ = ["alias_moved_modules", "lazy_exports"]


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


class _MovedModules(importlib.abc.MetaPathFinder, importlib.abc.Loader):
    """Finds ``old`` names (only when no real module of that name exists: it sits last on
    ``sys.meta_path``) and loads them as the module at the new path."""

    def __init__(self, moves: dict[str, str]):
        self.moves = dict(moves)
        self._specs: dict[str, object] = {}

    def find_spec(self, fullname, path=None, target=None):
        if fullname not in self.moves:
            return None
        return importlib.util.spec_from_loader(fullname, self)

    def create_module(self, spec):
        new = self.moves[spec.name]
        warnings.warn(
            f"{spec.name} moved to {new}; import it from there (or the name from "
            f"credit_parallel): the old path goes in the next release",
            DeprecationWarning,
            stacklevel=2,
        )
        module = importlib.import_module(new)
        self._specs[spec.name] = module.__spec__
        return module

    def exec_module(self, module) -> None:
        # module_from_spec set __spec__ to the alias's spec: the module keeps its own
        for old, real in list(self._specs.items()):
            if module.__name__ == real.name:
                module.__spec__ = real
                del self._specs[old]


def alias_moved_modules(package: str, moves: dict[str, str]) -> None:
    """Keep ``package.<old>`` importable as ``package.<new>`` for every ``old -> new`` in
    ``moves`` (names relative to ``package``); a name that is a real module or package is never
    shadowed.  Installed once per package."""
    absolute = {f"{package}.{old}": f"{package}.{new}" for old, new in moves.items()}
    for finder in sys.meta_path:
        if isinstance(finder, _MovedModules):
            finder.moves.update(absolute)
            return
    sys.meta_path.append(_MovedModules(absolute))
