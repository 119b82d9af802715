"""Inductor options the library sets, and why: one place.

On CUDA, inductor's ``layout_optimization`` (channels-last convolution inputs) meets a
convolution weight that is a graph input in bf16 — FSDP2's unsharded parameter under its bf16
policy, so there is no cast inside the graph — and the first backward stops in
``assert_size_stride`` on ``aten.convolution_backward``: the forward saves the weight contiguous
while the backward graph is planned with the channels-last copy.  Seen on an H200 with torch
2.11 (the bundled CrossFormer's cross-embed under ``{data: fsdp2, amp: true}``, with
``trainer.compile`` and with a user's own ``torch.compile`` of the parallelized model); upstream
pytorch/pytorch#171622 and #175969 describe the same mismatch.  The CPU is not affected.
"""

from __future__ import annotations

import os
import warnings

import torch

__all__ = ["BLOCK_INDUCTOR_OPTIONS", "LAYOUT_ENV", "guard_inductor_layout"]

#: Inductor options of every block ``compile_blocks`` compiles (``trainer.compile``): the
#: blocks keep the model's own memory format.
BLOCK_INDUCTOR_OPTIONS = {"layout_optimization": False}

#: inductor's own switch for the option; a user who sets it keeps their choice
LAYOUT_ENV = "TORCHINDUCTOR_LAYOUT_OPTIMIZATION"


def guard_inductor_layout(device_type: str, param_dtype: torch.dtype | None) -> bool:
    """Switch inductor's ``layout_optimization`` off for this process when FSDP2 hands the
    graphs low-precision parameters on CUDA, so that a user's own whole-model ``torch.compile``
    of the parallelized model (either order, SPEC 5a) does not stop in the backward as the module
    docstring describes.  A user who set ``TORCHINDUCTOR_LAYOUT_OPTIMIZATION`` keeps their
    choice.  Returns True when it switched the option off (once, with a warning saying so)."""
    if device_type != "cuda" or param_dtype not in (torch.bfloat16, torch.float16):
        return False
    if LAYOUT_ENV in os.environ:
        return False
    import torch._inductor.config as inductor_config

    if not inductor_config.layout_optimization:
        return False
    inductor_config.layout_optimization = False
    warnings.warn(
        "credit_parallel: FSDP2 with bf16 parameters on CUDA: torch._inductor.config."
        "layout_optimization set to False for this process (inductor's channels-last conversion "
        "of a convolution weight that is a graph input breaks the backward: "
        "pytorch/pytorch#171622); set TORCHINDUCTOR_LAYOUT_OPTIMIZATION=1 to keep it on",
        stacklevel=3,
    )
    return True
