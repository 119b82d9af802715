"""``credit-parallel bench`` (and ``python -m credit_parallel.tools.bench``): options, the run, its files."""

from __future__ import annotations

import argparse
import json
import os
import shutil
import sys
import time
from dataclasses import asdict

from ..profile import format_profile, mean_profile
from .measure import measure
from .report import (
    LEGEND,
    NOTES,
    evaluate_targets,
    format_table,
    target_status,
    write_chart,
    write_markdown,
)
from .specs import Layout, default_layouts, default_models
from .suite import _loadavg, _machine, run_suite

__all__ = ["add_bench_arguments", "main", "parse_args", "run_bench", "run_loader", "run_profile"]


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
    ap.add_argument(
        "--profile",
        action="store_true",
        help="per layer kind: compute, window assembly, blocked in communication, overhead",
    )
    ap.add_argument(
        "--loader",
        metavar="STORE",
        default=None,
        help="loader only, no model: samples/s and MB/s of one rank's training loader over STORE",
    )
    ap.add_argument("--loader-workers", type=int, default=2, help="DataLoader workers (--loader)")
    ap.add_argument("--loader-domain", type=int, default=1, help="domain size (--loader)")
    ap.add_argument(
        "--gpu",
        action="store_true",
        help="the node check instead of the layout suite: environment, trainer smoke, verify "
        "float32/float64, plain vs library step time and peak memory (CUDA when --device allows, "
        "else the same table on gloo CPU ranks at small sizes)",
    )
    ap.add_argument(
        "--device",
        choices=("auto", "cuda", "cpu"),
        default="auto",
        help="auto: CUDA when a GPU is visible (--gpu), else the CPU; the layout suite runs gloo "
        "CPU ranks and refuses cuda",
    )
    return ap


def run_loader(args) -> int:
    """``bench --loader STORE``: the loader-only number of the middle domain rank."""
    from .loader import format_loader_line, loader_conf, measure_loader

    conf = loader_conf(args.loader, args.loader_workers)
    batches = getattr(args, "steps", None) or (2 if getattr(args, "quick", False) else 6)
    result = measure_loader(conf, domain=args.loader_domain, batches=batches)
    print(format_loader_line(args.loader, result))
    return 0


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
    if getattr(args, "loader", None):
        return run_loader(args)
    device = getattr(args, "device", "auto") or "auto"
    if getattr(args, "gpu", False):
        from .node_check import run_node_check

        return run_node_check(device=device, quick=quick)
    if device == "cuda":
        raise ValueError(
            "bench --device cuda: the layout suite runs gloo ranks on the CPU; the GPU check is "
            "`credit-parallel bench --gpu` (or drop --device)"
        )
    models, layouts = _select(args)
    if getattr(args, "profile", False):
        return run_profile(models, layouts, steps=steps, warmup=warmup)
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


def run_profile(models, layouts, *, steps: int, warmup: int) -> int:
    """``bench --profile``: one per-layer-kind table per model and layout (mean over ranks)."""
    for spec in models:
        for layout in layouts:
            per_rank = measure(spec, layout, steps=steps, warmup=warmup, memory=False, profile=True)
            title = f"{spec.describe()}; {layout.name}"
            print(format_profile(mean_profile([r["profile"] for r in per_rank]), title))
            print()
    return 0


def main(argv=None) -> int:
    args = parse_args(argv)
    script = sys.argv[0] if argv is None else "benchmarks/bench.py"
    if script.replace(os.sep, "/").endswith("credit_parallel/tools/bench/__main__.py"):
        script = "-m credit_parallel.tools.bench"
    else:
        script = os.path.relpath(script) if os.path.isabs(script) else script
    rest = sys.argv[1:] if argv is None else list(argv)
    args.command_line = " ".join([".venv/bin/python", script, *rest])
    return run_bench(args)
