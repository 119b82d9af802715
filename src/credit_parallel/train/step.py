"""The one training step: shard the batch -> autoregressive rollout -> loss share -> backward ->
domain gradient reduction -> global-norm clipping.

The trainer, ``credit-parallel verify``, the benchmark, the test harness and the tests all run
this code; what differs between them is configuration (the loss, the number of forecast steps,
whether to clip), never a second copy of the step.

Rollout: a batch holds inputs ``x`` (4-D models) or ``x_upper``/``x_surface`` (5-D, Pangu-style)
and targets ``y`` or ``y_upper``/``y_surface``.  Time is folded into the channel axis, oldest step
first (see ``data/dataset.py``): an input carries ``history_len`` steps, a target
``forecast_len``.  Forecast step k compares the model's outputs with the k-th block of target
channels, then the state advances: the oldest time step (as many channels as the model
predicts) is dropped and the prediction appended.  With ``history_len == 1`` that is the
prediction itself.  The state stays in its domain shard between steps.

Dynamic forcing and static fields (``data.dynamic_forcing_variables`` / ``data.static_variables``)
are input-only channels at the END of the last input (``x``, or ``x_surface`` of a 5-D model):
``[history_len x prognostic (oldest first), forcing at the input time, static]``.  Advancing
replaces the forcing channels with the next input time's (the batch's ``forcing`` key holds them
for steps 2 .. ``forecast_len``) and keeps the static ones.

Diagnostic (output-only) channels (``data.diagnostic_variables``) are the LAST
``n_diagnostic`` channels of the model's (last) output and of each forecast step of the target:
the loss covers them, the state never holds them (only the prognostic part is fed back).

Loss shares: each rank's loss is its share of the globally normalised loss (local sum divided
by the global count), so summing gradients over the domain ranks (``op="sum"``) is exact for any
shard sizes, and dp averaging (DDP/FSDP2) gives the mean over the global batch.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterable
from dataclasses import KW_ONLY, dataclass, field

import torch

from ..domain.sharding import shard_batch
from ..layout.config import has_process_group
from ..layout.small_collectives import sum_small_
from ..parallel.collectives import clip_grad_norm_, sync_domain_gradients
from ..parallel.fsdp import no_grad_sync
from .loss import latitude_weighted_mse_share

__all__ = [
    "INPUT_KEYS",
    "TARGET_KEYS",
    "LossFn",
    "StepResult",
    "TrainStep",
    "advance_state",
    "batch_keys",
    "forcing_at",
    "latitude_weighted_loss",
    "replica_mean_loss",
    "rollout_loss",
]

INPUT_KEYS = (("x",), ("x_upper", "x_surface"))
TARGET_KEYS = (("y",), ("y_upper", "y_surface"))

#: ``loss_fn(outputs, targets) -> this rank's loss share`` for one forecast step (tuples of tensors)
LossFn = Callable[[tuple, tuple], torch.Tensor]


def batch_keys(batch: dict) -> tuple[tuple[str, ...], tuple[str, ...]]:
    """(input keys, target keys) of a 4-D or 5-D batch."""
    for inputs, targets in zip(INPUT_KEYS, TARGET_KEYS):
        if all(k in batch for k in inputs):
            return inputs, targets
    raise ValueError(f"batch has none of the expected input keys {INPUT_KEYS}; got {sorted(batch)}")


def _as_tuple(value) -> tuple:
    return tuple(value) if isinstance(value, (tuple, list)) else (value,)


def _per_input(value, n: int, what: str) -> tuple:
    """An int (the last input's; the others 0) or a tuple of ``n`` ints, as a tuple of ``n``."""
    if isinstance(value, (tuple, list)):
        if len(value) != n:
            raise ValueError(f"advance_state: {what} has {len(value)} entries for {n} inputs")
        return tuple(int(v) for v in value)
    return (0,) * (n - 1) + (int(value),)


def _forcing_tuple(forcing, n: int) -> tuple:
    """``forcing`` as one entry per input: a tensor or tuple for the LAST input(s)."""
    if forcing is None:
        return (None,) * n
    forcing = _as_tuple(forcing)
    if len(forcing) > n:
        raise ValueError(f"advance_state: {len(forcing)} forcing tensors for {n} inputs")
    return (None,) * (n - len(forcing)) + tuple(forcing)


def advance_state(
    state: tuple, outputs: tuple, forcing=None, *, n_forcing=0, n_static=0, n_diagnostic=0
) -> tuple:
    """The input of the next forecast step: per input, drop the oldest time step (as many
    channels as its output has prognostic ones), append the prediction's prognostic channels
    after the remaining history, replace the ``n_forcing`` dynamic forcing channels with
    ``forcing`` (the next input time's) and keep the ``n_static`` static channels.

    ``n_forcing`` / ``n_static``: an int (channels at the end of the LAST input, as the dataset
    lays them out) or one int per input.  ``n_diagnostic``: the output-only channels at the end
    of the LAST output (or one int per output), never fed back.  ``forcing``: None when there is
    no forcing, else a tensor (the last input's) or a tuple aligned with the last inputs,
    ``n_forcing`` channels.
    """
    n = len(state)
    n_forcing, n_static = _per_input(n_forcing, n, "n_forcing"), _per_input(n_static, n, "n_static")
    n_diagnostic = _per_input(n_diagnostic, n, "n_diagnostic")
    forcing = _forcing_tuple(forcing, n)
    out = []
    for s, o, f, nf, ns, nd in zip(state, outputs, forcing, n_forcing, n_static, n_diagnostic):
        if nd:
            if o.shape[1] <= nd:
                raise ValueError(
                    f"advance_state: an output of {o.shape[1]} channels has no prognostic "
                    f"channel besides its {nd} diagnostic ones"
                )
            o = o[:, : o.shape[1] - nd]
        if nf == 0 and ns == 0:
            out.append(torch.cat([s[:, o.shape[1] :], o.to(s.dtype)], dim=1))
            continue
        if nf and (f is None or f.shape[1] != nf):
            got = "none" if f is None else f"{f.shape[1]} channels"
            raise ValueError(f"advance_state: {nf} forcing channels expected, got {got}")
        history = s.shape[1] - nf - ns
        parts = [s[:, o.shape[1] : history], o.to(s.dtype)]
        if nf:
            parts.append(f.to(s.dtype))
        if ns:
            parts.append(s[:, s.shape[1] - ns :])
        out.append(torch.cat(parts, dim=1))
    return tuple(out)


def forcing_at(forcing: torch.Tensor | None, k: int, n_forcing: int):
    """The forcing of forecast step ``k``'s input (``k >= 1``) from a batch's ``forcing`` key
    (the forcing of steps 1 .. forecast_len - 1 stacked on channels), or None."""
    if forcing is None or n_forcing == 0:
        return None
    return forcing[:, (k - 1) * n_forcing : k * n_forcing]


def rollout_loss(
    model,
    inputs: tuple,
    targets: tuple,
    loss_fn: LossFn,
    forecast_len: int = 1,
    *,
    forcing: torch.Tensor | None = None,
    n_forcing: int = 0,
    n_static: int = 0,
    n_diagnostic: int = 0,
) -> tuple[torch.Tensor, tuple]:
    """Mean loss share over ``forecast_len`` autoregressive steps, and the last step's outputs.
    ``forcing``: the batch's ``forcing`` tensor (``n_forcing`` channels per later step);
    ``n_forcing`` / ``n_static``: the input-only channels of the last input; ``n_diagnostic``:
    the output-only channels of the last output, in the loss, never fed back (see
    :func:`advance_state`)."""
    state = tuple(inputs)
    total = None
    outputs: tuple = ()
    for k in range(forecast_len):
        outputs = _as_tuple(model(*state))
        step_targets = tuple(
            t[:, k * o.shape[1] : (k + 1) * o.shape[1]] for t, o in zip(targets, outputs)
        )
        loss = loss_fn(outputs, step_targets)
        total = loss if total is None else total + loss
        if k + 1 < forecast_len:
            step_forcing = forcing_at(forcing, k + 1, n_forcing)
            state = advance_state(
                state,
                outputs,
                step_forcing,
                n_forcing=n_forcing,
                n_static=n_static,
                n_diagnostic=n_diagnostic,
            )
    # no kernel a plain loop would not run: x / 1 is x
    return (total if forecast_len == 1 else total / forecast_len), outputs


def latitude_weighted_loss(
    lat_weights_local: torch.Tensor, global_height: int, global_width: int | None = None
) -> LossFn:
    """The trainer's loss: latitude-weighted MSE share, averaged over the model's outputs
    (``global_width``: on lat x lon tiles, the global W)."""

    def loss_fn(outputs: tuple, targets: tuple) -> torch.Tensor:
        shares = [
            latitude_weighted_mse_share(o, t, lat_weights_local, global_height, global_width)
            for o, t in zip(outputs, targets)
        ]
        total = shares[0]
        for share in shares[1:]:
            total = total + share
        return total if len(shares) == 1 else total / len(shares)

    return loss_fn


def replica_mean_loss(loss_share: torch.Tensor, *, tp_size: int, dp_size: int) -> torch.Tensor:
    """The step's loss from each rank's share: summed over the domain ranks, counted once over
    the ``tp_size`` replicas (which hold identical shares) and averaged over ``dp_size``
    (the degrees of the run's :class:`~credit_parallel.layout.config.ParallelDims`).  A world
    collective."""
    total = loss_share.detach().clone()
    if has_process_group():
        sum_small_(total, None)
    return total / (tp_size * dp_size)


@dataclass(frozen=True)
class StepResult:
    """What one step leaves behind: the summed loss share of this rank (float64, on the
    step's device), the gradient norm before clipping (None without clipping) and the
    outputs of the last forecast step of the last micro-batch (detached)."""

    loss_share: torch.Tensor
    grad_norm: torch.Tensor | None
    outputs: tuple


@dataclass
class TrainStep:
    """One optimisation step's forward/backward/reduction/clipping for ``model``.

    ``loss_fn``: see :data:`LossFn`.  ``shard_inputs``: shard global batches over the domain
    ranks of ``manager`` (False when the caller passes shards already).  ``max_norm``: clip to
    this global norm (``float("inf")`` measures without clipping; None skips the norm).
    ``n_forcing`` / ``n_static``: the input-only channels at the end of the last input (the
    batch's ``forcing`` key feeds the forcing of later steps).  ``n_diagnostic``: the
    output-only channels at the end of the last output (in the loss, not fed back).  ``autocast``: a factory of the
    mixed-precision context.  ``guard``: a factory
    ``guard(model)`` of a functional-call guard (``domain.guard.FunctionalCallGuard``) active
    around every model call when the domain is split; its findings collect in ``findings``
    (a raising guard stops at the first).  The optimizer's ``zero_grad`` and ``step`` stay with
    the caller, which owns the optimizer.
    """

    model: torch.nn.Module
    loss_fn: LossFn
    _: KW_ONLY
    manager: object = None
    forecast_len: int = 1
    max_norm: float | None = None
    shard_inputs: bool = True
    autocast: Callable = contextlib.nullcontext
    guard: Callable | None = None
    findings: list = field(default_factory=list)
    n_forcing: int = 0
    n_static: int = 0
    n_diagnostic: int = 0
    # ensemble members of each sample this rank runs (K/E; train/crps.py): the inputs and the
    # forcing are repeated member by member (CREDIT's repeat_interleave), the targets are not
    members: int = 1

    def shard(self, batch: dict) -> dict:
        """This rank's rows of a global batch, only through the model's own manager
        (``manager=None`` would fall back to a process-wide manager of another layout)."""
        if not self.shard_inputs or self.manager is None:
            return batch
        return shard_batch(batch, manager=self.manager)

    def forward_backward(self, batch: dict, *, divide_by: int = 1) -> tuple[torch.Tensor, tuple]:
        """Rollout loss share of one (sharded) batch over ``divide_by``, back-propagated;
        returns (the detached share, the last forecast step's detached outputs)."""
        in_keys, out_keys = batch_keys(batch)
        return self.forward_backward_tensors(
            tuple(batch[k] for k in in_keys),
            tuple(batch[k] for k in out_keys),
            divide_by=divide_by,
            forcing=batch.get("forcing"),
        )

    def forward_backward_tensors(
        self, inputs: tuple, targets: tuple, *, divide_by: int = 1, forcing=None
    ) -> tuple[torch.Tensor, tuple]:
        """:meth:`forward_backward` for explicit tuples of input and target tensors (and the
        forcing of the later forecast steps)."""
        if self.members > 1:
            inputs = tuple(t.repeat_interleave(self.members, 0) for t in inputs)
            if forcing is not None:
                forcing = forcing.repeat_interleave(self.members, 0)
        with self.autocast():
            share, outputs = rollout_loss(
                self._model_call(),
                inputs,
                targets,
                self.loss_fn,
                self.forecast_len,
                forcing=forcing,
                n_forcing=self.n_forcing,
                n_static=self.n_static,
                n_diagnostic=self.n_diagnostic,
            )
            if divide_by != 1:
                share = share / divide_by
        share.backward()
        return share.detach(), tuple(o.detach() for o in outputs)

    def _model_call(self) -> Callable:
        """The model, or the model under the functional-call guard (only the model's own
        calls are watched: the loss reduces over H on purpose)."""
        if self.guard is None or self.manager is None or self.manager.domain_world_size == 1:
            return self.model

        def guarded(*state):
            with self.guard(self.model) as guard:
                guard.mark(*state)
                out = self.model(*state)
            self.findings.extend(guard.findings)
            return out

        return guarded

    def reduce_gradients(self) -> None:
        """Sum the gradient shares over the domain ranks (exact on uneven shards)."""
        if self.manager is not None and self.manager.domain_world_size > 1:
            sync_domain_gradients(self.model, self.manager, op="sum")

    def clip(self) -> torch.Tensor | None:
        """Global gradient norm (every rank computes the same value), clipped to ``max_norm``."""
        if self.max_norm is None:
            return None
        params = [p for p in self.model.parameters() if p.grad is not None]
        return clip_grad_norm_(params, self.max_norm)

    def __call__(self, micro_batches: Iterable[dict], grad_accum: int = 1) -> StepResult:
        """Accumulate ``grad_accum`` micro-batches (gradient sync of DDP/FSDP2 suppressed until
        the last), then reduce over the domain and clip."""
        loss_sum = None
        outputs: tuple = ()
        for micro, batch in enumerate(micro_batches):
            last = micro + 1 == grad_accum
            ctx = contextlib.nullcontext() if last else no_grad_sync(self.model)
            with ctx:
                share, outputs = self.forward_backward(self.shard(batch), divide_by=grad_accum)
            share = share.double()
            loss_sum = share if loss_sum is None else loss_sum + share
        self.reduce_gradients()
        return StepResult(loss_sum, self.clip(), outputs)
