"""``verify`` under an ensemble: the one-process K-member CRPS step against the layout's
(K/E members per ensemble rank, their CRPS shares, members gathered back for the table).

A run with ``trainer.ensemble_size`` K and a CRPS loss (train/crps.py) is verified on its own
loss; the random draws of a stochastic model start from the same seed in both runs (the layout's
draws are layout-independent: domain/random_draws.py).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.distributed as dist

from ..layout.config import ENSEMBLE, ParallelDims
from ..train.crps import EnsembleLoss, crps_weighted_loss
from ..train.ensemble_conf import crps_loss
from ..train.loss import local_lat_weights

__all__ = ["VerifyEnsemble"]


@dataclass(frozen=True)
class VerifyEnsemble:
    """The ensemble of a verified config: its CRPS ``loss`` (None: deterministic), the
    ensemble degree ``ensemble`` and the ``seed`` both runs draw from."""

    loss: EnsembleLoss | None
    ensemble: int
    seed: int

    @classmethod
    def from_conf(cls, conf: dict) -> VerifyEnsemble:
        trainer = conf.get("trainer") or {}
        loss = crps_loss(conf, int(trainer.get("ensemble_size", 1)))
        ensemble = ParallelDims.from_conf(conf).ensemble
        return cls(loss, ensemble, int(trainer.get("seed", 0)))

    @property
    def members(self) -> int:
        return self.loss.members if self.loss is not None else 1

    @property
    def local_members(self) -> int:
        return self.members // self.ensemble

    def reference_loss(self, lat_weights: torch.Tensor, height: int):
        return crps_weighted_loss(self.loss, lat_weights, height) if self.loss else None

    def layout_loss(self, model, lat_weights, manager, height: int, width: int | None):
        if self.loss is None:
            return None
        return crps_weighted_loss(
            self.loss, local_lat_weights(lat_weights, manager), height, width, self.group(model)
        )

    def group(self, model):
        if self.ensemble == 1:
            return None
        return model._device_mesh[ENSEMBLE].get_group()

    def members_gathered(self, t: torch.Tensor, model) -> torch.Tensor:
        """This rank's (b * K/E, ...) member outputs -> the (b * K, ...) of one process."""
        if self.ensemble == 1:
            return t
        k = self.local_members
        mine = t.reshape(-1, k, *t.shape[1:]).contiguous()
        parts = [torch.empty_like(mine) for _ in range(self.ensemble)]
        dist.all_gather(parts, mine, group=self.group(model))
        return torch.cat(parts, dim=1).reshape(-1, *t.shape[1:])

    def input_grad_summed(self, g: torch.Tensor, model) -> torch.Tensor:
        """An input's gradient summed over the members' ensemble ranks (every member of a sample
        read the same input)."""
        if self.ensemble == 1:
            return g
        g = g.clone()
        dist.all_reduce(g, group=self.group(model))
        return g
