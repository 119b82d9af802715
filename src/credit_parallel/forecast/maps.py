"""The forecast's map: one field at one lead, forecast, truth and error side by side.

:func:`map_figure` draws the panels from whole fields (the forecast; with the truth, also the
truth in the same colour range and the error ``forecast - truth`` on a diverging scale centred
on zero); :func:`truth_field` reads the truth of one variable at one level and one time from the
dataset (that field only, raw physical values); ``scores.plot_field_map`` reads the forecast back
from the store and saves the PNG, ``scores.forecast_map`` is the forecast command's map.
"""

from __future__ import annotations

import numpy as np

__all__ = ["MAP_POINTS", "map_figure", "map_stride", "truth_field"]

# a panel is drawn from at most this many points along its longer side (every k-th point of a
# finer grid): the PNG is ~700 pixels per panel, and a 0.1-degree field (1801 x 3600) would
# otherwise hold rank 0 to three whole-globe images in float64 (docs/forecast.md)
MAP_POINTS = 1440


def map_stride(height: int, width: int) -> int:
    """Every how many points a ``height x width`` field is drawn (1 up to :data:`MAP_POINTS`)."""
    return max(1, -(-max(height, width) // MAP_POINTS))


def map_figure(
    forecast: np.ndarray,
    truth: np.ndarray | None = None,
    *,
    latitude: np.ndarray,
    longitude: np.ndarray,
    title: str = "",
    units: str = "",
):
    """A matplotlib figure of ``forecast`` ``(latitude, longitude)`` on a regular grid (an image
    per panel), and with ``truth`` (same shape) the truth and the error beside it; returns
    ``(figure, panels)`` (the map axes, left to right; each has its own colour bar)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    forecast = np.asarray(forecast, dtype=np.float64)
    panels = [("forecast", forecast, "viridis", None)]
    if truth is not None:
        truth = np.asarray(truth, dtype=np.float64)
        if truth.shape != forecast.shape:
            raise ValueError(
                f"map_figure: the truth's shape {truth.shape} is not the forecast's "
                f"{forecast.shape}"
            )
        low = float(np.nanmin([np.nanmin(forecast), np.nanmin(truth)]))
        high = float(np.nanmax([np.nanmax(forecast), np.nanmax(truth)]))
        error = forecast - truth
        bound = float(np.nanmax(np.abs(error))) or 1.0
        panels = [
            ("forecast", forecast, "viridis", (low, high)),
            ("truth", truth, "viridis", (low, high)),
            ("error (forecast - truth)", error, "RdBu_r", (-bound, bound)),
        ]
    fig, axes = plt.subplots(1, len(panels), figsize=(6.2 * len(panels), 3.6), squeeze=False)
    latitude, longitude = np.asarray(latitude), np.asarray(longitude)
    north_first = latitude[0] > latitude[-1]  # row 0 at the top of the image
    extent = (longitude.min(), longitude.max(), latitude.min(), latitude.max())
    for ax, (name, values, cmap, limits) in zip(axes[0], panels):
        vmin, vmax = limits if limits is not None else (None, None)
        image = ax.imshow(
            values,
            extent=extent,
            origin="upper" if north_first else "lower",
            aspect="auto",
            interpolation="nearest",
            cmap=cmap,
            vmin=vmin,
            vmax=vmax,
        )
        fig.colorbar(image, ax=ax, label=units)
        ax.set_title(name)
        ax.set_xlabel("longitude")
        ax.set_ylabel("latitude")
    if title:
        fig.suptitle(title)
    fig.tight_layout()
    return fig, list(axes[0])


def truth_field(conf: dict, variable: str, level, position: int) -> np.ndarray | None:
    """The dataset's field of ``variable`` (a dataset name; at ``level``, a value of
    ``data.levels``, for an upper-air variable) at ``position`` of the forecast's time axis
    (the whole store's times, as the forecast reads them), raw physical values ``(H, W)``
    float32; None when the dataset ends before ``position``."""
    from ..data.dataset import dataset_from_conf

    d = conf["data"]
    upper = variable in d.get("upper_air_variables", ())
    only = {
        key: ()
        for key in (
            "upper_air_variables",
            "surface_variables",
            "diagnostic_variables",
            "dynamic_forcing_variables",
            "static_variables",
        )
    }
    only["upper_air_variables" if upper else "surface_variables"] = [variable]
    data = {k: v for k, v in d.items() if k not in ("time_slice", "valid_time_slice")}
    data.update(only, levels=[level] if upper else d.get("levels"), history_len=1)
    dataset = dataset_from_conf(
        {**conf, "data": data}, forecast_len=1, normalize=False, cache_limit_bytes=0
    )
    if not 0 <= position < len(dataset.times):
        return None
    return dataset.read_steps(position, position + 1)[0, 0]
