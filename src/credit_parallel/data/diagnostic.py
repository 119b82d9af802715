"""Output-only (diagnostic) variables of ``ERA5Dataset``: fields the model predicts but is never
fed (CREDIT's ``diagnostic`` group: total precipitation, evaporation, outgoing radiation, ...).

Layout (CREDIT gen-2's, ``credit.datasets.gen_2.channel_utils``: the target is prognostic then
diagnostic): each time step is READ as ``[prognostic, diagnostic, dynamic forcing]``; an input
``x`` holds no diagnostic channel; each forecast step of the target ``y`` holds the step's
prognostic channels then its diagnostic ones (``channels_out_per_step`` of them), normalised by
each variable's own statistics.  A 5-D sample (``as_5d``) carries them after the surface
variables of ``y_surface``.  Diagnostic variables are 2-D, dims ``(time, latitude, longitude)``.

:class:`DiagnosticChannels` is the part of ``ERA5Dataset`` that names and slices them.
"""

from __future__ import annotations

import numpy as np

__all__ = ["DiagnosticChannels"]


class DiagnosticChannels:
    """The output channels of an ``ERA5Dataset`` (a mixin: reads the dataset's variable lists,
    ``channels_per_step`` and statistics)."""

    diagnostic_variables: list
    channels_per_step: int

    @property
    def n_diagnostic(self) -> int:
        """Diagnostic (output-only) channels per forecast step."""
        return len(self.diagnostic_variables)

    @property
    def channels_out_per_step(self) -> int:
        """Channels of one forecast step of ``y`` (and of the model's output): prognostic then
        diagnostic."""
        return self.channels_per_step + self.n_diagnostic

    @property
    def output_variable_names(self) -> list[str]:
        """The channels of one forecast step of ``y``: ``variable_names`` then the diagnostic
        variables."""
        return list(self.variable_names) + list(self.diagnostic_variables)

    @property
    def output_mean(self) -> np.ndarray:
        """Per output channel (:attr:`output_variable_names`), the mean subtracted (float64)."""
        return np.array(self._mean[: self.channels_out_per_step], dtype=np.float64)

    @property
    def output_std(self) -> np.ndarray:
        """Per output channel, the std divided by (float64)."""
        return np.array(self._std[: self.channels_out_per_step], dtype=np.float64)

    @property
    def forcing_channels(self) -> slice:
        """The dynamic forcing channels of one time step of :meth:`read_steps`."""
        first = self.channels_out_per_step
        return slice(first, first + self.n_forcing)
