"""How the forecast store names things: the default layout (the dataset's names, SPEC §7) or the
layout WeatherBench 2 evaluates without renaming (``--layout weatherbench2``).

============  =========================  ===========================================
              ``default``                ``weatherbench2``
============  =========================  ===========================================
dims          ``init_time, [member,]``   ``time, [number,] prediction_timedelta,``
              ``lead_time, [level,]``    ``[level,] latitude, longitude``
              ``latitude, longitude``
variables     the dataset's names        ERA5's long names (:data:`ERA5_LONG_NAMES`:
                                         ``T`` -> ``temperature``, ``t2m`` ->
                                         ``2m_temperature``, ``Z500`` ->
                                         ``geopotential_500``, ...); a name not in the
                                         table is kept
levels        the dataset's values       pressure in hPa (integers when whole), from
                                         the level coordinate's units (``hPa``,
                                         ``millibars``, ``Pa``) or its name
                                         (``pressure_level``, ``isobaricInhPa``);
                                         anything else (model levels, no units) is
                                         refused: WeatherBench 2 scores pressure levels
============  =========================  ===========================================

WeatherBench 2's conventions (``weatherbench2/evaluation.py``, ``schema.py``,
``scripts/evaluate.py``): the forecast's initial time is ``time`` and its lead
``prediction_timedelta`` (``schema.apply_time_conventions`` renames them to ``init_time`` /
``lead_time`` with ``by_init=True``); the ensemble dimension is ``number`` (``--ensemble_dim``'s
default); ``level`` in hPa; ``latitude`` / ``longitude`` in degrees, in either latitude order
(``make_latitude_increasing`` flips a north-to-south store on opening; the store keeps the
dataset's order so that every rank's rows stay one block). A single-level field named with its
pressure (``Z500``) becomes ``geopotential_500``, WeatherBench 2's suffix form
(``pressure_level_suffixes=True`` folds it into ``level``).

Pure functions of names and coordinates: no store is touched here.
"""

from __future__ import annotations

import re
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field

import numpy as np

__all__ = [
    "ERA5_LONG_NAMES",
    "LAYOUTS",
    "StoreLayout",
    "era5_long_name",
    "layout_for_dataset",
    "pressure_levels_hpa",
    "store_layout",
]

LAYOUTS = ("default", "weatherbench2")

# CREDIT's (and ERA5's GRIB) short names -> ERA5's long names as WeatherBench 2's ERA5 stores
# spell them; looked up case-insensitively
ERA5_LONG_NAMES = {
    # on pressure levels
    "z": "geopotential",
    "t": "temperature",
    "u": "u_component_of_wind",
    "v": "v_component_of_wind",
    "q": "specific_humidity",
    "w": "vertical_velocity",
    "r": "relative_humidity",
    "rh": "relative_humidity",
    "vo": "vorticity",
    "d": "divergence",
    "pv": "potential_vorticity",
    "clwc": "specific_cloud_liquid_water_content",
    "ciwc": "specific_cloud_ice_water_content",
    "cc": "fraction_of_cloud_cover",
    # single level
    "t2m": "2m_temperature",
    "2t": "2m_temperature",
    "var_2t": "2m_temperature",
    "d2m": "2m_dewpoint_temperature",
    "2d": "2m_dewpoint_temperature",
    "var_2d": "2m_dewpoint_temperature",
    "u10": "10m_u_component_of_wind",
    "10u": "10m_u_component_of_wind",
    "var_10u": "10m_u_component_of_wind",
    "v10": "10m_v_component_of_wind",
    "10v": "10m_v_component_of_wind",
    "var_10v": "10m_v_component_of_wind",
    "u100": "100m_u_component_of_wind",
    "100u": "100m_u_component_of_wind",
    "v100": "100m_v_component_of_wind",
    "100v": "100m_v_component_of_wind",
    "msl": "mean_sea_level_pressure",
    "mslp": "mean_sea_level_pressure",
    "sp": "surface_pressure",
    "tp": "total_precipitation",
    "tcwv": "total_column_water_vapour",
    "tcw": "total_column_water",
    "sst": "sea_surface_temperature",
    "skt": "skin_temperature",
    "tsi": "toa_incident_solar_radiation",
    "tisr": "toa_incident_solar_radiation",
    "lsm": "land_sea_mask",
    "z_gds4_sfc": "geopotential_at_surface",
}

# the units a level coordinate states pressure in, as the factor to hPa
_PRESSURE_UNITS = {"hpa": 1.0, "millibars": 1.0, "millibar": 1.0, "mbar": 1.0, "mb": 1.0}
_PRESSURE_UNITS["pa"] = 0.01
_PRESSURE_DIMS = ("pressure_level", "isobaricinhpa")  # ERA5 (CDS) and GRIB: always hPa
_SUFFIXED = re.compile(r"([A-Za-z]+)(\d+)")
# the long names a single-level field at a pressure can be (``Z500``)
_UPPER_AIR = frozenset(ERA5_LONG_NAMES[k] for k in ("z", "t", "u", "v", "q", "w", "r", "vo", "d"))


def era5_long_name(name: str) -> str:
    """ERA5's long name of a CREDIT / ERA5 short name (``T`` -> ``temperature``), the suffix form
    of a single-level field at a pressure (``Z500`` -> ``geopotential_500``), else ``name``."""
    long = ERA5_LONG_NAMES.get(name.lower())
    if long is not None:
        return long
    match = _SUFFIXED.fullmatch(name)
    if match is not None:
        base = ERA5_LONG_NAMES.get(match.group(1).lower())
        pressure = int(match.group(2))
        if base is not None and base in _UPPER_AIR and 0 < pressure <= 1100:
            return f"{base}_{pressure}"
    return name


def pressure_levels_hpa(levels: Sequence[float], dim: str, units: str) -> np.ndarray:
    """The levels as pressures in hPa (int64 when all whole, as WeatherBench 2's ERA5), from the
    level coordinate ``dim``'s ``units`` or, without units, its name; ``ValueError`` for levels
    that are not pressures (model levels, or no way to tell)."""
    factor = _PRESSURE_UNITS.get(units.strip().lower())
    if factor is None and not units.strip() and dim.lower() in _PRESSURE_DIMS:
        factor = 1.0
    if factor is None:
        raise ValueError(
            f"--layout weatherbench2: the dataset's level coordinate {dim!r} (units "
            f"{units!r}) is not pressure in hPa or Pa (model levels?); WeatherBench 2 scores "
            "pressure levels: interpolate to pressure levels first, set the coordinate's units "
            "attribute to 'hPa' if they are pressures, or use the default layout"
        )
    hpa = np.asarray(levels, dtype=np.float64) * factor
    whole = np.round(hpa)
    return whole.astype(np.int64) if np.allclose(hpa, whole, rtol=0, atol=1e-9) else hpa


@dataclass(frozen=True)
class StoreLayout:
    """The store's dimension names, its variable names (dataset name -> store name; absent:
    unchanged) and its level coordinate (None: the dataset's levels)."""

    name: str = "default"
    init_dim: str = "init_time"
    member_dim: str = "member"
    lead_dim: str = "lead_time"
    names: Mapping[str, str] = field(default_factory=dict)
    levels: np.ndarray | None = None

    def store_name(self, name: str) -> str:
        return self.names.get(name, name)

    def lead_dims(self, members: int) -> tuple[str, ...]:
        """The leading dims of a data variable: (init, [member,] lead)."""
        if members > 1:
            return (self.init_dim, self.member_dim, self.lead_dim)
        return (self.init_dim, self.lead_dim)


WEATHERBENCH2 = {"init_dim": "time", "member_dim": "number", "lead_dim": "prediction_timedelta"}


def store_layout(name: str | None, attrs: Mapping | None = None) -> StoreLayout:
    """The dims of layout ``name`` (None: the one a store's root ``attrs`` name, default
    without one), for reading a store back; variable names and levels are the store's own."""
    if name is None:
        name = (attrs or {}).get("layout", "default")
    if name not in LAYOUTS:
        raise ValueError(f"--layout {name!r} is not one of {list(LAYOUTS)}")
    return StoreLayout(name, **WEATHERBENCH2) if name == "weatherbench2" else StoreLayout()


def layout_for_dataset(
    name: str | None,
    variables: Sequence[str],
    levels: Sequence[float] = (),
    level_coordinate: tuple[str, str] | None = None,
) -> StoreLayout:
    """The layout ``name`` of a forecast of the dataset variables ``variables`` on ``levels``
    (``level_coordinate``: the level dim's name and units, None without upper-air variables);
    ``ValueError`` (one line, naming ``--layout``) for levels that are not pressures or two
    variables that would get one name."""
    base = store_layout(name or "default")
    if base.name == "default":
        return base
    names = {v: era5_long_name(v) for v in variables}
    seen: dict[str, str] = {}
    for short, long in names.items():
        if long in seen:
            raise ValueError(
                f"--layout weatherbench2: data variables {seen[long]!r} and {short!r} both "
                f"become {long!r}; forecast one of them, or use the default layout"
            )
        seen[long] = short
    hpa = None
    if level_coordinate is not None and len(levels):
        hpa = pressure_levels_hpa(levels, *level_coordinate)
    return StoreLayout(base.name, **WEATHERBENCH2, names=names, levels=hpa)
