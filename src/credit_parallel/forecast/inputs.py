"""What a forecast starts from, checked before anything is written: the initial times (listed or
a range), their history and dynamic forcing in the dataset, the lead times, ``--parallelism``.

Every check raises ``ValueError`` with one line naming the flag and the value, so the command
stops before the store exists (no partial output).  Pure functions of the dataset's time axis.
"""

from __future__ import annotations

import re
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

__all__ = [
    "ForecastTimes",
    "parse_parallelism_flag",
    "parse_step",
    "resolve_init_times",
]


def _fmt(t) -> str:
    return str(np.datetime64(t, "m"))


def parse_step(text: str) -> np.timedelta64:
    """``--init-range``'s STEP: hours (``12``), or a number with a unit (``6h``, ``1d``)."""
    match = re.fullmatch(r"\s*(\d+)\s*([hd]?)\s*", str(text))
    if match is None or int(match.group(1)) < 1:
        raise ValueError(
            f"--init-range STEP {text!r} must be a positive whole number of hours (12, 6h) or "
            "days (1d)"
        )
    hours = int(match.group(1)) * (24 if match.group(2) == "d" else 1)
    return np.timedelta64(hours, "h")


def _as_time(text: str, flag: str) -> np.datetime64:
    try:
        return np.datetime64(text, "ns")
    except ValueError:
        raise ValueError(f"{flag} {text!r} is not an ISO time (2020-01-05T12)") from None


@dataclass(frozen=True)
class ForecastTimes:
    """The initial times of a forecast as positions on the dataset's time axis, and its leads.

    ``positions[i]``: the dataset position of initial time ``init_times[i]``;
    ``lead_times``: ``k * step`` for ``k = 1 .. steps``; ``truth_steps[i]``: how many leads of
    initial time ``i`` have a truth in the dataset (scores stop there)."""

    init_times: np.ndarray
    positions: tuple[int, ...]
    lead_times: np.ndarray
    truth_steps: tuple[int, ...]

    @property
    def scored_to(self) -> int:
        return max(self.truth_steps) if self.truth_steps else 0


def resolve_init_times(
    times: np.ndarray,
    *,
    init_times: Sequence[str] | None,
    init_range: Sequence[str] | None,
    steps: int,
    history_len: int,
    needs_forcing: bool,
) -> ForecastTimes:
    """Check the initial times against the dataset's ``times`` (datetime64, evenly spaced) and
    return them; ``ValueError`` (one line) for a time the dataset does not hold, one without
    ``history_len - 1`` earlier times, or (``needs_forcing``) one whose dynamic forcing stops
    before lead ``steps``."""
    times = np.asarray(times, dtype="datetime64[ns]")
    if isinstance(steps, bool) or not isinstance(steps, int) or steps < 1:
        raise ValueError(f"--steps must be an integer >= 1, got {steps!r}")
    if (init_times is None) == (init_range is None):
        raise ValueError("give the initial times with --init-times T [T ...] or --init-range")
    if times.size < 2:
        raise ValueError("the dataset holds fewer than 2 times; nothing to forecast from")
    spacing = times[1] - times[0]
    span = f"the dataset holds {_fmt(times[0])} .. {_fmt(times[-1])} every {_hours(spacing)} h"
    if init_range is not None:
        start, end = (_as_time(v, "--init-range") for v in init_range[:2])
        step = parse_step(init_range[2])
        if end < start:
            raise ValueError(f"--init-range END {_fmt(end)} is before START {_fmt(start)}")
        wanted = np.arange(start, end + np.timedelta64(1, "s"), step).astype("datetime64[ns]")
    else:
        wanted = np.array([_as_time(v, "--init-times") for v in init_times], "datetime64[ns]")
    if wanted.size == 0:
        raise ValueError("no initial times given")
    if np.unique(wanted).size != wanted.size:
        raise ValueError("--init-times lists an initial time twice")
    index = {t: i for i, t in enumerate(times.tolist())}
    positions, truth = [], []
    for t in wanted:
        p = index.get(t.astype("datetime64[ns]").tolist())
        if p is None:
            raise ValueError(f"initial time {_fmt(t)} is not a time of the dataset ({span})")
        if p < history_len - 1:
            raise ValueError(
                f"initial time {_fmt(t)} has no history: data.history_len {history_len} needs "
                f"{history_len - 1} earlier time(s) ({span})"
            )
        available = times.size - 1 - p  # later times in the dataset
        if needs_forcing and available < steps - 1:
            raise ValueError(
                f"initial time {_fmt(t)}: no dynamic forcing for lead {available + 2} of "
                f"--steps {steps} (valid time "
                f"{_fmt(times[-1] + spacing)} is beyond the dataset; {span})"
            )
        positions.append(p)
        truth.append(min(steps, available))
    return ForecastTimes(wanted, tuple(positions), np.arange(1, steps + 1) * spacing, tuple(truth))


def _hours(delta: np.timedelta64) -> float:
    return float(delta / np.timedelta64(1, "h"))


def _positive(key: str, value: str) -> int:
    if not value.isdigit() or int(value) < 1:
        raise ValueError(f"--parallelism {key}={value!r} must be a positive integer")
    return int(value)


def _domain_pair(value: str) -> dict:
    """``PxQ`` (``2x4``) as ``{"lat": P, "lon": Q}``."""
    lat, _, lon = (v.strip() for v in value.lower().partition("x"))
    if not (lat.isdigit() and lon.isdigit() and int(lat) >= 1 and int(lon) >= 1):
        raise ValueError(
            f"--parallelism domain={value!r} must be PxQ with positive integers P (latitude) "
            "and Q (longitude), e.g. 2x2"
        )
    return {"lat": int(lat), "lon": int(lon)}


def parse_parallelism_flag(text: str) -> dict:
    """``--parallelism data=fsdp2,tensor=2,domain=4`` as a ``trainer.parallelism`` block.

    A two-dimensional domain (SPEC §3b) is ``domain=PxQ`` (SPEC §7) or, the same,
    ``lat=P,lon=Q``; either becomes ``domain: {lat: P, lon: Q}`` (``domain=Px1`` is the
    latitude-only domain P, as in the config)."""
    block: dict = {}
    pair: dict = {}  # lat=P,lon=Q
    usage = "expected data=MODE,tensor=T,domain=N (or domain=PxQ, or lat=P,lon=Q)"
    for part in str(text).split(","):
        key, sep, value = part.partition("=")
        key, value = key.strip(), value.strip()
        if not sep or key not in ("data", "tensor", "domain", "lat", "lon") or not value:
            raise ValueError(f"--parallelism {text!r}: {usage} (got {part!r})")
        if key in block or key in pair:
            raise ValueError(f"--parallelism {text!r}: {key} is given twice")
        if key == "data":
            block[key] = value
        elif key in ("lat", "lon"):
            pair[key] = _positive(key, value)
        elif key == "domain" and "x" in value.lower():
            block[key] = _domain_pair(value)
        else:
            block[key] = _positive(key, value)
    if pair:
        if "domain" in block:
            raise ValueError(
                f"--parallelism {text!r}: give domain=N, domain=PxQ or lat=P,lon=Q, not two of them"
            )
        if len(pair) != 2:
            raise ValueError(f"--parallelism {text!r}: lat=P needs lon=Q and lon=Q needs lat=P")
        block["domain"] = pair
    return block
