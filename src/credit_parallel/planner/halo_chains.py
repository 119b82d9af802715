"""The halo chains of a conversion plan (``domain/layers/halo_chain.py``), as the planner counts
them: at each traced call of a run's first stencil, the run is cut by the same pure function
the ranks use (``HaloChainRun.pieces``: the call's global height, the domain size, the batch,
channels and width, the element size and the device's :class:`ChainCosts`), so the planned
exchanges are the ones a real step makes.  A chain's first stencil exchanges the chain's
window over its input; the chain's other stencils exchange nothing."""

from __future__ import annotations

from .cost import SHARD_DIM

__all__ = ["chain_exchanges"]


def chain_exchanges(plan, trace, n: int, batch: int, itemsize: int, device: str, notes=None):
    """``{call index: exchange}`` (``cost.layer_call_plan``'s ``exchange``: ``(windows, input
    shape)`` or False) for the traced calls of the members of ``plan.halo_chains``; ``notes``
    (a list): one line per run and height saying how it was cut."""
    member_of = {}
    for fusion in plan.halo_chains:
        for index, (_, layer) in enumerate(fusion.run.layers):
            member_of[id(layer)] = (fusion, index)
    out, cut_of, said = {}, {}, set()
    for call, (_, _, layer, in_shape, _, _) in enumerate(trace.calls):
        entry = member_of.get(id(layer))
        if entry is None or n == 1:
            continue
        fusion, index = entry
        dim = SHARD_DIM % len(in_shape)
        if index == 0 and len(in_shape) == 4:
            shape = (batch, in_shape[1], in_shape[dim], in_shape[-1])
            cut = fusion.run.pieces(in_shape[dim], n, shape, itemsize, device)
            cut_of[id(fusion)] = {a: (b, geo) for a, b, geo in cut}
            key = (id(fusion), in_shape[dim])
            if notes is not None and key not in said:
                said.add(key)
                notes.append(_describe(fusion, cut, in_shape[dim], n, device))
        pieces = cut_of.get(id(fusion), {})
        if index in pieces and pieces[index][1] is not None:
            out[call] = (pieces[index][1].windows, tuple(in_shape))
        elif any(a < index < b and geo is not None for a, (b, geo) in pieces.items()):
            out[call] = False  # inside a chain: the chain's first exchange brought its rows
    return out


def _describe(fusion, cut, height: int, n: int, device: str) -> str:
    chains = []
    for a, b, geo in cut:
        if geo is None:
            continue
        members = fusion.paths[a:b]
        stencils = sum(1 for role, _ in fusion.run.layers[a:b] if role == "stencil")
        chains.append(f"[{', '.join(members)}] ({stencils} stencils, 1 exchange)")
    how = "cost model" if fusion.run.mode == "auto" else f"<= {fusion.run.mode} stencils"
    body = "; ".join(chains) if chains else "no chain pays here: each stencil exchanges alone"
    return (
        f"halo chains of {fusion.container_path} at height {height} over {n} ranks "
        f"({how}, {device}): {body}"
    )
