"""What an :class:`~credit_parallel.data.dataset.ERA5Dataset` reads, worked out once when it is
built: the store's dims, the variables of each kind and their checks, the selected levels and
times, the channel names, the grid window (rows / tile) of the sample, the dynamic forcing's own
files, the static store and the normalisation statistics.

:class:`ERA5Schema` is a mixin of ``ERA5Dataset`` (as ``diagnostic.DiagnosticChannels`` is): its
methods set the attributes the dataset's reading path (``dataset.py``) uses, and raise a
``ValueError`` naming the ``data.*`` key or the variable at fault.
"""

from __future__ import annotations

import numpy as np
import xarray as xr

from .credit_stats import dataset_stats
from .forcing_files import ForcingFiles
from .multistore import StaticStore
from .selection import (
    every_timestep,
    format_level,
    latitude_weights,
    level_coord_dim,
    name_list,
    select_levels,
    select_times,
    tile_window,
    time_label,
)
from .store import LAT_NAMES, LON_NAMES, TIME_NAMES, direct_float32_array, find_dim

__all__ = ["ERA5Schema"]


class ERA5Schema:
    """The construction steps of ``ERA5Dataset`` (see its docstring for the attributes)."""

    def _set_grid(self, ds: xr.Dataset, rows, domain_shard) -> None:
        latitude = ds[self._lat_dim].values.astype(np.float64)
        # north to south, as ERA5 and as domain rank 0 (north edge) expects
        self._flip_lat = bool(latitude.size > 1 and latitude[0] < latitude[-1])
        self.latitude = latitude[::-1].copy() if self._flip_lat else latitude
        self.longitude = ds[self._lon_dim].values.astype(np.float64)
        self.grid_shape = (self.latitude.size, self.longitude.size)
        self.lat_weights = latitude_weights(self.latitude)
        self.rows, self.columns = tile_window(rows, domain_shard, self.grid_shape)
        first, stop = self.rows if self.rows is not None else (0, self.grid_shape[0])
        west, east = self.columns if self.columns is not None else (0, self.grid_shape[1])
        self.sample_grid_shape = (stop - first, east - west)
        self.row_lat_weights = self.lat_weights[first:stop]

    @property
    def _store_variables(self) -> list[str]:
        """The variables read per time step from the stores of ``path`` (all of them, less the
        dynamic forcing when ``forcing_path`` gives it files of its own)."""
        if self._forcing_path is None:
            return self._read_variables
        return [name for name in self._read_variables if name not in self.forcing_variables]

    def _open_forcing_files(self) -> None:
        """``forcing_path``: the dynamic forcing's files, every selected time in them."""
        if self._forcing_path is None:
            return
        if not self.forcing_variables:
            raise ValueError(
                f"ERA5Dataset: data.forcing_path {str(self._forcing_path)!r} is given but "
                "data.dynamic_forcing_variables is empty; name them or drop the key"
            )
        files = ForcingFiles(
            self._forcing_path, self.forcing_variables, self.latitude, self.longitude
        )
        self._stores.forcing = files  # released with the stores
        files.positions(self.times)  # every selected time, or the first missing one named
        self.variable_units.update(files.units)

    def _set_statistics(self, static_path, stats_path, mean_path, std_path) -> None:
        """The static store (``static_path``) and the per-channel mean / std."""
        self._static_store = None
        if static_path is not None and not self.static_variables:
            raise ValueError(
                f"ERA5Dataset: data.static_path {str(static_path)!r} is given but "
                "data.static_variables is empty; name the static variables or drop the key"
            )
        if static_path is not None:
            self._static_store = StaticStore(
                static_path, self.static_variables, self.latitude, self.longitude
            )
            self._stores.static = self._static_store  # released with the stores
            self.variable_units.update(self._static_store.units)
        if self.normalize:
            self._mean, self._std = dataset_stats(
                self._stats_variables(),
                self.levels,
                self.output_variable_names + self.forcing_variables + self.static_variables,
                self.store_paths,
                level_dim=self._level_dim,
                stats_path=stats_path,
                mean_path=mean_path,
                std_path=std_path,
            )
        else:
            n = self._channels_read + len(self.static_variables)
            self._mean, self._std = np.zeros(n), np.ones(n)
        self._mean32 = np.asarray(self._mean, dtype=np.float32)
        self._std32 = np.asarray(self._std, dtype=np.float32)

    def _stats_variables(self) -> list[tuple[str, bool, bool]]:
        """``(name, upper, output)`` per read and static channel variable, in channel order
        (``credit_stats.dataset_stats``): the output ones are the prognostic and diagnostic."""
        inputs_only = set(self.forcing_variables) | set(self.static_variables)
        return [
            (name, name in self.upper_air_variables, name not in inputs_only)
            for name in self._read_variables + self.static_variables
        ]

    def _set_scaler_blocks(self, spec) -> None:
        """``data.bridgescaler``: CREDIT's bridgescaler / log pre-blocks on each raw sample."""
        self.scaler_blocks = self.sample_layout = None
        if spec is None:
            return
        if self.as_5d:
            raise ValueError(
                "ERA5Dataset: data.bridgescaler is read for 4-D samples (as_5d: false)"
            )
        from .bridgescaler_blocks import SampleLayout, ScalerBlocks

        self.scaler_blocks = ScalerBlocks(spec)
        self.sample_layout = SampleLayout(self, self.scaler_blocks.source)

    def _set_variables(self, upper, surface, forcing, static) -> None:
        self.upper_air_variables = name_list(upper, "upper_air_variables")
        self.surface_variables = name_list(surface, "surface_variables")
        self.forcing_variables = name_list(forcing, "dynamic_forcing_variables")
        self.static_variables = name_list(static, "static_variables")
        kinds = (
            self.upper_air_variables,
            self.surface_variables,
            self.diagnostic_variables,
            self.forcing_variables,
            self.static_variables,
        )
        listed = [name for names in kinds for name in names]
        twice = sorted({name for name in listed if listed.count(name) > 1})
        if twice:
            raise ValueError(
                f"ERA5Dataset: {twice} listed as more than one kind of variable (upper-air, "
                "surface, diagnostic, dynamic forcing, static)"
            )
        # read per time step: the prognostic ones, the diagnostic ones, the dynamic forcing
        self._read_variables = [name for names in kinds[:4] for name in names]

    def _name_channels(self) -> None:
        self.variable_names = [
            f"{name}_{format_level(level)}"
            for name in self.upper_air_variables
            for level in self.levels
        ] + list(self.surface_variables)
        self.n_upper_channels = len(self.upper_air_variables) * len(self.levels)
        self.channels_per_step = len(self.variable_names)
        self.n_forcing = len(self.forcing_variables)
        self.n_static = len(self.static_variables)
        self._channels_read = self.channels_out_per_step + self.n_forcing
        self.channels_in = (
            self.history_len * self.channels_per_step + self.n_forcing + self.n_static
        )
        self.channels_out = self.forecast_len * self.channels_out_per_step
        self.channel_names_in = (
            [
                f"{name}@{time_label(step - self.history_len + 1)}"
                for step in range(self.history_len)
                for name in self.variable_names
            ]
            + [f"{name}@t" for name in self.forcing_variables]
            + list(self.static_variables)
        )
        self.channel_names_out = [
            f"{name}@{time_label(step + 1)}"
            for step in range(self.forecast_len)
            for name in self.output_variable_names
        ]

    def _direct_arrays(self, ds: xr.Dataset, store) -> dict:
        """The variables zarr decodes straight into a sample (``store.direct_float32_array``)."""
        direct = {}
        for name in self._store_variables:
            dims = [self._time_dim, self._lat_dim, self._lon_dim]
            if name in self.upper_air_variables:
                dims.insert(1, self._level_dim)
            array = direct_float32_array(ds, store, name, dims)
            if array is not None:
                direct[name] = array
        return direct

    def _find_dims(self, ds: xr.Dataset, level_coord: str | None = None) -> None:
        self._time_dim = find_dim(ds.dims, TIME_NAMES)
        self._lat_dim = find_dim(ds.dims, LAT_NAMES)
        self._lon_dim = find_dim(ds.dims, LON_NAMES)
        for key, dim, names in (
            ("time", self._time_dim, TIME_NAMES),
            ("latitude", self._lat_dim, LAT_NAMES),
            ("longitude", self._lon_dim, LON_NAMES),
        ):
            if dim is None:
                raise ValueError(
                    f"ERA5Dataset: {str(self.path)!r} has no {key} dimension (looked for "
                    f"{list(names)}; dims are {list(ds.dims)})"
                )
        self._level_dim = level_coord_dim(ds.dims, level_coord, self.path)

    def _check_variables(self, ds: xr.Dataset, static) -> None:
        available = sorted(ds.data_vars)
        spatial = {self._time_dim, self._lat_dim, self._lon_dim}
        for kind, names, dims in (
            ("upper-air", self.upper_air_variables, spatial | {self._level_dim}),
            ("surface", self.surface_variables, spatial),
            ("diagnostic", self.diagnostic_variables, spatial),
            ("dynamic forcing", () if self._forcing_path else self.forcing_variables, spatial),
            ("static", static, {self._lat_dim, self._lon_dim}),
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
                        "right kind (upper_air_variables, surface_variables, diagnostic_"
                        "variables, dynamic_forcing_variables or static_variables)?"
                    )

    def _select_times(self, time_slice):
        return select_times(self._stores.time_index(), time_slice)  # every store's times

    def _set_levels_and_times(self, ds: xr.Dataset, levels, time_slice, timestep) -> int:
        """The selected levels (and what they are) and times; the number of samples they give
        (``_length``), refused when the selection is shorter than one sample's window.  Returns
        the number of selected times."""
        store_levels = ds[self._level_dim].values if self.upper_air_variables else None
        # what the levels are (pressure in hPa / Pa, or model levels): the level
        # coordinate's name and units, for a store that states them (forecast layouts)
        self.level_coordinate = (
            (self._level_dim, str(ds[self._level_dim].attrs.get("units", "")))
            if self.upper_air_variables
            else None
        )
        self._level_positions, self.levels = select_levels(
            store_levels, levels, self.path, self._level_dim
        )
        self._time_positions, self.times = self._select_times(time_slice)
        if timestep is not None:  # every k-th time of the store ("6h" of an hourly store)
            self._time_positions, self.times = every_timestep(self, timestep)

        n_times = len(self._time_positions)
        self._window = self.history_len + self.forecast_len
        self._length = n_times - self._window + 1
        if self._length < 1:
            raise ValueError(
                f"ERA5Dataset: history_len={self.history_len} + forecast_len={self.forecast_len} "
                f"needs at least {self._window} time steps but the selection has {n_times}; "
                "shorten history_len/forecast_len or widen time_slice"
            )
        return n_times
