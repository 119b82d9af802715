"""The optional extra ``credit-parallel[credit]``: what only CREDIT's own configs and files need.

The core (the layouts, the models, credit-parallel's zarr data, training, forecasts) imports
and runs with the package's dependencies alone.  CREDIT's configs may ask for more:

* ``bridgescaler`` (with scikit-learn, scipy, numba, crick under it): CREDIT's
  ``bridgescaler_transform`` pre- and postblocks and ``loss.type: base``'s scaler file;
* ``h5netcdf`` / ``h5py``: CREDIT's netCDF files (``data.mean_path`` / ``std_path``, netCDF
  dynamic forcing and static files), read through xarray's h5netcdf engine;
* ``cftime``: miles-credit's ``credit.trainers.utils`` (its ``inject_flat_var_keys`` reads a
  gen-2 data block; its ``EMATracker`` for ``trainer.use_ema``) imports it.

:func:`require` imports one of them or raises a ``ValueError`` naming the config key that needs
it and the extra that installs it, so a config is refused before any rank starts.
"""

from __future__ import annotations

import importlib

__all__ = ["CREDIT_EXTRA", "CREDIT_EXTRA_MODULES", "extra_hint", "require"]

CREDIT_EXTRA = "credit-parallel[credit]"
# module -> what it is for (pyproject.toml's [project.optional-dependencies] credit)
CREDIT_EXTRA_MODULES = {
    "bridgescaler": "CREDIT's bridgescaler scaler files",
    "h5netcdf": "CREDIT's netCDF files (xarray's h5netcdf engine)",
    "h5py": "CREDIT's netCDF files (the HDF5 library h5netcdf reads through)",
    "cftime": "miles-credit's credit.trainers.utils (gen-2 data blocks, EMATracker)",
}


def extra_hint() -> str:
    """The sentence that says how to install the extra."""
    return f"install the optional extra: pip install '{CREDIT_EXTRA}'"


def require(module: str, where: str):
    """``module`` imported, or a ``ValueError`` naming ``where`` (the config key that needs it),
    the module and the extra ``credit-parallel[credit]``."""
    try:
        return importlib.import_module(module)
    except ImportError as err:
        why = CREDIT_EXTRA_MODULES.get(module, "CREDIT's configs")
        raise ValueError(
            f"{where} needs `{module}` ({why}), which cannot be imported ({err}); {extra_hint()}"
        ) from err
