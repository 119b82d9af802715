"""Forecast scores per variable, level and lead time (SPEC §7), exact under any layout.

:class:`ScoreAccumulator` takes each forecast step's local rows and the truth's, turns them into
per-initial-time global values with the exact metrics of :mod:`.metrics` (summed over the domain
group at each ``add``), and keeps per (lead, channel) the sums over its initial times: the
count, the spatial MSE, the anomaly correlation and, for ensembles, the fair CRPS and the member
variance.  :meth:`ScoreAccumulator.result` sums them ONCE over the ranks that hold other initial
times (``dp_group``) and returns rows with SPEC §7's columns::

    variable, level, lead_time_hours, rmse, acc            (+ crps, spread with members > 1)

``rmse = sqrt(mean_t mse_t)``, ``acc = mean_t acc_t`` over the initial times ``t``; with an
ensemble, ``rmse`` and ``acc`` are those of the ensemble mean, ``spread = sqrt(mean_t var_t)``.
Fields are scored in the units they are given in (the forecast command passes physical units,
as in the store); the climatology must be in the same units.

Channel layout of a scored field (the dataset's, ``ERA5Dataset.output_variable_names``): each
upper-air variable at each level, then the surface variables, then the diagnostic (output-only)
ones, scored like surface variables.  A 4-D model's output ``(B, C, H, W)`` is in
that order already; a 5-D model's ``(upper (B, V, Z, H, W), surface (B, S, H, W))`` is flattened
into it.  With ``members > 1`` every field has a leading member axis ``(M_local, B, ...)``.

Also here: :func:`write_scores` (``scores.csv``, ``scores.json``, ``scores.png``),
:func:`plot_field_map` (one field at one lead, read back from the forecast store) and
:func:`climatology` (the time mean of the training range at each grid point of this rank's rows,
computed by rows from the dataset, or read from a file).
"""

from __future__ import annotations

import csv
import datetime
import gc
import json
import math
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch
import torch.distributed as dist

from ..layout.device import device_for_process_group
from . import metrics as fm

__all__ = [
    "SCORE_COLUMNS",
    "Channel",
    "ScoreAccumulator",
    "channels_of",
    "climatology",
    "flatten_channels",
    "forecast_map",
    "plot_field_map",
    "write_scores",
]

SCORE_COLUMNS = ("variable", "level", "lead_time_hours", "rmse", "acc")
ENSEMBLE_COLUMNS = ("crps", "spread")
# the sums kept per (lead, channel)
_COUNT, _MSE, _ACC, _CRPS, _VAR = range(5)


@dataclass(frozen=True)
class Channel:
    """One scored channel: a variable and its level (None for a surface variable)."""

    variable: str
    level: float | None = None


def _level_value(level) -> float | int:
    level = float(level)
    return int(level) if level.is_integer() else level


def channels_of(variables: Sequence[str], levels: Sequence, surface_variables=()) -> list:
    """The dataset's channel order: each upper-air variable at each level, then the surface
    variables."""
    upper = [Channel(v, _level_value(z)) for v in variables for z in levels]
    return upper + [Channel(v, None) for v in surface_variables]


def flatten_channels(fields, member_axis: bool = False) -> torch.Tensor:
    """A model output (a tensor, or a tuple of 5-D upper and 4-D surface tensors) as one
    ``([M,] B, C, H, W)`` tensor in the dataset's channel order."""
    fields = tuple(fields) if isinstance(fields, (tuple, list)) else (fields,)
    lead = 3 if member_axis else 2  # ([M,] B, C) in front of the levels
    parts = [
        f.reshape(*f.shape[: lead - 1], math.prod(f.shape[lead - 1 : -2]), *f.shape[-2:])
        for f in fields
    ]  # explicit sizes: a rank may hold no member
    return parts[0] if len(parts) == 1 else torch.cat(parts, dim=lead - 1)


def _hours(lead) -> float:
    if isinstance(lead, np.ndarray) and lead.ndim == 0:
        lead = lead[()]
    if isinstance(lead, np.timedelta64):
        return float(lead / np.timedelta64(1, "h"))
    if isinstance(lead, datetime.timedelta):
        return lead.total_seconds() / 3600.0
    return float(lead)


def _group_size(group) -> int:
    if group is None or not (dist.is_available() and dist.is_initialized()):
        return 1
    return dist.get_world_size(group)


def _default_dp_group(manager):
    if manager is not None:
        return manager.data_parallel_group
    if dist.is_available() and dist.is_initialized():
        return dist.group.WORLD
    return None


class ScoreAccumulator:
    """Sums of the exact scores per (lead, variable, level) over the initial times added.

    ``variables``/``levels``/``surface_variables``: the channel layout (:func:`channels_of`;
    :meth:`for_dataset` takes it from an ``ERA5Dataset``).  ``lead_times``: the lead of forecast
    steps 1..N (hours, ``numpy.timedelta64`` or ``datetime.timedelta``).  ``lat_weights_local``:
    the latitude weights of this rank's rows.  ``climatology``: this rank's rows of the
    climatology ``(C, H_local, W_local)`` in the fields' units (None: ``acc`` stays empty).
    ``manager``: the domain manager (None: whole fields).  ``members``: ensemble size (> 1: the
    fields carry a member axis; ``member_group``: the ranks holding the other members of the
    same initial times and rows, None when all are here).  ``dp_group``: the ranks over which
    the initial times are spread, one rank per (tp, domain) position (default: the manager's
    data-parallel group; without a manager the world).  Under an ensemble split over
    ``member_group``, only its first rank contributes an initial time (all compute it).
    """

    def __init__(
        self,
        variables: Sequence[str],
        levels: Sequence,
        lead_times: Sequence,
        *,
        surface_variables: Sequence[str] = (),
        lat_weights_local: torch.Tensor,
        climatology: torch.Tensor | None = None,
        manager=None,
        members: int = 1,
        member_group=None,
        dp_group="default",
    ):
        self.channels = channels_of(variables, levels, surface_variables)
        self.lead_hours = [_hours(lead) for lead in lead_times]
        if not self.lead_hours:
            raise ValueError("ScoreAccumulator: lead_times is empty")
        if isinstance(members, bool) or not isinstance(members, int) or members < 1:
            raise ValueError(f"ScoreAccumulator: members must be an integer >= 1, got {members!r}")
        self.members = members
        self.weights = lat_weights_local.detach().to(torch.float64)
        self.climatology = None if climatology is None else torch.as_tensor(climatology)
        self.manager = manager
        self.member_group = member_group
        self.dp_group = _default_dp_group(manager) if dp_group == "default" else dp_group
        self.sums = torch.zeros(len(self.lead_hours), len(self.channels), 5, dtype=torch.float64)
        self._seen: set = set()

    @classmethod
    def for_dataset(cls, dataset, lead_times: Sequence, **kwargs) -> ScoreAccumulator:
        """The accumulator of ``dataset``'s channels (an ``ERA5Dataset``)."""
        return cls(
            dataset.upper_air_variables,
            dataset.levels if dataset.upper_air_variables else (),
            lead_times,
            surface_variables=[
                *dataset.surface_variables,
                *getattr(dataset, "diagnostic_variables", ()),
            ],
            **kwargs,
        )

    def _contributes(self) -> bool:
        return _group_size(self.member_group) == 1 or dist.get_rank(self.member_group) == 0

    def _check(self, init_time, lead: int, pred: torch.Tensor, truth: torch.Tensor) -> list:
        if not 1 <= lead <= len(self.lead_hours):
            raise ValueError(
                f"ScoreAccumulator.add: lead {lead} outside forecast steps 1..{len(self.lead_hours)}"
            )
        if pred.shape[-3] != len(self.channels) or truth.shape[-3] != len(self.channels):
            raise ValueError(
                f"ScoreAccumulator.add: {len(self.channels)} channels expected "
                f"({self.channels[0].variable} ...), got prediction {tuple(pred.shape)} and truth "
                f"{tuple(truth.shape)}"
            )
        times = list(init_time) if isinstance(init_time, (list, tuple, np.ndarray)) else [init_time]
        if len(times) != truth.shape[0]:
            raise ValueError(
                f"ScoreAccumulator.add: {len(times)} initial times for a batch of {truth.shape[0]}"
            )
        keys = [(str(t), lead) for t in times]
        again = [k for k in keys if k in self._seen]
        if again:
            raise ValueError(f"ScoreAccumulator.add: initial time {again[0][0]} lead {lead} twice")
        return keys

    def add(self, init_time, lead: int, pred_local, truth_local) -> None:
        """Score forecast step ``lead`` (1-based) of the initial time(s) ``init_time`` (one per
        batch entry).  ``pred_local``/``truth_local``: this rank's rows (model outputs: a tensor
        or a 5-D model's tuple; the prediction with a member axis first when ``members > 1``).
        A collective over the domain group (and ``member_group``): every rank of them calls it
        for the same initial times and lead."""
        ensemble = self.members > 1
        pred = flatten_channels(pred_local, member_axis=ensemble)
        truth = flatten_channels(truth_local).to(torch.float64)
        keys = self._check(init_time, lead, pred, truth)
        kw = {"manager": self.manager}
        if ensemble:
            everyone = fm.gather_members(pred, self.member_group).to(torch.float64)
            crps = fm.spatial_crps(everyone, truth, self.weights, **kw)
            var = fm.spatial_variance(everyone, self.weights, **kw)
            pred = everyone.mean(dim=0)
        mse = fm.spatial_mse(pred, truth, self.weights, **kw)
        acc = None
        if self.climatology is not None:
            acc = fm.spatial_acc(pred, truth, self.climatology, self.weights, **kw)
        self._seen.update(keys)
        if not self._contributes():
            return
        row = self.sums[lead - 1]
        row[:, _COUNT] += truth.shape[0]
        row[:, _MSE] += mse.sum(dim=0).cpu()
        if acc is not None:
            row[:, _ACC] += acc.sum(dim=0).cpu()
        if ensemble:
            row[:, _CRPS] += crps.sum(dim=0).cpu()
            row[:, _VAR] += var.sum(dim=0).cpu()

    def totals(self) -> torch.Tensor:
        """The sums over every rank's initial times, ``(lead, channel, 5)``: ONE sum over
        ``dp_group`` (a collective: every rank of it calls this)."""
        sums = self.sums.clone()
        if _group_size(self.dp_group) > 1:
            moved = sums.to(device_for_process_group(self.dp_group))
            dist.all_reduce(moved, group=self.dp_group)
            sums = moved.cpu()
        return sums

    def result(self) -> list[dict]:
        """One row per (lead, channel) that has at least one scored initial time, in lead then
        channel order (a collective, see :meth:`totals`)."""
        sums = self.totals()
        rows = []
        for k, hours in enumerate(self.lead_hours):
            for c, channel in enumerate(self.channels):
                count = float(sums[k, c, _COUNT])
                if count == 0:
                    continue
                mean = sums[k, c] / count
                row = {
                    "variable": channel.variable,
                    "level": channel.level,
                    "lead_time_hours": hours,
                    "rmse": math.sqrt(float(mean[_MSE])),
                    "acc": float(mean[_ACC]) if self.climatology is not None else None,
                }
                if self.members > 1:
                    row["crps"] = float(mean[_CRPS])
                    row["spread"] = math.sqrt(float(mean[_VAR]))
                rows.append(row)
        return rows


# ------------------------------------------------------------------ files
def _columns(rows: list[dict]) -> list[str]:
    ensemble = any("crps" in r for r in rows)
    return list(SCORE_COLUMNS) + (list(ENSEMBLE_COLUMNS) if ensemble else [])


def _cell(value) -> str:
    if value is None:
        return ""
    return repr(value) if isinstance(value, float) else str(value)


def write_scores(directory, rows: list[dict]) -> dict[str, Path]:
    """``scores.csv`` (SPEC §7's columns; ``level`` empty for surface fields), ``scores.json``
    (the same rows) and ``scores.png`` (RMSE and ACC, and CRPS/spread for an ensemble, against
    lead time) in ``directory``; returns their paths by name."""
    directory = Path(directory)
    directory.mkdir(parents=True, exist_ok=True)
    columns = _columns(rows)
    paths = {n: directory / f"scores.{n}" for n in ("csv", "json", "png")}
    with open(paths["csv"], "w", newline="") as fh:
        writer = csv.writer(fh)
        writer.writerow(columns)
        for row in rows:
            writer.writerow([_cell(row.get(c)) for c in columns])
    paths["json"].write_text(
        json.dumps([{c: row.get(c) for c in columns} for row in rows], indent=1)
    )
    _plot_scores(paths["png"], rows, columns)
    return paths


def _label(variable: str, level) -> str:
    return variable if level is None else f"{variable} {level}"


def _plot_scores(path: Path, rows: list[dict], columns: list[str]) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    panels = [c for c in columns[3:] if any(r.get(c) is not None for r in rows)]
    fig, axes = plt.subplots(1, max(1, len(panels)), figsize=(4.2 * max(1, len(panels)), 3.8))
    axes = np.atleast_1d(axes)
    series: dict = {}
    for r in rows:
        series.setdefault((r["variable"], r["level"]), []).append(r)
    for ax, column in zip(axes, panels):
        for (variable, level), points in series.items():
            ax.plot(
                [p["lead_time_hours"] for p in points],
                [p[column] for p in points],
                "o-",
                ms=3,
                label=_label(variable, level),
            )
        ax.set_xlabel("lead time (hours)")
        ax.set_ylabel(column.upper())
        ax.grid(True, alpha=0.3)
        if column != "acc":
            ax.set_yscale("log")
    if series:
        axes[-1].legend(fontsize=6, ncol=1 + len(series) // 16, loc="best")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


# ------------------------------------------------------------------ maps
def _dim_named(da, names: tuple[str, ...]) -> str | None:
    for name in names:
        if name in da.dims:
            return name
    return None


def plot_field_map(
    store_path,
    variable: str,
    lead: int,
    path,
    level=None,
    init_time=None,
    member: int = 0,
    truth=None,
) -> Path:
    """A map of ``variable`` (at ``level`` for an upper-air variable) at forecast step ``lead``
    (1-based) of ``init_time`` (default: the first) read back from the forecast store
    ``store_path`` (``xarray.open_zarr``; either layout), saved as a PNG at ``path``; with
    ``truth`` (the true field, ``(latitude, longitude)`` as the store's), forecast, truth and
    error side by side (:func:`.maps.map_figure`); a grid finer than :data:`.maps.MAP_POINTS`
    is drawn from every k-th point (:func:`.maps.map_stride`)."""
    import matplotlib
    import xarray as xr

    from .maps import map_figure, map_stride
    from .store_layout import store_layout

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    ds = xr.open_zarr(store_path)
    layout = store_layout(None, ds.attrs)
    if variable not in ds.data_vars:
        raise ValueError(
            f"plot_field_map: {variable!r} is not in {store_path} (has {sorted(ds.data_vars)})"
        )
    da = ds[variable]
    n_leads = da.sizes[layout.lead_dim]
    if not 1 <= lead <= n_leads:
        raise ValueError(f"plot_field_map: lead {lead} outside 1..{n_leads}")
    da = da.isel({layout.lead_dim: lead - 1})
    init = layout.init_dim
    da = da.isel({init: 0}) if init_time is None else da.sel({init: np.datetime64(init_time)})
    if layout.member_dim in da.dims:
        da = da.isel({layout.member_dim: member})
    level_dim = _dim_named(da, ("level", "pressure_level", "plev"))
    if level_dim is not None:
        if level is None:
            raise ValueError(f"plot_field_map: {variable!r} has levels; pass level=")
        da = da.sel({level_dim: level})
    k = map_stride(da.sizes["latitude"], da.sizes["longitude"])
    da = da.isel(latitude=slice(None, None, k), longitude=slice(None, None, k))
    truth = None if truth is None else np.asarray(truth)[::k, ::k]
    hours = _hours(ds[layout.lead_dim].values[lead - 1])
    when = str(np.datetime_as_string(da[init].values, unit="h"))
    title = _label(variable, _level_value(level) if level_dim else None)
    fig, _ = map_figure(
        da.values,
        truth,
        latitude=da["latitude"].values,
        longitude=da["longitude"].values,
        title=f"{title}  init {when}  +{hours:g} h",
        units=da.attrs.get("units", ""),
    )
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def forecast_map(conf: dict, dataset, layout, store_path, position: int, lead: int, path):
    """The map the forecast command writes: the first output variable of ``dataset`` (its first
    level) at ``lead`` of the store's first initial time (dataset position ``position``),
    forecast, truth and error (the forecast alone where the dataset ends before the valid
    time), saved at ``path`` (``{name}``: the store's name of the variable); returns the path."""
    from .maps import truth_field

    name = [*dataset.upper_air_variables, *dataset.surface_variables][0]
    upper = bool(dataset.upper_air_variables)
    level = dataset.levels[0] if upper else None
    store_level = layout.levels[0] if upper and layout.levels is not None else level
    stored = layout.store_name(name)
    truth = truth_field(conf, name, level, position + lead)
    return plot_field_map(
        store_path,
        stored,
        lead,
        Path(str(path).format(name=stored)),
        level=store_level,
        truth=truth,
    )


# ------------------------------------------------------------------ climatology
def _clim_dataset(conf: dict, domain_shard, forecast_len: int):
    from ..data.dataset import ERA5Dataset

    d = conf["data"]
    time_slice = d.get("time_slice")
    return ERA5Dataset(
        d["path"],
        upper_air_variables=d.get("upper_air_variables", ()),
        # the diagnostic fields after the surface ones: the output channels' order, raw values
        surface_variables=[*d.get("surface_variables", ()), *d.get("diagnostic_variables", ())],
        levels=d.get("levels"),
        history_len=1,
        forecast_len=forecast_len,
        normalize=False,
        time_slice=tuple(time_slice) if isinstance(time_slice, list) else time_slice,
        domain_shard=domain_shard,
        reader=d.get("reader", "auto"),
    )


def _time_mean_from_dataset(conf: dict, domain_shard, block: int = 8) -> np.ndarray:
    """Mean over the training range of every channel at this rank's rows, each time read once:
    samples of ``block`` target times, the input of the first one adds time 0."""
    probe = _clim_dataset(conf, domain_shard, 1)
    n_times, channels = len(probe) + 1, probe.channels_per_step
    k = max(1, min(block, n_times - 1))
    ds = probe if k == 1 else _clim_dataset(conf, domain_shard, k)
    total = np.asarray(ds[0]["x"][:channels], dtype=np.float64).copy()
    covered = 0  # the last time index already summed
    starts = list(range(0, len(ds), k))
    if starts[-1] + k < n_times - 1:
        starts.append(len(ds) - 1)
    for s in starts:
        y = np.asarray(ds[s]["y"], dtype=np.float64).reshape(k, channels, *total.shape[1:])
        first_new = covered + 1 - (s + 1)  # y[j] is time s + 1 + j
        total += y[first_new:].sum(axis=0)
        covered = s + k
    del probe, ds
    # the datasets' read buffers sit in reference cycles: freed now, not whenever the cyclic
    # collector next runs (that left ~270 MiB per rank in a 0.1-degree forecast at domain 8)
    gc.collect()
    return total / n_times


def _time_mean_from_file(path, conf: dict, domain_shard) -> np.ndarray:
    """The climatology file's fields in the dataset's channel order and row order, this rank's
    rows: data variables named as the dataset's, dims ``([level,] latitude, longitude)``."""
    import xarray as xr

    from ..data.selection import tile_window
    from ..data.store import LAT_NAMES, LEVEL_NAMES

    path = Path(path)
    ds = xr.open_zarr(path) if path.is_dir() else xr.open_dataset(path)
    d = conf["data"]
    lat_dim = next(n for n in LAT_NAMES if n in ds.dims)
    ds = ds.sortby(lat_dim, ascending=False)  # north to south, as the dataset's rows
    parts = []
    names = [d.get(k, ()) for k in ("upper_air_variables", "surface_variables")]
    for name in [*names[0], *names[1], *d.get("diagnostic_variables", ())]:
        if name not in ds.data_vars:
            raise ValueError(f"climatology file {str(path)!r} has no variable {name!r}")
        da = ds[name]
        level_dim = next((n for n in LEVEL_NAMES if n in da.dims), None)
        if level_dim is not None:
            if d.get("levels") is not None:
                da = da.sel({level_dim: list(d["levels"])})
            parts.extend(np.asarray(da.transpose(level_dim, ...).values, dtype=np.float64))
        else:
            parts.append(np.asarray(da.values, dtype=np.float64))
    field = np.stack(parts)
    if domain_shard is not None:  # rows, or a lat x lon tile: rows x columns
        (a, b), columns = tile_window(None, domain_shard, field.shape[-2:])
        west, east = columns if columns is not None else (0, field.shape[-1])
        field = field[..., a:b, west:east]
    return field


def climatology(conf: dict, *, domain_shard=None, path=None) -> torch.Tensor:
    """The climatology of this rank's rows, ``(C, H_local, W)`` float64 in physical units, in
    the dataset's channel order: the time mean at each grid point of the training range
    (``data.time_slice``) of the store ``data.path``, read by rows (``domain_shard=(domain_rank,
    domain_size)``; None: the whole globe; ``(domain_rank, (P, Q))``: the rank's lat x lon tile),
    or the fields of the file ``path`` (zarr directory or netCDF; same variable names, dims
    ``([level,] latitude, longitude)``)."""
    if path is not None:
        return torch.from_numpy(_time_mean_from_file(path, conf, domain_shard))
    return torch.from_numpy(_time_mean_from_dataset(conf, domain_shard))
