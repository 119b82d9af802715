"""CREDIT's computed ``tisr`` source (``dataset_type: tisr``) for one rank's rows or tile.

miles-credit's gen-2 ``TISRDataset`` (``credit.datasets.gen_2.tisr``) reads no file: for each
time ``t`` it integrates the top-of-atmosphere incident solar radiation over
``(t - timestep, t]`` (``num_integration_steps`` trapezoids, J/m^2) at every point of a lat/lon
grid given by ``lat_spec`` / ``lon_spec`` (``[start, end, num_points]``, endpoints inclusive) or
read from ``latlon_grid_path``.  Every grid point is computed from its own latitude and
longitude only, so a domain rank computes its own rows (lat x lon tile) and nothing else:
:class:`TISRSource` builds the grid with miles-credit's own ``_get_latlon_grid``, keeps the
rank's rows and columns, and calls miles-credit's own ``_compute_tisr`` (with its CMIP6 total
solar irradiance table) on them, one latitude row at a time over the whole width (then keeps its columns).

Why a row at a time: CREDIT computes in float32, and the vectorised float32 sin / cos round a
point by its position in the flattened tensor, so the same point computed in a shard and in the
whole grid can differ by an ulp or two.  A row over the whole width is the same tensor whatever
the layout, so every layout (one process, rows, lat x lon tiles) gets bitwise the same field;
it equals CREDIT's whole-grid ``TISRDataset`` values to float32 rounding (<= 2 ulps,
``tests/test_tisr_source.py``).  miles-credit 2026.2.0 is needed (an error names it).

Not yet wired into the training data path: a gen-2 config with a ``tisr`` source is still
refused by ``layout/credit_gen2.py`` (several sources).
"""

from __future__ import annotations

import importlib
from dataclasses import dataclass

import pandas as pd
import torch

from ..domain.rows import shard_range

__all__ = ["TISRSource", "tisr_grid_rows"]

_MODULE = "credit.datasets.gen_2.tisr"


def _credit_tisr():
    try:
        return importlib.import_module(_MODULE)
    except ImportError as err:
        raise ValueError(
            f"data.source.<NAME>.dataset_type: tisr is computed by miles-credit's {_MODULE} "
            f"(pip install miles-credit==2026.2.0), which cannot be imported: {err}"
        ) from err


def tisr_grid_rows(
    height: int, width: int, shape: tuple[int, int], coords: tuple[int, int]
) -> tuple[tuple[int, int], tuple[int, int]]:
    """``((row start, stop), (column start, stop))`` of the tile ``coords`` = (lat, lon) of a
    ``shape`` = (P, Q) domain (``(n, 1)`` and ``(rank, 0)`` for latitude rows)."""
    (p, q), (lat, lon) = shape, coords
    return shard_range(height, p, lat), shard_range(width, q, lon)


def _check_source(name: str, source: dict) -> None:
    where = f"data.source.{name}"
    if source.get("dataset_type") != "tisr":
        raise ValueError(f"{where}.dataset_type must be 'tisr', got {source.get('dataset_type')!r}")
    forcing = ((source.get("variables") or {}).get("dynamic_forcing")) or {}
    names = forcing.get("vars_2D", forcing.get("var_2d"))
    if names != ["tisr"]:
        raise ValueError(
            f"{where}.variables.dynamic_forcing.vars_2D must be ['tisr'] (the only field "
            f"miles-credit's TISRDataset computes), got {names!r}"
        )
    has_path = source.get("latlon_grid_path") is not None
    has_spec = (source.get("lat_spec"), source.get("lon_spec")) != (None, None)
    if has_path == has_spec:
        raise ValueError(
            f"{where}: give exactly one grid, latlon_grid_path or lat_spec and lon_spec "
            f"(got latlon_grid_path={source.get('latlon_grid_path')!r}, "
            f"lat_spec={source.get('lat_spec')!r}, lon_spec={source.get('lon_spec')!r})"
        )


@dataclass(frozen=True)
class TISRSource:
    """This rank's rows of CREDIT's tisr source; see the module docstring.  Build it with
    :meth:`from_source`; :meth:`at` gives the ``(1, 1, rows, columns)`` float32 field at a time."""

    latitude: torch.Tensor  # (1, rows, width), degrees: the rank's rows of the grid
    longitude: torch.Tensor
    grid_shape: tuple[int, int]  # the whole grid
    rows: tuple[int, int]
    columns: tuple[int, int]
    integration_period: pd.Timedelta
    num_integration_steps: int
    tsi: tuple[torch.Tensor, torch.Tensor]  # CREDIT's CMIP6 total solar irradiance table

    @classmethod
    def from_source(
        cls,
        source: dict,
        timestep,
        *,
        name: str = "TISR",
        shape: tuple[int, int] = (1, 1),
        coords: tuple[int, int] = (0, 0),
    ) -> TISRSource:
        """The tile ``coords`` of a ``shape`` = (P, Q) domain (``(n, 1)`` / ``(rank, 0)``:
        latitude rows) of the source block ``data.source.<name>``; ``timestep`` is
        ``data.timestep``, the integration period (as CREDIT's ``self.dt``)."""
        _check_source(name, source)
        tisr = _credit_tisr()
        latitude, longitude = tisr._get_latlon_grid(
            path=source.get("latlon_grid_path"),
            lat_spec=source.get("lat_spec"),
            lon_spec=source.get("lon_spec"),
        )
        height, width = latitude.shape[-2:]
        (r0, r1), (c0, c1) = tisr_grid_rows(height, width, shape, coords)
        return cls(
            latitude[:, r0:r1].contiguous(),  # whole rows: see the module docstring
            longitude[:, r0:r1].contiguous(),
            (height, width),
            (r0, r1),
            (c0, c1),
            pd.Timedelta(timestep),
            int(source.get("num_integration_steps", 360)),
            tisr._cmip6_tsi_data(),
        )

    def at(self, time) -> torch.Tensor:
        """The tisr integrated over ``(time - timestep, time]`` at this rank's points, in
        CREDIT's sample layout ``(1, 1, rows, columns)`` (J/m^2, float32)."""
        compute = _credit_tisr()._compute_tisr
        time = pd.Timestamp(time)
        rows = [
            compute(
                time,
                self.integration_period,
                self.num_integration_steps,
                self.latitude[:, i : i + 1],
                self.longitude[:, i : i + 1],
                *self.tsi,
            )
            for i in range(self.latitude.shape[1])
        ]
        c0, c1 = self.columns
        field = torch.cat(rows, dim=0) if rows else self.latitude[0, :, :0]
        return field[:, c0:c1].unsqueeze(0).unsqueeze(0)
