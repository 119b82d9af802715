"""A small, deterministic ERA5-like zarr store with real atmospheric structure, for tests and demos.

``write_sample_dataset`` builds the fields analytically (no noise) on the ERA5 layout:

- grid: 33 x 64 at 5.625 degrees by default, latitude 90 .. -90 (descending, both poles present,
  row 0 is the north pole as in ERA5), longitude 0 .. 354.375 increasing eastward;
- time: 6-hourly from ``start``;
- upper-air variables on pressure levels, dims ``(time, level, latitude, longitude)``:
  ``Z`` geopotential (m2 s-2), ``T`` temperature (K), ``U`` / ``V`` wind (m s-1);
- surface variables, dims ``(time, latitude, longitude)``: ``SP`` surface pressure (Pa) and
  ``t2m`` 2-metre temperature (K).

Structure: a standard-atmosphere profile plus a meridional gradient (warm, high geopotential
at the equator); a wave pattern (zonal wavenumbers 1-5 with seeded amplitudes and phases, vanishing
at the poles) carried eastward by a zonal flow of angular speed ``zonal_angular_speed(lat, level)``
(a solid-body rotation plus a mid-latitude jet, faster aloft), so every latitude circle translates
rigidly; ``U`` is exactly the wind of that flow plus the geostrophic wind of the wave, ``V`` the
geostrophic wind of the wave; ``t2m`` adds a diurnal cycle that follows the sun (clipped cosine of
the solar zenith angle with a 3-hour lag, seasonal declination included).  Everything is a
deterministic function of ``seed``.

Dynamic forcing and static fields (for ``data.dynamic_forcing_variables`` /
``data.static_variables``; configs that do not list them never read them):

- ``tsi``, dims ``(time, latitude, longitude)``: top-of-atmosphere incoming solar radiation (W m-2),
  the solar constant times the clipped cosine of the solar zenith angle at that time (no lag): it
  drives ``t2m``'s diurnal cycle three hours later, so a model sees the cause of the cycle;
- ``orography``, dims ``(latitude, longitude)``: an analytic surface height (m, seeded
  independently of the flow so the other fields do not change), two smooth "mountain ranges";
- ``land_sea_mask``, dims ``(latitude, longitude)``: 1 where ``orography`` > 0, else 0.

Normalisation statistics (per variable and level mean / std over time, latitude and longitude,
unweighted, ddof 0) are written as a SECOND zarr store at ``default_stats_path(path)``
(``<name>_stats.zarr`` beside the data); see ``credit_parallel.data.dataset`` for its layout.
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path

import numpy as np
import xarray as xr

from .store import compute_normalization_stats, default_stats_path

__all__ = [
    "SAMPLE_FORCING_VARIABLES",
    "SAMPLE_STATIC_VARIABLES",
    "SAMPLE_SURFACE_VARIABLES",
    "SAMPLE_UPPER_AIR_VARIABLES",
    "write_sample_dataset",
    "zonal_angular_speed",
]

SAMPLE_UPPER_AIR_VARIABLES = ("Z", "T", "U", "V")
SAMPLE_SURFACE_VARIABLES = ("SP", "t2m")
SAMPLE_FORCING_VARIABLES = ("tsi",)
SAMPLE_STATIC_VARIABLES = ("orography", "land_sea_mask")

_EARTH_RADIUS_M = 6.371e6
_GRAVITY = 9.80665
_CORIOLIS_F0 = 1.0e-4  # constant f: geostrophic winds without the equatorial singularity
_SURFACE_LEVEL_HPA = 1000.0  # surface fields are carried by the 1000 hPa flow
_TIME_STEP_HOURS = 6
_MAX_WAVENUMBER = 5
_SOLAR_CONSTANT = 1361.0  # W m-2


def zonal_angular_speed(lat_degrees, level_hpa: float) -> np.ndarray:
    """Eastward angular speed (degrees of longitude per hour) of the sample flow.

    A solid-body rotation (0.2 deg/h) plus a jet centred on 45 N/S (1.3 deg/h at its core), scaled
    by height: 1.0 at 500 hPa, about 0.6 at 850 hPa, about 0.4 at 1000 hPa.  Every pattern on a
    latitude circle of the sample store moves east by exactly this much per hour.
    """
    lat = np.asarray(lat_degrees, dtype=np.float64)
    jet = np.exp(-(((np.abs(lat) - 45.0) / 12.0) ** 2))
    height_scale = 0.4 + 1.2 * (1.0 - float(level_hpa) / 1013.25)
    return height_scale * (0.2 + 1.3 * jet)


def _standard_height_m(level_hpa: float) -> float:
    return 44330.8 * (1.0 - (level_hpa / 1013.25) ** 0.190263)


def _standard_temperature_k(level_hpa: float) -> float:
    return 288.15 * (level_hpa / 1013.25) ** 0.190263


def _wave_pattern(rng, lat_rad, lon_rad, shift_rad):
    """Seeded sum of zonal wavenumbers, rigidly shifted east by ``shift_rad`` (time, lat).

    Returns the pattern and its longitude derivative, dims (time, lat, lon); the envelope has a
    cos^2(lat) factor so the pattern (and its winds) vanish at the poles.
    """
    amplitudes = rng.uniform(0.5, 1.0, _MAX_WAVENUMBER) / np.arange(1, _MAX_WAVENUMBER + 1) ** 0.7
    phases = rng.uniform(0.0, 2.0 * np.pi, _MAX_WAVENUMBER)
    tilt = rng.uniform(-1.0, 1.0)  # phase change across latitude: waves lean SW-NE or NW-SE
    envelope = np.cos(lat_rad) ** 2 * (0.3 + np.exp(-(((np.abs(lat_rad) - np.pi / 4) / 0.4) ** 2)))
    # sum_k a_k cos(k (lon - shift) + phase_k + tilt lat) as the real part of a complex matrix
    # product: (time, lat, k) coefficients times (k, lon) zonal harmonics
    wavenumbers = np.arange(1, _MAX_WAVENUMBER + 1)
    coefficients = amplitudes * np.exp(
        1j * (phases + tilt * lat_rad[None, :, None] - wavenumbers * shift_rad[:, :, None])
    )
    harmonics = np.exp(1j * wavenumbers[:, None] * lon_rad[None, :])
    pattern = (coefficients @ harmonics).real
    d_pattern = ((1j * wavenumbers * coefficients) @ harmonics).real
    scale = envelope[None, :, None] / amplitudes.sum()
    return pattern * scale, d_pattern * scale


def _cos_solar_zenith(times: np.ndarray, lat_rad, lon_deg, lag_hours: float) -> np.ndarray:
    """Cosine of the solar zenith angle (time, lat, lon), evaluated ``lag_hours`` earlier."""
    hours = (times - times.astype("datetime64[D]")).astype("timedelta64[s]").astype(
        np.float64
    ) / 3600.0
    day_of_year = (
        times.astype("datetime64[D]") - times.astype("datetime64[Y]").astype("datetime64[D]")
    ).astype(np.float64)
    declination = np.deg2rad(-23.44) * np.cos(2.0 * np.pi * (day_of_year + 10.0) / 365.0)
    solar_time = (hours - lag_hours)[:, None] + lon_deg[None, :] / 15.0  # local solar hours
    hour_angle = 2.0 * np.pi * (solar_time - 12.0) / 24.0
    sin_lat, cos_lat = np.sin(lat_rad), np.cos(lat_rad)
    return (
        sin_lat[None, :, None] * np.sin(declination)[:, None, None]
        + cos_lat[None, :, None] * np.cos(declination)[:, None, None] * np.cos(hour_angle)[:, None]
    )


def _upper_air_fields(rng, level, lat, lon, hours):
    lat_rad, lon_rad = np.deg2rad(lat), np.deg2rad(lon)
    speed = zonal_angular_speed(lat, level)  # deg/h
    shift = np.deg2rad(speed[None, :] * hours[:, None])  # (time, lat)
    wave, d_wave_dlon = _wave_pattern(rng, lat_rad, lon_rad, shift)
    height = _standard_height_m(level)
    # geopotential: standard height, higher at the equator, wave of ~ 2-3 % of the height
    wave_geopotential = _GRAVITY * (60.0 + 0.02 * height) * wave
    d_geopotential_dlon = _GRAVITY * (60.0 + 0.02 * height) * d_wave_dlon
    meridional = np.cos(lat_rad) ** 2 - 0.5
    z = _GRAVITY * (height + 0.11 * height * meridional)[None, :, None] + wave_geopotential
    t = (_standard_temperature_k(level) + 32.0 * meridional)[None, :, None] + 6.0 * wave
    # geostrophic wind of the wave (constant f): u' = -dPhi/dy / f, v' = dPhi/dx / f
    d_geopotential_dlat = np.gradient(wave_geopotential, lat_rad, axis=1)
    # the grid's edge rows are the poles, where the cos^2 envelope makes the exact derivative 0;
    # the one-sided difference there would invent a longitude-dependent wind at a single point
    d_geopotential_dlat[:, [0, -1]] = 0.0
    u_wave = -d_geopotential_dlat / (_CORIOLIS_F0 * _EARTH_RADIUS_M)
    v = d_geopotential_dlon / (_CORIOLIS_F0 * _EARTH_RADIUS_M)
    # the zonal wind that turns the latitude circle at ``speed`` (zero at the poles)
    u_flow = np.deg2rad(speed) / 3600.0 * _EARTH_RADIUS_M * np.cos(lat_rad)
    u = u_flow[None, :, None] + u_wave
    return {"Z": z, "T": t, "U": u, "V": v}


def _surface_fields(rng, times, lat, lon, hours):
    lat_rad, lon_rad = np.deg2rad(lat), np.deg2rad(lon)
    shift = np.deg2rad(zonal_angular_speed(lat, _SURFACE_LEVEL_HPA)[None, :] * hours[:, None])
    wave, _ = _wave_pattern(rng, lat_rad, lon_rad, shift)
    # subtropical highs near 30 and subpolar lows near 60 degrees
    belts = 800.0 * np.cos(np.deg2rad(3.0 * np.abs(lat))) * np.cos(lat_rad)
    sp = (101325.0 + belts)[None, :, None] + 1500.0 * wave
    sun = np.clip(_cos_solar_zenith(times, lat_rad, lon, lag_hours=3.0), 0.0, None)
    t2m = (288.0 - 45.0 * np.sin(lat_rad) ** 2)[None, :, None] + 4.0 * wave + 12.0 * sun
    return {"SP": sp, "t2m": t2m}


def _forcing_and_static(times, lat, lon) -> dict:
    """``tsi`` (time, lat, lon) and the static ``orography`` / ``land_sea_mask`` (lat, lon)."""
    lat_rad = np.deg2rad(lat)
    sun = np.clip(_cos_solar_zenith(times, lat_rad, lon, lag_hours=0.0), 0.0, None)
    lon_rad = np.deg2rad(lon)[None, :]
    ridge = np.exp(-(((lat[:, None] - 40.0) / 15.0) ** 2)) * np.cos(lon_rad - 1.0) ** 2
    plateau = np.exp(-(((lat[:, None] + 20.0) / 20.0) ** 2)) * np.cos(2.0 * lon_rad + 0.5)
    orography = 2500.0 * ridge + 1200.0 * plateau - 300.0
    return {
        "tsi": _SOLAR_CONSTANT * sun,
        "orography": orography,
        "land_sea_mask": (orography > 0.0).astype(np.float64),
    }


def _encoding(ds: xr.Dataset, chunk: int, rows: int, compress: bool) -> dict:
    """Chunks of ``chunk`` time steps and ``rows`` latitude rows (all longitudes) per variable."""
    nlon = ds.sizes["longitude"]
    encoding = {
        name: {"chunks": (chunk, *ds[name].shape[1:-2], rows, nlon)}
        for name in ds.data_vars
        if "time" in ds[name].dims
    }
    encoding.update({name: {"chunks": (rows, nlon)} for name in SAMPLE_STATIC_VARIABLES})
    if not compress:
        for name in ds.data_vars:
            encoding[name]["compressors"] = None
    return encoding


def _checked_arguments(n_times, nlat, nlon, time_chunk, lat_chunk, levels) -> tuple[float, ...]:
    """``write_sample_dataset``'s sizes checked (integers >= their minimum) and its levels as
    distinct pressures in hPa; the levels as floats."""
    for name, value, minimum in (
        ("n_times", n_times, 1),
        ("nlat", nlat, 2),
        ("nlon", nlon, 1),
        ("time_chunk", time_chunk, 1),
        ("lat_chunk", nlat if lat_chunk is None else lat_chunk, 1),
    ):
        if isinstance(value, bool) or not isinstance(value, int | np.integer) or value < minimum:
            raise ValueError(
                f"write_sample_dataset: {name} must be an integer >= {minimum}, got {value!r}"
            )
    levels = tuple(float(level) for level in levels)
    if not levels or any(not 0.0 < level <= 1100.0 for level in levels):
        raise ValueError(
            f"write_sample_dataset: levels must be pressures in hPa in (0, 1100], got {levels!r}"
        )
    if len(set(levels)) != len(levels):
        raise ValueError(f"write_sample_dataset: levels must be distinct, got {levels!r}")
    return levels


def _sample_fields(n_times, nlat, nlon, levels, seed: int, start: str) -> xr.Dataset:
    """The sample store's variables, coordinates and units (see :func:`write_sample_dataset`)."""
    lat = np.linspace(90.0, -90.0, nlat)
    lon = np.arange(nlon) * (360.0 / nlon)
    times = np.datetime64(start, "h") + np.arange(n_times) * np.timedelta64(_TIME_STEP_HOURS, "h")
    times = times.astype("datetime64[ns]")
    hours = np.arange(n_times, dtype=np.float64) * _TIME_STEP_HOURS

    # one stream for everything, consumed in a fixed order: deterministic by seed
    rng = np.random.default_rng(seed)
    per_level = [_upper_air_fields(rng, level, lat, lon, hours) for level in levels]
    surface = _surface_fields(rng, times, lat, lon, hours)

    data_vars = {}
    for name in SAMPLE_UPPER_AIR_VARIABLES:
        stacked = np.stack([fields[name] for fields in per_level], axis=1).astype(np.float32)
        data_vars[name] = (("time", "level", "latitude", "longitude"), stacked)
    for name in SAMPLE_SURFACE_VARIABLES:
        data_vars[name] = (("time", "latitude", "longitude"), surface[name].astype(np.float32))
    extra = _forcing_and_static(times, lat, lon)
    data_vars["tsi"] = (("time", "latitude", "longitude"), extra["tsi"].astype(np.float32))
    for name in SAMPLE_STATIC_VARIABLES:
        data_vars[name] = (("latitude", "longitude"), extra[name].astype(np.float32))
    ds = xr.Dataset(
        data_vars,
        coords={
            "time": times,
            "level": np.asarray(levels),
            "latitude": lat,
            "longitude": lon,
        },
        attrs={
            "title": "credit-parallel synthetic ERA5-like sample",
            "seed": int(seed),
            "stats_store": "separate zarr store, see credit_parallel.data.default_stats_path",
        },
    )
    units = {"Z": "m2 s-2", "T": "K", "U": "m s-1", "V": "m s-1", "SP": "Pa", "t2m": "K"}
    units.update({"tsi": "W m-2", "orography": "m", "land_sea_mask": "1"})
    for name, unit in units.items():
        ds[name].attrs["units"] = unit
    ds["level"].attrs["units"] = "hPa"
    return ds


def write_sample_dataset(
    path,
    n_times: int = 64,
    nlat: int = 33,
    nlon: int = 64,
    levels: Sequence[float] = (500, 850),
    seed: int = 0,
    *,
    start: str = "2020-01-01T00:00",
    stats_path=None,
    time_chunk: int = 32,
    lat_chunk: int | None = None,
    compress: bool = True,
) -> Path:
    """Write the sample store to ``path`` (overwritten) and its statistics; return ``Path(path)``.

    ``nlat`` latitudes from 90 to -90 inclusive (so ``nlat`` >= 2 and both poles are rows),
    ``nlon`` longitudes from 0 eastward at spacing 360/nlon, ``n_times`` 6-hourly steps from
    ``start``, ``levels`` pressure levels in hPa (coordinate ``level``).  Statistics go to
    ``stats_path`` (default ``default_stats_path(path)``).  Float32 data, chunked
    ``time_chunk`` steps at a time and ``lat_chunk`` latitude rows at a time (default: all rows,
    one chunk per time block, as ERA5 stores usually are).  ``compress=False`` stores chunks
    uncompressed, so the bytes read from the store equal the decoded bytes (what a test of
    "bytes read per rank" measures exactly); row chunks let a domain rank fetch only its rows.
    """
    levels = _checked_arguments(n_times, nlat, nlon, time_chunk, lat_chunk, levels)
    ds = _sample_fields(n_times, nlat, nlon, levels, seed, start)

    path = Path(path)
    rows = nlat if lat_chunk is None else min(lat_chunk, nlat)
    encoding = _encoding(ds, min(time_chunk, n_times), rows, compress)
    ds.to_zarr(path, mode="w", encoding=encoding, consolidated=False)
    stats = compute_normalization_stats(ds)
    stats.to_zarr(
        default_stats_path(path) if stats_path is None else Path(stats_path),
        mode="w",
        consolidated=False,
    )
    return path
