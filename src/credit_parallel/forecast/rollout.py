"""The autoregressive rollout of a (parallelised) model: each step's local rows, nothing gathered.

``rollout(model, state, steps, forcing=...)`` runs the model ``steps`` times from the initial
state, feeding each prediction back as the next input exactly as training advances its state
(:func:`credit_parallel.train.step.advance_state`: drop the oldest history step, append the
prediction's prognostic channels (its diagnostic ones are yielded, never fed back), replace the dynamic forcing channels with the next input time's, keep the static
ones).  Every tensor stays this rank's rows (on a lat x lon domain: its tile, rows x columns): a
domain-parallel model never sees the globe, and
the caller writes or scores the rows it is handed.

The model runs in eval mode under ``torch.no_grad()`` (bf16 autocast with ``amp``), each step
inside its own context so that the caller's code between steps runs in its own grad mode; the
model's previous train/eval mode is restored when the generator finishes.  Not
``torch.inference_mode()``: inference tensors carry no version counter, which the domain layers'
shared-input halo cache keys on (``domain/exchange/shared_input.py``), and FSDP2's unsharded
parameters must stay ordinary tensors.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator

import torch

from ..data.loader import register_row_batch
from ..domain.manager import is_tiled
from ..layout.device import autocast_for
from ..parallel.composition import get_domain_manager
from ..train.step import advance_state

__all__ = ["rollout"]

ForcingFn = Callable[[int], object]


class _HeightOwner:
    """The owner under which the rollout asks the domain group for the global height once."""


def _as_tuple(value) -> tuple:
    return tuple(value) if isinstance(value, (tuple, list)) else (value,)


def _global_size(manager, state: tuple) -> tuple[int, int | None]:
    """The global (H, W) of the state; W is None unless the domain is lat x lon tiles."""
    local = int(state[0].shape[-2])
    if manager is None or manager.domain_world_size == 1:
        return local, None
    if is_tiled(manager):  # ask each axis of the tile (SPEC §3b)
        width = int(state[0].shape[-1])
        height = manager.lat.global_length(_HeightOwner(), local, cached=False)
        return int(height), int(manager.lon.global_length(_HeightOwner(), width, cached=False))
    return int(manager.global_length(_HeightOwner(), local, cached=False)), None


def _register(state: tuple, size: tuple[int, int | None], manager) -> None:
    """The forward token of the coming step, as the trainer registers a row batch."""
    if manager is not None and manager.domain_world_size > 1:
        batch = {f"state{i}": s for i, s in enumerate(state)}
        register_row_batch(batch, size[0], manager=manager, global_width=size[1])


def _step_forcing(forcing: ForcingFn | None, k: int) -> tuple | None:
    if forcing is None:
        return None
    values = _as_tuple(forcing(k))
    if not values or any(v is None for v in values[-1:]):
        raise ValueError(f"rollout: forcing({k}) returned no tensor for the input of step {k}")
    return values


def rollout(
    model: torch.nn.Module,
    state,
    steps: int,
    *,
    forcing: ForcingFn | None = None,
    manager=None,
    amp: bool = False,
    n_static: int = 0,
    n_diagnostic: int = 0,
) -> Iterator[tuple]:
    """Yield the outputs of forecast steps 1 .. ``steps`` (tuples of this rank's rows, detached).

    ``state``: this rank's rows of the initial input (a tensor or a tuple of them, batch dim
    first, laid out ``[history x prognostic (oldest first), forcing, static]`` as the dataset
    does; a 5-D model's forcing and static channels are in its last input).  ``forcing``: None
    (the state holds no forcing channels) or ``forcing(k)`` -> this rank's rows of the forcing
    channels of step ``k``'s input (``k >= 1``: a tensor for the last input, or a tuple aligned
    with the last inputs).  ``n_static``: static channels at the end of the last input;
    ``n_diagnostic``: output-only channels at the end of the last output (yielded, never fed
    back).
    ``manager``: the domain manager (default: the model's own); ``amp``: bf16 autocast as the
    trainer's ``amp``.  Fed back: the outputs cast to the state's dtype.
    """
    if isinstance(steps, bool) or not isinstance(steps, int) or steps < 1:
        raise ValueError(f"rollout: steps must be an integer >= 1, got {steps!r}")
    state = _as_tuple(state)
    manager = manager if manager is not None else get_domain_manager(model)
    was_training = model.training
    model.eval()
    try:
        with torch.no_grad():
            size = _global_size(manager, state)
        for k in range(steps):
            with torch.no_grad(), autocast_for(state[0].device, amp):
                _register(state, size, manager)
                outputs = tuple(o.detach() for o in _as_tuple(model(*state)))
            yield outputs
            if k + 1 == steps:
                break
            step_forcing = _step_forcing(forcing, k + 1)
            with torch.no_grad():
                n_forcing = 0 if step_forcing is None else int(step_forcing[-1].shape[1])
                state = advance_state(
                    state,
                    outputs,
                    step_forcing,
                    n_forcing=n_forcing,
                    n_static=n_static,
                    n_diagnostic=n_diagnostic,
                )
    finally:
        model.train(was_training)
