"""Training: the latitude-weighted loss, the parallel trainer and its worker entry point."""

from .loss import latitude_weighted_mse_share

__all__ = ["latitude_weighted_mse_share"]
