"""The forecast store: ONE zarr store ``DIR/forecast.zarr`` written by rows (or lat x lon tiles)
from every rank.

Layout (``xarray.open_zarr`` opens it): one data variable per dataset variable, named as in the
dataset, in physical units, dims ``(init_time, [member,] lead_time, [level,] latitude,
longitude)``; coordinates ``init_time`` (datetime64), ``lead_time`` (timedelta64, 1 .. N dataset
time steps), ``level`` (hPa), ``latitude`` / ``longitude`` (the dataset's values, north to south),
``member`` with an ensemble; a variable ``complete`` ``(init_time,)`` (int8, 1 once every rank has
flushed that initial time); CF attributes (``units``, ``long_name``, ``standard_name`` where
known, ``Conventions``); the run's config (JSON) and checkpoint in the root attributes.

Chunks: one initial time, member and lead per chunk, all levels, and whole blocks of
``row_chunk`` latitude rows (and ``column_chunk`` longitudes on a lat x lon domain, SPEC §3b),
each written by ONE rank, the chunk's owner (:mod:`.chunks`: about one chunk per rank, never a
one-row chunk; the rows of a chunk straddling two ranks reach its owner by a neighbour exchange
before the write), so the writes need no lock and no read-modify-write.  Compression: blosc
lz4 with byte shuffle (``DEFAULT_COMPRESSION``; docs/forecast.md has the measurement).

Rank 0 creates the store (metadata only, consolidated: every data chunk is the NaN fill value
until written, so no rank holds more than its rows of a field), then every rank writes its
chunks of its own initial times through tensorstore (:meth:`ForecastStore.write_async`,
asynchronous, outside the interpreter lock) from :class:`.writer.StepWriter`, while the next
forecast step computes.
"""

from __future__ import annotations

import json
import os
import shutil
import warnings
from collections.abc import Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import xarray as xr
import zarr

__all__ = [
    "DEFAULT_COMPRESSION",
    "STORE_NAME",
    "ForecastStore",
    "StoreVariable",
    "check_existing_store",
]

STORE_NAME = "forecast.zarr"
COMPLETE = "complete"
# blosc lz4 (level 5, byte shuffle): docs/forecast.md "Writing" (CPU time and size per codec,
# measured: the least CPU per GB and the smallest chunks of zstd 1, zstd 3, lz4 and none)
DEFAULT_COMPRESSION = ("lz4", 5)

_CF_NAMES = {  # ERA5 short names -> (standard_name, long_name)
    "Z": ("geopotential", "geopotential"),
    "T": ("air_temperature", "temperature"),
    "U": ("eastward_wind", "eastward wind"),
    "V": ("northward_wind", "northward wind"),
    "Q": ("specific_humidity", "specific humidity"),
    "SP": ("surface_air_pressure", "surface pressure"),
    "t2m": ("air_temperature", "2 metre temperature"),
    "MSL": ("air_pressure_at_mean_sea_level", "mean sea level pressure"),
}


@dataclass(frozen=True)
class StoreVariable:
    """One data variable of the store: its name, whether it has levels, its units."""

    name: str
    upper: bool
    units: str = ""


def chunk_indices(region: tuple, chunks: tuple) -> set[tuple]:
    """The chunk grid indices a write of ``region`` (a tuple of slices) touches."""
    ranges = [range(s.start // c, (s.stop - 1) // c + 1) for s, c in zip(region, chunks)]
    out = {()}
    for r in ranges:
        out = {prefix + (i,) for prefix in out for i in r}
    return out


def _compressors(compression):
    """zarr v3 compressors of ``compression`` (``DEFAULT_COMPRESSION``'s form); tensorstore's
    ``zarr3`` driver reads and writes both."""
    if compression is None:
        return None
    kind, level = compression
    if kind == "zstd":
        return zarr.codecs.ZstdCodec(level=int(level))
    if kind == "lz4":
        return zarr.codecs.BloscCodec(cname="lz4", clevel=int(level), shuffle="shuffle")
    raise ValueError(f"ForecastStore: compression {compression!r}: zstd, lz4 or None")


def _cf_attrs(variable: StoreVariable) -> dict:
    standard, long_name = _CF_NAMES.get(variable.name, (None, variable.name))
    attrs = {"units": variable.units, "long_name": long_name}
    if standard is not None:
        attrs["standard_name"] = standard
    return attrs


@dataclass
class ForecastStore:
    """Handle of ``DIR/forecast.zarr`` on one rank (see the module docstring).

    :meth:`create` (rank 0, once) writes the metadata; :meth:`open` returns a handle on every
    rank; :meth:`write` writes one field's rows (called from the writer thread);
    :meth:`complete_times` / :meth:`mark_complete` read and set the completion marks.
    """

    path: Path
    members: int = 1
    written_chunks: set = field(default_factory=set)

    @classmethod
    def create(
        cls,
        path,
        *,
        variables: Sequence[StoreVariable],
        init_times: np.ndarray,
        lead_times: np.ndarray,
        latitude: np.ndarray,
        longitude: np.ndarray,
        levels: Sequence[float] = (),
        members: int = 1,
        row_chunk: int,
        column_chunk: int | None = None,
        attrs: dict | None = None,
        layout=None,
        compression: tuple[str, int] | None = DEFAULT_COMPRESSION,
    ) -> ForecastStore:
        """Write the store's metadata and coordinates (no data chunk) to ``path``;
        ``column_chunk``: longitudes per chunk (None: all of them); ``layout``: the dims' names
        and the level coordinate (:class:`.store_layout.StoreLayout`; None: the default; the
        variables come already named as the store names them); ``compression``:
        ``("zstd", level)``, ``("lz4", clevel)`` (blosc) or None (raw chunks)."""
        from .store_layout import StoreLayout

        path = Path(path)
        layout = layout or StoreLayout()
        init, lead, member = layout.init_dim, layout.lead_dim, layout.member_dim
        coords = {
            init: (init, np.asarray(init_times, dtype="datetime64[ns]")),
            lead: (lead, np.asarray(lead_times, dtype="timedelta64[ns]")),
            "latitude": ("latitude", np.asarray(latitude, dtype=np.float64)),
            "longitude": ("longitude", np.asarray(longitude, dtype=np.float64)),
        }
        if len(levels):  # the dataset's values, or the layout's (hPa, int64 when whole)
            own = layout.levels is None
            values = np.asarray(levels, dtype=np.float64) if own else np.asarray(layout.levels)
            coords["level"] = ("level", values)
        if members > 1:
            coords[member] = (member, np.arange(members, dtype=np.int64))
        n_init = len(coords[init][1])
        ds = xr.Dataset(
            {COMPLETE: (init, np.zeros(n_init, dtype=np.int8))},
            coords=coords,
            attrs={"Conventions": "CF-1.8", "layout": layout.name, **(attrs or {})},
        )
        ds["latitude"].attrs.update(units="degrees_north", standard_name="latitude")
        ds["longitude"].attrs.update(units="degrees_east", standard_name="longitude")
        ds[init].attrs.update(standard_name="forecast_reference_time")
        ds[lead].attrs.update(standard_name="forecast_period")
        if len(levels):
            ds["level"].attrs.update(units="hPa", standard_name="air_pressure", positive="down")
        ds[COMPLETE].attrs["description"] = "1 once every rank has flushed this initial time"
        encoding = {COMPLETE: {"chunks": (1,)}}
        ds.to_zarr(path, mode="w", consolidated=False, encoding=encoding)
        group = zarr.open_group(path, mode="r+")
        height, width = len(latitude), len(longitude)
        n_lead = len(lead_times)
        for variable in variables:
            lead_dims = layout.lead_dims(members)
            lead_shape = (n_init, members, n_lead) if members > 1 else (n_init, n_lead)
            level_dims = ("level",) if variable.upper else ()
            level_shape = (len(levels),) if variable.upper else ()
            group.create_array(
                variable.name,
                shape=(*lead_shape, *level_shape, height, width),
                chunks=(*(1 for _ in lead_shape), *level_shape, row_chunk, column_chunk or width),
                dtype="float32",
                fill_value=np.float32("nan"),
                dimension_names=(*lead_dims, *level_dims, "latitude", "longitude"),
                attributes=_cf_attrs(variable),
                compressors=_compressors(compression),
            )
        with warnings.catch_warnings():  # zarr's notice that v3 has no consolidated spec yet
            warnings.simplefilter("ignore", UserWarning)
            # the metadata never changes after this (data and the marks are chunks), so
            # ``xarray.open_zarr(path)`` opens the store from one document, without a warning
            zarr.consolidate_metadata(path)
        return cls(path, members)

    @classmethod
    def open(cls, path, members: int = 1) -> ForecastStore:
        return cls(Path(path), members)

    def _group(self):
        group = getattr(self, "_cached_group", None)
        if group is None:
            group = self._cached_group = zarr.open_group(
                self.path, mode="r+", use_consolidated=False
            )
        return group

    def write(
        self,
        name: str,
        index: tuple,
        rows: tuple[int, int],
        values: np.ndarray,
        columns: tuple[int, int] | None = None,
    ) -> None:
        """Write ``values`` (``[levels,] rows, columns``) at ``index`` (init position, [member,]
        lead) into rows ``rows`` (and longitudes ``columns``; None: from 0) of ``name``."""
        region = self._written(name, index, rows, values, columns)
        array = self._group()[name]
        array[region] = values.reshape(tuple(s.stop - s.start for s in region))

    def _written(self, name, index, rows, values, columns) -> tuple:
        """The region (slices) a write of ``values`` covers; its chunks noted as written."""
        columns = columns if columns is not None else (0, values.shape[-1])
        region = (*(slice(i, i + 1) for i in index), *(slice(0, n) for n in values.shape[:-2]))
        region = (*region, slice(*rows), slice(*columns))
        for chunk in chunk_indices(region, self.chunk_shape(name)):
            self.written_chunks.add((name, chunk))
        return region

    def _array(self, name: str):
        """The tensorstore handle of variable ``name`` (opened once per process; tensorstore's
        own thread pools encode, compress and write the chunks)."""
        import tensorstore as ts

        from ..data import chunk_reader

        chunk_reader._started_in = os.getpid()  # a process forked from here must not use it
        arrays = self.__dict__.setdefault("_ts_arrays", {})
        if arrays.get("pid") != os.getpid():
            arrays.clear()
            arrays["pid"] = os.getpid()
        if name not in arrays:
            spec = {"driver": "zarr3", "kvstore": {"driver": "file", "path": str(self.path / name)}}
            arrays[name] = ts.open(spec, open=True, context=_ts_context()).result()
        return arrays[name]

    def write_async(
        self,
        name: str,
        index: tuple,
        rows: tuple[int, int],
        values: np.ndarray,
        columns: tuple[int, int] | None = None,
    ):
        """As :meth:`write` without waiting: returns a future of the write's commit (with
        ``add_done_callback`` and ``exception``); ``values`` stay unchanged until it is done.
        Through tensorstore (its own threads, no read-back: whole chunks only, ``rows`` /
        ``columns`` chunk-aligned), or, in a process forked from one that used tensorstore
        (which would abort there: ``data/chunk_reader.py``), through zarr on a thread."""
        from ..data.chunk_reader import tensorstore_usable

        if not tensorstore_usable():
            return _zarr_pool().submit(self.write, name, index, rows, values, columns)
        region = self._written(name, index, rows, values, columns)
        target = self._array(name)[(*map(int, index), ..., *region[-2:])]
        return target.write(values).commit

    def chunk_shape(self, name: str) -> tuple:
        """The chunk shape of variable ``name`` as the store holds it."""
        shapes = self.__dict__.setdefault("_chunk_shapes", {})
        if name not in shapes:
            shapes[name] = tuple(self._group()[name].chunks)
        return shapes[name]

    def read(
        self,
        name: str,
        index: tuple,
        rows: tuple[int, int],
        columns: tuple[int, int] | None = None,
    ) -> np.ndarray:
        """The inverse of :meth:`write`: rows ``rows`` (and longitudes ``columns``; None: all)
        of variable ``name`` at ``index``, ``([levels,] rows, columns)``."""
        array = self._group()[name]
        lon = slice(*columns) if columns is not None else slice(None)
        values = array[(*index, ..., slice(*rows), lon)]
        return np.asarray(values)

    def complete_times(self) -> np.ndarray:
        """Boolean per initial time: marked complete."""
        return np.asarray(self._group()[COMPLETE][:]) == 1

    def mark_complete(self, positions: Sequence[int]) -> None:
        """Mark initial times complete (rank 0, after every rank flushed them)."""
        array = self._group()[COMPLETE]
        for p in positions:
            array[int(p)] = 1

    def init_times(self) -> np.ndarray:
        from .store_layout import store_layout

        return np.asarray(self._group()[store_layout(None, self.attrs()).init_dim][:])

    def attrs(self) -> dict:
        return dict(self._group().attrs)


def _ts_context():
    """One tensorstore context per process (its thread pools are shared by the variables)."""
    import tensorstore as ts

    global _CONTEXT
    if _CONTEXT is None:
        _CONTEXT = ts.Context({"cache_pool": {"total_bytes_limit": 0}})
    return _CONTEXT


_CONTEXT = None
_ZARR_POOL: tuple[int, ThreadPoolExecutor] | None = None


def _zarr_pool() -> ThreadPoolExecutor:
    """The writer threads of a process that cannot use tensorstore (one per process)."""
    global _ZARR_POOL
    if _ZARR_POOL is None or _ZARR_POOL[0] != os.getpid():
        _ZARR_POOL = (os.getpid(), ThreadPoolExecutor(4, thread_name_prefix="forecast-zarr"))
    return _ZARR_POOL[1]


def check_existing_store(
    path: Path, resume: bool, overwrite: bool, times, variables, members, layout=None
) -> None:
    """Refuse an existing store without ``--resume`` / ``--overwrite``, or one ``--resume``
    cannot continue (other initial times, leads, variables, members or ``layout``: the
    :class:`.store_layout.StoreLayout` of this run, None: the default)."""
    from .store_layout import StoreLayout, store_layout

    if resume and overwrite:
        raise ValueError("--resume and --overwrite exclude each other")
    if not path.exists() or overwrite:
        return
    if not resume:
        raise ValueError(
            f"{path} exists; pass --resume to continue it or --overwrite to replace it"
        )
    try:
        ds = xr.open_zarr(path)
    except Exception as exc:  # noqa: BLE001 - any unreadable store is reported in one line
        raise ValueError(f"--resume: {path} is not a readable forecast store ({exc})") from None
    layout = layout or StoreLayout()
    held = store_layout(ds.attrs.get("layout", "default"))
    if held.name != layout.name:
        raise ValueError(
            f"--resume: {path} has the {held.name} layout, this run asks for the {layout.name} "
            "one; pass the same --layout, or --overwrite"
        )
    same = (
        np.array_equal(ds[layout.init_dim].values, times.init_times)
        and ds.sizes.get(layout.lead_dim) == len(times.lead_times)
        and sorted(v.name for v in variables) == sorted(n for n in ds.data_vars if n != "complete")
        and ds.sizes.get(layout.member_dim, 1) == members
    )
    if not same:
        raise ValueError(
            f"--resume: {path} holds other initial times, leads, variables or members than "
            "this run; pass the same flags, or --overwrite"
        )


def remove_store(path) -> None:
    """Delete a store directory (``--overwrite``)."""
    path = Path(path)
    if path.exists():
        shutil.rmtree(path)


def config_attrs(conf: dict, checkpoint: str, extra: dict | None = None) -> dict:
    """The root attributes recording the run: its config (JSON) and checkpoint."""
    return {
        "config": json.dumps(conf, default=str, sort_keys=True),
        "checkpoint": str(checkpoint),
        "source": "credit-parallel forecast",
        **(extra or {}),
    }
