"""A forecast's units: what the model reads and writes, and the physical units the store holds.

A run normalises in one of two ways, and the forecast (and ``Trainer.use_training_climatology``)
uses the run's own:

* per-channel mean / std (credit-parallel's statistics, or CREDIT's ``era5_normalizer``): the
  dataset's reads are normalised already; the outputs are ``output * std + mean``;
* CREDIT's pre- and postblocks (``data.bridgescaler``: ``bridgescaler_transform``,
  ``log_transform`` / ``exp_transform``, ``sqrt_transform`` / ``square_transform``): the dataset
  reads raw values (``normalize`` off); the initial state and each step's dynamic forcing go
  through the preblock chain as an ``input``, as the training samples do
  (``data/bridgescaler_blocks.py``), and each output through the postblock chain (CREDIT's
  ``y_processed`` postblocks: the bridgescaler inverse transform, ``exp_transform``,
  ``square_transform``) to the store's physical units.  An output variable no postblock selects
  is written in the model's units, as CREDIT's postblocks leave it.  A climatology (raw, the
  time mean of the training range) goes through the ``target`` preblock chain to be compared
  with outputs in the model's units: for a non-linear chain that is the transform of the mean,
  not the mean of the transformed fields.

Every transform is per grid point (a spatial scaler picks its rows' statistics by their global
indices), so a rank's rows or tile are exactly those rows of the whole-globe values.
"""

from __future__ import annotations

import numpy as np
import torch

from ..data.bridgescaler_blocks import VarSlot

__all__ = ["ForecastUnits"]


class ForecastUnits:
    """The unit conversions of a forecast of ``dataset`` (this rank's rows) on ``device``."""

    def __init__(self, dataset, device):
        self.dataset = dataset
        self.blocks = getattr(dataset, "scaler_blocks", None)
        self.layout = None
        if self.blocks is not None:
            from ..data.bridgescaler_blocks import SampleLayout

            # built from ``dataset`` itself: its own rows (also of a RowView of a whole globe)
            self.layout = SampleLayout(dataset, self.blocks.source)
        # the output channels: prognostic, then diagnostic (output-only, 2-D)
        self.mean = torch.as_tensor(dataset.output_mean, device=device).view(-1, 1, 1)
        self.std = torch.as_tensor(dataset.output_std, device=device).view(-1, 1, 1)
        if self.blocks is not None:
            slots = [s for s in self.layout.input_slots if "/dynamic_forcing/" in s.key]
            at = slots[0].start if slots else 0
            self._forcing_slots = [VarSlot(s.key, s.start - at, s.width) for s in slots]

    @property
    def raw_reads(self) -> bool:
        """Whether the dataset reads raw values (CREDIT's preblocks normalise them)."""
        return self.blocks is not None

    def model_input(self, sample: dict) -> dict:
        """``dataset.compose_input``'s sample (4-D ``x``) in the model's units."""
        if self.blocks is None:
            return sample
        x = self.blocks.model_units(sample["x"], "input", self.layout.input_slots, self.layout)
        return {**sample, "x": x}

    def model_forcing(self, forcing: np.ndarray) -> np.ndarray:
        """One step's dynamic forcing ``(n_forcing, rows, W)`` (as ``read_steps`` returns it)
        in the model's units."""
        if self.blocks is None:
            return forcing
        raw = torch.from_numpy(np.ascontiguousarray(forcing))
        out = self.blocks.model_units(raw, "input", self._forcing_slots, self.layout)
        return out.numpy()

    def physical(self, flat: torch.Tensor) -> torch.Tensor:
        """Outputs ``(B, C, rows, W)`` in the model's units -> physical units (float64)."""
        if self.blocks is None:
            return flat.double() * self.std + self.mean
        per_var = self.blocks.physical(flat, self.layout)  # {key: (B, L, 1, h, w)}
        parts = [per_var[s.key][:, :, 0] for s in self.layout.output_slots]
        return torch.cat(parts, dim=1).double()

    def truth(self, step: np.ndarray, device) -> torch.Tensor:
        """One time step of ``read_steps`` (its output channels) in physical units,
        ``(1, C, rows, W)`` float64."""
        output = torch.from_numpy(step[: self.dataset.channels_out_per_step]).to(device)
        if self.blocks is not None:
            return output.double().unsqueeze(0)  # read raw: already physical
        return (output.double() * self.std + self.mean).unsqueeze(0)

    def climatology_in_model_units(self, raw: torch.Tensor) -> torch.Tensor:
        """A raw climatology ``(C_out, rows, W)`` in the model's units (float64)."""
        if self.blocks is None:
            mean, std = self.mean.to(raw.device), self.std.to(raw.device)
            return ((raw - mean) / std).double()
        flat = raw.to(torch.float32)
        return self.blocks.model_units(
            flat, "target", self.layout.output_slots, self.layout
        ).double()
