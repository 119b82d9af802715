"""Counters of this rank's domain exchange traffic, opt-in: what the benchmarks read.

Inside ``with record_exchange_stats() as stats:`` every exchange (``exchange/halo.py``) adds its
calls, messages, bytes and seconds blocked to ``stats``; outside any such block nothing is
counted or timed, so production steps pay nothing for the counters.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from dataclasses import dataclass, field

__all__ = ["ExchangeStats", "active_recorder", "exchange_stats", "record_exchange_stats"]


def _directions(value):
    return {"forward": value, "backward": value}


@dataclass
class ExchangeStats:
    """Counters of domain P2P traffic on this rank (read by the benchmarks).

    ``p2p_calls``: batched posts (one ``batch_isend_irecv``, or on gloo each message posted
    once on the group: ``replay.py``); ``messages``: sends; ``bytes_sent`` (also split
    ``by_direction``); ``seconds``: time blocked in exchanges by direction (posting + waiting);
    ``overlapped_calls``: calls whose wait was deferred behind computation;
    ``statistics_bytes``: GroupNorm statistics sent inside halo exchanges (``norm_halo.py``),
    not counted in ``bytes_sent`` (which stays the halo rows).
    """

    p2p_calls: int = 0
    messages: int = 0
    bytes_sent: int = 0
    by_direction: dict = field(default_factory=lambda: _directions(0))
    seconds: dict = field(default_factory=lambda: _directions(0.0))
    overlapped_calls: int = 0
    statistics_bytes: int = 0

    def reset(self) -> None:
        self.p2p_calls = self.messages = self.bytes_sent = self.overlapped_calls = 0
        self.statistics_bytes = 0
        self.by_direction = _directions(0)
        self.seconds = _directions(0.0)


exchange_stats = ExchangeStats()  # what record_exchange_stats() fills by default
_recording: list[ExchangeStats] = []  # the innermost active recorder last; empty: not counted


@contextlib.contextmanager
def record_exchange_stats(stats: ExchangeStats | None = None) -> Iterator[ExchangeStats]:
    """Count this rank's exchanges inside the block into ``stats`` (default: the module's
    :data:`exchange_stats`), reset on entry; yields it.  Off outside any such block."""
    stats = exchange_stats if stats is None else stats
    stats.reset()
    _recording.append(stats)
    try:
        yield stats
    finally:
        _recording.remove(stats)


def active_recorder() -> ExchangeStats | None:
    """The innermost active recorder, or None (nothing is counted)."""
    return _recording[-1] if _recording else None
