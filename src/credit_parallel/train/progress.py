"""Rank 0's report of a long run: a tqdm bar on a terminal, plain lines otherwise (a
carriage-return bar in a batch job's log is one unreadable line per run).  ``train`` and
``forecast`` each say what a step shows; the bar, the plain lines and their switch are here."""

from __future__ import annotations

__all__ = ["RankZeroReport"]


class RankZeroReport:
    """``enabled``: this rank reports (rank 0); the bar only when ``stream`` is a terminal.
    ``bar_options``: tqdm's (``desc``, ``initial``, ...)."""

    def __init__(self, stream, total: int, enabled: bool, **bar_options):
        self.stream, self.enabled, self.bar = stream, enabled, None
        if enabled and getattr(stream, "isatty", lambda: False)():
            from tqdm import tqdm

            self.bar = tqdm(total=total, file=stream, **bar_options)

    def line(self, text: str) -> None:
        """A plain line (batch jobs)."""
        print(text, file=self.stream, flush=True)

    def write(self, text: str) -> None:
        if not self.enabled:
            return
        if self.bar is not None:
            self.bar.write(text, file=self.stream)
        else:
            self.line(text)

    def close(self) -> None:
        if self.bar is not None:
            self.bar.close()
