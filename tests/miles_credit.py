"""Importing miles-credit's model modules in tests (a test dependency, never a library one).

miles-credit 2026.2.0 is installed with ``--no-deps`` by ``scripts/setup.sh``: its model files
import, at import time only, packages its model classes never use in the code paths we build
(cftime, torchvision, torch_harmonics, segmentation_models_pytorch, scipy; no torchvision wheel
imports beside this torch build).  :func:`import_credit` puts an inert placeholder module in the
place of each of those that is NOT importable, for the duration of that import only, imports
the requested ``credit`` module and returns it.  A real installation of any of them always
wins; a placeholder's attributes are classes that raise as soon as they are used, so a code
path that does need one fails loudly.
"""

from __future__ import annotations

import importlib
import importlib.abc
import importlib.machinery
import importlib.util
import sys
import types

__all__ = ["PLACEHOLDER_ROOTS", "import_credit"]

# what credit.models.{crossformer, wxformer.crossformer, unet_diffusion} import but never call
PLACEHOLDER_ROOTS = (
    "cftime",
    "scipy",
    "segmentation_models_pytorch",
    "torch_harmonics",
    "torchvision",
)


class _Inert:
    """Stands in for any attribute of a placeholder module; unusable beyond being named."""

    def __init__(self, *args, **kwargs):
        raise RuntimeError(f"{type(self).__qualname__} is an import-only placeholder")


class _PlaceholderModule(types.ModuleType):
    def __getattr__(self, name):
        if name.startswith("__"):
            raise AttributeError(name)
        cls = type(name, (_Inert,), {"__qualname__": f"{self.__name__}.{name}"})
        setattr(self, name, cls)
        return cls


class _PlaceholderFinder(importlib.abc.MetaPathFinder, importlib.abc.Loader):
    def __init__(self, roots):
        self.roots = frozenset(roots)

    def find_spec(self, fullname, path, target=None):
        if fullname.split(".")[0] in self.roots:
            return importlib.machinery.ModuleSpec(fullname, self, is_package=True)
        return None

    def create_module(self, spec):
        return _PlaceholderModule(spec.name)

    def exec_module(self, module):
        module.__path__ = []


def import_credit(module: str):
    """``importlib.import_module(module)`` for a ``credit.*`` module, with placeholders for the
    missing import-only dependencies present DURING that import only: afterwards the finder and
    the placeholder modules are removed again, so no other code (xarray probing for scipy, say)
    ever sees them.  A missing miles-credit is an error: scripts/setup.sh installs it."""
    if importlib.util.find_spec("credit") is None or importlib.util.find_spec("einops") is None:
        raise ImportError(
            "miles-credit / einops are test dependencies: run `bash scripts/setup.sh` "
            "(pip install --no-deps miles-credit==2026.2.0 einops)"
        )
    if module in sys.modules:
        return sys.modules[module]
    missing = [r for r in PLACEHOLDER_ROOTS if importlib.util.find_spec(r) is None]
    finder = _PlaceholderFinder(missing)
    sys.meta_path.append(finder)  # after the real finders
    try:
        return importlib.import_module(module)
    finally:
        sys.meta_path.remove(finder)
        for name in [n for n, m in sys.modules.items() if isinstance(m, _PlaceholderModule)]:
            del sys.modules[name]
