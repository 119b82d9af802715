"""The benchmark behind ``credit-parallel bench`` (and the thin scripts in ``benchmarks/``), a tool above the library.

For reference models at two sizes and the layouts (dp, tp, domain) in {domain 1/2/4, tp 1/2,
dp 1/2} it runs training steps on local gloo CPU ranks (:func:`credit_parallel.testing.run_on_ranks`,
one intra-op thread per rank) through the library's own path (``parallelize``, ``shard`` rows,
globally normalised loss, ``sync_domain_gradients``) and prints ONE table with, per model, size,
layout and halo overlap on/off:

* the step time per rank (median of ``steps`` after ``warmup``; the slowest rank's median) and
  the parallel efficiency ``T_ref / T`` against the 1-rank run with the same number of threads in
  total and the same global batch (``dp x batch``);
* the halo bytes per step of one domain group: measured (``exchange_stats``), predicted by the
  cost model (:func:`credit_parallel.planner.predicted_halo_bytes` through ``make_plan``) and the
  theoretical minimum (every row a rank needs from another rank crosses once per direction);
  batched P2P calls per exchange (1 means every exchange is one ``batch_isend_irecv``);
* collectives per step and rank by kind, measured (every ``c10d`` op a step dispatches) against
  the cost model's :func:`~credit_parallel.planner.predicted_collectives`;
* bytes saved for backward per rank (distinct storages seen by
  ``torch.autograd.graph.saved_tensors_hooks``, parameters excluded) and the peak of allocated
  bytes during a step above its start (the profiler's memory events), both relative to the 1-rank
  run (x domain: 1.00 is a perfect 1/domain share), and the cost model's activation estimate;
* the halo time a step spends blocked in exchanges, and the share of it that overlap hides.

It writes ``bench.json`` (every figure, the machine and the command) and ``bench.png``
(scaling and memory), and with ``docs=PATH`` a Markdown page with the table and the targets.
"""

from __future__ import annotations

from .cli import add_bench_arguments, main, parse_args, run_bench
from .measure import KINDS, measure, predicted_kinds
from .report import (
    LEGEND,
    NOTES,
    evaluate_targets,
    format_table,
    target_status,
    write_chart,
    write_markdown,
)
from .specs import Layout, ModelSpec, build_conv_stack, default_layouts, default_models
from .suite import Row, run_suite

__all__ = [
    "KINDS",
    "LEGEND",
    "NOTES",
    "Layout",
    "ModelSpec",
    "Row",
    "add_bench_arguments",
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
