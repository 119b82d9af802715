"""Training: the latitude-weighted loss, the one training step, the trainer and its entry point."""

from .loss import latitude_weighted_mse_share
from .step import TrainStep, latitude_weighted_loss, rollout_loss

__all__ = ["TrainStep", "latitude_weighted_loss", "latitude_weighted_mse_share", "rollout_loss"]
