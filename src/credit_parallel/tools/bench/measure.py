"""One benchmark run on local ranks: step time, halo bytes, collectives by kind, saved and peak bytes.

Every rank runs the library's one training step (:class:`credit_parallel.train.step.TrainStep`:
forward, the share of a globally normalised loss, backward, domain gradient sum) on the device
:func:`credit_parallel.layout.device.device_for_process_group` decides (the CPU under gloo); on CUDA
the step times are taken after ``torch.cuda.synchronize`` so they cover the GPU work."""

from __future__ import annotations

import collections
import contextlib
import os
import statistics
import sys
import time

import torch
import torch.distributed as dist

from ...domain.exchange.traffic import record_exchange_stats
from ...domain.layers.split_conv import set_model_overlap
from ...domain.rows import shard_range
from ...layout.device import device_for_process_group, synchronize
from ...layout.small_collectives import record_small_collectives
from ...parallel.composition import get_domain_manager, parallelize
from ...planner import make_plan
from ...testing import run_on_ranks
from ...train.step import TrainStep
from ..profile import profile_step
from .specs import Layout, ModelSpec

__all__ = ["KINDS", "measure", "predicted_kinds", "setup_run"]


_KIND_OF_OP = {
    "allreduce_": "all_reduce",
    "allreduce_coalesced_": "all_reduce",
    "all_reduce": "all_reduce",
    "_allgather_base_": "all_gather",
    "allgather_": "all_gather",
    "allgather_coalesced_": "all_gather",
    "allgather_into_tensor_coalesced_": "all_gather",
    "all_gather_into_tensor": "all_gather",
    "reduce_scatter_": "reduce_scatter",
    "_reduce_scatter_base_": "reduce_scatter",
    "reduce_scatter_tensor_coalesced_": "reduce_scatter",
    "reduce_scatter_tensor": "reduce_scatter",
    "broadcast_": "broadcast",
    "broadcast": "broadcast",
    "alltoall_": "all_to_all",
    "alltoall_base_": "all_to_all",
    "all_to_all_single": "all_to_all",
}
KINDS = ("p2p", "all_gather", "all_reduce", "reduce_scatter", "broadcast", "all_to_all")


def _collective_counter():
    """A dispatch mode counting the c10d collectives issued inside it (sends/receives are
    counted as batched calls by ``exchange_stats`` instead)."""
    from torch.utils._python_dispatch import TorchDispatchMode

    class _Counter(TorchDispatchMode):
        def __init__(self):
            super().__init__()
            self.counts = collections.Counter()

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            if func.namespace in ("c10d", "_c10d_functional"):
                name = func._schema.name.split("::")[-1]
                kind = _KIND_OF_OP.get(name)
                if kind is not None:
                    self.counts[kind] += 1
            return func(*args, **(kwargs or {}))

    return _Counter()


def predicted_kinds(collectives: dict) -> dict:
    """The cost model's counts (``plan.collectives``) grouped by the kinds measured here."""
    c = collectives
    return {
        "p2p": c["domain_p2p"],
        "all_gather": c["domain_all_gather"] + c["fsdp_all_gather"],
        "all_reduce": c["domain_all_reduce_norm"]
        + c["domain_grad_all_reduce"]
        + c["tp_all_reduce"]
        + c["ddp_all_reduce"],
        "reduce_scatter": c["fsdp_reduce_scatter"],
        "broadcast": 0,
        "all_to_all": 0,
        "tp_weight_regroup": c["tp_weight_regroup"],
    }


def _saved_bytes(step, parameters) -> int:
    """Bytes of the distinct storages autograd saves during ``step()`` (parameters excluded)."""
    skip = set()
    for p in parameters:
        local = p.to_local() if hasattr(p, "to_local") else p
        skip.add(local.untyped_storage().data_ptr())
    seen: dict[int, int] = {}

    def pack(t):
        storage = t.untyped_storage()
        if storage.data_ptr() not in skip:
            seen[storage.data_ptr()] = storage.nbytes()
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        step()
    return sum(seen.values())


@contextlib.contextmanager
def _quiet_stderr():
    """The profiler's native layer logs to fd 2; keep the benchmark output readable."""
    sys.stderr.flush()
    saved = os.dup(2)
    devnull = os.open(os.devnull, os.O_WRONLY)
    os.dup2(devnull, 2)
    try:
        yield
    finally:
        os.dup2(saved, 2)
        os.close(saved)
        os.close(devnull)


def _peak_bytes(step, device: torch.device | None = None) -> int:
    """Peak of bytes allocated during ``step()`` above what was allocated at its start: the
    CUDA caching allocator's statistics on a GPU, the profiler's memory events on the CPU."""
    from torch.profiler import ProfilerActivity, profile

    if device is not None and torch.device(device).type == "cuda":
        synchronize(device)
        start = torch.cuda.memory_allocated(device)
        torch.cuda.reset_peak_memory_stats(device)
        step()
        synchronize(device)
        return torch.cuda.max_memory_allocated(device) - start

    with _quiet_stderr(), profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
        step()
    events = [e for e in prof.profiler.kineto_results.events() if e.name() == "[memory]"]
    current = peak = 0
    for e in sorted(events, key=lambda e: e.start_ns()):
        if str(e.device_type()).endswith("CPU"):
            current += e.nbytes()
            peak = max(peak, current)
    return peak


def _warm_profiler() -> None:
    """Initialise the profiler once in the parent: forked ranks then skip its ~2 s start-up."""
    _peak_bytes(lambda: torch.ones(1) + 1)


# --------------------------------------------------------------------------- one run
def setup_run(rank, spec: ModelSpec, layout: Layout, opts: dict, device: torch.device):
    """(model, step) of one rank: ``step()`` runs one training step of the library's
    :class:`TrainStep` on this rank's fixed input rows, everything on ``device``."""
    torch.manual_seed(0)
    model = spec.build().to(device)
    if layout.world > 1:
        model = parallelize(model, layout.conf(spec.batch))
    set_model_overlap(model, opts.get("overlap", False))
    manager = get_domain_manager(model)
    domain_rank = rank % layout.domain
    dp_rank = rank // (layout.tp * layout.domain)
    shape = (spec.batch * opts["batch_scale"], *spec.input_shape)
    gen = torch.Generator().manual_seed(1 + dp_rank)  # a host generator: the same draws anywhere
    x = torch.randn(shape, generator=gen)
    weights = torch.randn(shape, generator=gen)
    a, b = shard_range(spec.height, layout.domain, domain_rank)
    x_local = x[:, :, a:b].contiguous().to(device)  # a training step's: needs no gradient
    w_local = weights[:, :, a:b].contiguous().to(device)
    count = weights.numel()
    token = ("bench", spec, shape)

    def weighted_share(outputs, targets):
        # each rank's share of a globally normalised loss; DDP averages over dp
        return (outputs[0] * targets[0]).sum() / count

    train_step = TrainStep(model, weighted_share, manager=manager, shard_inputs=False)
    batch = {"x": x_local, "y": w_local}

    def step():
        if manager is not None:
            manager.begin_forward(token)
        model.zero_grad(set_to_none=True)
        train_step.forward_backward(batch)
        train_step.reduce_gradients()

    step.batch = batch  # what the step reads, for checks of where it lives
    return model, step


def _timed(step, device: torch.device) -> float:
    """Seconds of one step; on CUDA after the queued kernels finished (they run asynchronously)."""
    synchronize(device)
    t0 = time.perf_counter()
    step()
    synchronize(device)
    return time.perf_counter() - t0


def _worker(rank, world, spec: ModelSpec, layout: Layout, overlap: bool, opts: dict):
    torch.set_num_threads(opts["threads"])
    opts = dict(opts, overlap=overlap)
    device = opts.get("device") or device_for_process_group()
    model, step = setup_run(rank, spec, layout, opts, device)

    def barrier():
        if world > 1:
            dist.barrier()

    for _ in range(opts["warmup"]):
        step()
    barrier()
    if opts.get("profile"):
        return {"profile": profile_step(step, model, steps=opts["steps"], warmup=0)}
    counter = _collective_counter()
    with counter, record_exchange_stats() as exchange_stats, record_small_collectives() as small:
        saved = _saved_bytes(step, list(model.parameters()))
    counts = dict(counter.counts + small)  # an all-reduce taken point to point is one still
    counts["p2p"] = exchange_stats.p2p_calls
    barrier()
    peak = _peak_bytes(step, device) if opts["memory"] else 0
    times = []
    with record_exchange_stats() as exchange_stats:
        for _ in range(opts["steps"]):
            barrier()
            times.append(_timed(step, device))
    n = opts["steps"]
    return {
        "median_s": statistics.median(times),
        "times_s": times,
        "halo_bytes": exchange_stats.bytes_sent / n,
        "halo_bytes_forward": exchange_stats.by_direction["forward"] / n,
        "halo_bytes_backward": exchange_stats.by_direction["backward"] / n,
        "halo_s": (exchange_stats.seconds["forward"] + exchange_stats.seconds["backward"]) / n,
        "p2p_calls": exchange_stats.p2p_calls / n,
        "overlapped_calls": exchange_stats.overlapped_calls / n,
        "collectives": {k: counts.get(k, 0) for k in KINDS},
        "saved_bytes": saved,
        "peak_bytes": peak,
    }


def _plan(spec: ModelSpec, layout: Layout):
    conf = layout.conf(spec.batch)
    conf["model"] = {"type": spec.kind}
    return make_plan(conf, layout.world, model=spec.build(), input_shapes=[spec.input_shape])


def _minimum_halo_bytes(plan, batch: int, dtype_bytes: int = 4) -> int:
    """Theoretical minimum per step and domain group: every distinct row a rank needs from
    another rank crosses once forward and its gradient once backward (none for an input that
    needs no gradient: the model's)."""
    total = 0
    for layer in plan.layers:
        if layer.halo_before:
            rows = sum(layer.halo_before) + sum(layer.halo_after)
            passes = 2 if layer.input_grad else 1
            total += passes * rows * layer.row_elements * batch * dtype_bytes
    return total


def measure(
    spec: ModelSpec,
    layout: Layout,
    *,
    overlap: bool = True,
    steps: int = 5,
    warmup: int = 2,
    threads: int = 1,
    batch_scale: int = 1,
    memory: bool = True,
    timeout: float = 3600.0,
    device: torch.device | None = None,
    profile: bool = False,
) -> list[dict]:
    """One run of ``spec`` under ``layout``: the per-rank results of :func:`_worker`.

    ``device``: where every rank computes (default: its process group's device).
    ``profile``: instead of timings, each rank returns ``{"profile": StepProfile}`` (per layer
    kind: compute, window assembly, blocked in communication, overhead; tools/profile.py)."""
    opts = dict(
        steps=steps,
        warmup=max(warmup, 2 if layout.dp > 1 else warmup),  # DDP rebuilds buckets at step 2
        threads=threads,
        batch_scale=batch_scale,
        memory=memory,
        device=device,
        profile=profile,
    )
    return run_on_ranks(_worker, layout.world, spec, layout, overlap, opts, timeout=timeout)
