"""Where a process keeps its tensors: one decision for the trainer, verify and the benchmark.

An NCCL process group communicates CUDA tensors, so its ranks compute on ``cuda:LOCAL_RANK``;
gloo (and a run without a process group) computes on the CPU.  Every other place follows the
device this module decides, or the device of the tensor it was given, never a literal.

Choosing the device of a run (``--device {auto,cuda,cpu}`` on ``train``, ``verify``, ``bench``)
is :func:`choose_device`, before any rank starts: ``auto`` takes CUDA (NCCL) when there are at
least as many visible GPUs as local ranks and the CPU (gloo) otherwise; ``cuda`` with fewer GPUs
than local ranks is refused naming both counts.  The choice reaches the ranks through the
``CREDIT_PARALLEL_DEVICE`` environment variable (:data:`DEVICE_ENV`), which
:func:`credit_parallel.layout.launch.init_distributed_from_env` reads to pick the backend, and the rank's
CUDA device is set in ONE place, :func:`set_local_cuda_device`.
"""

from __future__ import annotations

import contextlib
import os

import torch
import torch.distributed as dist

__all__ = [
    "DETERMINISM_NOTE",
    "DEVICE_CHOICES",
    "DEVICE_ENV",
    "autocast_for",
    "backend_for",
    "batch_to_device",
    "choose_device",
    "deterministic_kernels",
    "device_for_process_group",
    "local_rank",
    "requested_device",
    "set_local_cuda_device",
    "synchronize",
    "visible_gpu_count",
]

DEVICE_ENV = "CREDIT_PARALLEL_DEVICE"
DEVICE_CHOICES = ("auto", "cuda", "cpu")


def visible_gpu_count() -> int:
    """CUDA devices this process can see (0 without CUDA)."""
    return torch.cuda.device_count() if torch.cuda.is_available() else 0


def local_rank() -> int:
    return int(os.environ.get("LOCAL_RANK", "0"))


def choose_device(requested: str, local_ranks: int, gpus: int | None = None) -> str:
    """``"cuda"`` or ``"cpu"`` for a run of ``local_ranks`` ranks on this node.

    ``auto``: CUDA when ``gpus`` (default: the visible GPUs) >= ``local_ranks`` >= 1, else the
    CPU.  ``cuda`` with fewer GPUs than local ranks raises ValueError naming both counts and the
    two ways out (fewer ranks, or ``--device cpu``), so no rank starts only to die with
    ``invalid device ordinal``.
    """
    if requested not in DEVICE_CHOICES:
        raise ValueError(f"--device must be one of {DEVICE_CHOICES}, got {requested!r}")
    gpus = visible_gpu_count() if gpus is None else int(gpus)
    if requested == "cpu":
        return "cpu"
    if requested == "auto":
        return "cuda" if gpus >= local_ranks >= 1 else "cpu"
    if gpus < local_ranks:
        raise ValueError(
            f"--device cuda with {local_ranks} local rank(s) but only {gpus} visible GPU(s) "
            f"(CUDA_VISIBLE_DEVICES={os.environ.get('CUDA_VISIBLE_DEVICES', 'unset')}): start at "
            f"most {gpus} rank(s) per node (--nproc {max(gpus, 1)}), or run gloo ranks on the CPU "
            "with --device cpu"
        )
    return "cuda"


def requested_device() -> str:
    """The device the command line chose for this run (:data:`DEVICE_ENV`), ``"auto"`` unset."""
    value = os.environ.get(DEVICE_ENV, "auto").strip().lower() or "auto"
    if value not in DEVICE_CHOICES:
        raise ValueError(f"{DEVICE_ENV} must be one of {DEVICE_CHOICES}, got {value!r}")
    return value


def backend_for(device: str) -> str:
    """The process-group backend that communicates ``device``'s tensors."""
    return "nccl" if device == "cuda" else "gloo"


def set_local_cuda_device() -> torch.device:
    """Make ``cuda:LOCAL_RANK`` this process's current CUDA device (the ONE place that does) and
    return it."""
    device = torch.device("cuda", local_rank())
    torch.cuda.set_device(device)
    return device


def device_for_process_group(group=None) -> torch.device:
    """``cuda:LOCAL_RANK`` when ``group`` (default: the world) uses NCCL, else the CPU.

    Without a process group (a one-rank run of the command line) it is ``cuda:LOCAL_RANK`` when
    the command line chose CUDA (:data:`DEVICE_ENV` = ``cuda``), else the CPU."""
    if dist.is_available() and dist.is_initialized():
        backend = str(dist.get_backend(group)).lower()
        if "nccl" in backend:
            return torch.device("cuda", local_rank())
        return torch.device("cpu")
    if os.environ.get(DEVICE_ENV, "").strip().lower() == "cuda":
        return torch.device("cuda", local_rank())
    return torch.device("cpu")


def batch_to_device(batch: dict, device: torch.device, dtype: torch.dtype | None = None) -> dict:
    """A new dict with every tensor of ``batch`` on ``device`` (floating ones cast to ``dtype``).

    Host tensors bound for a CUDA device are pinned first and copied without blocking, so the
    copy overlaps with whatever the stream still runs; the same stream then orders the copy
    before the first kernel that reads it.
    """
    device = torch.device(device)
    out = {}
    for key, value in batch.items():
        if not isinstance(value, torch.Tensor):
            out[key] = value
            continue
        if device.type == "cuda" and value.device.type == "cpu":
            # pin_memory returns a tensor the DataLoader pinned already as it is
            value = value.pin_memory().to(device, non_blocking=True)
        else:
            value = value.to(device)
        if dtype is not None and value.is_floating_point():
            value = value.to(dtype)  # after the copy: the smaller dtype crosses the bus
        out[key] = value
    return out


def autocast_for(device: torch.device, enabled: bool, dtype: torch.dtype = torch.bfloat16):
    """``torch.autocast`` for ``device``'s type; a no-op context when not ``enabled``."""
    device = torch.device(device)
    if not enabled or device.type not in ("cpu", "cuda"):
        return contextlib.nullcontext()
    return torch.autocast(device.type, dtype=dtype, enabled=True)


def synchronize(device: torch.device) -> None:
    """Wait for the work queued on ``device`` (CUDA kernels run asynchronously; the CPU does not)."""
    device = torch.device(device)
    if device.type == "cuda":
        torch.cuda.synchronize(device)


DETERMINISM_NOTE = (
    "TF32 off (matmul, cuDNN), deterministic algorithms, cuDNN deterministic, cuDNN benchmark off"
)


@contextlib.contextmanager
def deterministic_kernels(device):
    """On a CUDA ``device``: pin what makes two runs of one function differ on a GPU, and restore
    torch's settings on exit.  TF32 is forbidden in matmuls and cuDNN convolutions (a TF32
    product keeps 10 mantissa bits: a float32 comparison at 1e-5 fails on it), deterministic
    algorithms are requested (``warn_only``: an op without a deterministic kernel warns instead
    of stopping the comparison; cuBLAS gets the workspace it needs for that,
    ``CUBLAS_WORKSPACE_CONFIG=:4096:8``), cuDNN runs deterministic kernels and does not
    benchmark (the same algorithm for both runs).  On the CPU nothing changes (no TF32, and its
    kernels are deterministic for a fixed thread count).  Yields the note for a report header
    (None on the CPU)."""
    from .compat import apply_tf32_settings, disable_tf32, tf32_settings

    if torch.device(device).type != "cuda":
        yield None
        return
    cudnn = torch.backends.cudnn
    saved = (
        tf32_settings(),
        torch.are_deterministic_algorithms_enabled(),
        torch.is_deterministic_algorithms_warn_only_enabled(),
        cudnn.deterministic,
        cudnn.benchmark,
        os.environ.get("CUBLAS_WORKSPACE_CONFIG"),
    )
    try:
        os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")
        disable_tf32()
        torch.use_deterministic_algorithms(True, warn_only=True)
        cudnn.deterministic, cudnn.benchmark = True, False
        yield DETERMINISM_NOTE
    finally:
        tf32, algorithms, warn_only, cudnn.deterministic, cudnn.benchmark, workspace = saved
        apply_tf32_settings(tf32)
        torch.use_deterministic_algorithms(algorithms, warn_only=warn_only)
        if workspace is None:
            os.environ.pop("CUBLAS_WORKSPACE_CONFIG", None)
        else:
            os.environ["CUBLAS_WORKSPACE_CONFIG"] = workspace
