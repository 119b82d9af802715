"""Ensemble initial states: a seeded Gaussian perturbation that is the same whatever the layout.

Method (``perturb``): member 0 is the control (the state unchanged); member ``m >= 1`` adds
independent Gaussian noise of standard deviation ``scale`` (per channel if ``scale`` is a vector)
to the perturbed channels of the initial state, in the units the state is in (the model's
normalised units: ``scale = 0.01`` is 1 % of each channel's climatological standard deviation).
Only the prognostic channels are perturbed (``channels``: the leading channels of each input;
dynamic forcing and static fields follow them and stay exact).

Layout independence: the noise of global row ``h`` of initial time ``t`` is drawn from its own
NumPy ``PCG64`` stream seeded by ``SeedSequence((seed, member, t, input, h))``, one full row
(channels, [levels,] all longitudes) at a time.  A rank draws only its own rows, so the
perturbation of a row never depends on how the rows (or the initial times, keyed by ``t``, not
by their position in a batch) are split over ranks: the perturbed state at domain 4 is bitwise
the rows of the perturbed state at domain 1.  On a 2-D domain (SPEC §3b: latitude x longitude
tiles) a rank draws its rows whole and keeps its columns, so the tiles agree the same way.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
import torch

from ..layout.small_collectives import gather_small

__all__ = ["member_split", "member_states", "perturb", "row_noise"]


def row_noise(
    shape: tuple[int, ...], seed: int, member: int, init_time: int, which: int, row: int
) -> np.ndarray:
    """The float64 standard normal noise of global row ``row`` of input ``which`` of initial
    time ``init_time``: an array of ``shape`` (channels, [levels,] longitudes)."""
    stream = np.random.SeedSequence((int(seed), int(member), int(init_time), int(which), int(row)))
    return np.random.Generator(np.random.PCG64(stream)).standard_normal(shape)


@dataclass(frozen=True)
class _Tile:
    """Where this rank's tile lies in the global grid: its first row, its first column and the
    global width (a latitude-only layout: first column 0, the width its own)."""

    first_row: int
    first_col: int
    width: int


def _tile(x: torch.Tensor, manager) -> _Tile:
    """This rank's tile from every domain rank's (rows, columns), gathered over the domain group
    in domain rank order ``lat * Q + lon`` (SPEC §3b; ``Q = 1`` without ``domain_shape``)."""
    height, width = int(x.shape[-2]), int(x.shape[-1])
    if manager is None or manager.domain_world_size == 1:
        return _Tile(0, 0, width)
    _, q = getattr(manager, "domain_shape", (manager.domain_world_size, 1))
    lat, lon = divmod(manager.domain_rank, q)
    mine = torch.tensor([height, width], dtype=torch.int64, device=manager.device)
    sizes = gather_small(mine, manager.domain_group).view(-1, q, 2).tolist()  # [lat][lon]
    first_row = sum(sizes[r][0][0] for r in range(lat))
    first_col = sum(sizes[lat][c][1] for c in range(lon))
    return _Tile(first_row, first_col, sum(sizes[lat][c][1] for c in range(q)))


def _noise(x: torch.Tensor, count: int, tile: _Tile, key: tuple, times: Sequence[int]):
    """Noise for the leading ``count`` channels of ``x`` (B, C, [Z,] H_local, W_local): one
    stream per (initial time, global row), drawn for the whole row and cut to this tile's
    columns."""
    seed, member, which = key
    batch, height, width = x.shape[0], x.shape[-2], x.shape[-1]
    row_shape = (count, *x.shape[2:-2], tile.width)
    columns = slice(tile.first_col, tile.first_col + width)
    noise = np.empty((batch, height, *row_shape[:-1], width))
    for b in range(batch):
        for r in range(height):
            row = row_noise(row_shape, seed, member, times[b], which, tile.first_row + r)
            noise[b, r] = row[..., columns]
    # (B, H, C, [Z,] W) -> (B, C, [Z,] H, W)
    return torch.from_numpy(np.moveaxis(noise, 1, -2))


def _per_input(value, n: int, what: str) -> tuple:
    if isinstance(value, (tuple, list)) and not isinstance(value, torch.Tensor):
        if len(value) != n:
            raise ValueError(f"perturb: {what} has {len(value)} entries for {n} inputs")
        return tuple(value)
    return (value,) * n


def perturb(
    state,
    member: int,
    seed: int,
    *,
    manager=None,
    scale=0.01,
    channels=None,
    init_times: Sequence[int] | None = None,
):
    """The initial state of ensemble ``member`` (a tensor or a tuple like ``state``).

    ``state``: this rank's rows of the initial input(s), batch first (``(B, C, [Z,] H_local,
    W)``).  ``seed``: the run's seed.  ``manager``: the domain manager (None: whole rows).
    ``scale``: noise standard deviation, a float or a per-channel vector (one per input for a
    tuple state).  ``channels``: how many leading channels of each input to perturb (an int, or
    one per input; None: all).  ``init_times``: an integer key per batch entry (the dataset's
    time index of each initial time), so that an initial time gets the same noise on whichever
    rank and batch position it lands (default: the batch positions).  A collective over the
    domain group (each rank's first global row) when the rows are split.
    """
    if isinstance(member, bool) or not isinstance(member, int) or member < 0:
        raise ValueError(f"perturb: member must be an integer >= 0, got {member!r}")
    single = isinstance(state, torch.Tensor)
    inputs = (state,) if single else tuple(state)
    if member == 0:
        return state
    batch = inputs[0].shape[0]
    times = list(range(batch)) if init_times is None else [int(t) for t in init_times]
    if len(times) != batch:
        raise ValueError(f"perturb: {len(times)} init_times for a batch of {batch}")
    counts = _per_input(channels, len(inputs), "channels")
    scales = _per_input(scale, len(inputs), "scale")
    tile = _tile(inputs[0], manager)
    out = []
    for which, (x, count, sigma) in enumerate(zip(inputs, counts, scales)):
        count = x.shape[1] if count is None else int(count)
        if not 0 <= count <= x.shape[1]:
            raise ValueError(f"perturb: channels {count} outside 0..{x.shape[1]} of input {which}")
        noise = _noise(x, count, tile, (seed, member, which), times)
        sigma = torch.as_tensor(sigma, dtype=torch.float64).reshape(-1)
        sigma = sigma.view(-1, *([1] * (x.dim() - 2))) if sigma.numel() > 1 else sigma[0]
        delta = (noise * sigma).to(device=x.device, dtype=x.dtype)
        out.append(torch.cat([x[:, :count] + delta, x[:, count:]], dim=1))
    return out[0] if single else tuple(out)


def member_split(members: int, dp: int) -> int:
    """Over how many dp groups the members of one initial time are spread: the largest number
    dividing both (each of them runs ``members / split`` members as one batch)."""
    return math.gcd(members, dp) if members > 1 else 1


def member_states(state: tuple, members: range, seed: int, manager, extra: int, key: int):
    """The batch of the perturbed copies ``members`` of a one-sample state (the control alone:
    the state itself): :func:`perturb` on the prognostic channels (``extra``: the
    forcing and static channels at the end of the last input stay exact), keyed by the initial
    time's dataset position ``key`` so every layout draws the same noise."""
    if list(members) == [0]:
        return state
    channels = [s.shape[1] for s in state]
    channels[-1] -= extra
    copies = [
        perturb(state, m, seed, manager=manager, channels=channels, init_times=[key])
        for m in members
    ]
    return tuple(torch.cat([c[i] for c in copies]) for i in range(len(state)))
