"""Importing miles-credit's and timm's model modules in tests (test dependencies, never library
ones).

miles-credit 2026.2.0 and timm 1.0.31 are installed with ``--no-deps`` by ``scripts/setup.sh``:
their model files import, at import time only, packages their model classes never use in the
code paths we build (cftime, torchvision, torch_harmonics, segmentation_models_pytorch, scipy;
no torchvision wheel imports beside this torch build).  :func:`import_credit` /
:func:`import_timm` put an inert placeholder module in the place of each of those that is NOT
importable, for the duration of that import only, import the requested module and return it.
A real installation of any of them always wins; a placeholder's attributes are classes that
raise as soon as they are instantiated, and their own attributes are such classes again
(timm's data module builds a table keyed by ``InterpolationMode.NEAREST`` at import), so a code
path that does need one fails loudly.
"""

from __future__ import annotations

import importlib
import importlib.abc
import importlib.machinery
import importlib.util
import sys
import types

__all__ = ["PLACEHOLDER_ROOTS", "import_credit", "import_timm"]

# what credit.models.{crossformer, wxformer.crossformer, unet_diffusion, swin} and
# timm.models.swin_transformer_v2 import but never call
PLACEHOLDER_ROOTS = (
    "cftime",
    "scipy",
    "segmentation_models_pytorch",
    "torch_harmonics",
    "torchvision",
)


def _inert_class(name: str, qualname: str) -> type:
    return _InertMeta(name, (_Inert,), {"__qualname__": qualname})


class _InertMeta(type):
    """Attributes of a placeholder class are placeholder classes too (``Enum.MEMBER``)."""

    def __getattr__(cls, name):
        if name.startswith("__"):
            raise AttributeError(name)
        inner = _inert_class(name, f"{cls.__qualname__}.{name}")
        setattr(cls, name, inner)
        return inner


class _Inert(metaclass=_InertMeta):
    """Stands in for any attribute of a placeholder module; unusable beyond being named."""

    def __init__(self, *args, **kwargs):
        raise RuntimeError(f"{type(self).__qualname__} is an import-only placeholder")


class _PlaceholderModule(types.ModuleType):
    def __getattr__(self, name):
        if name.startswith("__"):
            raise AttributeError(name)
        cls = _inert_class(name, f"{self.__name__}.{name}")
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


def _import_with_placeholders(module: str):
    """``importlib.import_module(module)`` with placeholders for the missing import-only
    dependencies present DURING that import only: afterwards the finder and the placeholder
    modules are removed again, so no other code (xarray probing for scipy, say) ever sees them."""
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


def import_credit(module: str):
    """A ``credit.*`` module (its swin and fuxi files import timm too).  A missing miles-credit
    is an error: scripts/setup.sh installs it."""
    if any(importlib.util.find_spec(p) is None for p in ("credit", "einops")):
        raise ImportError(
            "miles-credit / einops / timm are test dependencies: run `bash scripts/setup.sh` "
            "(pip install --no-deps miles-credit==2026.2.0 timm==1.0.31 einops)"
        )
    return _import_with_placeholders(module)


def import_timm(module: str):
    """A ``timm.*`` module.  A missing timm is an error: scripts/setup.sh installs it."""
    if importlib.util.find_spec("timm") is None:
        raise ImportError(
            "timm is a test dependency: run `bash scripts/setup.sh` "
            "(pip install --no-deps timm==1.0.31)"
        )
    return _import_with_placeholders(module)
