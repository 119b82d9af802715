"""The parallelisms besides the domain, and the recipe that composes them all.

* ``tensor_parallel`` — the ``_tp_col`` / ``_tp_row`` plan and the Linear / 1x1-conv styles;
  ``tensor_parallel_guard`` — replicated tensors meeting tp-sharded ones (gradients summed over tp);
  ``tensor_parallel_heads`` — when a fused q|k|v split is exact (head count from the width);
  ``credit_api`` — CREDIT 2026.2's names (``Tp*`` modules, ``supports_native_tp``, ...);
* ``fsdp`` — FSDP2 over dp (or dp x domain) and DDP; ``grad_overlap`` — the domain gradient sum
  overlapped with the backward; ``collectives`` — bucketed gradient all-reduce, the domain
  gradient sync, global-norm clipping;
* ``compile`` — ``torch.compile`` per block;
* ``composition`` — :func:`parallelize`: build the layout, then domain conversion -> tensor
  parallel -> compile -> FSDP2 / DDP.

It stands on :mod:`credit_parallel.layout.ranks` and :mod:`credit_parallel.domain`; training and the
tools stand on it.  A new parallelism, or a new step in the recipe, goes here.
"""

from __future__ import annotations

from ..lazy import lazy_exports

_EXPORTS = {
    "apply_tensor_parallel": "tensor_parallel",
    "apply_fsdp2": "fsdp",
    "apply_ddp": "fsdp",
    "allreduce_grads_avg": "collectives",
    "sync_domain_gradients": "collectives",
    "clip_grad_norm_": "collectives",
    "compile_blocks": "compile",
    "parallelize": "composition",
    "get_domain_manager": "composition",
    "get_raw_model": "composition",
}

__all__ = sorted(_EXPORTS)

__getattr__, __dir__ = lazy_exports(__name__, _EXPORTS, globals())
