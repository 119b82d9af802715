"""CREDIT's ``loss.type: base`` (``credit/losses/base.py``), exact under every layout.

miles-credit's ``BaseLoss`` scores each variable of the postblocks' physical-unit output
(``y_processed``) against the target twin (``y_target_processed``) with a univariate loss
(``training_loss``, per variable ``base_loss_overrides``; ``reduction="none"``), weights each
element by cos(latitude) (``use_latitude_weights``), takes the mean per variable and combines the
variables: ``mean_v(w_v * L_v)`` with ``w_v`` from ``var_weighting`` (``inverse_variance``: 1 /
the scaler's variance, ``manual``: ``variable_weights``, ``none``; ``normalize_weights``: mean 1),
or Kendall-Gal's ``mean_v(m_v * exp(-s_v) * L_v + 0.5 * s_v)`` with a learnable ``s_v = log
sigma_v^2`` (``learnable``).

Here the loss is built from miles-credit's own ``BaseLoss`` (its univariate losses, its
variances from the scaler file, its static weights, its initial ``log_variance``: called, not
copied) and computed as this rank's SHARE: per variable the weighted sum over this rank's rows
(or tile) over the GLOBAL count of elements, so that the shares summed over the domain ranks
are the one-process mean whatever the shard sizes (``train/loss.py``'s rule).  The physical
units come from ``data/bridgescaler_blocks.py`` (the postblock chain on the prediction and on
the normalised target, per point).  Kendall-Gal's ``0.5 * s_v`` is added as ``1 / domain`` of it
on each domain rank.

``learnable``: the ``log_variance`` parameter lives in :class:`LearnableWeights`, replicated on
every rank, stepped by its own AdamW with the model optimizer's hyperparameters and schedule
(CREDIT adds it as a param group of the one AdamW: the same update, AdamW being per parameter),
its gradient summed over the domain and averaged over dp (one world all-reduce divided by tp x
dp), and saved in the DCP checkpoint (``credit_loss.*``), which CREDIT does not do yet.
Validation (``Trainer.evaluate``) reports ``loss`` with ``validation_loss`` when given.
"""

from __future__ import annotations

import math
import os

import torch
import torch.distributed as dist

from .crps import crps_share

__all__ = [
    "CreditBaseLoss",
    "LearnableWeights",
    "credit_base_loss",
    "loss_state",
    "restore_loss_state",
]

TOP = "credit_loss"  # the checkpoint's top-level key of the learnable weights


class _Schema:
    """CREDIT's ``ChannelSchema`` as ``BaseLoss`` reads it: the target variables in order."""

    def __init__(self, keys):
        self.target_layout = [{"var_key": k} for k in keys]


def _credit_losses():
    try:
        import credit.losses.base as base
    except ImportError as err:
        raise ValueError(
            "loss.type: base is computed with miles-credit's own BaseLoss (credit.losses.base), "
            f"which cannot be imported ({err}); install miles-credit 2026.2"
        ) from err
    return base


def _credit_base_loss(args: dict, keys, validation: bool):
    base = _credit_losses()
    args = {k: v for k, v in args.items() if k not in ("use_latitude_weights", "latitude_weights")}
    return base.BaseLoss(**args, channel_schema=_Schema(keys), validation=validation)


def credit_lat_weights(path: str, latitude) -> torch.Tensor:
    """CREDIT's ``_cos_lat_weights(path)`` (float32 cos(lat) over its mean) in the dataset's row
    order (north to south); the file's latitudes must be the dataset's."""
    import numpy as np
    import xarray as xr

    weights = _credit_losses()._cos_lat_weights(path)
    with xr.open_dataset(os.path.expandvars(path)) as ds:
        file_lat = np.asarray(ds["latitude"].values, dtype=np.float64)
    ours = np.asarray(latitude, dtype=np.float64)
    if (
        file_lat.shape == ours.shape
        and np.allclose(file_lat[::-1], ours)
        and file_lat[0] != ours[0]
    ):
        return weights.flip(0)
    if file_lat.shape != ours.shape or not np.allclose(file_lat, ours):
        raise ValueError(
            f"loss.args.latitude_weights {path!r}: its {file_lat.size} latitudes are not the "
            f"data's {ours.size}"
        )
    return weights


class LearnableWeights(torch.nn.Module):
    """Kendall-Gal's ``log sigma_v^2`` per scored variable (``var_weighting: learnable``)."""

    def __init__(self, init: torch.Tensor):
        super().__init__()
        self.log_variance = torch.nn.Parameter(init.detach().clone())

    def reduce_grad(self, tp: int, dp: int) -> None:
        """Sum the gradient shares over the domain, average over dp (tp ranks hold the same)."""
        grad = self.log_variance.grad
        if grad is None or not dist.is_available() or not dist.is_initialized():
            return
        dist.all_reduce(grad)
        grad /= tp * dp


class CreditBaseLoss:
    """A :data:`~credit_parallel.train.step.LossFn`: CREDIT's base loss share of one forecast
    step (see the module docstring).  ``blocks``: the dataset's ``ScalerBlocks`` (None: the
    output's units are scored); ``layout``: ``SampleLayout`` of this rank's samples;
    ``lat_local``: this rank's rows of CREDIT's latitude weights (None: unweighted)."""

    def __init__(
        self, args, blocks, layout, lat_local, global_height, global_width, domain_size, validation
    ):
        self.keys = [s.key for s in layout.output_slots]
        self.credit = _credit_base_loss(dict(args), self.keys, validation)
        self.blocks, self.layout = blocks, layout
        self.lat_local = lat_local
        self.global_hw = global_height * global_width
        self.domain_size = domain_size
        self.learnable = None
        self.weights = None
        if self.credit.var_weighting == "learnable":
            self.learnable = LearnableWeights(self.credit.log_variance.detach())
        else:
            self.weights = self.credit._build_static_weights(self.keys)
        self.last_var_losses: dict = {}
        # (EnsembleLoss, ensemble group) under trainer.ensemble_size with ring-crps as the
        # training_loss: each variable scored by train/crps.py's share of the members
        self.ensemble: tuple | None = None

    def physical(self, output: torch.Tensor) -> dict:
        if self.blocks is None:
            grid = output.shape[-2:]
            return {
                s.key: output[:, s.start : s.start + s.width].reshape(-1, s.width, 1, *grid)
                for s in self.layout.output_slots
            }
        return self.blocks.physical(output, self.layout)

    def var_shares(self, output: torch.Tensor, target: torch.Tensor) -> dict:
        """Per variable: this rank's share of CREDIT's mean of the elementwise loss."""
        pred, truth = self.physical(output), self.physical(target)
        dtype = torch.promote_types(output.dtype, torch.float32)  # CREDIT scores in float32
        shares = {}
        for key in self.keys:
            p, t = pred[key].to(dtype), truth[key].to(dtype)
            if self.ensemble is not None:  # p: this rank's members, t: the samples
                elementwise = crps_share(p, t, *self.ensemble)
            else:
                fn = self.credit.overrides.get(key, self.credit.base_loss)
                elementwise = fn(t, p)
            if self.lat_local is not None:
                w = self.lat_local.to(device=p.device, dtype=dtype)
                elementwise = elementwise * w.view(1, 1, 1, -1, 1)
            count = math.prod(t.shape[:3]) * self.global_hw
            shares[key] = elementwise.sum() / count
        return shares

    def __call__(self, outputs: tuple, targets: tuple) -> torch.Tensor:
        if len(outputs) != 1:
            raise ValueError("loss.type: base reads a model with one output tensor (4-D samples)")
        shares = self.var_shares(outputs[0], targets[0])
        self.last_var_losses = {k: float(v.detach()) for k, v in shares.items()}
        if self.learnable is None:
            return torch.stack([self.weights[k] * shares[k] for k in self.keys]).mean()
        log_var = self.learnable.log_variance
        terms = []
        for i, key in enumerate(self.keys):
            manual = self.credit.manual_weights.get(key, 1.0)
            s = log_var[i].to(shares[key].dtype)
            terms.append(manual * torch.exp(-s) * shares[key] + 0.5 * s / self.domain_size)
        return torch.stack(terms).mean()


def credit_base_loss(
    conf: dict, dataset, lat_local_of, global_width, domain_size, validation=False
):
    """The trainer's :class:`CreditBaseLoss` for ``conf["loss"]`` (``{type: base, args,
    source}``, written by ``layout/credit_gen2.py``), or None when the config has none.
    ``lat_local_of(weights)``: this rank's rows of global latitude weights."""
    loss = conf.get("loss")
    if not isinstance(loss, dict) or loss.get("type") != "base":
        return None
    from ..data.bridgescaler_blocks import SampleLayout

    args = loss.get("args") or {}
    blocks = getattr(dataset, "scaler_blocks", None)
    layout = SampleLayout(dataset, loss.get("source") or (blocks.source if blocks else "ERA5"))
    lat_local = None
    if args.get("use_latitude_weights"):
        lat_local = lat_local_of(credit_lat_weights(args["latitude_weights"], dataset.latitude))
    height, width = dataset.grid_shape
    return CreditBaseLoss(
        args, blocks, layout, lat_local, height, global_width or width, domain_size, validation
    )


def loss_state(learnable: LearnableWeights, optimizer, empty: bool = False) -> dict:
    """``{"credit_loss": {...}}`` for ``save_checkpoint(extra=)``: ``log_variance`` and its
    AdamW moments and step (``empty``: the template ``load_checkpoint(extra=)`` fills)."""
    param = learnable.log_variance
    state = {} if empty else optimizer.state.get(param, {})
    zeros = torch.zeros_like(param.detach())
    out = {
        "log_variance": zeros.clone() if empty else param.detach().clone(),
        "exp_avg": state.get("exp_avg", zeros).detach().clone(),
        "exp_avg_sq": state.get("exp_avg_sq", zeros).detach().clone(),
        "step": torch.tensor(float(state["step"]) if "step" in state else 0.0, dtype=torch.float64),
    }
    return {TOP: out}


def restore_loss_state(learnable: LearnableWeights, optimizer, loaded: dict) -> None:
    """Put a loaded :func:`loss_state` back: the parameter and its optimizer's moments."""
    state = loaded[TOP]
    param = learnable.log_variance
    with torch.no_grad():
        param.copy_(state["log_variance"])
    optimizer.state.pop(param, None)
    step = float(state["step"])
    if step > 0:
        optimizer.state[param] = {
            "step": torch.tensor(step, dtype=torch.float32),
            "exp_avg": state["exp_avg"].to(param).clone(),
            "exp_avg_sq": state["exp_avg_sq"].to(param).clone(),
        }
