"""Several zarr stores read as ONE time axis, and static fields from a store (or netCDF file) of their own.

``data.path`` may name one zarr store, a glob of stores (CREDIT's one store per year,
``/data/ERA5_plevel_6h_*.zarr``) or a list of stores and globs.  :class:`StoreSet` opens each
store through its own ``ByteCountingStore`` (``store.py``), orders them by their first time
(never by name), and checks that they are one data set split along time: the same non-time
dims, coordinate values (latitude, longitude, levels) and, for every variable read, the same
dims and dtype; the times strictly increasing across stores (no overlap) with the stores'
own spacing at every boundary (no gap).  Errors name both stores.  A window of times
(``slice`` over the combined axis) is split into per-store pieces, each read by that store's
chunk reader (tensorstore or zarr, ``chunk_reader.py``) straight into its rows of the sample
buffer, so a sample whose history or forecast crosses a store boundary is read as from one
store, and each rank still reads only its rows (or tile) of each store.  Bytes read are the
sum over the stores (``CountingStores``).

:class:`StaticStore` reads ``data.static_path``: time-invariant fields with dims
``(latitude, longitude)`` (a dummy time dim of size 1 is dropped, as CREDIT's gen-2 dataset
does) on the data's grid (its latitude may run either way), each rank reading its rows.
"""

from __future__ import annotations

import contextlib
import glob
import os
from pathlib import Path

import numpy as np

from .store import LAT_NAMES, LON_NAMES, TIME_NAMES, find_dim, open_fields, open_store

__all__ = ["CountingStores", "StaticStore", "StoreSet", "missing_store", "store_paths"]

_GLOB_CHARS = "*?["


def _items(path) -> list:
    if isinstance(path, str | os.PathLike):
        return [path]
    if isinstance(path, list | tuple) and path:
        return list(path)
    raise ValueError(
        f"data.path must be a zarr store, a glob of stores or a list of them, got {path!r}"
    )


def store_paths(path) -> list[Path]:
    """The stores ``path`` names (one path, a glob, or a list of paths and globs), globs
    expanded in name order; ``FileNotFoundError`` for a glob that matches nothing."""
    out: list[Path] = []
    for item in _items(path):
        text = os.fspath(item)
        if any(c in text for c in _GLOB_CHARS):
            matches = sorted(glob.glob(text))
            if not matches:
                raise FileNotFoundError(f"ERA5Dataset: the glob {text!r} matches no zarr store")
            out += [Path(m) for m in matches]
        else:
            out.append(Path(text))
    twice = sorted({str(p) for p in out if out.count(p) > 1})
    if twice:
        raise ValueError(f"ERA5Dataset: data.path names the store(s) {twice} more than once")
    return out


def missing_store(path) -> str | None:
    """Why ``path`` (as :func:`store_paths` takes it) names no existing store, or None."""
    try:
        paths = store_paths(path)
    except (FileNotFoundError, ValueError) as err:
        return str(err)
    missing = [str(p) for p in paths if not p.exists()]
    return f"data.path {missing[0]!r} does not exist" if missing else None


def _open_any(path: Path, what: str):
    """A zarr store (directory) or a netCDF file (CREDIT's ``static_norm_old.nc``)."""
    if path.is_dir() or not path.exists():
        return open_store(path, what)
    return open_fields(path, what)


class CountingStores:
    """The byte counters of several stores read as one: ``chunk_bytes`` / ``chunk_reads``
    summed per array name, ``metadata_bytes`` summed, ``reset()`` resets them all."""

    def __init__(self, counters) -> None:
        self.counters = list(counters)

    def _merged(self, attribute: str) -> dict[str, int]:
        out: dict[str, int] = {}
        for counter in self.counters:
            for name, value in getattr(counter, attribute).items():
                out[name] = out.get(name, 0) + value
        return out

    @property
    def chunk_bytes(self) -> dict[str, int]:
        return self._merged("chunk_bytes")

    @property
    def chunk_reads(self) -> dict[str, int]:
        return self._merged("chunk_reads")

    @property
    def metadata_bytes(self) -> int:
        return sum(counter.metadata_bytes for counter in self.counters)

    def reset(self) -> None:
        for counter in self.counters:
            counter.reset()


class _Part:
    """One store of a :class:`StoreSet`: its dataset, counter, place on the time axis, and the
    direct-read arrays and chunk reader the dataset gives it."""

    def __init__(self, path: Path, what: str) -> None:
        self.path = path
        self.ds, self.counter = open_store(path, what)
        self.start = self.size = 0
        self.direct: dict = {}
        self.reader = None

    def release(self) -> None:
        if self.reader is not None:
            self.reader.release()
        self.direct = {}
        if self.ds is not None:
            self.ds.close()
            self.ds = None


class StoreSet:
    """The store(s) of ``data.path`` as one time axis (see the module docstring)."""

    def __init__(self, path, what: str = "ERA5Dataset") -> None:
        self.what = what
        self.paths = store_paths(path)
        self.parts, self.static = [], None  # static: the StaticStore of data.static_path
        self.forcing = None  # the ForcingFiles of data.forcing_path (forcing_files.py)
        with self.released_on_error():  # the stores opened before a failure are closed
            for p in self.paths:
                self.parts.append(_Part(p, what))
            self.ds = self.parts[0].ds  # the metadata (dims, coordinates, attributes) of them all
            self.time_dim = find_dim(self.ds.dims, TIME_NAMES)
            if len(self.parts) > 1:
                self._order()
            for part in self.parts:
                part.size = part.ds.sizes.get(self.time_dim, 0)

    @property
    def path(self) -> Path:
        """The store, or the first store (by time) of several."""
        return self.parts[0].path

    def _order(self) -> None:
        for part in self.parts:
            if find_dim(part.ds.dims, TIME_NAMES) != self.time_dim or self.time_dim is None:
                raise ValueError(
                    f"{self.what}: the stores of data.path must share a time dimension "
                    f"({list(TIME_NAMES)}); {str(part.path)!r} has dims {list(part.ds.dims)}"
                )
            if part.ds.sizes[self.time_dim] == 0:
                raise ValueError(f"{self.what}: the store {str(part.path)!r} has no times")
        self.parts.sort(key=lambda part: part.ds[self.time_dim].values[0])
        self.ds = self.parts[0].ds
        start = 0
        step = self._common_step()
        for before, after in zip(self.parts, self.parts[1:]):
            start += before.ds.sizes[self.time_dim]
            after.start = start
            self._check_boundary(before, after, step)

    def _common_step(self):
        """The one time step of all stores: each store's own spacing constant and the same in
        every store of more than one time (None when no store has two times)."""
        step, first = None, None
        for part in self.parts:
            times = part.ds[self.time_dim].values
            if times.size < 2:
                continue
            steps = np.unique(np.diff(times))
            if steps.size != 1:
                raise ValueError(
                    f"{self.what}: the store {str(part.path)!r} has uneven time steps "
                    f"{list(steps)}; the stores of data.path must share one time step"
                )
            if step is None:
                step, first = steps[0], part
            elif steps[0] != step:
                raise ValueError(
                    f"{self.what}: the stores {str(first.path)!r} (time step {step}) and "
                    f"{str(part.path)!r} (time step {steps[0]}) differ in time step; the "
                    "stores of data.path must share one time step"
                )
        return step

    def _check_boundary(self, before: _Part, after: _Part, step) -> None:
        a, b = before.ds[self.time_dim].values, after.ds[self.time_dim].values
        if not b[0] > a[-1]:
            raise ValueError(
                f"{self.what}: the stores {str(before.path)!r} (times {a[0]} .. {a[-1]}) and "
                f"{str(after.path)!r} (times {b[0]} .. {b[-1]}) overlap in time; each time must "
                "be in one store only"
            )
        if step is not None and b[0] - a[-1] != step:
            raise ValueError(
                f"{self.what}: between the stores {str(before.path)!r} (last time {a[-1]}) and "
                f"{str(after.path)!r} (first time {b[0]}) the time step is {b[0] - a[-1]}, not "
                f"the stores' common {step}: a gap in the time axis (a missing store?)"
            )

    def check(self, names, static_names=()) -> None:
        """Every store like the first: the non-time dims and their coordinate values, and the
        dims and dtype of each variable in ``names`` (and of ``static_names`` read from it)."""
        first = self.parts[0]
        for part in self.parts[1:]:
            where = f"{self.what}: the stores {str(first.path)!r} and {str(part.path)!r}"
            for dim, size in first.ds.sizes.items():
                if dim == self.time_dim:
                    continue
                if part.ds.sizes.get(dim) != size:
                    raise ValueError(
                        f"{where} differ in dimension {dim!r}: {size} and "
                        f"{part.ds.sizes.get(dim)} points; the stores must share one grid"
                    )
                if dim in first.ds.coords and not np.array_equal(
                    first.ds[dim].values, part.ds[dim].values
                ):
                    raise ValueError(
                        f"{where} differ in the {dim!r} coordinate values; the stores must "
                        "share one grid and one set of levels"
                    )
            for name in [*names, *static_names]:
                if name not in part.ds.data_vars:
                    raise ValueError(f"{where}: variable {name!r} is missing from the second")
                mine, theirs = first.ds[name], part.ds[name]
                if mine.dims != theirs.dims or mine.dtype != theirs.dtype:
                    raise ValueError(
                        f"{where} differ in variable {name!r}: dims {mine.dims} {mine.dtype} "
                        f"and {theirs.dims} {theirs.dtype}"
                    )

    def time_index(self):
        """The times of all stores in order, as an index (``.slice_indexer`` for labels)."""
        indexes = [part.ds.indexes[self.time_dim] for part in self.parts]
        return indexes[0].append(indexes[1:]) if len(indexes) > 1 else indexes[0]

    def open_readers(self, reader: str, direct_arrays, choose, make) -> str:
        """Each store's direct-read arrays (``direct_arrays(ds, counter)``) and chunk reader;
        one reader kind for all (``choose(reader, path, arrays)``; zarr when they differ)."""
        for part in self.parts:
            part.direct = direct_arrays(part.ds, part.counter)
        kinds = {choose(reader, p.path, p.direct) for p in self.parts if p.direct}
        kind = kinds.pop() if len(kinds) == 1 else "zarr"
        for part in self.parts:
            part.reader = make(kind, part.path, part.direct, part.counter)
        return kind

    def split(self, time_index: slice) -> list[tuple[_Part, slice, slice]]:
        """``(store, its local time slice, the window's positions)`` per store the window of
        combined positions ``time_index`` (``start < stop``, a positive step) touches."""
        positions = np.arange(time_index.start, time_index.stop, time_index.step or 1)
        pieces = []
        for part in self.parts:
            end = part.start + part.size
            inside = np.flatnonzero((positions >= part.start) & (positions < end))
            if inside.size:
                local = positions[inside] - part.start
                pieces.append(
                    (
                        part,
                        slice(int(local[0]), int(local[-1]) + 1, time_index.step or 1),
                        slice(int(inside[0]), int(inside[-1]) + 1),
                    )
                )
        return pieces

    def read(self, time_index: slice, target: np.ndarray, read_part):
        """One variable's window: ``read_part(store, local slice, target rows)`` per store,
        each decoding into ``target`` (then None) or returning the raw values; returns None
        when every piece was decoded, else the raw window (decoded pieces taken from
        ``target``; time is axis 0 of both)."""
        pieces = self.split(time_index)
        raws = [read_part(part, local, target[out]) for part, local, out in pieces]
        if len(raws) == 1 or all(raw is None for raw in raws):
            return raws[0] if len(raws) == 1 else None
        return np.concatenate(
            [target[out] if raw is None else raw for raw, (_, _, out) in zip(raws, pieces)]
        )

    @property
    def counter(self):
        """The byte counter of the store, or the :class:`CountingStores` of several (and of
        the static store)."""
        counters = [part.counter for part in self.parts]
        if self.static is not None:
            counters.append(self.static.counter)
        return counters[0] if len(counters) == 1 else CountingStores(counters)

    def release(self) -> None:
        """Close every store (and the static store) and drop its readers (after a cached
        dataset's one read, or a failure while the dataset is built)."""
        for part in self.parts:
            part.release()
        if self.static is not None:
            self.static.release()
        if self.forcing is not None:
            self.forcing.release()
        self.ds = None

    @contextlib.contextmanager
    def released_on_error(self):
        """Release every store when the block raises (anything: the error is re-raised)."""
        try:
            yield self
        except BaseException:
            self.release()
            raise


class StaticStore:
    """Static fields ``names`` from the store at ``path`` on the grid ``latitude`` (north to
    south) x ``longitude`` of the data (see the module docstring)."""

    def __init__(self, path, names, latitude, longitude, what: str = "ERA5Dataset") -> None:
        self.path = Path(path)
        self.names = list(names)
        self.ds, self.counter = _open_any(self.path, f"{what} static store (data.static_path)")
        try:
            self._validate(latitude, longitude, f"{what}: the static store {str(self.path)!r}")
        except BaseException:
            self.release()
            raise
        self.units = {n: str(self.ds[n].attrs.get("units", "")) for n in self.names}

    def _validate(self, latitude, longitude, where: str) -> None:
        self.lat_dim = find_dim(self.ds.dims, LAT_NAMES)
        self.lon_dim = find_dim(self.ds.dims, LON_NAMES)
        if self.lat_dim is None or self.lon_dim is None:
            raise ValueError(f"{where} has no latitude / longitude dims: {list(self.ds.dims)}")
        lat = self.ds[self.lat_dim].values.astype(np.float64)
        lon = self.ds[self.lon_dim].values.astype(np.float64)
        self.flip = bool(lat.size > 1 and lat[0] < lat[-1])
        lat = lat[::-1] if self.flip else lat
        for axis, mine, theirs in (("latitude", lat, latitude), ("longitude", lon, longitude)):
            if mine.shape != np.shape(theirs) or not np.allclose(mine, theirs, rtol=0, atol=1e-5):
                raise ValueError(
                    f"{where} is on another grid than data.path: {mine.size} {axis} points "
                    f"{mine[:1]}..{mine[-1:]} against {np.size(theirs)} "
                    f"{np.asarray(theirs)[:1]}..{np.asarray(theirs)[-1:]}"
                )
        self.time_dim = find_dim(self.ds.dims, TIME_NAMES)
        for name in self.names:
            self._check(name, where)

    def release(self) -> None:
        """Close the store (once)."""
        if self.ds is not None:
            self.ds.close()
            self.ds = None

    def _check(self, name: str, where: str) -> None:
        if name not in self.ds.data_vars:
            raise ValueError(
                f"{where} has no static variable {name!r}; available variables: "
                f"{sorted(self.ds.data_vars)}"
            )
        dims = set(self.ds[name].dims)
        dummy = self.time_dim in dims and self.ds.sizes[self.time_dim] == 1
        if dims - ({self.time_dim} if dummy else set()) != {self.lat_dim, self.lon_dim}:
            raise ValueError(
                f"{where}: static variable {name!r} has dims {self.ds[name].dims}, expected "
                f"({self.lat_dim!r}, {self.lon_dim!r}) (and at most a time dim of size 1)"
            )

    def read(self, rows: tuple[int, int], columns: tuple[int, int]) -> np.ndarray:
        """The raw fields of rows ``rows`` (north to south) and ``columns``, float32
        ``(n_static, rows, columns)``; then the store is closed."""
        height = self.ds.sizes[self.lat_dim]
        first, stop = rows
        lat_index = slice(height - stop, height - first) if self.flip else slice(first, stop)
        out = np.empty((len(self.names), stop - first, columns[1] - columns[0]), np.float32)
        try:
            for c, name in enumerate(self.names):
                variable = self.ds[name]
                if self.time_dim in variable.dims:
                    variable = variable.isel({self.time_dim: 0}, drop=True)
                raw = variable.isel({self.lat_dim: lat_index, self.lon_dim: slice(*columns)})
                raw = raw.transpose(self.lat_dim, self.lon_dim).values
                out[c] = raw[::-1] if self.flip else raw
        finally:
            self.release()
        return out
