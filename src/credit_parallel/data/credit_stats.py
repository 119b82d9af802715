"""The per-channel normalisation statistics of ``ERA5Dataset``: credit-parallel's statistics
store, or CREDIT's netCDF mean / std files.

``data.stats_path`` (default ``default_stats_path(data.path)``): the zarr store
``compute_normalization_stats`` writes (``store.load_channel_stats``).

``data.mean_path`` / ``data.std_path``: CREDIT's two netCDF files (``scaler_type: std_new``),
one variable per data variable, a 1-D level dim for upper-air variables and a scalar for 2-D
ones, read as miles-credit reads them (``credit.preblock.norm.ERA5Normalizer``, the gen-2
normaliser, and ``credit.transforms.transforms_global.Normalize_ERA5_and_Forcing``):
normalised channel = (raw - mean) / std per variable and level.  The levels of a variable are
matched by each file's own level coordinate values (xarray's alignment in
``Normalize_ERA5_and_Forcing``; a selected level missing from them is an error naming it), and by
position only when the level dim has no coordinate and exactly the selected number of levels
(``ERA5Normalizer``, which indexes positionally).  As ``ERA5Normalizer`` does, a dynamic
forcing or static variable absent from both files passes through unchanged (mean 0, std 1);
a prognostic variable absent from them, or a variable in one file only, is an error naming it.
The values are those CREDIT computes: bitwise ``ERA5Normalizer``'s float32 arithmetic on a
domain rank's rows (row mode), and ``Normalize_ERA5_and_Forcing``'s float64 arithmetic
rounded once on the whole globe (tests/test_credit_stores.py).  Reading netCDF needs an xarray
engine: ``h5netcdf``, of the optional extra ``credit-parallel[credit]`` (``layout/extras.py``).
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import xarray as xr

from ..layout.extras import extra_hint, require
from .store import default_stats_path, load_channel_stats

__all__ = ["dataset_stats", "load_netcdf_stats"]


def _open(path, key: str, what: str) -> xr.Dataset:
    path = Path(path)
    if not path.exists():
        raise FileNotFoundError(f"{what}: data.{key} {str(path)!r} does not exist")
    require("h5netcdf", f"{what}: data.{key}")
    try:
        with xr.open_dataset(path) as ds:
            return ds.load()
    except (OSError, ValueError) as err:
        raise ValueError(
            f"{what}: data.{key} {str(path)!r} cannot be read as netCDF ({err}); "
            "CREDIT's statistics files are read with xarray's h5netcdf engine "
            f"({extra_hint()})"
        ) from err


def _at_levels(values, name: str, key: str, levels, what: str) -> list[float]:
    """``values`` (one file's 1-D per-level array of ``name``) at each of ``levels``: matched by
    the file's own level coordinate, else (no coordinate) by position when the counts agree."""
    dim = values.dims[0]
    if dim in values.coords:
        have = values[dim].values.astype(np.float64)
        at = [np.flatnonzero(np.isclose(have, float(level))) for level in levels]
        absent = [level for level, match in zip(levels, at) if not match.size]
        if absent:
            raise ValueError(
                f"{what}: the statistics of {name!r} in data.{key} have levels "
                f"{have.tolist()} along {dim!r}; the selected levels {absent} are not among them"
            )
        return values.values[[int(match[0]) for match in at]].tolist()
    if values.size == len(levels):  # no level coordinate: positional, as ERA5Normalizer indexes
        return values.values.tolist()
    raise ValueError(
        f"{what}: the statistics of {name!r} in data.{key} have {values.size} levels along "
        f"{dim!r} (no coordinate) and not the {len(levels)} selected levels {list(levels)}"
    )


def _level_values(mean, std, name: str, levels, what: str):
    """The (mean, std) of ``name`` at each of ``levels`` from its 1-D per-level arrays."""
    mean, std = mean.squeeze(), std.squeeze()
    if mean.ndim == 0 and std.ndim == 0 and len(levels) == 1:
        return [float(mean)], [float(std)]
    if mean.ndim != 1 or std.ndim != 1:
        raise ValueError(
            f"{what}: the statistics of upper-air variable {name!r} have dims {mean.dims} / "
            f"{std.dims}; expected one level dim"
        )
    return (
        _at_levels(mean, name, "mean_path", levels, what),
        _at_levels(std, name, "std_path", levels, what),
    )


def load_netcdf_stats(mean_path, std_path, variables, levels, what: str = "ERA5Dataset"):
    """Per channel, the float64 (mean, std) of ``variables`` (``(name, upper, required)`` in
    channel order: an upper-air variable one channel per level of ``levels``) from CREDIT's
    netCDF files (see the module docstring)."""
    mean_ds = _open(mean_path, "mean_path", what)
    std_ds = _open(std_path, "std_path", what)
    means, stds, missing = [], [], []
    for name, upper, required in variables:
        where = [key for key, ds in (("mean_path", mean_ds), ("std_path", std_ds)) if name in ds]
        width = len(levels) if upper else 1
        if not where and not required:  # passed through unchanged, as ERA5Normalizer does
            means += [0.0] * width
            stds += [1.0] * width
            continue
        if len(where) < 2:
            missing.append(f"{name!r} (in {where[0] if where else 'neither file'})")
            continue
        mean, std = mean_ds[name], std_ds[name]
        if upper:
            m, s = _level_values(mean, std, name, levels, what)
        elif mean.size != 1 or std.size != 1:
            raise ValueError(
                f"{what}: the statistics of 2-D variable {name!r} have dims {mean.dims}; "
                "expected one value"
            )
        else:
            m, s = [float(mean.values.reshape(()))], [float(std.values.reshape(()))]
        means += m
        stds += s
    if missing:
        raise ValueError(
            f"{what}: variables {', '.join(missing)} need a mean and a std in data.mean_path "
            f"{str(mean_path)!r} and data.std_path {str(std_path)!r}"
        )
    return np.asarray(means, np.float64), np.asarray(stds, np.float64)


def dataset_stats(
    variables,
    levels,
    channel_names,
    store_paths,
    *,
    level_dim=None,
    stats_path=None,
    mean_path=None,
    std_path=None,
    what: str = "ERA5Dataset",
):
    """The per-channel float64 (mean, std) of the channels a dataset reads.

    ``variables``: ``(name, upper, output)`` per read or static variable in channel order (an
    upper-air one is a channel per level of ``levels``, along the store's ``level_dim``;
    ``output``: a prognostic or diagnostic variable, which CREDIT's netCDF files must hold);
    ``channel_names``: the name of every channel (for the errors); ``store_paths``: the stores
    of ``data.path`` (the statistics store beside the first is the default).  From CREDIT's
    netCDF files when ``mean_path`` / ``std_path`` are given, else the statistics store."""
    if (mean_path is None) != (std_path is None):
        raise ValueError(f"{what}: data.mean_path and data.std_path go together; give both")
    if mean_path is not None and stats_path is not None:
        raise ValueError(
            f"{what}: data.stats_path and data.mean_path / data.std_path both given; "
            "normalise with one of them"
        )
    if mean_path is not None:
        mean, std = load_netcdf_stats(mean_path, std_path, variables, levels, what)
        source = f"data.std_path {str(std_path)!r}"
    else:
        if stats_path is None and len(store_paths) > 1:
            raise ValueError(
                f"{what}: data.path names {len(store_paths)} stores; give their "
                "statistics as data.stats_path or data.mean_path / data.std_path"
            )
        stats_path = default_stats_path(store_paths[0]) if stats_path is None else Path(stats_path)
        variables = [(name, upper) for name, upper, _ in variables]
        mean, std = load_channel_stats(stats_path, variables, levels, level_dim, what)
        source = repr(str(stats_path))
    bad = [channel_names[c] for c in range(std.size) if not np.isfinite(std[c]) or std[c] <= 0]
    if bad:
        raise ValueError(
            f"{what}: channels {bad} have a zero or non-finite std in {source}; they cannot "
            "be normalised"
        )
    return mean, std
