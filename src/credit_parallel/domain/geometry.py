"""What every domain-parallel layer says about itself: its form and its row geometry.

The planner, the cost model and the converter's exchange fusion ask the layers through this one
small interface instead of re-deriving their arithmetic:

* ``domain_form`` (class attribute): how the layer works across ranks, one of :data:`FORMS` —
  ``"halo"`` reads neighbour rows through an exchange window, ``"local"`` is row-local (no
  communication), ``"collective"`` is row-local plus a statistics collective (GroupNorm),
  ``"relayout"`` re-lays rows out around the module (windowed attention), ``"regroup"`` moves rows
  into strided groups, ``"sequence"`` runs all-to-all / ring over all positions, ``"gather"`` runs
  on the whole globe;
* ``output_height(input_height) -> int``: the GLOBAL output height of a GLOBAL input height;
* ``input_windows(input_height, n)``: per domain rank, the global input rows (:data:`FILL` = -1 for
  a fill row) that the rank's owned output rows read, or None for forms that do not work by
  windows.  Every rank computes the same tuple, which is what lets both ends of every message
  agree on its size without talking (``rows.plan_exchange``).

``domain_kind`` (class attribute, optional) is a short label for reports ("conv", "group_norm").
Pure: nothing here touches torch.distributed.
"""

from __future__ import annotations

from typing import Protocol, runtime_checkable

from .rows import FILL

__all__ = [
    "FILL",
    "FORMS",
    "DomainLayer",
    "domain_form_of",
    "domain_kind_of",
    "input_windows_of",
    "is_domain_layer",
]

FORMS = ("halo", "local", "collective", "relayout", "regroup", "sequence", "gather")


@runtime_checkable
class DomainLayer(Protocol):
    """The geometry every domain-parallel layer answers (see the module docstring)."""

    domain_form: str

    def output_height(self, input_height: int) -> int: ...

    def input_windows(self, input_height: int, n: int) -> tuple[tuple[int, ...], ...] | None: ...


def is_domain_layer(module) -> bool:
    """Whether ``module`` answers the geometry interface with a known form."""
    return getattr(module, "domain_form", None) in FORMS and isinstance(module, DomainLayer)


def domain_form_of(module) -> str | None:
    """The layer's ``domain_form``, or None for a module that is not a domain layer."""
    return module.domain_form if is_domain_layer(module) else None


def domain_kind_of(module) -> str:
    """The layer's report label: its ``domain_kind``, else its class name."""
    return getattr(module, "domain_kind", None) or type(module).__name__


def input_windows_of(layer, input_height: int, n: int, *, double: bool = False):
    """``layer.input_windows(input_height, n)``; a layer whose windows depend on the arithmetic
    precision (``windows_depend_on_precision = True``, e.g. interpolation indices) is asked for
    those of float64 inputs when ``double``."""
    if getattr(layer, "windows_depend_on_precision", False):
        return layer.input_windows(input_height, n, double=double)
    return layer.input_windows(input_height, n)
