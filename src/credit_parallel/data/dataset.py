"""ERA5-style zarr stores as a torch ``Dataset`` of (input history, forecast target) samples.

Store layout read here (the ERA5 / WeatherBench convention, also what ``write_sample_dataset``
writes): a zarr store holding upper-air variables with dims ``(time, level, latitude, longitude)``
and surface variables with dims ``(time, latitude, longitude)``; the names ``lat``/``lon`` and
``pressure_level``/``plev``/``isobaricInhPa`` are accepted too.  Rows are delivered north to south
(a store whose latitude ascends is flipped), so row 0 is the north edge that domain rank 0 owns.

Channel order of one time step (``ERA5Dataset.variable_names``): each upper-air variable in the
order requested, each of its levels in the order requested (store order when ``levels=None``),
named ``"<var>_<level>"`` (``"T_500"``); then the surface variables in the order requested.
``x`` stacks ``history_len`` such steps, oldest first; ``y`` the next ``forecast_len`` steps.

Normalisation statistics live in a separate small zarr store (``default_stats_path(path)``,
``<name>_stats.zarr`` beside the data, unless ``stats_path`` is given): one variable per data
variable, same name, dims ``("statistic", level)`` for upper-air and ``("statistic",)`` for
surface variables, index 0 of ``statistic`` the mean and 1 the std (no coordinate: zarr v3 has no
stable string dtype; the store's ``statistic_order`` attribute says so); unweighted over time, latitude and longitude,
ddof 0 (``compute_normalization_stats`` writes it).  Normalised channel = (raw - mean) / std.
"""

from __future__ import annotations

import warnings
from collections.abc import Sequence
from pathlib import Path

import numpy as np
import torch
import xarray as xr
from torch.utils.data import Dataset

__all__ = [
    "DEFAULT_CACHE_LIMIT_BYTES",
    "ERA5Dataset",
    "compute_normalization_stats",
    "dataset_from_conf",
    "default_stats_path",
    "latitude_weights",
]

# Below this size (float32, selected variables, levels and times) the whole selection is read once
# and kept in memory, already normalised; above it each sample is read from the store on demand.
DEFAULT_CACHE_LIMIT_BYTES = 1 << 30

_TIME_NAMES = ("time",)
_LAT_NAMES = ("latitude", "lat")
_LON_NAMES = ("longitude", "lon")
_LEVEL_NAMES = ("level", "pressure_level", "plev", "isobaricInhPa")
_STATISTICS = ("mean", "std")


def default_stats_path(path) -> Path:
    """Where the statistics of the store at ``path`` live: ``<stem>_stats.zarr`` beside it."""
    path = Path(path)
    stem = path.stem if path.suffix == ".zarr" else path.name
    return path.with_name(f"{stem}_stats.zarr")


def latitude_weights(lat_degrees, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """``cos(lat)`` normalised to mean 1, shape ``(H,)``; the poles keep their exact (tiny) value."""
    if isinstance(lat_degrees, torch.Tensor):
        lat_degrees = lat_degrees.detach().cpu().numpy()
    lat = np.asarray(lat_degrees, dtype=np.float64)
    if lat.ndim != 1 or lat.size == 0:
        raise ValueError(
            f"latitude_weights: lat_degrees must be a non-empty 1-D array, got shape {lat.shape}"
        )
    if not np.all(np.isfinite(lat)) or np.any(np.abs(lat) > 90.0):
        raise ValueError(
            "latitude_weights: lat_degrees must be finite degrees in [-90, 90], got "
            f"min {lat.min()} max {lat.max()}"
        )
    weights = np.cos(np.deg2rad(lat))
    if weights.sum() <= 0.0:
        raise ValueError("latitude_weights: all latitudes are poles; cos(lat) has no mass")
    return torch.as_tensor(weights / weights.mean(), dtype=dtype)


def _open_store(path, what: str) -> xr.Dataset:
    path = Path(path)
    if not path.exists():
        raise FileNotFoundError(
            f"{what}: no zarr store at {str(path)!r}; write a sample one with "
            "credit_parallel.data.write_sample_dataset(path) or `credit-parallel sample-data`"
        )
    with warnings.catch_warnings():
        # stores written without consolidated metadata are fine; do not warn about the fallback
        warnings.filterwarnings("ignore", message=".*consolidated metadata.*")
        try:
            return xr.open_dataset(path, engine="zarr", chunks=None, cache=False)
        except Exception as err:  # zarr raises several types for "not a store"
            raise ValueError(f"{what}: {str(path)!r} is not a readable zarr store: {err}") from err


def _find_dim(names, candidates: Sequence[str]) -> str | None:
    for candidate in candidates:
        if candidate in names:
            return candidate
    return None


def _level_dim(ds: xr.Dataset) -> str | None:
    return _find_dim(ds.dims, _LEVEL_NAMES)


def compute_normalization_stats(data, out_path=None) -> xr.Dataset:
    """Mean and std (unweighted over time/latitude/longitude, ddof 0) of every data variable.

    ``data`` is an ``xr.Dataset`` or the path of a zarr store.  Variables with a level dim get one
    value per level.  Computed in float64, one variable at a time.  Written as a zarr store to
    ``out_path`` when given.  Returns the statistics dataset (layout in the module docstring).
    """
    ds = data if isinstance(data, xr.Dataset) else _open_store(data, "compute_normalization_stats")
    level_dim = _level_dim(ds)
    stats = {}
    for name, variable in ds.data_vars.items():
        reduce_dims = [dim for dim in variable.dims if dim != level_dim]
        values = variable.astype(np.float64)
        mean = values.mean(reduce_dims)
        std = values.std(reduce_dims, ddof=0)
        stats[name] = xr.concat([mean, std], dim="statistic")
    out = xr.Dataset(stats)
    out.attrs = {
        "statistic_order": list(_STATISTICS),
        "description": "normalisation statistics: (raw - mean) / std per variable and level",
        "reduction": "unweighted over time, latitude and longitude, ddof 0",
    }
    if out_path is not None:
        out.to_zarr(Path(out_path), mode="w", consolidated=False)
    return out


def _as_name_list(names, key: str) -> list[str]:
    if names is None:
        return []
    if isinstance(names, str):
        names = [names]
    names = list(names)
    for name in names:
        if not isinstance(name, str):
            raise ValueError(f"ERA5Dataset: {key} must be variable names, got {name!r}")
    if len(set(names)) != len(names):
        raise ValueError(f"ERA5Dataset: {key} lists a variable twice: {names}")
    return names


def _positive_int(value, key: str) -> int:
    if isinstance(value, bool) or not isinstance(value, int | np.integer) or value < 1:
        raise ValueError(f"ERA5Dataset: {key} must be an integer >= 1, got {value!r}")
    return int(value)


def _time_label(offset: int) -> str:
    return "t" if offset == 0 else f"t{offset:+d}"


def _format_level(level: float) -> str:
    return str(int(level)) if float(level).is_integer() else str(level)


class ERA5Dataset(Dataset):
    """Samples ``{"x": (C_in, H, W), "y": (C_out, H, W), "time_index": int64}`` from a zarr store.

    Sample ``i`` takes times ``i .. i+history_len-1`` of the (sliced) time axis as input and the
    next ``forecast_len`` times as target, so there are ``n_times - history_len - forecast_len + 1``
    samples.  ``time_index`` is the position of the first input time in the STORE's time axis
    (``time_slice`` offsets it).  float32, normalised when ``normalize`` (statistics from
    ``stats_path``, default ``default_stats_path(path)``).

    ``levels``: pressure levels to use (values, matched to the store's level coordinate); ``None``
    = all.  ``time_slice``: a ``slice`` (or ``(start, stop)`` pair) of integer positions, or of
    labels (``"2020-01-03"``, ``np.datetime64``) selected with ``.sel``, inclusive as in xarray.

    ``as_5d=True`` (for 3-D models) returns instead ``x_upper`` ``(history_len * n_upper, Z, H, W)``
    (history step outer, variable inner), ``x_surface`` ``(history_len * n_surface, H, W)`` and
    likewise ``y_upper`` / ``y_surface`` over ``forecast_len``; it needs an upper-air variable.

    When the selection is at most ``cache_limit_bytes`` (float32; default 1 GiB) it is read once
    and kept normalised in memory (``.cached``, ``.nbytes``); otherwise each sample reads its
    window lazily through xarray.

    Attributes: ``channels_in``, ``channels_out``, ``grid_shape`` ``(H, W)``, ``variable_names``
    (the channels of ONE time step, in order), ``channel_names_in`` / ``channel_names_out`` (every
    channel of x / y: ``"T_500@t-1"``, ``"T_500@t"``, ``"T_500@t+1"``, offsets from the last
    input time),
    ``latitude``, ``longitude``, ``levels``, ``times``, ``lat_weights`` (``latitude_weights``).
    """

    def __init__(
        self,
        path,
        upper_air_variables: Sequence[str] = (),
        surface_variables: Sequence[str] = (),
        levels: Sequence[float] | None = None,
        history_len: int = 1,
        forecast_len: int = 1,
        normalize: bool = True,
        stats_path=None,
        time_slice=None,
        *,
        as_5d: bool = False,
        cache_limit_bytes: int = DEFAULT_CACHE_LIMIT_BYTES,
    ):
        super().__init__()
        self.path = Path(path)
        self.history_len = _positive_int(history_len, "history_len")
        self.forecast_len = _positive_int(forecast_len, "forecast_len")
        self.upper_air_variables = _as_name_list(upper_air_variables, "upper_air_variables")
        self.surface_variables = _as_name_list(surface_variables, "surface_variables")
        both = set(self.upper_air_variables) & set(self.surface_variables)
        if both:
            raise ValueError(
                f"ERA5Dataset: {sorted(both)} listed as both upper-air and surface variables"
            )
        if not self.upper_air_variables and not self.surface_variables:
            raise ValueError(
                "ERA5Dataset: no variables requested; pass upper_air_variables and/or "
                "surface_variables"
            )
        if as_5d and not self.upper_air_variables:
            raise ValueError("ERA5Dataset: as_5d=True needs at least one upper_air_variable")
        self.as_5d = bool(as_5d)
        self.normalize = bool(normalize)

        ds = _open_store(self.path, "ERA5Dataset")
        self._time_dim = _find_dim(ds.dims, _TIME_NAMES)
        self._lat_dim = _find_dim(ds.dims, _LAT_NAMES)
        self._lon_dim = _find_dim(ds.dims, _LON_NAMES)
        for key, dim, names in (
            ("time", self._time_dim, _TIME_NAMES),
            ("latitude", self._lat_dim, _LAT_NAMES),
            ("longitude", self._lon_dim, _LON_NAMES),
        ):
            if dim is None:
                raise ValueError(
                    f"ERA5Dataset: {str(self.path)!r} has no {key} dimension (looked for "
                    f"{list(names)}; dims are {list(ds.dims)})"
                )
        self._level_dim = _level_dim(ds)
        self._check_variables(ds)
        self._level_positions, self.levels = self._select_levels(ds, levels)
        self._time_positions, self.times = self._select_times(ds, time_slice)

        n_times = len(self._time_positions)
        self._window = self.history_len + self.forecast_len
        self._length = n_times - self._window + 1
        if self._length < 1:
            raise ValueError(
                f"ERA5Dataset: history_len={self.history_len} + forecast_len={self.forecast_len} "
                f"needs at least {self._window} time steps but the selection has {n_times}; "
                "shorten history_len/forecast_len or widen time_slice"
            )

        latitude = ds[self._lat_dim].values.astype(np.float64)
        # north to south, as ERA5 and as domain rank 0 (north edge) expects
        self._flip_lat = bool(latitude.size > 1 and latitude[0] < latitude[-1])
        self.latitude = latitude[::-1].copy() if self._flip_lat else latitude
        self.longitude = ds[self._lon_dim].values.astype(np.float64)
        self.grid_shape = (self.latitude.size, self.longitude.size)
        self.lat_weights = latitude_weights(self.latitude)

        self.variable_names = [
            f"{name}_{_format_level(level)}"
            for name in self.upper_air_variables
            for level in self.levels
        ] + list(self.surface_variables)
        self.n_upper_channels = len(self.upper_air_variables) * len(self.levels)
        self.channels_per_step = len(self.variable_names)
        self.channels_in = self.history_len * self.channels_per_step
        self.channels_out = self.forecast_len * self.channels_per_step
        self.channel_names_in = [
            f"{name}@{_time_label(step - self.history_len + 1)}"
            for step in range(self.history_len)
            for name in self.variable_names
        ]
        self.channel_names_out = [
            f"{name}@{_time_label(step + 1)}"
            for step in range(self.forecast_len)
            for name in self.variable_names
        ]

        if self.normalize:
            self._mean, self._std = self._load_stats(stats_path)
        else:
            self._mean = np.zeros(self.channels_per_step)
            self._std = np.ones(self.channels_per_step)

        self.nbytes = n_times * self.channels_per_step * int(np.prod(self.grid_shape)) * 4
        self.cached = self.nbytes <= cache_limit_bytes
        self._ds = ds
        self._cache = None
        self._cache = self._read(0, n_times) if self.cached else None
        if self.cached:
            self._ds = None
            ds.close()

    # ---- construction helpers -------------------------------------------------------------
    def _check_variables(self, ds: xr.Dataset) -> None:
        available = sorted(ds.data_vars)
        spatial = {self._time_dim, self._lat_dim, self._lon_dim}
        for kind, names, dims in (
            ("upper-air", self.upper_air_variables, spatial | {self._level_dim}),
            ("surface", self.surface_variables, spatial),
        ):
            for name in names:
                if name not in ds.data_vars:
                    raise ValueError(
                        f"ERA5Dataset: {kind} variable {name!r} is not in {str(self.path)!r}; "
                        f"available variables: {available}"
                    )
                if set(ds[name].dims) != dims:
                    raise ValueError(
                        f"ERA5Dataset: {kind} variable {name!r} has dims {ds[name].dims}, "
                        f"expected {sorted(d for d in dims if d is not None)}; is it listed as the "
                        "right kind (upper_air_variables vs surface_variables)?"
                    )

    def _select_levels(self, ds: xr.Dataset, levels):
        if not self.upper_air_variables:
            return [], ()
        store_levels = ds[self._level_dim].values.astype(np.float64)
        if levels is None:
            return list(range(store_levels.size)), tuple(store_levels.tolist())
        if isinstance(levels, int | float | np.number):
            levels = [levels]
        positions = []
        for level in levels:
            matches = np.flatnonzero(np.isclose(store_levels, float(level)))
            if matches.size == 0:
                raise ValueError(
                    f"ERA5Dataset: level {level!r} is not in {str(self.path)!r}; available "
                    f"{self._level_dim} values: {[_format_level(v) for v in store_levels]}"
                )
            positions.append(int(matches[0]))
        if len(set(positions)) != len(positions):
            raise ValueError(f"ERA5Dataset: levels lists a level twice: {list(levels)}")
        if not positions:
            raise ValueError("ERA5Dataset: levels is empty but upper-air variables were requested")
        return positions, tuple(float(store_levels[p]) for p in positions)

    def _select_times(self, ds: xr.Dataset, time_slice):
        n_store = ds.sizes[self._time_dim]
        positions = np.arange(n_store)
        if time_slice is not None:
            if isinstance(time_slice, tuple | list) and len(time_slice) == 2:
                time_slice = slice(*time_slice)
            if not isinstance(time_slice, slice):
                raise ValueError(
                    f"ERA5Dataset: time_slice must be a slice or a (start, stop) pair, "
                    f"got {time_slice!r}"
                )
            ends = (time_slice.start, time_slice.stop)
            if all(end is None or isinstance(end, int | np.integer) for end in ends):
                positions = positions[time_slice]
            else:
                index = ds.indexes[self._time_dim]
                positions = positions[index.slice_indexer(time_slice.start, time_slice.stop)]
                positions = positions[:: time_slice.step or 1]
            if positions.size and np.any(np.diff(positions) != positions[1] - positions[0]):
                raise ValueError(f"ERA5Dataset: time_slice {time_slice!r} is not evenly spaced")
        times = ds[self._time_dim].values[positions]
        return positions, times

    def _load_stats(self, stats_path):
        stats_path = default_stats_path(self.path) if stats_path is None else Path(stats_path)
        if not stats_path.exists():
            raise FileNotFoundError(
                f"ERA5Dataset: normalize=True but no statistics store at {str(stats_path)!r}; "
                "pass stats_path=, write one with "
                "credit_parallel.data.compute_normalization_stats(path, out_path), "
                "or use normalize=False"
            )
        stats = _open_store(stats_path, "ERA5Dataset statistics")
        means, stds = [], []
        for name in self.upper_air_variables + self.surface_variables:
            if name not in stats.data_vars:
                raise ValueError(
                    f"ERA5Dataset: variable {name!r} has no statistics in {str(stats_path)!r}; "
                    "recompute them with compute_normalization_stats"
                )
            variable = stats[name].load()
            mean = variable.isel(statistic=_STATISTICS.index("mean"))
            std = variable.isel(statistic=_STATISTICS.index("std"))
            if name in self.upper_air_variables:
                stat_levels = variable[self._level_dim].values.astype(np.float64)
                for level in self.levels:
                    matches = np.flatnonzero(np.isclose(stat_levels, level))
                    if matches.size == 0:
                        raise ValueError(
                            f"ERA5Dataset: no statistics for {name!r} at level "
                            f"{_format_level(level)} in {str(stats_path)!r}"
                        )
                    means.append(float(mean.values[matches[0]]))
                    stds.append(float(std.values[matches[0]]))
            else:
                means.append(float(mean.values))
                stds.append(float(std.values))
        stats.close()
        mean, std = np.asarray(means), np.asarray(stds)
        bad = [
            self.variable_names[c]
            for c in range(std.size)
            if not np.isfinite(std[c]) or std[c] <= 0
        ]
        if bad:
            raise ValueError(
                f"ERA5Dataset: channels {bad} have a zero or non-finite std in "
                f"{str(stats_path)!r}; they cannot be normalised"
            )
        return mean, std

    # ---- reading ---------------------------------------------------------------------------
    def _read(self, start: int, stop: int) -> np.ndarray:
        """Times ``start..stop-1`` of the selection as float32 ``(T, channels_per_step, H, W)``."""
        if self._cache is not None:
            return self._cache[start:stop]
        out = np.empty((stop - start, self.channels_per_step, *self.grid_shape), dtype=np.float32)
        lat_order = slice(None, None, -1) if self._flip_lat else slice(None)
        times = self._time_positions[start:stop]
        time_index = slice(int(times[0]), int(times[-1]) + 1, 1)
        if times.size > 1:
            time_index = slice(int(times[0]), int(times[-1]) + 1, int(times[1] - times[0]))
        channel = 0
        for name in self.upper_air_variables + self.surface_variables:
            variable = self._ds[name]
            index = {self._time_dim: time_index, self._lat_dim: lat_order}
            dims = [self._time_dim, self._lat_dim, self._lon_dim]
            if name in self.upper_air_variables:
                index[self._level_dim] = self._level_positions
                dims.insert(1, self._level_dim)
            raw = variable.isel(index).transpose(*dims).values.astype(np.float64)
            if raw.ndim == 3:
                raw = raw[:, None]
            width = raw.shape[1]
            mean = self._mean[channel : channel + width, None, None]
            std = self._std[channel : channel + width, None, None]
            out[:, channel : channel + width] = (raw - mean) / std
            channel += width
        return out

    def __len__(self) -> int:
        return self._length

    def __getitem__(self, index: int) -> dict:
        if index < 0:
            index += self._length
        if not 0 <= index < self._length:
            raise IndexError(f"ERA5Dataset: index {index} out of range for {self._length} samples")
        window = np.array(self._read(index, index + self._window))  # a copy, never the cache
        inputs, targets = window[: self.history_len], window[self.history_len :]
        sample = {"time_index": torch.tensor(int(self._time_positions[index]), dtype=torch.int64)}
        if not self.as_5d:
            sample["x"] = torch.from_numpy(inputs.reshape(self.channels_in, *self.grid_shape))
            sample["y"] = torch.from_numpy(targets.reshape(self.channels_out, *self.grid_shape))
            return sample
        n_levels = len(self.levels)
        for prefix, block in (("x", inputs), ("y", targets)):
            steps = block.shape[0]
            upper = block[:, : self.n_upper_channels]
            surface = block[:, self.n_upper_channels :]
            sample[f"{prefix}_upper"] = torch.from_numpy(
                np.ascontiguousarray(upper).reshape(-1, n_levels, *self.grid_shape)
            )
            sample[f"{prefix}_surface"] = torch.from_numpy(
                np.ascontiguousarray(surface).reshape(steps * surface.shape[1], *self.grid_shape)
            )
        return sample


_CONF_KEYS = (
    "upper_air_variables",
    "surface_variables",
    "levels",
    "history_len",
    "forecast_len",
    "normalize",
    "stats_path",
    "as_5d",
)


def dataset_from_conf(conf: dict, split: str = "train", **overrides) -> ERA5Dataset:
    """The ERA5Dataset a config's ``data`` section describes (``time_slice`` for "train",
    ``valid_time_slice`` for "valid"); ``overrides`` go to the constructor.  Errors name the
    ``data.*`` key."""
    d = conf.get("data")
    if not isinstance(d, dict):
        raise ValueError(
            "config is missing the 'data' section (data.path, data.upper_air_variables, ...)"
        )
    if "path" not in d:
        raise ValueError(
            "data.path is required (run `credit-parallel sample-data` for a demo store)"
        )
    kwargs = {k: d[k] for k in _CONF_KEYS if k in d}
    key = "valid_time_slice" if split == "valid" else "time_slice"
    if d.get(key) is not None:
        kwargs["time_slice"] = tuple(d[key]) if isinstance(d[key], list) else d[key]
    kwargs.update(overrides)
    try:
        return ERA5Dataset(d["path"], **kwargs)
    except TypeError as err:  # a wrongly typed argument: name the data section
        raise ValueError(f"data: {err}") from err
