"""ERA5-style zarr stores as a torch ``Dataset`` of (input history, forecast target) samples.

Store layout read here (the ERA5 / WeatherBench convention, also what ``write_sample_dataset``
writes): upper-air variables with dims ``(time, level, latitude, longitude)``, surface variables
``(time, latitude, longitude)`` (``lat``/``lon``, ``pressure_level``/``plev``/``isobaricInhPa``
accepted too), in one zarr store or in several split along time (``path`` a glob or a list;
``multistore.py``), static fields optionally in a store of their own (``static_path``).  Rows are
delivered north to south (a store whose latitude ascends is flipped): row 0 is domain rank 0's.

Channel order of one time step (``ERA5Dataset.variable_names``): each upper-air variable in the
order requested, each of its levels in the order requested (store order when ``levels=None``),
named ``"<var>_<level>"`` (``"T_500"``); then the surface variables in the order requested.
``x`` stacks ``history_len`` such steps, oldest first, then the dynamic forcing variables
(``dynamic_forcing_variables``, dims ``(time, latitude, longitude)``) at the last input time, then
the static ones (``static_variables``, dims ``(latitude, longitude)``); ``y`` the next
``forecast_len`` steps, each its prognostic then its diagnostic channels (output-only
``diagnostic_variables``: ``diagnostic.py``); ``forcing`` the forcing of target times 1 .. L-1.

Normalisation (``credit_stats.py``): (raw - mean) / std per channel, the statistics from the
zarr store ``compute_normalization_stats`` writes (``stats_path``, default
``default_stats_path(path)``; its layout in ``store.py``) or from CREDIT's netCDF files
(``mean_path`` / ``std_path``), as miles-credit normalises.

This module reads samples; what a dataset reads (dims, variables, levels and times, channel
names, the grid window, forcing and static files, statistics) is worked out once by the
``era5_schema.ERA5Schema`` mixin.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np
import torch
import xarray as xr
from torch.utils.data import Dataset

from .chunk_reader import ChunkReader, choose_reader
from .diagnostic import DiagnosticChannels
from .era5_schema import ERA5Schema
from .multistore import StoreSet
from .selection import (
    latitude_weights,
    level_index,
    name_list,
    positive_int,
)

__all__ = ["DEFAULT_CACHE_LIMIT_BYTES", "ERA5Dataset", "dataset_from_conf", "latitude_weights"]

# Below this size (float32, selected variables, levels, times and rows) the whole selection is
# read once and kept in memory, already normalised; above it each sample is read on demand.
DEFAULT_CACHE_LIMIT_BYTES = 1 << 30


class ERA5Dataset(ERA5Schema, DiagnosticChannels, Dataset):
    """Samples ``{"x": (C_in, H, W), "y": (C_out, H, W), "time_index": int64}`` from a zarr store.

    Sample ``i`` takes times ``i .. i+history_len-1`` of the (sliced) time axis as input and the
    next ``forecast_len`` times as target, so there are ``n_times - history_len - forecast_len + 1``
    samples.  ``time_index`` is the position of the first input time in the STORE's time axis
    (``time_slice`` offsets it).  float32, normalised when ``normalize`` (statistics from
    ``stats_path``, default ``default_stats_path(path)``).

    ``levels``: pressure levels to use (values, matched to the store's level coordinate); ``None``
    = all.  ``time_slice``: a ``slice`` (or ``(start, stop)`` pair) of integer positions, or of
    labels (``"2020-01-03"``, ``np.datetime64``) selected with ``.sel``, inclusive as in xarray.
    ``path``: a store, a glob or list of stores (one time axis; ``store_paths`` in time order);
    ``static_path``: the static fields' own store (or netCDF file); ``mean_path`` / ``std_path``:
    CREDIT's netCDF statistics instead of ``stats_path``; ``forcing_path``: the dynamic forcing
    variables' own files (netCDF or zarr, a glob: CREDIT's second store), read by time label
    (``forcing_files.py``).

    ``as_5d=True`` (for 3-D models) returns instead ``x_upper`` ``(history_len * n_upper, Z, H, W)``
    (history step outer, variable inner), ``x_surface`` ``(history_len * n_surface, H, W)`` and
    likewise ``y_upper`` / ``y_surface`` over ``forecast_len``; it needs an upper-air variable.

    ``diagnostic_variables``: output-only 2-D fields, in ``y`` after each step's prognostic
    channels (after the surface ones of ``y_surface``), never in ``x`` (``diagnostic.py``:
    ``n_diagnostic``, ``channels_out_per_step``, ``output_variable_names``, ``output_mean``).

    ``rows=(start, stop)``: read only the global latitude rows ``start..stop-1`` (north to south,
    after any flip) of every sample; ``domain_shard=(domain_rank, domain_size)`` instead: the rows
    the balanced layout gives that domain rank (``credit_parallel.domain.rows.shard_range``);
    ``domain_shard=(domain_rank, (P, Q))``: the tile (rows x ``columns``) of domain rank
    ``lat * Q + lon`` of a lat x lon domain (SPEC §3b).  Samples then have ``stop - start`` rows
    (and the tile's columns), normalised in float32 (the whole-globe mode
    ``rows=None`` normalises in float64 and rounds once, the single-process reference).  Every
    element is computed by the same float32 operations whatever the row range, so a rank's rows
    (or tile) are bitwise the same elements of a ``rows=(0, H)`` read.

    When the selection is at most ``cache_limit_bytes`` (float32; default 1 GiB) it is read once
    and kept normalised in memory (``.cached``, ``.nbytes``); otherwise each sample reads its
    window lazily.  ``bytes_read``: bytes of data-variable chunks this process fetched from the
    store so far (``reset_bytes_read()`` zeroes it; ``store.py``).  ``reader``: ``"auto"``
    (tensorstore when it can read the store, else zarr), ``"tensorstore"`` or ``"zarr"``
    (``data.reader``; ``.reader`` is the one chosen; ``chunk_reader.py``).

    Attributes: ``channels_in``, ``channels_out``, ``grid_shape`` ``(H, W)``, ``variable_units``
    (the store's ``units`` attribute per variable), ``variable_names``
    (the prognostic channels of ONE time step, in order), ``channel_names_in`` / ``channel_names_out`` (every
    channel of x / y: ``"T_500@t-1"``, ``"T_500@t"``, ``"T_500@t+1"``, offsets from the last
    input time), ``latitude``, ``longitude``, ``levels`` (``level_coordinate``: the store's
    level dim and its ``units`` attribute, None without upper-air variables), ``times``,
    ``lat_weights``
    (``latitude_weights`` of the GLOBE, shape ``(H,)``); ``rows`` / ``columns`` (``None`` or the
    range read), ``sample_grid_shape`` (rows and columns of a sample), ``row_lat_weights`` (the
    weights of the sample's rows: the loss weights of a domain rank, normalised over the globe).
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
        rows: tuple[int, int] | None = None,
        domain_shard: tuple[int, int] | None = None,
        reader: str = "auto",
        dynamic_forcing_variables: Sequence[str] = (),
        static_variables: Sequence[str] = (),
        level_coord: str | None = None,
        timestep: str | None = None,
        diagnostic_variables: Sequence[str] = (),
        static_path=None,
        mean_path=None,
        std_path=None,
        forcing_path=None,
        bridgescaler=None,
    ):
        super().__init__()
        self.history_len = positive_int(history_len, "history_len")
        self.forecast_len = positive_int(forecast_len, "forecast_len")
        self.diagnostic_variables = name_list(diagnostic_variables, "diagnostic_variables")
        self._set_variables(
            upper_air_variables, surface_variables, dynamic_forcing_variables, static_variables
        )
        if not self.upper_air_variables and not self.surface_variables:
            raise ValueError(
                "ERA5Dataset: no variables requested; pass upper_air_variables and/or "
                "surface_variables"
            )
        if as_5d and not self.upper_air_variables:
            raise ValueError("ERA5Dataset: as_5d=True needs at least one upper_air_variable")
        self.as_5d = bool(as_5d)
        # CREDIT's bridgescaler blocks (bridgescaler_blocks.py) normalise the raw sample instead
        self.normalize = bool(normalize) and bridgescaler is None

        self._forcing_path = forcing_path  # the dynamic forcing's own files (forcing_files.py)
        self._stores = StoreSet(path, "ERA5Dataset")  # one store, or several along time
        with self._stores.released_on_error():  # a failure below closes the stores
            self.path, self.store_paths = self._stores.path, [p.path for p in self._stores.parts]
            ds = self._stores.ds
            self._find_dims(ds, level_coord)
            in_store = self.static_variables if static_path is None else []
            self._check_variables(ds, in_store)
            self._stores.check(self._store_variables, in_store)
            self.variable_units = {
                n: str(ds[n].attrs.get("units", "")) for n in self._store_variables + in_store
            }
            n_times = self._set_levels_and_times(ds, levels, time_slice, timestep)

            self._set_grid(ds, rows, domain_shard)
            self._open_forcing_files()
            self._name_channels()
            self._set_scaler_blocks(bridgescaler)
            self._set_statistics(static_path, stats_path, mean_path, std_path)
            self._static = self._read_static(ds)
            self._level_index, self._level_block = level_index(self._level_positions)
            self.reader = self._stores.open_readers(
                reader, self._direct_arrays, choose_reader, ChunkReader
            )

            self.nbytes = n_times * self._channels_read * int(np.prod(self.sample_grid_shape)) * 4
            self.cached = self.nbytes <= cache_limit_bytes
            self._cache = None
            self._cache = self._read(0, n_times) if self.cached else None
            if self.cached:
                self._stores.release()

    @property
    def _direct(self) -> dict:
        """The direct-read arrays of the (first) store; assigning sets every store's."""
        return self._stores.parts[0].direct

    @_direct.setter
    def _direct(self, arrays: dict) -> None:
        for part in self._stores.parts:
            part.direct = arrays

    @property
    def channel_mean(self) -> np.ndarray:
        """Per channel of one time step (``variable_names``), the mean subtracted (float64)."""
        return np.array(self._mean[: self.channels_per_step], dtype=np.float64)

    @property
    def channel_std(self) -> np.ndarray:
        """Per channel of one time step, the std divided by (float64)."""
        return np.array(self._std[: self.channels_per_step], dtype=np.float64)

    @property
    def bytes_read(self) -> int:
        """Bytes of the selected variables' chunks fetched from the store by this process."""
        counts = self._stores.counter.chunk_bytes
        return sum(counts.get(name, 0) for name in self._read_variables + self.static_variables)

    @property
    def read_counter(self):
        """The ``ByteCountingStore`` under this dataset: every byte this process read, by array
        (``chunk_bytes``) and metadata (``metadata_bytes``)."""
        return self._stores.counter

    def reset_bytes_read(self) -> None:
        self._stores.counter.reset()

    def _lat_index(self) -> slice:
        """Store positions of the sample's rows (ascending; flipped after reading if needed)."""
        height = self.grid_shape[0]
        first, stop = self.rows if self.rows is not None else (0, height)
        return slice(height - stop, height - first) if self._flip_lat else slice(first, stop)

    def _lon_index(self) -> slice:
        """Store positions of the sample's columns (all of them unless a tile's)."""
        return slice(*self.columns) if self.columns is not None else slice(None)

    def _read(self, start: int, stop: int) -> np.ndarray:
        """Times ``start..stop-1`` of the selection, float32 ``(T, channels_per_step, rows, W)``.

        Each variable is ONE request for the whole window and the rank's rows (its levels one
        block when they are consecutive in the store), decoded by the chunk reader (``reader``:
        tensorstore or zarr, ``chunk_reader.py``) straight into its channels of the output buffer
        and normalised there in place: no intermediate array.
        """
        if self._cache is not None:
            return self._cache[start:stop]
        out = np.empty((stop - start, self._channels_read, *self.sample_grid_shape), np.float32)
        times = self._time_positions[start:stop]
        step = int(times[1] - times[0]) if times.size > 1 else 1
        time_index = slice(int(times[0]), int(times[-1]) + 1, step)
        channel = 0
        for name in self._read_variables:
            upper = name in self.upper_air_variables
            width = len(self._level_positions) if upper else 1
            target = out[:, channel : channel + width]
            if self._forcing_path is not None and name in self.forcing_variables:
                raw = self._read_forcing(name, start, stop)
            else:
                raw = self._read_variable(name, time_index, target if upper else target[:, 0])
            self._normalise(target, slice(channel, channel + width), raw)
            channel += width
        return out

    def _read_variable(self, name: str, time_index: slice, target: np.ndarray):
        """``name``'s raw rows decoded into ``target`` by the chunk reader, else read by xarray,
        from each store the window touches (``multistore.StoreSet.read``)."""
        return self._stores.read(
            time_index, target, lambda part, index, out: self._read_part(part, name, index, out)
        )

    def _read_forcing(self, name: str, start: int, stop: int) -> np.ndarray:
        """``name`` at the selected times ``start..stop-1`` from ``forcing_path``'s files, by
        their labels, this sample's rows and columns (``forcing_files.ForcingFiles``)."""
        rows = self.rows or (0, self.grid_shape[0])
        columns = self.columns or (0, self.grid_shape[1])
        return self._stores.forcing.read(name, self.times[start:stop], rows, columns)

    def _read_part(self, part, name: str, time_index: slice, target: np.ndarray):
        upper = name in self.upper_air_variables
        if name in part.direct:
            view = target[..., ::-1, :] if self._flip_lat else target  # the store's row order
            selection = [time_index, self._lat_index(), self._lon_index()]
            if upper:
                selection.insert(1, self._level_index)
            part.reader.read(name, tuple(selection), self._level_block or not upper, view)
            return None
        index = {self._time_dim: time_index, self._lat_dim: self._lat_index()}
        index[self._lon_dim] = self._lon_index()
        dims = [self._time_dim, self._lat_dim, self._lon_dim]
        if upper:
            index[self._level_dim] = self._level_positions
            dims.insert(1, self._level_dim)
        raw = part.ds[name].isel(index).transpose(*dims).values
        return raw[..., ::-1, :] if self._flip_lat else raw

    def _normalise(self, target: np.ndarray, channels: slice, raw=None) -> None:
        """``target = (values - mean) / std`` per channel; the values are ``raw`` when given
        (shaped like ``target``'s variable), else ``target`` itself (normalised in place)."""
        if raw is not None and raw.ndim == target.ndim - 1:
            raw = raw[:, None]
        if self.rows is None and self.columns is None:
            # the single-process reference: float64 arithmetic, rounded once to float32
            source = target if raw is None else raw
            mean = self._mean[channels, None, None]
            std = self._std[channels, None, None]
            target[...] = (source.astype(np.float64) - mean) / std
            return
        # row mode: float32 end to end, in place (no float64 copy of the rows)
        if raw is not None:
            target[...] = raw
        np.subtract(target, self._mean32[channels, None, None], out=target)
        np.divide(target, self._std32[channels, None, None], out=target)

    def __len__(self) -> int:
        return self._length

    def __getitem__(self, index: int) -> dict:
        if index < 0:
            index += self._length
        if not 0 <= index < self._length:
            raise IndexError(f"ERA5Dataset: index {index} out of range for {self._length} samples")
        window = self._read(index, index + self._window)
        if self._cache is not None:
            window = np.array(window)  # a copy, never the cache
        inputs, targets = window[: self.history_len], window[self.history_len :]
        sample = {"time_index": torch.tensor(int(self._time_positions[index]), dtype=torch.int64)}
        sample.update(self.compose_input(inputs))
        sample.update(self._compose(targets[:, : self.channels_out_per_step], "y", ()))
        if self.n_forcing and self.forecast_len > 1:
            # the forcing of the inputs of forecast steps 2 .. forecast_len (advance_state)
            future = targets[:-1, self.forcing_channels]
            sample["forcing"] = torch.from_numpy(
                np.ascontiguousarray(future).reshape(
                    future.shape[0] * future.shape[1], *self.sample_grid_shape
                )
            )
        if self.scaler_blocks is not None:
            sample = self.scaler_blocks.sample_transform(sample, self.sample_layout)
        return sample

    def compose_input(self, steps: np.ndarray) -> dict:
        """The model input of ``history_len`` time steps ``(history_len, channels, rows, W)`` as
        :meth:`read_steps` returns them: ``{"x": ...}`` or ``{"x_upper": ..., "x_surface": ...}``
        (tensors without a batch dim), the dynamic forcing of the last step and the static fields
        appended after the prognostic channels (of ``x_surface`` for 5-D samples)."""
        if steps.shape[0] != self.history_len:
            raise ValueError(
                f"ERA5Dataset.compose_input: {steps.shape[0]} time steps for history_len "
                f"{self.history_len}"
            )
        extras = (steps[-1, self.forcing_channels], self._static)
        return self._compose(steps[:, : self.channels_per_step], "x", extras)

    def _compose(self, block: np.ndarray, prefix: str, extras: tuple) -> dict:
        grid = self.sample_grid_shape
        steps = block.shape[0]
        extras = tuple(e for e in extras if e is not None and e.shape[0])
        if not self.as_5d:
            flat = block.reshape(steps * block.shape[1], *grid)
            flat = np.concatenate([flat, *extras]) if extras else np.ascontiguousarray(flat)
            return {prefix: torch.from_numpy(flat)}
        n_levels = len(self.levels)
        upper = np.ascontiguousarray(block[:, : self.n_upper_channels]).reshape(
            steps * len(self.upper_air_variables), n_levels, *grid
        )
        surface = np.ascontiguousarray(block[:, self.n_upper_channels :])
        surface = surface.reshape(steps * surface.shape[1], *grid)
        if extras:
            surface = np.concatenate([surface, *extras])
        return {
            f"{prefix}_upper": torch.from_numpy(upper),
            f"{prefix}_surface": torch.from_numpy(surface),
        }

    def read_steps(self, start: int, stop: int) -> np.ndarray:
        """Positions ``start .. stop-1`` of the (sliced) time axis, normalised float32
        ``(T, channels_out_per_step + n_forcing, rows, W)``: the prognostic channels of each
        time, its diagnostic ones, then its dynamic forcing (``forcing_channels``; a copy)."""
        if not 0 <= start <= stop <= len(self._time_positions):
            raise IndexError(
                f"ERA5Dataset.read_steps: [{start}, {stop}) outside the "
                f"{len(self._time_positions)} selected times"
            )
        if start == stop:
            return np.empty((0, self._channels_read, *self.sample_grid_shape), np.float32)
        return np.array(self._read(start, stop))

    @property
    def static_fields(self) -> np.ndarray:
        """The normalised static fields of the sample's rows, float32 ``(n_static, rows, W)``."""
        return np.array(self._static)

    def _read_static(self, ds: xr.Dataset) -> np.ndarray:
        out = np.empty((self.n_static, *self.sample_grid_shape), np.float32)
        if self._static_store is not None:  # data.static_path
            rows, columns = self.rows or (0, self.grid_shape[0]), self.columns
            out = self._static_store.read(rows, columns or (0, self.grid_shape[1]))
        for c, name in enumerate(self.static_variables if self._static_store is None else ()):
            index = {self._lat_dim: self._lat_index(), self._lon_dim: self._lon_index()}
            raw = ds[name].isel(index)
            raw = raw.transpose(self._lat_dim, self._lon_dim).values
            out[c] = raw[::-1] if self._flip_lat else raw
        channels = slice(self._channels_read, self._channels_read + self.n_static)
        self._normalise(out[None], channels)
        return out


_CONF_KEYS = (
    "level_coord",
    "timestep",
    "upper_air_variables",
    "surface_variables",
    "diagnostic_variables",
    "dynamic_forcing_variables",
    "static_variables",
    "levels",
    "history_len",
    "forecast_len",
    "normalize",
    "stats_path",
    "as_5d",
    "cache_limit_bytes",
    "reader",
    "static_path",
    "mean_path",
    "std_path",
    "forcing_path",
    "bridgescaler",
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
        raise ValueError("data.path is required (`credit-parallel sample-data`: a demo store)")
    kwargs = {k: d[k] for k in _CONF_KEYS if k in d}
    key = "valid_time_slice" if split == "valid" else "time_slice"
    if d.get(key) is not None:
        kwargs["time_slice"] = tuple(d[key]) if isinstance(d[key], list) else d[key]
    kwargs.update(overrides)
    try:
        return ERA5Dataset(d["path"], **kwargs)
    except TypeError as err:  # a wrongly typed argument: name the data section
        raise ValueError(f"data: {err}") from err
