"""The benchmark suite: every (model, layout, overlap) run plus the 1-rank references, one row each."""

from __future__ import annotations

import contextlib
import os
import platform
import statistics
from dataclasses import dataclass, field

import torch

from .measure import KINDS, _minimum_halo_bytes, _plan, _warm_profiler, measure, predicted_kinds
from .specs import Layout, ModelSpec

__all__ = ["Row", "run_suite"]


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
        # what autograd saves: the traced saved tensors, the halo-extended inputs, the inputs
        saved_predicted_bytes=plan.memory.activation_bytes
        + plan.memory.exchange_bytes
        + plan.memory.input_bytes,
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
        jobs, plans = _jobs(spec, layouts, overlap_modes, log)
        results: dict[tuple, list[dict]] = {}
        for round_index in range(rounds):
            for job in jobs:
                first = round_index == 0
                log(f"  [{round_index + 1}/{rounds}] {_job_label(job)}")
                out = _measure_job(spec, job, steps=steps, warmup=warmup, memory=memory and first)
                if first:
                    results[job] = out
                else:
                    _pool(results[job], out)
        rows.extend(_model_rows(spec, plans, results, overlap_modes))
    return rows


def _jobs(spec: ModelSpec, layouts: list[Layout], overlap_modes, log) -> tuple[list, dict]:
    """The jobs of one round of ``spec``: ("ref", threads, batch scale) for each reference and
    ("run", layout, overlap) for each run; and ``{layout: plan}`` of the layouts it runs (a
    layout the planner refuses is skipped, with its first violation logged)."""
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
    return jobs, plans


def _job_label(job: tuple) -> str:
    if job[0] == "ref":
        return f"1 rank, {job[1]} thread(s), batch x{job[2]}"
    _, layout, overlap = job
    state = f", overlap {'on' if overlap else 'off'}" if layout.domain > 1 else ""
    return f"{layout.name}{state}"


def _measure_job(spec: ModelSpec, job: tuple, *, steps: int, warmup: int, memory: bool):
    """One job's per-rank measurements; a reference's memory only for the 1-thread one."""
    if job[0] == "ref":
        _, threads, scale = job
        return measure(
            spec, Layout(), steps=steps, warmup=warmup, threads=threads, batch_scale=scale,
            memory=memory and job == ("ref", 1, 1),
        )  # fmt: skip
    _, layout, overlap = job
    return measure(spec, layout, overlap=overlap, steps=steps, warmup=warmup, memory=memory)


def _model_rows(spec: ModelSpec, plans: dict, results: dict, overlap_modes) -> list[Row]:
    """The rows of one model from its jobs' results, with the share of the halo time overlap
    hides per layout measured with both settings."""
    rows: list[Row] = []
    single = results[("ref", 1, 1)][0]
    for layout, plan in plans.items():
        reference_s = results[("ref", layout.world, layout.dp)][0]["median_s"]
        if layout.world == 1:
            rows.append(_row(spec, layout, True, [single], reference_s, single, plan))
            continue
        for overlap in overlap_modes if layout.domain > 1 else (True,):
            out = results[("run", layout, overlap)]
            rows.append(_row(spec, layout, overlap, out, reference_s, single, plan))
    by_key = {(r.model, r.layout, r.overlap): r for r in rows}
    for (model, name, overlap), row in by_key.items():
        off = by_key.get((model, name, False))
        if overlap and off is not None and off.halo_s > 0:
            row.halo_hidden = 1.0 - row.halo_s / off.halo_s
    return rows
