"""What the forecast command shows and writes per step: the progress report (a bar on a
terminal, plain lines in a batch job) and the model's outputs as the store's physical
variables (and back, for scoring what a store already holds)."""

from __future__ import annotations

import numpy as np
import torch

from ..train.progress import RankZeroReport

__all__ = ["Fields", "Progress", "dataset_layout", "store_variables"]


class Progress(RankZeroReport):
    """Rank 0's report of a forecast: the bar, or ``forecast init T step k/N ...`` lines."""

    def __init__(self, stream, total: int, enabled: bool):
        super().__init__(stream, total, enabled, desc="forecast", unit="step")

    def step(self, init: str, k: int, n: int, rate: float, lag: int, behind_s: float) -> None:
        """Step ``k`` of ``n`` of initial time ``init``; ``rate`` steps/s; the writer's lag:
        ``lag`` steps not written yet, the oldest handed over ``behind_s`` seconds ago."""
        if not self.enabled:
            return
        if self.bar is not None:
            writer = f"{lag} steps/{behind_s:.1f}s"
            self.bar.set_postfix(init=init, steps_s=f"{rate:.2f}", writer_lag=writer)
            self.bar.update(1)
        else:
            self.line(
                f"forecast init {init} step {k}/{n} steps/s {rate:.3g} "
                f"writer_lag {lag} steps {behind_s:.2f} s"
            )


class Fields:
    """Model outputs (normalised, this rank's rows) -> physical channels and store variables,
    in the run's own units (``units``: mean / std, or CREDIT's pre- and postblocks)."""

    def __init__(self, dataset, device):
        from .units import ForecastUnits

        self.dataset = dataset
        self.units = ForecastUnits(dataset, device)
        n_levels = len(dataset.levels)
        self.slices = []
        c = 0
        for name in dataset.upper_air_variables:
            self.slices.append((name, slice(c, c + n_levels), True))
            c += n_levels
        for name in [*dataset.surface_variables, *dataset.diagnostic_variables]:
            self.slices.append((name, slice(c, c + 1), False))
            c += 1

    def physical(self, outputs) -> torch.Tensor:
        from .scores import flatten_channels

        return self.units.physical(flatten_channels(outputs))  # (B, C, rows, W)

    def truth(self, step: np.ndarray, device) -> torch.Tensor:
        """One time step of :meth:`ERA5Dataset.read_steps` in physical units, ``(1, C, rows, W)``."""
        return self.units.truth(step, device)

    def from_store(
        self, store, index: tuple, rows: tuple, device, columns=None, layout=None
    ) -> torch.Tensor:
        """What :meth:`variables` wrote at ``index``, read back as physical channels
        ``(C, rows, W)`` (float32 values, as the store holds them; ``columns``: a tile's;
        ``layout``: the store's names, None: the dataset's)."""
        parts = []
        for name, _, upper in self.slices:
            stored = layout.store_name(name) if layout is not None else name
            values = torch.from_numpy(store.read(stored, index, rows, columns))
            parts.append(values if upper else values.unsqueeze(0))
        return torch.cat(parts).to(device, torch.float64)

    def variables(self, physical: torch.Tensor):
        """``(name, values)`` per store variable of one batch entry (CPU float32 numpy)."""
        host = physical.to("cpu", torch.float32).numpy()
        for name, channels, upper in self.slices:
            yield name, host[channels] if upper else host[channels.start]


def store_variables(dataset, layout=None) -> list:
    """The store's variables of ``dataset``'s outputs, named as ``layout`` names them (a
    :class:`.store_layout.StoreLayout`; None: the dataset's names)."""
    from .store import StoreVariable

    units = dataset.variable_units
    name = layout.store_name if layout is not None else str
    surface = [*dataset.surface_variables, *dataset.diagnostic_variables]
    return [StoreVariable(name(n), True, units.get(n, "")) for n in dataset.upper_air_variables] + [
        StoreVariable(name(n), False, units.get(n, "")) for n in surface
    ]


def dataset_layout(dataset, name: str | None):
    """The store layout ``name`` (``--layout``) of a forecast of ``dataset``'s outputs."""
    from .store_layout import layout_for_dataset

    outputs = [
        *dataset.upper_air_variables,
        *dataset.surface_variables,
        *dataset.diagnostic_variables,
    ]
    levels = dataset.levels if dataset.upper_air_variables else ()
    return layout_for_dataset(name, outputs, levels, dataset.level_coordinate)
