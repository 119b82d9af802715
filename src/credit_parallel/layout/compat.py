"""The PyTorch APIs that differ between the releases the project supports (torch >= 2.11).

Every call whose spelling or behaviour changed between torch 2.11 and the newest release goes
through this module, so the rest of the code is written once:

* :func:`all_gather_single` — ``dist.all_gather_single`` (torch >= 2.13), else its older name
  ``dist.all_gather_into_tensor`` (same arguments, same result).
* :func:`affine_per_channel` — ``t * scale + shift`` per (sample, channel) in one pass.  It used
  the native inference batch norm with mean 0, variance 1 and ``eps=0``; torch 2.11 refuses
  ``eps=0`` ("batch_norm eps must be positive"), so it is ``torch.addcmul`` on every release.
* :func:`regroup_parts` — a fused projection's ``Shard(0)`` weight regrouped into the per-part
  layout (``_StridedShard(0, split_factor=parts)``).  torch 2.11's DTensor cannot interpret a
  one-axis ``_StridedShard`` as a shard order and raises; there the same local slices are taken
  from the all-gathered weight, and the gradient returns as a ``Partial`` (reduce-scattered:
  every rank's gradient is zero outside its own slices, so the sum is exact).
* :func:`disable_tf32` / :func:`tf32_settings` / :func:`apply_tf32_settings` — TF32 in CUDA
  matmuls and cuDNN convolutions: the ``fp32_precision`` attributes (recent torch) or the older
  ``allow_tf32`` flags.

The capability checks read the live ``torch`` modules at call time, so the tests simulate the
older API surface by removing the newer attribute (``monkeypatch.delattr``) or lowering
:data:`STRIDED_SHARD_REDISTRIBUTE`.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

__all__ = [
    "STRIDED_SHARD_REDISTRIBUTE",
    "TORCH_VERSION",
    "affine_per_channel",
    "all_gather_single",
    "apply_tf32_settings",
    "disable_tf32",
    "regroup_parts",
    "tf32_settings",
]


def _version(text: str) -> tuple[int, int]:
    major, minor = text.split("+")[0].split(".")[:2]
    return int(major), int("".join(ch for ch in minor if ch.isdigit()) or 0)


TORCH_VERSION = _version(torch.__version__)
# a DTensor redistribute from Shard(0) to a one-axis _StridedShard (torch 2.11 raises "placements
# ... unable to be interpreted"; 2.13 does it)
STRIDED_SHARD_REDISTRIBUTE = TORCH_VERSION >= (2, 13)


def all_gather_single(out: torch.Tensor, x: torch.Tensor, group=None):
    """Every rank's ``x`` concatenated along dim 0 into ``out`` (``world * x.shape[0]`` rows)."""
    gather = getattr(dist, "all_gather_single", None)
    if gather is None:  # torch < 2.13
        gather = dist.all_gather_into_tensor
    return gather(out, x, group=group)


def affine_per_channel(t: torch.Tensor, scale: torch.Tensor, shift: torch.Tensor) -> torch.Tensor:
    """``t * scale + shift`` per channel, in one pass: ``t`` holds ``scale.numel()`` channels of
    contiguous elements each (e.g. (B, C, L) with ``scale``/``shift`` (B, C)); one rounding of the
    product and one of the sum (``addcmul``), as the batch-norm kernel it replaces."""
    if t.numel() == 0:  # a rank without rows
        return t.clone()
    n = scale.numel()
    flat = t.reshape(n, t.numel() // n)
    out = torch.addcmul(shift.reshape(n, 1), flat, scale.reshape(n, 1))
    return out.view(t.shape)


def regroup_parts(param, parts: int) -> torch.Tensor:
    """This rank's slice of each of the ``parts`` blocks of a ``Shard(0)`` DTensor ``param`` on a
    one-axis mesh, concatenated (the per-part layout), as a differentiable local tensor whose
    gradient returns to ``param``'s ``Shard(0)`` layout."""
    from torch.distributed.tensor import Partial, Replicate
    from torch.distributed.tensor.placement_types import _StridedShard

    if STRIDED_SHARD_REDISTRIBUTE:
        return param.redistribute(placements=[_StridedShard(0, split_factor=parts)]).to_local()
    mesh = param.device_mesh
    rank, size = mesh.get_local_rank(), mesh.size()
    full = param.redistribute(placements=[Replicate()]).to_local(grad_placements=[Partial()])
    return torch.cat([block.tensor_split(size, 0)[rank] for block in full.chunk(parts, 0)], 0)


def _tf32_knobs():
    """(name, owner, attribute, value that forbids TF32) for CUDA matmuls and cuDNN convolutions:
    the ``fp32_precision`` attributes where torch has them, else the legacy ``allow_tf32``."""
    matmul, cudnn = torch.backends.cuda.matmul, torch.backends.cudnn
    conv = getattr(cudnn, "conv", None)
    return (
        ("matmul", matmul, "fp32_precision", "ieee")
        if hasattr(matmul, "fp32_precision")
        else ("matmul", matmul, "allow_tf32", False),
        ("cudnn", conv, "fp32_precision", "ieee")
        if conv is not None and hasattr(conv, "fp32_precision")
        else ("cudnn", cudnn, "allow_tf32", False),
    )


def tf32_settings() -> dict:
    """The TF32 settings as torch has them now (to give back to :func:`apply_tf32_settings`)."""
    return {name: getattr(owner, attr) for name, owner, attr, _ in _tf32_knobs()}


def apply_tf32_settings(settings: dict) -> None:
    """Restore settings returned by :func:`tf32_settings`."""
    for name, owner, attr, _ in _tf32_knobs():
        if name in settings:
            setattr(owner, attr, settings[name])


def disable_tf32() -> None:
    """Forbid TF32 in CUDA matmuls and cuDNN convolutions (full float32 precision)."""
    for _, owner, attr, off in _tf32_knobs():
        setattr(owner, attr, off)
