"""The small U-Net on the sample store that the trainer, checkpoint, CLI, device and operations
tests train: one place for the config they share (each test file sets its own trainer keys)."""

from __future__ import annotations

__all__ = ["SAMPLE_DATA", "SINGLE_PROCESS", "tiny_unet", "tiny_unet_conf", "unet_run_conf"]

# the sample store's variables (credit_parallel.data.sample.write_sample_dataset): 3 x 2 levels
# upper-air + 2 surface = 8 channels
SAMPLE_DATA = {
    "upper_air_variables": ["T", "U", "V"],
    "surface_variables": ["t2m", "SP"],
    "levels": [500, 850],
}
# trainer.parallelism of a one-process run
SINGLE_PROCESS = {"data": "none", "tensor": 1, "domain": 1}


def tiny_unet(height: int, width: int, channels: int = 8, **keys) -> dict:
    """``model`` section: a 2-level U-Net with ``channels`` (8: the sample store's) in and out;
    ``keys`` add or override model keys."""
    return {
        "type": "unet",
        "in_channels": channels,
        "out_channels": channels,
        "image_height": height,
        "image_width": width,
        "base_channels": 4,
        "channel_mults": [1, 2],
        "norm_groups": 2,
        **keys,
    }


def tiny_unet_conf(store, height: int, width: int, *, time_slice, trainer: dict, **data) -> dict:
    """A full config: :func:`tiny_unet`, the sample store's variables over ``time_slice``
    (plus ``data`` keys) and the ``trainer`` section as given."""
    return {
        "model": tiny_unet(height, width),
        "data": {"path": str(store), **SAMPLE_DATA, "time_slice": list(time_slice), **data},
        "trainer": dict(trainer),
    }


def unet_run_conf(
    store, height: int, width: int, *, time_slice, parallelism=None, data=None, **trainer
) -> dict:
    """:func:`tiny_unet_conf` with the trainer section ``{"parallelism": parallelism or
    SINGLE_PROCESS, **trainer}`` (each test file passes its own keys) and ``data`` keys."""
    section = {"parallelism": parallelism or dict(SINGLE_PROCESS), **trainer}
    return tiny_unet_conf(
        store, height, width, time_slice=time_slice, trainer=section, **(data or {})
    )
