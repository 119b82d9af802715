"""Dynamic forcing variables from files of their own beside the data stores, by time label.

CREDIT's gen-2 ``LocalDataset`` reads each variable group from its own ``path`` template: in
``wxformer_npj_era5_028deg.yml`` the prognostic fields come from zarr stores
(``y_TOTAL_%Y-*.zarr``) and the solar forcing from netCDF files
(``solar_irradiance_%Y-*.nc``).  For each time of a sample it finds the file whose times hold
it, opens it with ``xr.open_dataset`` and selects the time by its label (``ds.sel(time=t)``),
then casts to float32 (``torch.tensor(arr, dtype=torch.float32)``).

:class:`ForcingFiles` reads ``data.forcing_path`` (one file or store, a glob, or a list: netCDF
files through xarray's h5netcdf engine, zarr stores as directories) the same way: the times of
every file form one index by label (a time in two files is refused naming both), every time
the dataset selects must be in it (the first missing one is named), and a read selects those
times by label from each file, only the rows (and columns) a rank reads, north to south (a
file whose latitude ascends is flipped), cast to float32 as CREDIT casts.  The files must be
on the data's grid; every listed variable must have dims (time, latitude, longitude).  Files
are opened on first read in each process (a DataLoader worker opens its own) and closed by
:meth:`release`.
"""

from __future__ import annotations

import os
from pathlib import Path

import numpy as np

from .multistore import store_paths
from .store import LAT_NAMES, LON_NAMES, TIME_NAMES, find_dim, open_fields

__all__ = ["ForcingFiles"]


class ForcingFiles:
    """The dynamic forcing ``names`` from the files of ``path`` on the grid ``latitude`` (north
    to south) x ``longitude`` (see the module docstring)."""

    def __init__(self, path, names, latitude, longitude, what: str = "ERA5Dataset") -> None:
        self.what = f"{what}: data.forcing_path"
        self.names = list(names)
        self.paths: list[Path] = store_paths(path)
        self._open: dict[int, tuple] = {}
        self._pid = os.getpid()
        self._flips: list[bool] = []  # per file: its latitude ascends (read flipped)
        times, owners, local = [], [], []
        try:
            for index, file in enumerate(self.paths):
                ds = self._dataset(index)
                if index == 0:
                    self._dims(ds, file)
                    self.units = {n: str(ds[n].attrs.get("units", "")) for n in self.names}
                self._flips.append(self._grid(ds, file, latitude, longitude))
                self._check(ds, file)
                values = ds[self.time_dim].values
                times.append(values)
                owners.append(np.full(values.size, index))
                local.append(np.arange(values.size))
        except BaseException:
            self.release()
            raise
        times = np.concatenate(times)
        order = np.argsort(times, kind="stable")
        self.times, self._owner = times[order], np.concatenate(owners)[order]
        self._local = np.concatenate(local)[order]
        twice = np.flatnonzero(self.times[1:] == self.times[:-1])
        if twice.size:
            i = int(twice[0])
            files = sorted({str(self.paths[self._owner[i]]), str(self.paths[self._owner[i + 1]])})
            raise ValueError(
                f"{self.what}: the time {self.times[i]} is in {' and '.join(map(repr, files))}; "
                "each time must be in one file only"
            )

    # ---- construction
    def _dataset(self, index: int):
        """File ``index`` opened in this process (reopened after a fork)."""
        if self._pid != os.getpid():
            self._open, self._pid = {}, os.getpid()  # the parent's handles are not ours
        if index not in self._open:
            self._open[index] = open_fields(self.paths[index], self.what)
        return self._open[index][0]

    def _dims(self, ds, path: Path) -> None:
        self.time_dim = find_dim(ds.dims, TIME_NAMES)
        self.lat_dim = find_dim(ds.dims, LAT_NAMES)
        self.lon_dim = find_dim(ds.dims, LON_NAMES)
        if None in (self.time_dim, self.lat_dim, self.lon_dim):
            raise ValueError(
                f"{self.what} {str(path)!r} has no time / latitude / longitude dims: "
                f"{list(ds.dims)}"
            )

    def _grid(self, ds, path: Path, latitude, longitude) -> bool:
        """Whether the file's latitude ascends (it is read flipped); ``ValueError`` when the
        file is on another grid than the data."""
        where = f"{self.what} {str(path)!r}"
        if self.lat_dim not in ds.dims or self.lon_dim not in ds.dims:
            raise ValueError(f"{where} has no {self.lat_dim!r} / {self.lon_dim!r} dims")
        lat = ds[self.lat_dim].values.astype(np.float64)
        flip = bool(lat.size > 1 and lat[0] < lat[-1])
        lat = lat[::-1] if flip else lat
        lon = ds[self.lon_dim].values.astype(np.float64)
        for axis, mine, theirs in (("latitude", lat, latitude), ("longitude", lon, longitude)):
            if mine.shape != np.shape(theirs) or not np.allclose(mine, theirs, rtol=0, atol=1e-5):
                raise ValueError(
                    f"{where} is on another grid than data.path: {mine.size} {axis} points "
                    f"against {np.size(theirs)}"
                )
        return flip

    def _check(self, ds, path: Path) -> None:
        where = f"{self.what} {str(path)!r}"
        dims = {self.time_dim, self.lat_dim, self.lon_dim}
        for name in self.names:
            if name not in ds.data_vars:
                raise ValueError(
                    f"{where} has no dynamic forcing variable {name!r}; available variables: "
                    f"{sorted(ds.data_vars)}"
                )
            if set(ds[name].dims) != dims:
                raise ValueError(
                    f"{where}: dynamic forcing variable {name!r} has dims {ds[name].dims}, "
                    f"expected ({self.time_dim!r}, {self.lat_dim!r}, {self.lon_dim!r})"
                )

    # ---- reading
    def positions(self, times) -> np.ndarray:
        """The index of each of ``times`` (labels) among the files' times; ``ValueError``
        naming the first time no file holds."""
        times = np.asarray(times)
        at = np.searchsorted(self.times, times)
        inside = at < self.times.size
        found = inside & (self.times[np.minimum(at, self.times.size - 1)] == times)
        if not found.all():
            missing = times[np.flatnonzero(~found)[0]]
            raise ValueError(
                f"{self.what}: no file holds the time {missing} (the files' times run "
                f"{self.times[0]} .. {self.times[-1]}, {self.times.size} times); the dynamic "
                "forcing must cover every time of the data"
            )
        return at

    def read(self, name: str, times, rows: tuple[int, int], columns: tuple[int, int]):
        """``name`` at the labels ``times``, rows ``rows`` (north to south) and ``columns``,
        float32 ``(len(times), rows, columns)``."""
        at = self.positions(times)
        first, stop = rows
        height = self._height()
        out = np.empty((len(at), stop - first, columns[1] - columns[0]), np.float32)
        owners = self._owner[at]
        for index in np.unique(owners):
            picks = np.flatnonzero(owners == index)
            variable = self._dataset(int(index))[name]
            flip = self._flips[int(index)]
            lat_index = slice(height - stop, height - first) if flip else slice(first, stop)
            raw = variable.isel(
                {
                    self.time_dim: self._local[at[picks]],
                    self.lat_dim: lat_index,
                    self.lon_dim: slice(*columns),
                }
            )
            raw = raw.transpose(self.time_dim, self.lat_dim, self.lon_dim).values
            out[picks] = raw[:, ::-1] if flip else raw  # float32 as CREDIT casts
        return out

    def _height(self) -> int:
        return int(self._dataset(0).sizes[self.lat_dim])

    def release(self) -> None:
        """Close every file this process opened."""
        if self._pid == os.getpid():
            for ds, _ in self._open.values():
                ds.close()
        self._open = {}
