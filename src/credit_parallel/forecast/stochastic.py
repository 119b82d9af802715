"""Forecast members of a stochastic model (``forecast --members M``): each member's noise from
its own stream, seeded by (run seed, member, initial time), the same at every layout.

A model that draws random numbers in its forward (``crossformer-ensemble``'s noise, dropout
left on) makes its members differ by those draws.  :func:`member_noise_steps` runs the rollout
with one generator per member of this rank's batch (``domain/random_draws.py``'s
``MemberStreams``): whichever dp rank runs a member, whatever its batch position and however
the rows (tiles) are split, member m of initial time t draws the same numbers.  A deterministic
model's rollout is returned as it is.
"""

from __future__ import annotations

from ..domain.random_draws import MemberStreams, member_noise, random_drawing_modules
from ..parallel.composition import get_domain_manager

__all__ = ["member_noise_steps"]


def member_noise_steps(steps, model, seed: int, members, init_position: int, device):
    """``steps`` (the rollout generator of ``model``) with each of ``members`` (the global
    member ids of this rank's batch) drawing from its own stream keyed by ``init_position``."""
    if not random_drawing_modules(model):
        return steps
    streams = MemberStreams(seed, members, init_position, device)
    return member_noise(steps, streams, model, get_domain_manager(model))
