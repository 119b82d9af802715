"""Activation recompute inside layout-independent draws (SPEC §0, issue 40 item 5).

``trainer.activation_checkpoint`` recomputes a block's forward in backward, after the root
forward hooks closed :class:`~credit_parallel.domain.random_draws.LayoutIndependentDraws`.  Run plainly, that
recompute redraws the block's dropout masks and noise per rank (this rank's local shape from
the generator state checkpoint restored): the forward and the loss stay exact, the gradients
do not.  :func:`recompute_context_fn` gives ``torch.utils.checkpoint`` a recompute context
that re-enters the same mode.
"""

from __future__ import annotations

import contextlib

from ..domain.random_draws import LayoutIndependentDraws

__all__ = ["active_draws", "recompute_context_fn"]


def active_draws() -> LayoutIndependentDraws | None:
    """The innermost :class:`LayoutIndependentDraws` running now (None: draws are plain)."""
    from torch.overrides import _get_current_function_mode_stack

    for mode in reversed(_get_current_function_mode_stack()):
        if isinstance(mode, LayoutIndependentDraws):
            return mode
    return None


def recompute_context_fn():
    """The ``context_fn`` of ``torch.utils.checkpoint`` for a block checkpointed inside a
    forward whose draws are layout-independent, None outside one.  The recompute runs in
    backward, after the root forward hooks closed the mode: without it the block's dropout
    masks and noise are redrawn per rank (this rank's local shape from the restored generator),
    so the forward is exact and the gradients are not.  The recompute re-enters the same mode
    (layout, member streams, the modules running around the block), and checkpoint's restored
    generator state makes it draw the same global tensors as the forward did."""
    mode = active_draws()
    if mode is None or mode.replay is None:
        return None
    replay = mode.replay()  # snapshot now: the modules running around the block
    return lambda: (contextlib.nullcontext(), replay)
