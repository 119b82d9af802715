"""Training: everything a run does between its config and its checkpoints.

* ``preflight`` — a whole run checked (layout, model, data) before any model is built;
* ``model_init`` — the model built on the meta device, materialised already sharded;
* ``loss`` — the latitude-weighted loss, exact on uneven shards; ``step`` — THE training step
  (shard -> rollout -> loss share -> backward -> domain gradient sum -> clip);
* ``trainer`` — the loop (CREDIT's gen2 trainer), one code path for 1 process or N ranks;
  ``main`` — the worker entry point of ``credit-parallel train``;
* ``checkpoint`` — DCP checkpoints: saved under one layout, loaded under any.

It stands on the library below (layout, domain, parallel, data, planner).  A new training
feature (a schedule, a loss, a callback, a checkpoint format) goes here.
"""

from .loss import latitude_weighted_mse_share
from .step import TrainStep, latitude_weighted_loss, rollout_loss

__all__ = ["TrainStep", "latitude_weighted_loss", "latitude_weighted_mse_share", "rollout_loss"]
