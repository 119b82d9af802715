"""The small U-Net on the sample store that the trainer, checkpoint, CLI, device and operations
tests train: one place for the config they share (each test file sets its own trainer keys)."""

from __future__ import annotations

__all__ = ["SAMPLE_DATA", "tiny_unet", "tiny_unet_conf"]

# the sample store's variables (credit_parallel.data.sample.write_sample_dataset): 3 x 2 levels
# upper-air + 2 surface = 8 channels
SAMPLE_DATA = {
    "upper_air_variables": ["T", "U", "V"],
    "surface_variables": ["t2m", "SP"],
    "levels": [500, 850],
}


def tiny_unet(height: int, width: int) -> dict:
    """``model`` section: a 2-level U-Net with 8 channels in and out."""
    return {
        "type": "unet",
        "in_channels": 8,
        "out_channels": 8,
        "image_height": height,
        "image_width": width,
        "base_channels": 4,
        "channel_mults": [1, 2],
        "norm_groups": 2,
    }


def tiny_unet_conf(store, height: int, width: int, *, time_slice, trainer: dict, **data) -> dict:
    """A full config: :func:`tiny_unet`, the sample store's variables over ``time_slice``
    (plus ``data`` keys) and the ``trainer`` section as given."""
    return {
        "model": tiny_unet(height, width),
        "data": {"path": str(store), **SAMPLE_DATA, "time_slice": list(time_slice), **data},
        "trainer": dict(trainer),
    }
