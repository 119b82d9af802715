"""The forecast's host allocator: glibc's mmap threshold fixed for the forecast's worker
processes (:func:`fix_mmap_threshold`; ``forecast/command.py``'s ``main`` and the benchmark's
ranks call it, not ``run_forecast``, whose caller's own process keeps its allocator), so every
field-sized buffer is its own mapping, returned to the system when freed (glibc's default
threshold rises to 32 MiB after the first large free, and a domain rank's 13-40 MB fields then
fragment the heap: docs/performance.md "0.1 degrees under domain 8")."""

from __future__ import annotations

import os

__all__ = ["MMAP_THRESHOLD", "TRIM_THRESHOLD", "fix_mmap_threshold"]

# glibc's mmap threshold during a forecast (bytes; fix_mmap_threshold)
MMAP_THRESHOLD = 1 << 20
_M_TRIM_THRESHOLD, _M_MMAP_THRESHOLD = -1, -3  # glibc's mallopt parameter numbers
TRIM_THRESHOLD = 128 * 1024  # glibc's default, which its dynamic threshold may have raised


def fix_mmap_threshold(threshold: int = MMAP_THRESHOLD, environ=None) -> int | None:
    """Fix glibc's mmap threshold at ``threshold`` bytes (``mallopt(M_MMAP_THRESHOLD)``, which
    also stops glibc raising it after each large free) and its trim threshold at glibc's default:
    allocations of ``threshold`` or more are mapped and unmapped on their own instead of
    fragmenting the heap.  Each is left alone where the user declared it
    (``MALLOC_MMAP_THRESHOLD_`` / ``MALLOC_TRIM_THRESHOLD_`` or ``GLIBC_TUNABLES``'
    ``mmap_threshold`` / ``trim_threshold`` in ``environ``, default ``os.environ``); nothing off
    glibc.  Returns the mmap threshold set, else None."""
    import ctypes

    environ = os.environ if environ is None else environ
    tunables = environ.get("GLIBC_TUNABLES", "")
    if "MALLOC_MMAP_THRESHOLD_" in environ or "mmap_threshold" in tunables:
        return None
    try:
        mallopt = ctypes.CDLL(None).mallopt
    except (OSError, AttributeError):
        return None
    if mallopt(_M_MMAP_THRESHOLD, int(threshold)) != 1:
        return None
    # the free heap top each arena keeps: back to glibc's default (a large free before this
    # raised it to twice the old threshold, up to 64 MiB per arena), unless declared
    if "MALLOC_TRIM_THRESHOLD_" not in environ and "trim_threshold" not in tunables:
        mallopt(_M_TRIM_THRESHOLD, TRIM_THRESHOLD)
    return threshold
