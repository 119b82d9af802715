"""A forecast and one training step at 0.1 degrees (1801 x 3600) under domain 8 on CPU ranks, with
the peak memory per rank against what domain 1 needs.

1. Writes (if absent) the sample store at 1801 x 3600 (``era5_025deg.write_store``: both poles,
   16 rows per chunk, uncompressed; ``--levels`` 500 hPa only: Z, T, U, V at 500 hPa, SP, t2m,
   ``tsi`` forcing, ``orography`` static) and one checkpoint of a small U-Net (``--base-channels``
   4, mults 1/2, fp32: 8 inputs -> 6 outputs), as ``benchmarks/forecast.py`` does.
2. Runs under torchrun on ``--domain`` CPU ranks (one intra-op thread each): the forecast worker
   (``credit-parallel forecast``'s code: ``--inits`` x ``--steps``, every rank writing its rows),
   then, in a second launch, ONE training step (``run_training``, batch 1, AdamW).  Per rank: the
   peak RSS increase over the process with every library imported (``ru_maxrss``) and the CPU
   time.
3. What domain 1 needs, from the planner (``make_plan`` at domain 1 on one rank, the same model
   and grid; the forecast: ``planner/inference.py``, the activations alive at once under
   ``no_grad`` traced on meta), and the planner's figure for domain ``--domain`` beside the
   measured one.  ``--measure-domain1`` also runs the domain-1 forecast (it fits on the CPU).

    PYTHONPATH=src:benchmarks .venv/bin/python benchmarks/forecast_01deg.py --domain 8

Goal (issue 32 item 4): peak memory per rank at domain 8 <= 0.16 x domain 1.
"""

from __future__ import annotations

import argparse
import io
import json
import os
import resource
import subprocess
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent))

import forecast as fb  # noqa: E402 - the 0.25-degree forecast benchmark's store, model and worker

__all__ = ["main"]

MIB = 2**20


def parse_args(argv=None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--store", default="/tmp/credit_parallel_01deg/era5_01deg.zarr")
    ap.add_argument("--out", default="/tmp/credit_parallel_01deg/runs")
    ap.add_argument("--domain", type=int, default=8)
    ap.add_argument("--base-channels", type=int, default=4)
    ap.add_argument("--steps", type=int, default=2)
    ap.add_argument("--inits", type=int, default=1)
    ap.add_argument("--measure-domain1", action="store_true")
    ap.add_argument("--rank-worker", choices=("forecast", "train"), default=None)
    return ap.parse_args(argv)


def _bench_args(args) -> argparse.Namespace:
    """The arguments of ``benchmarks/forecast.py`` for this grid, store and model."""
    argv = ["--store", args.store, "--out", args.out, "--grid", "1801", "3600"]
    argv += ["--times", str(args.inits + args.steps + 1), "--levels", "500"]
    argv += ["--steps", str(args.steps), "--inits", str(args.inits)]
    argv += ["--base-channels", str(args.base_channels), "--channel-mults", "1", "2"]
    argv += ["--norm-groups", "2"]
    bench = fb.parse_args(argv)
    bench.checkpoint = Path(args.out) / "checkpoint"
    return bench


def _train_conf(bench, domain: int) -> dict:
    conf = fb._config(bench, domain)
    conf["trainer"].update(
        steps=1,
        batch_size=1,
        checkpoint_every=0,
        validate_every=0,
        final_checkpoint=False,
        lr=1e-3,
        warmup_steps=0,
    )
    conf["data"]["num_workers"] = 0
    return conf


def _train_rank(bench) -> dict:
    import torch
    import torch.distributed as dist

    from credit_parallel.train.main import run_training
    from credit_parallel.train.trainer import Trainer  # noqa: F401 - imported before the baseline

    torch.set_num_threads(1)
    rss_before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024.0
    dist.init_process_group("gloo")
    world = dist.get_world_size()
    cpu = time.process_time()
    run_training(
        _train_conf(bench, world),
        Path(bench.out) / f"train_d{world}",
        progress=False,
        stream=io.StringIO(),
    )
    out = {
        "rank": dist.get_rank(),
        "world": world,
        "peak_mib": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024.0 - rss_before,
        "cpu_s": time.process_time() - cpu,
    }
    dist.destroy_process_group()
    return out


def _result_path(out, mode: str, world: int, rank: int) -> Path:
    return Path(out) / "results" / f"{mode}_d{world}_rank{rank}.json"


def _launch(args, mode: str, domain: int) -> list[dict]:
    argv = [
        sys.executable, "-m", "torch.distributed.run", "--standalone",
        f"--nproc-per-node={domain}", __file__, "--rank-worker", mode,
        *[a for a in sys.argv[1:] if a != "--measure-domain1"],
    ]  # fmt: skip
    env = dict(os.environ, OMP_NUM_THREADS="1")
    paths = [_result_path(args.out, mode, domain, rank) for rank in range(domain)]
    for path in paths:
        path.unlink(missing_ok=True)
    done = subprocess.run(argv, env=env, capture_output=True, text=True, check=False)
    results = [json.loads(path.read_text()) for path in paths if path.exists()]
    if done.returncode != 0 or len(results) != domain:
        raise RuntimeError(
            f"{mode} at {domain} failed:\n{done.stdout[-3000:]}\n{done.stderr[-3000:]}"
        )
    return sorted(results, key=lambda r: r["rank"])


def planned(bench, domain: int) -> dict:
    """The planner's bytes per rank at ``domain`` (on ``domain`` ranks, the CPU): the training
    step's total and the forecast step's."""
    from credit_parallel.planner.inference import forecast_bytes, inference_live_elements
    from credit_parallel.planner.make import make_plan
    from credit_parallel.planner.trace import build_meta_model, model_input_shapes

    conf = _train_conf(bench, domain)
    plan = make_plan(conf, domain, device="cpu")
    model, _ = build_meta_model(conf)
    heights = {h for h, _ in plan.levels}
    live = inference_live_elements(model, model_input_shapes(model), heights, domain)
    return {
        "training_mib": plan.memory.total_bytes / MIB,
        "forecast_mib": forecast_bytes(plan.memory, live) / MIB,
    }


def main(argv=None) -> int:
    args = parse_args(argv)
    bench = _bench_args(args)
    if args.rank_worker is not None:  # one rank: its figures to a file (stdout interleaves)
        if args.rank_worker == "forecast":
            bench.checkpoint = fb._checkpoint(bench)
            result = fb._rank(bench)
        else:
            result = _train_rank(bench)
        path = _result_path(args.out, args.rank_worker, result["world"], result["rank"])
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(json.dumps(result))
        return 0
    from era5_025deg import write_store

    write_store(bench.store, bench.times, bench.levels, tuple(bench.grid))
    bench.checkpoint = fb._checkpoint(bench)
    started = time.perf_counter()
    rows = {"forecast": _launch(args, "forecast", args.domain)}
    rows["training step"] = _launch(args, "train", args.domain)
    one, many = planned(bench, 1), planned(bench, args.domain)
    d = args.domain
    print(
        f"0.1 degree (1801 x 3600), U-Net base {args.base_channels} mults [1, 2], 8 -> 6 "
        f"channels, fp32, domain {d} on CPU ranks, one thread each "
        f"({time.perf_counter() - started:.0f} s)"
    )
    print(f"what | measured peak MiB per rank (max, min over {d} ranks) | planned domain {d} | "
          "planned domain 1 | measured / planned domain 1")  # fmt: skip
    for what, key in (("forecast", "forecast_mib"), ("training step", "training_mib")):
        peaks = [r["peak_mib"] for r in rows[what]]
        print(
            f"{what} | {max(peaks):.0f}, {min(peaks):.0f} | {many[key]:.0f} | {one[key]:.0f} | "
            f"{max(peaks) / one[key]:.3f}"
        )
    if args.measure_domain1:
        base = _launch(args, "forecast", 1)[0]["peak_mib"]
        peak = max(r["peak_mib"] for r in rows["forecast"])
        print(f"forecast at domain 1 measured: {base:.0f} MiB; domain {d} / domain 1 "
              f"{peak / base:.3f}")  # fmt: skip
    return 0


if __name__ == "__main__":
    sys.exit(main())
