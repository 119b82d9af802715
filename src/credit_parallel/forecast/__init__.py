"""Forecasts under any layout: the rollout, the forecast store, the command and exact scores.

- ``rollout``: ``rollout`` (a generator of each forecast step's local rows, the prediction fed
  back without gathering the globe, dynamic forcing per step, 4-D and 5-D models);
- ``store``: ``ForecastStore`` (ONE zarr store ``DIR/forecast.zarr`` written by rows from every
  rank, a background writer thread per rank, completion marks for ``--resume``);
- ``command``: the worker of ``credit-parallel forecast`` (one process per rank, like
  ``credit_parallel.train.main``).

Names resolve lazily so that importing the package imports neither xarray nor zarr.
"""

from __future__ import annotations

from ..lazy import lazy_exports

_EXPORTS = {
    "rollout": "rollout",
    "ForecastStore": "store",
    "BackgroundWriter": "store",
    "run_forecast": "command",
}

__all__ = sorted(_EXPORTS)


__getattr__, __dir__ = lazy_exports(__name__, _EXPORTS, globals())
