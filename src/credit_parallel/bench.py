"""The benchmark behind ``credit-parallel bench`` (and the thin scripts in ``benchmarks/``).

For reference models at two sizes and the layouts (dp, tp, domain) in {domain 1/2/4, tp 1/2,
dp 1/2} it runs training steps on local gloo CPU ranks (:func:`credit_parallel.testing.run_on_ranks`,
one intra-op thread per rank) through the library's own path (``parallelize``, ``shard`` rows,
globally normalised loss, ``sync_domain_gradients``) and prints ONE table with, per model, size,
layout and halo overlap on/off:

* the step time per rank (median of ``steps`` after ``warmup``; the slowest rank's median) and
  the parallel efficiency ``T_ref / T`` against the 1-rank run with the same number of threads in
  total and the same global batch (``dp x batch``);
* the halo bytes per step of one domain group: measured (``exchange_stats``), predicted by the
  cost model (:func:`credit_parallel.plan.predicted_halo_bytes` through ``make_plan``) and the
  theoretical minimum (every row a rank needs from another rank crosses once per direction);
  batched P2P calls per exchange (1 means every exchange is one ``batch_isend_irecv``);
* collectives per step and rank by kind, measured (every ``c10d`` op a step dispatches) against
  the cost model's :func:`~credit_parallel.plan.predicted_collectives`;
* bytes saved for backward per rank (distinct storages seen by
  ``torch.autograd.graph.saved_tensors_hooks``, parameters excluded) and the peak of allocated
  bytes during a step above its start (the profiler's memory events), both relative to the 1-rank
  run (x domain: 1.00 is a perfect 1/domain share), and the cost model's activation estimate;
* the halo time a step spends blocked in exchanges, and the share of it that overlap hides.

It writes ``bench.json`` (every figure, the machine and the command) and ``bench.png``
(scaling and memory), and with ``docs=PATH`` a Markdown page with the table and the targets.
"""

from __future__ import annotations

import argparse
import collections
import contextlib
import json
import os
import platform
import shutil
import statistics
import sys
import time
from dataclasses import asdict, dataclass, field

import torch
import torch.distributed as dist
from torch import nn

__all__ = [
    "KINDS",
    "LEGEND",
    "Layout",
    "ModelSpec",
    "Row",
    "build_conv_stack",
    "default_layouts",
    "default_models",
    "evaluate_targets",
    "format_table",
    "main",
    "measure",
    "parse_args",
    "predicted_kinds",
    "run_bench",
    "run_suite",
    "target_status",
    "write_chart",
    "write_markdown",
]

_MIB = 2**20


# --------------------------------------------------------------------------- what is measured
def build_conv_stack(channels: int, blocks: int, groups: int) -> nn.Sequential:
    """``blocks`` x [3x3 conv (padding 1), GroupNorm(groups), SiLU] at a fixed width."""
    layers = []
    for _ in range(blocks):
        layers += [
            nn.Conv2d(channels, channels, 3, padding=1),
            nn.GroupNorm(groups, channels),
            nn.SiLU(),
        ]
    return nn.Sequential(*layers)


@dataclass(frozen=True)
class ModelSpec:
    """A reference model at one size: ``kind`` "conv_stack" or "unet" (``credit_parallel.models``)."""

    kind: str
    size: str
    channels: int
    height: int
    width: int
    batch: int = 1
    blocks: int = 4  # conv_stack
    groups: int = 8  # GroupNorm groups
    base_channels: int = 16  # unet
    channel_mults: tuple = (1, 2, 2)  # unet

    @property
    def label(self) -> str:
        return f"{self.kind}/{self.size}"

    def describe(self) -> str:
        if self.kind == "conv_stack":
            return (
                f"conv_stack {self.size}: {self.blocks} x [conv3x3 p1, GroupNorm({self.groups}), "
                f"SiLU], C={self.channels}, {self.height}x{self.width}, batch {self.batch}"
            )
        return (
            f"unet {self.size}: in/out {self.channels}, {self.height}x{self.width}, base "
            f"{self.base_channels} x {list(self.channel_mults)}, GroupNorm({self.groups}), "
            f"batch {self.batch}"
        )

    def build(self) -> nn.Module:
        if self.kind == "conv_stack":
            return build_conv_stack(self.channels, self.blocks, self.groups)
        if self.kind == "unet":
            from .models import UNet

            return UNet(
                self.channels,
                self.channels,
                self.height,
                self.width,
                base_channels=self.base_channels,
                channel_mults=self.channel_mults,
                norm_groups=self.groups,
            )
        raise ValueError(f"unknown benchmark model kind {self.kind!r} (conv_stack, unet)")

    @property
    def input_shape(self) -> tuple:
        """Per-sample input (and output) shape, C x H x W."""
        return (self.channels, self.height, self.width)

    @property
    def has_tensor_parallel(self) -> bool:
        return self.kind == "unet"


@dataclass(frozen=True)
class Layout:
    """Parallel degrees of one run; ranks are laid out row-major over (dp, tp, domain)."""

    dp: int = 1
    tp: int = 1
    domain: int = 1

    @property
    def world(self) -> int:
        return self.dp * self.tp * self.domain

    @property
    def data(self) -> str:
        if self.dp == 1:
            return "none"
        return "ddp" if self.tp == 1 else "fsdp2"

    @property
    def name(self) -> str:
        return f"dp{self.dp} tp{self.tp} d{self.domain}"

    def conf(self, batch: int) -> dict:
        return {
            "trainer": {
                "parallelism": {"data": self.data, "tensor": self.tp, "domain": self.domain},
                "batch_size": batch,
            }
        }


def default_models(quick: bool = False) -> list[ModelSpec]:
    if quick:
        return [
            ModelSpec("conv_stack", "tiny", channels=8, height=24, width=32, blocks=2, groups=2),
            ModelSpec(
                "unet",
                "tiny",
                channels=4,
                height=17,
                width=16,
                base_channels=8,
                groups=2,
                channel_mults=(1, 2),
            ),
        ]
    return [
        ModelSpec("conv_stack", "small", channels=32, height=96, width=192),
        ModelSpec("conv_stack", "large", channels=64, height=192, width=384),
        ModelSpec("unet", "small", channels=8, height=33, width=64, base_channels=16, groups=4),
        ModelSpec("unet", "large", channels=8, height=97, width=192, base_channels=32, groups=4),
    ]


def default_layouts(quick: bool = False) -> list[Layout]:
    if quick:
        return [Layout(), Layout(domain=2), Layout(tp=2), Layout(dp=2)]
    return [
        Layout(),
        Layout(domain=2),
        Layout(domain=4),
        Layout(tp=2),
        Layout(tp=2, domain=2),
        Layout(dp=2),
        Layout(dp=2, domain=2),
    ]


# --------------------------------------------------------------------------- counting
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


def _peak_bytes(step) -> int:
    """Peak of CPU bytes allocated during ``step()`` above what was allocated at its start."""
    from torch.profiler import ProfilerActivity, profile

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
def _worker(rank, world, spec: ModelSpec, layout: Layout, overlap: bool, opts: dict):
    from .collectives import sync_domain_gradients
    from .composition import get_domain_manager, get_raw_model, parallelize
    from .domain.exchange import record_exchange_stats
    from .domain.overlap import set_model_overlap
    from .domain.rows import shard_range

    torch.set_num_threads(opts["threads"])
    torch.manual_seed(0)
    model = spec.build()
    if layout.world > 1:
        model = parallelize(model, layout.conf(spec.batch))
    set_model_overlap(model, overlap)
    manager = get_domain_manager(model)
    raw = get_raw_model(model)
    domain_rank = rank % layout.domain
    dp_rank = rank // (layout.tp * layout.domain)
    batch = spec.batch * opts["batch_scale"]
    shape = (batch, *spec.input_shape)
    gen = torch.Generator().manual_seed(1 + dp_rank)
    x = torch.randn(shape, generator=gen)
    weights = torch.randn(shape, generator=gen)
    a, b = shard_range(spec.height, layout.domain, domain_rank)
    x_local = x[:, :, a:b].contiguous().requires_grad_()
    w_local = weights[:, :, a:b].contiguous()
    count = weights.numel()
    token = ("bench", spec, shape)

    def step():
        if manager is not None:
            manager.begin_forward(token)
        model.zero_grad(set_to_none=True)
        x_local.grad = None
        # each rank's share of a globally normalised loss; DDP averages over dp
        ((model(x_local) * w_local).sum() / count).backward()
        sync_domain_gradients(raw, manager, op="sum")

    def barrier():
        if world > 1:
            dist.barrier()

    for _ in range(opts["warmup"]):
        step()
    barrier()
    counter = _collective_counter()
    with counter, record_exchange_stats() as exchange_stats:
        saved = _saved_bytes(step, list(model.parameters()))
    counts = dict(counter.counts)
    counts["p2p"] = exchange_stats.p2p_calls
    barrier()
    peak = _peak_bytes(step) if opts["memory"] else 0
    times = []
    with record_exchange_stats() as exchange_stats:
        for _ in range(opts["steps"]):
            barrier()
            t0 = time.perf_counter()
            step()
            times.append(time.perf_counter() - t0)
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
    from .planner import make_plan

    conf = layout.conf(spec.batch)
    conf["model"] = {"type": spec.kind}
    return make_plan(conf, layout.world, model=spec.build(), input_shapes=[spec.input_shape])


def _minimum_halo_bytes(plan, batch: int, dtype_bytes: int = 4) -> int:
    """Theoretical minimum per step and domain group: every distinct row a rank needs from
    another rank crosses once forward and its gradient once backward."""
    total = 0
    for layer in plan.layers:
        if layer.halo_before:
            rows = sum(layer.halo_before) + sum(layer.halo_after)
            total += 2 * rows * layer.row_elements * batch * dtype_bytes
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
) -> list[dict]:
    """One run of ``spec`` under ``layout``: the per-rank results of :func:`_worker`."""
    from .testing import run_on_ranks

    opts = dict(
        steps=steps,
        warmup=max(warmup, 2 if layout.dp > 1 else warmup),  # DDP rebuilds buckets at step 2
        threads=threads,
        batch_scale=batch_scale,
        memory=memory,
    )
    return run_on_ranks(_worker, layout.world, spec, layout, overlap, opts, timeout=timeout)


@dataclass
class Row:
    """One line of the table (one model, size, layout and overlap setting)."""

    model: str
    layout: str
    dp: int
    tp: int
    domain: int
    overlap: bool | None
    ranks: int
    step_s: float
    step_s_per_rank: list
    reference_s: float
    efficiency: float
    halo_bytes: float
    halo_bytes_forward: float
    halo_bytes_backward: float
    halo_bytes_predicted: int
    halo_bytes_minimum: int
    p2p_per_exchange: float | None
    collectives: dict
    collectives_predicted: dict
    saved_bytes: int
    saved_ratio: float
    saved_predicted_bytes: int
    peak_bytes: int
    peak_ratio: float
    halo_s: float
    halo_hidden: float | None = None
    notes: list = field(default_factory=list)


def _row(spec, layout, overlap, results, reference_s, single, plan) -> Row:
    tp_dp = layout.dp * layout.tp
    step_s = max(r["median_s"] for r in results)
    measured_kinds = {k: max(r["collectives"][k] for r in results) for k in KINDS}
    exchanging = plan.collectives["domain_p2p"]
    p2p = max(r["p2p_calls"] for r in results)
    saved = max(r["saved_bytes"] for r in results)
    peak = max(r["peak_bytes"] for r in results)
    return Row(
        model=spec.label,
        layout=layout.name,
        dp=layout.dp,
        tp=layout.tp,
        domain=layout.domain,
        overlap=overlap if layout.domain > 1 else None,
        ranks=layout.world,
        step_s=step_s,
        step_s_per_rank=[r["median_s"] for r in results],
        reference_s=reference_s,
        efficiency=reference_s / step_s,
        halo_bytes=sum(r["halo_bytes"] for r in results) / tp_dp,
        halo_bytes_forward=sum(r["halo_bytes_forward"] for r in results) / tp_dp,
        halo_bytes_backward=sum(r["halo_bytes_backward"] for r in results) / tp_dp,
        halo_bytes_predicted=plan.halo_bytes_per_step,
        halo_bytes_minimum=_minimum_halo_bytes(plan, spec.batch),
        p2p_per_exchange=p2p / exchanging if exchanging else None,
        collectives=measured_kinds,
        collectives_predicted=predicted_kinds(plan.collectives),
        saved_bytes=saved,
        saved_ratio=saved * layout.domain / single["saved_bytes"],
        saved_predicted_bytes=plan.memory.activation_bytes,
        peak_bytes=peak,
        peak_ratio=(peak * layout.domain / single["peak_bytes"]) if single["peak_bytes"] else 0.0,
        halo_s=statistics.mean(r["halo_s"] for r in results),
    )


# --------------------------------------------------------------------------- the suite
def _machine() -> dict:
    cpu = platform.processor() or platform.machine()
    with contextlib.suppress(OSError):
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    cpu = line.split(":", 1)[1].strip()
                    break
    return {
        "cpu": cpu,
        "cores": os.cpu_count(),
        "python": platform.python_version(),
        "torch": torch.__version__,
        "backend": "gloo (CPU)",
        "platform": platform.platform(),
    }


def _loadavg() -> str:
    try:
        with open("/proc/loadavg") as f:
            return " ".join(f.read().split()[:3])
    except OSError:
        return "n/a"


def _pool(first: list[dict], more: list[dict]) -> None:
    """Add another round's step times (and halo seconds) to ``first``, per rank."""
    for a, b in zip(first, more):
        rounds = a.get("rounds", 1)
        a["halo_s"] = (a["halo_s"] * rounds + b["halo_s"]) / (rounds + 1)
        a["rounds"] = rounds + 1
        a["times_s"] = a["times_s"] + b["times_s"]
        a["median_s"] = statistics.median(a["times_s"])


def run_suite(
    models: list[ModelSpec],
    layouts: list[Layout],
    *,
    steps: int,
    warmup: int,
    overlap_modes=(True, False),
    memory: bool = True,
    rounds: int = 1,
    log=print,
) -> list[Row]:
    """Every (model, layout, overlap) run plus the references they need; rows in order.

    With ``rounds`` > 1 every run of a model is repeated that many times, the runs of one round
    interleaved (references, overlap on and off alternate), and the step times of all rounds are
    pooled before the median: a change of the machine's load then hits every configuration
    alike instead of whichever happened to run during it.  Bytes, calls and memory come from
    the first round.
    """
    # This process only plans and forks the ranks.  It must never run an OpenMP team of several
    # threads: GNU OpenMP does not survive fork, and a rank that asks for threads would hang.
    torch.set_num_threads(1)
    if memory:
        _warm_profiler()
    rows: list[Row] = []
    for spec in models:
        log(f"{spec.describe()}")
        # the jobs of one round: ("ref", threads, batch scale) and ("run", layout, overlap)
        jobs: list[tuple] = [("ref", 1, 1)]
        plans = {}
        for layout in layouts:
            if layout.tp > 1 and not spec.has_tensor_parallel:
                continue
            plan = _plan(spec, layout)
            if plan.violations:
                log(f"  {layout.name}: skipped ({plan.violations[0]})")
                continue
            plans[layout] = plan
            if ("ref", layout.world, layout.dp) not in jobs:
                jobs.append(("ref", layout.world, layout.dp))
            if layout.world > 1:
                for overlap in overlap_modes if layout.domain > 1 else (True,):
                    jobs.append(("run", layout, overlap))
        results: dict[tuple, list[dict]] = {}
        for round_index in range(rounds):
            for job in jobs:
                first = round_index == 0
                if job[0] == "ref":
                    _, threads, scale = job
                    log(
                        f"  [{round_index + 1}/{rounds}] 1 rank, {threads} thread(s), batch x{scale}"
                    )
                    out = measure(
                        spec,
                        Layout(),
                        steps=steps,
                        warmup=warmup,
                        threads=threads,
                        batch_scale=scale,
                        memory=memory and first and job == ("ref", 1, 1),
                    )
                else:
                    _, layout, overlap = job
                    state = f", overlap {'on' if overlap else 'off'}" if layout.domain > 1 else ""
                    log(f"  [{round_index + 1}/{rounds}] {layout.name}{state}")
                    out = measure(
                        spec,
                        layout,
                        overlap=overlap,
                        steps=steps,
                        warmup=warmup,
                        memory=memory and first,
                    )
                if first:
                    results[job] = out
                else:
                    _pool(results[job], out)
        single = results[("ref", 1, 1)][0]
        for layout, plan in plans.items():
            reference_s = results[("ref", layout.world, layout.dp)][0]["median_s"]
            if layout.world == 1:
                rows.append(_row(spec, layout, True, [single], reference_s, single, plan))
                continue
            for overlap in overlap_modes if layout.domain > 1 else (True,):
                out = results[("run", layout, overlap)]
                rows.append(_row(spec, layout, overlap, out, reference_s, single, plan))
        # the share of the halo time overlap hides, per layout with both settings
        by_key = {(r.model, r.layout, r.overlap): r for r in rows if r.model == spec.label}
        for (model, name, overlap), row in by_key.items():
            off = by_key.get((model, name, False))
            if overlap and off is not None and off.halo_s > 0:
                row.halo_hidden = 1.0 - row.halo_s / off.halo_s
    return rows


# --------------------------------------------------------------------------- reporting
def _mib(n: float) -> str:
    return f"{n / _MIB:.2f}"


def _kinds(c: dict) -> str:
    short = {
        "p2p": "p",
        "all_gather": "ag",
        "all_reduce": "ar",
        "reduce_scatter": "rs",
        "broadcast": "bc",
        "all_to_all": "a2a",
        "tp_weight_regroup": "rg",
    }
    parts = [f"{short[k]}{v}" for k, v in c.items() if v]
    return " ".join(parts) or "-"


_COLUMNS = [
    ("model", "model/size"),
    ("layout", "layout"),
    ("ovl", "ovl"),
    ("step", "step ms"),
    ("ref", "ref ms"),
    ("eff", "eff"),
    ("halo", "halo KiB/step meas/pred/min"),
    ("p2p", "p2p/exch"),
    ("coll", "collectives/step meas / pred"),
    ("saved", "saved MiB/rank"),
    ("savedr", "x d/1rk"),
    ("savedp", "pred MiB"),
    ("peak", "peak MiB/rank"),
    ("peakr", "x d/1rk"),
    ("halos", "halo ms"),
    ("hidden", "hidden"),
]


def _cells(row: Row) -> dict:
    overlap = "-" if row.overlap is None else ("on" if row.overlap else "off")
    halo = "-"
    if row.domain > 1:
        halo = (
            f"{row.halo_bytes / 1024:.0f} / {row.halo_bytes_predicted / 1024:.0f} / "
            f"{row.halo_bytes_minimum / 1024:.0f}"
        )
    return {
        "model": row.model,
        "layout": row.layout,
        "ovl": overlap,
        "step": f"{row.step_s * 1e3:.1f}",
        "ref": f"{row.reference_s * 1e3:.1f}",
        "eff": f"{row.efficiency:.3f}",
        "halo": halo,
        "p2p": "-" if row.p2p_per_exchange is None else f"{row.p2p_per_exchange:.2f}",
        "coll": f"{_kinds(row.collectives)} / {_kinds(row.collectives_predicted)}",
        "saved": _mib(row.saved_bytes),
        "savedr": f"{row.saved_ratio:.3f}",
        "savedp": _mib(row.saved_predicted_bytes),
        "peak": _mib(row.peak_bytes),
        "peakr": f"{row.peak_ratio:.3f}",
        "halos": "-" if row.domain == 1 else f"{row.halo_s * 1e3:.2f}",
        "hidden": "-" if row.halo_hidden is None else f"{row.halo_hidden:.2f}",
    }


def format_table(rows: list[Row]) -> str:
    """The one table of a run (plain text, aligned columns)."""
    cells = [_cells(r) for r in rows]
    header = {key: title for key, title in _COLUMNS}
    widths = {k: max(len(header[k]), *(len(c[k]) for c in cells)) for k, _ in _COLUMNS}
    left = {"model", "layout", "coll", "halo"}

    def line(c):
        return " | ".join(
            c[k].ljust(widths[k]) if k in left else c[k].rjust(widths[k]) for k, _ in _COLUMNS
        )

    out = [line(header), "-+-".join("-" * widths[k] for k, _ in _COLUMNS)]
    out += [line(c) for c in cells]
    return "\n".join(out)


LEGEND = (
    "step ms: median step (forward, backward, gradient sync) of the slowest rank; ref ms: 1 rank "
    "with as many threads as the layout has ranks and the same global batch; eff = ref/step. "
    "halo: bytes per step and domain group, measured / cost model / theoretical minimum. "
    "p2p/exch: batched P2P calls per exchange (1 = one batch_isend_irecv per layer and "
    "direction). collectives per rank and step by kind (p: batched P2P, ag: all-gather, ar: "
    "all-reduce, rs: reduce-scatter, bc: broadcast, rg: TP weight regroup), measured / cost model. "
    "saved: bytes saved for backward on the largest rank; peak: peak allocated bytes during a step "
    "above its start; 'x d/1rk' = per-rank value x domain / 1-rank value (1.00 = exactly 1/domain). "
    "halo ms: time per step blocked in exchanges (mean over ranks); hidden: share of the "
    "overlap-off halo time that overlap hides."
)


NOTES = (
    "Overlap (domain/conv.py): a convolution posts its halo exchange, convolves the interior "
    "output rows from its own shard while the rows travel, then the boundary rows; its backward "
    "computes the window's input gradient, posts the halo gradients and computes the weight and "
    "bias gradients while they travel.  On CPU the results are bitwise those of overlap off "
    "(tests/test_overlap.py).  It is off by default (on this 2-core machine the split "
    "convolution costs more than the halo time it hides; on CUDA cuDNN may choose other "
    "algorithms for a few boundary rows): turn it on with "
    "credit_parallel.domain.overlap.set_model_overlap(model, True).",
    "Efficiency is measured against ONE process using as many intra-op threads as the layout "
    "has ranks, on the same global batch: 1.0 means domain/tensor/data parallelism over N "
    "processes is as fast as N threads in one process.  tp layouts replicate every layer that "
    "is not tensor-parallel, so they cannot reach 1.0 on these models.",
    "The machine is shared with other jobs and has 2 cores: layouts with 4 ranks (and the "
    "4-thread references) oversubscribe it, and all timings move with the load average shown "
    "above; the byte, call and memory figures do not depend on the load.",
    "Halo time is the time a rank is blocked in exchanges (posting plus waiting, including "
    "waiting for a slower neighbour); with overlap on, the computation between post and wait "
    "is not counted, so 'hidden' is the share of the overlap-off halo time that disappeared.",
    "The cost model's activation estimate counts leaf-module outputs; autograd saves module "
    "inputs (the model input, not the last output) and the halo rows, hence the small gap.",
)


def evaluate_targets(rows: list[Row], target_model: str = "conv_stack/large") -> list[dict]:
    """The issue's targets, each with the figures it was judged on and whether it is met
    (``met`` is None when this run did not measure it)."""
    targets = []
    dom = [r for r in rows if r.domain > 1]
    bad_halo = [r for r in dom if round(r.halo_bytes) != r.halo_bytes_minimum]
    targets.append(
        {
            "target": "halo bytes per step equal to the theoretical minimum",
            "met": None if not dom else not bad_halo,
            "figures": f"{len(dom) - len(bad_halo)}/{len(dom)} domain runs exactly at the minimum",
        }
    )
    calls = [r.p2p_per_exchange for r in dom if r.p2p_per_exchange is not None]
    targets.append(
        {
            "target": "one batched call per exchange",
            "met": None if not calls else all(abs(c - 1.0) < 1e-9 for c in calls),
            "figures": f"P2P calls per exchange: {sorted(set(round(c, 3) for c in calls))}",
        }
    )
    for d in (2, 4):
        cands = [r for r in rows if r.domain == d and r.dp == 1 and r.tp == 1]
        worst = max((r.saved_ratio for r in cands), default=None)
        targets.append(
            {
                "target": f"saved-activation bytes per rank at domain {d} <= 1.1/{d} of 1 rank",
                "met": None if worst is None else worst <= 1.1,
                "figures": "n/a"
                if worst is None
                else f"worst per-rank x {d} / 1-rank = {worst:.3f}",
            }
        )
    eff = [
        r
        for r in rows
        if r.model == target_model and r.domain == 2 and r.dp == 1 and r.tp == 1 and r.overlap
    ]
    targets.append(
        {
            "target": f"parallel efficiency at domain 2 for {target_model} >= 0.9 (overlap on)",
            "met": None if not eff else eff[0].efficiency >= 0.9,
            "figures": "n/a"
            if not eff
            else (
                f"{eff[0].efficiency:.3f} (step {eff[0].step_s * 1e3:.0f} ms vs 1 rank x 2 threads "
                f"{eff[0].reference_s * 1e3:.0f} ms)"
            ),
        }
    )
    hidden = [r.halo_hidden for r in eff if r.halo_hidden is not None]
    targets.append(
        {
            "target": f"overlap hides >= half of the halo time ({target_model}, domain 2)",
            "met": None if not hidden else hidden[0] >= 0.5,
            "figures": "n/a" if not hidden else f"hidden share {hidden[0]:.2f}",
        }
    )
    return targets


def target_status(met) -> str:
    return "n/a" if met is None else ("met" if met else "NOT met")


def write_chart(rows: list[Row], path: str) -> None:
    """bench.png: parallel efficiency per layout (scaling) and memory per rank x domain."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    models = list(dict.fromkeys(r.model for r in rows))
    layouts = list(dict.fromkeys(r.layout for r in rows))
    fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(13, 4.8))
    width = 0.8 / max(1, len(models))
    for k, model in enumerate(models):
        mine = {r.layout: r for r in rows if r.model == model and r.overlap in (True, None)}
        xs = [
            i + (k - (len(models) - 1) / 2) * width
            for i, name in enumerate(layouts)
            if name in mine
        ]
        ax1.bar(xs, [mine[name].efficiency for name in layouts if name in mine], width, label=model)
        plain = sorted((r.domain, r) for r in mine.values() if r.dp == 1 and r.tp == 1)
        dom = [d for d, _ in plain]
        line = ax2.plot(
            dom, [r.saved_ratio / d for d, r in plain], marker="o", label=f"{model} saved"
        )[0]
        ax2.plot(
            dom,
            [r.peak_ratio / d for d, r in plain],
            marker="s",
            linestyle="--",
            color=line.get_color(),
            label=f"{model} peak",
        )
    ax1.set_xticks(range(len(layouts)))
    ax1.set_xticklabels(layouts)
    ax1.axhline(0.9, color="grey", linestyle=":", linewidth=1)
    ax1.set_ylabel("T(1 rank, same threads) / T(layout)")
    ax1.set_title("parallel efficiency per layout (overlap on; dotted: 0.9)")
    ax1.tick_params(axis="x", rotation=30)
    ax1.legend(fontsize=8)
    ds = [1, 2, 4]
    ax2.plot(ds, [1 / d for d in ds], color="black", linestyle=":", label="1/domain")
    ax2.plot(ds, [1.1 / d for d in ds], color="grey", linestyle=":", label="1.1/domain")
    ax2.set_xlabel("domain ranks")
    ax2.set_ylabel("per-rank bytes / 1-rank bytes")
    ax2.set_title("memory per rank (saved for backward, peak)")
    ax2.set_xticks(ds)
    ax2.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def write_markdown(result: dict, path: str) -> None:
    """A page with the machine, the command, the table and the targets of one run."""
    m = result["machine"]
    lines = [
        "# Performance",
        "",
        "Figures of the latest `credit-parallel bench` run (regenerate them with the command "
        "below; the page is written by the benchmark itself).",
        "",
        f"- command: `{result['command']}`",
        f"- machine: {m['cpu']}, {m['cores']} cores, {m['platform']}; Python {m['python']}, "
        f"torch {m['torch']}, {m['backend']}, 1 intra-op thread per rank",
        f"- load average (1/5/15 min) before / after: {result['loadavg_before']} / "
        f"{result['loadavg_after']} (the machine is shared; medians of {result['steps']} steps "
        f"after {result['warmup']} warm-up steps, x {result.get('rounds', 1)} interleaved rounds)",
        f"- date: {result['date']}, wall time {result['wall_s']:.0f} s",
        "",
        "Models:",
        "",
    ]
    lines += [f"- {d}" for d in result["models"]]
    lines += ["", "```", result["table"], "```", "", LEGEND, "", "## Targets", ""]
    lines += ["| target | met | figures |", "| --- | --- | --- |"]
    for t in result["targets"]:
        lines.append(f"| {t['target']} | {target_status(t['met'])} | {t['figures']} |")
    lines += ["", f"![scaling and memory]({result.get('chart', 'bench.png')})", ""]
    if result.get("notes"):
        lines += ["## Notes", ""] + [f"- {n}" for n in result["notes"]] + [""]
    with open(path, "w") as f:
        f.write("\n".join(lines))


# --------------------------------------------------------------------------- entry points
def add_bench_arguments(ap: argparse.ArgumentParser) -> argparse.ArgumentParser:
    """The options of ``credit-parallel bench`` (shared by the CLI and benchmarks/bench.py)."""
    ap.add_argument("--quick", action="store_true", help="tiny sizes, a few steps (smoke run)")
    ap.add_argument("--output", default="outputs/bench", help="bench.json and bench.png go here")
    ap.add_argument("--steps", type=int, default=None, help="timed steps (median taken)")
    ap.add_argument("--warmup", type=int, default=None, help="untimed steps first")
    ap.add_argument("--models", default=None, help="comma list of kind/size, e.g. conv_stack/large")
    ap.add_argument("--layouts", default=None, help="comma list like 1x1x2 (dp x tp x domain)")
    ap.add_argument("--no-memory", action="store_true", help="skip the profiled peak-memory step")
    ap.add_argument(
        "--rounds", type=int, default=None, help="interleaved repeats pooled per run (default 1)"
    )
    ap.add_argument("--docs", default=None, help="also write the Markdown page here")
    return ap


def parse_args(argv=None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(
        prog="credit-parallel bench",
        description="step time, halo bytes, collectives and memory per layout (gloo CPU ranks)",
    )
    return add_bench_arguments(ap).parse_args(argv)


def _select(args):
    quick = bool(getattr(args, "quick", False))
    models = default_models(quick)
    wanted = getattr(args, "models", None)
    if wanted:
        names = [w.strip() for w in wanted.split(",") if w.strip()]
        known = {m.label: m for m in default_models(False) + default_models(True)}
        missing = [n for n in names if n not in known]
        if missing:
            raise ValueError(f"bench --models: unknown {missing}; known: {sorted(known)}")
        models = [known[n] for n in names]
    layouts = default_layouts(quick)
    wanted = getattr(args, "layouts", None)
    if wanted:
        layouts = []
        for item in wanted.split(","):
            try:
                dp, tp, d = (int(v) for v in item.strip().split("x"))
            except ValueError:
                raise ValueError(
                    f"bench --layouts: {item!r} is not dp x tp x domain such as 1x1x2"
                ) from None
            layouts.append(Layout(dp, tp, d))
    return models, layouts


def run_bench(args) -> int:
    """``credit-parallel bench``: run the suite, print the table, write JSON, PNG (and docs)."""
    quick = bool(getattr(args, "quick", False))
    steps = getattr(args, "steps", None) or (2 if quick else 5)
    warmup = getattr(args, "warmup", None)
    warmup = (1 if quick else 2) if warmup is None else warmup
    output = getattr(args, "output", None) or "outputs/bench"
    memory = not getattr(args, "no_memory", False)
    rounds = getattr(args, "rounds", None) or 1
    models, layouts = _select(args)
    os.makedirs(output, exist_ok=True)
    command = getattr(args, "command_line", None) or "credit-parallel bench " + " ".join(
        sys.argv[2:] if len(sys.argv) > 2 and sys.argv[1] == "bench" else sys.argv[1:]
    )
    before = _loadavg()
    t0 = time.time()
    rows = run_suite(
        models,
        layouts,
        steps=steps,
        warmup=warmup,
        memory=memory,
        rounds=rounds,
        log=lambda s: print(s, file=sys.stderr, flush=True),
    )
    table = format_table(rows)
    targets = evaluate_targets(rows)
    print(table)
    print()
    print(LEGEND)
    print()
    for t in targets:
        print(f"[{target_status(t['met'])}] {t['target']}: {t['figures']}")
    result = {
        "command": command.strip(),
        "date": time.strftime("%Y-%m-%d %H:%M:%S %Z"),
        "machine": _machine(),
        "loadavg_before": before,
        "loadavg_after": _loadavg(),
        "wall_s": time.time() - t0,
        "steps": steps,
        "warmup": warmup,
        "rounds": rounds,
        "models": [m.describe() for m in models],
        "table": table,
        "targets": targets,
        "rows": [asdict(r) for r in rows],
        "notes": list(NOTES),
    }
    with open(os.path.join(output, "bench.json"), "w") as f:
        json.dump(result, f, indent=1, default=str)
    write_chart(rows, os.path.join(output, "bench.png"))
    docs = getattr(args, "docs", None)
    if docs:
        chart = os.path.splitext(docs)[0] + ".png"
        shutil.copyfile(os.path.join(output, "bench.png"), chart)
        result["chart"] = os.path.basename(chart)
        write_markdown(result, docs)
    print(f"\nwrote {os.path.join(output, 'bench.json')} and {os.path.join(output, 'bench.png')}")
    return 0


def main(argv=None) -> int:
    args = parse_args(argv)
    script = sys.argv[0] if argv is None else "benchmarks/bench.py"
    if script.replace(os.sep, "/").endswith("credit_parallel/bench.py"):
        script = "-m credit_parallel.bench"
    else:
        script = os.path.relpath(script) if os.path.isabs(script) else script
    rest = sys.argv[1:] if argv is None else list(argv)
    args.command_line = " ".join([".venv/bin/python", script, *rest])
    return run_bench(args)


if __name__ == "__main__":
    raise SystemExit(main())
