"""What the planner reports per converted module: its form, extra communication, memory.

Pure arithmetic on shapes (no process group): :func:`form_cost` asks a domain-parallel wrapper
(row-group attention, sequence-parallel attention, a gathered module) for its
``communication_bytes`` and ``activation_bytes`` at a given global input shape.
"""

from __future__ import annotations

__all__ = ["form_cost"]


def form_cost(module, input_shape, n: int, itemsize: int) -> dict | None:
    """``{"form", "communication_bytes", "activation_bytes"}`` of ``module`` for a global input
    of ``input_shape`` over ``n`` domain ranks (``None`` for modules that do not report it).

    ``communication_bytes``: extra bytes sent over all ranks per forward (the backward sends the
    same again); ``activation_bytes``: the module input held by the busiest rank while the module
    runs (its internal activations scale with it)."""
    if not hasattr(module, "communication_bytes") or not hasattr(module, "activation_bytes"):
        return None
    return {
        "form": module.domain_form,
        "communication_bytes": int(module.communication_bytes(input_shape, n, itemsize)),
        "activation_bytes": int(module.activation_bytes(input_shape, n, itemsize)),
    }
