"""Forecasts under any layout: the rollout, the forecast store, the command and exact scores.

- ``rollout``: ``rollout`` (a generator of each forecast step's local rows, the prediction fed
  back without gathering the globe, dynamic forcing per step, 4-D and 5-D models);
- ``store``: ``ForecastStore`` (ONE zarr store ``DIR/forecast.zarr`` written by rows from every
  rank, completion marks for ``--resume``); ``chunks``: which rank writes which chunk;
  ``writer``: ``StepWriter`` (each step's copy to the host and its chunk writes off the critical
  path);
- ``metrics``: the exact metrics (``weighted_rmse``, ``anomaly_correlation``, ``crps``,
  ``spread`` and their per-initial-time forms ``spatial_*``): local rows in, the GLOBAL value
  out, whatever the split of rows, initial times and members over ranks;
- ``scores``: ``ScoreAccumulator`` (per variable, level and lead, SPEC §7's columns),
  ``write_scores`` (scores.csv / .json / .png), ``plot_field_map``, ``climatology``;
- ``ensemble``: ``perturb`` (the seeded initial-state perturbation, the same whatever the layout);
- ``command``: the worker of ``credit-parallel forecast`` (one process per rank, like
  ``credit_parallel.train.main``).

Names resolve lazily so that importing the package imports neither xarray nor zarr.
"""

from __future__ import annotations

from ..lazy import lazy_exports

_EXPORTS = {
    "rollout": "rollout",
    "ForecastStore": "store",
    "StepWriter": "writer",
    "run_forecast": "command",
    "anomaly_correlation": "metrics",
    "crps": "metrics",
    "gather_members": "metrics",
    "spatial_acc": "metrics",
    "spatial_crps": "metrics",
    "spatial_mse": "metrics",
    "spatial_variance": "metrics",
    "spread": "metrics",
    "weighted_rmse": "metrics",
    "ScoreAccumulator": "scores",
    "climatology": "scores",
    "plot_field_map": "scores",
    "write_scores": "scores",
    "perturb": "ensemble",
}

__all__ = sorted(_EXPORTS)


__getattr__, __dir__ = lazy_exports(__name__, _EXPORTS, globals())
