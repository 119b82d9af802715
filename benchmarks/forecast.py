"""Forecast throughput and memory at 0.25 degrees: ``credit-parallel forecast`` at domain 1, 2, 4.

1. Writes (if absent) the 0.25-degree sample store (721 x 1440, both poles, 6-hourly, 16 rows per
   chunk, uncompressed: ``era5_025deg.write_store``) with ``--times`` times; it carries the
   top-of-atmosphere insolation ``tsi`` (dynamic forcing) and ``orography`` (static).
2. Saves one checkpoint of a small variant of the bundled ``era5_025deg_unet.yaml`` U-Net
   (``--base-channels``, ``--channel-mults``; fp32) with the sample variables, the forcing and the
   static field as inputs.
3. For each domain size in ``--domains`` runs the forecast worker (:func:`run_forecast`, the
   code ``credit-parallel forecast`` runs) on that many ranks under torchrun ({data: none,
   tensor 1, domain D}, one intra-op thread per rank): ``--inits`` initial times, ``--steps``
   steps each, every rank writing its rows into ``forecast.zarr``.  Per rank it reports the
   rollout steps per second (all steps of all initial times over the wall time of the loop),
   peak memory (CUDA: ``max_memory_allocated``; CPU: the peak RSS increase over the RSS before
   data and model existed, ``ru_maxrss``) and the share of the loop's wall time the rank spent
   waiting for its writer (the write time left on the critical path: ``in_flight`` steps not
   written yet, the fence of the previous initial time), the writer's busy time (wall time with
   a step in the writer) and its throughput per rank (MB written / busy time), and the loop's
   CPU time per step (``time.process_time``: all threads of the rank, the writer's included).

``--channels 71``: the size of a real 0.25-degree model's output (0.3 GB a step): Z, T, U, V on
17 levels, SP, t2m (70 prognostic) and ``tsi`` as a diagnostic (output-only) variable;
orography static; no forcing, so the store needs only the initial times and the truth of lead
1 (``--times`` >= ``--inits`` + 1; the 0.25-degree sample generator holds every time of the
store in memory, about 1 GB per time at 71 channels).  ``--channels 10`` (default): 2 levels, ``tsi`` as dynamic forcing.  An
existing ``--store`` whose grid, times, levels or variables differ from what is asked is
refused (``check_store``).

    PYTHONPATH=src .venv/bin/python benchmarks/forecast.py --steps 4 --inits 2
    PYTHONPATH=src .venv/bin/python benchmarks/forecast.py --channels 71 --steps 6 --inits 2 \
        --times 3 --domains 1 4

Goals: write share < 5 % (issue 32); peak memory per rank at domain 4 <= 0.35 x domain 1.
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

__all__ = ["main", "parse_args"]

RESULT_PREFIX = "FORECAST_BENCH_RESULT "
MIB = 2**20
# --channels 71: 4 x 17 levels + SP, t2m + tsi (diagnostic)
LEVELS_71 = [50, 100, 150, 200, 250, 300, 400, 500, 600, 700, 775, 850, 900, 925, 950, 975, 1000]


def parse_args(argv=None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument(
        "--store", default=None, help="(default /tmp/credit_parallel_forecast_025/era5_<C>ch.zarr)"
    )
    parser.add_argument("--out", default="/tmp/credit_parallel_forecast_025/runs")
    parser.add_argument("--times", type=int, default=8, help="time steps written to the store")
    parser.add_argument("--levels", type=float, nargs="+", default=None, help="(default 500 850)")
    parser.add_argument(
        "--channels", type=int, choices=(10, 71), default=10, help="output channels (see above)"
    )
    parser.add_argument("--steps", type=int, default=4, help="forecast steps per initial time")
    parser.add_argument("--inits", type=int, default=2, help="initial times")
    parser.add_argument("--base-channels", type=int, default=8)
    parser.add_argument("--channel-mults", type=int, nargs="+", default=[1, 2])
    parser.add_argument("--norm-groups", type=int, default=4)
    parser.add_argument("--domains", type=int, nargs="+", default=[1, 2, 4])
    parser.add_argument("--device", choices=("cpu", "cuda"), default="cpu")
    parser.add_argument("--grid", type=int, nargs=2, default=[721, 1440])
    parser.add_argument("--rank-worker", type=int, default=None, help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.levels is None:
        args.levels = [float(v) for v in (LEVELS_71 if args.channels == 71 else (500, 850))]
    elif args.channels == 71 and len(args.levels) != len(LEVELS_71):
        parser.error(f"--channels 71 takes {len(LEVELS_71)} levels, got {len(args.levels)}")
    if args.store is None:
        args.store = f"/tmp/credit_parallel_forecast_025/era5_{args.channels}ch.zarr"
    # 10 channels: tsi is the forcing of every lead; 71: no forcing, so an initial time needs
    # only itself (leads past the store's end are forecast and written, not scored)
    needed = args.inits + (args.steps if args.channels == 10 else 1)
    if args.times < needed:
        parser.error(f"--times {args.times} < {needed} (--inits, and --steps of forcing)")
    return args


def _config(args, domain: int) -> dict:
    from credit_parallel.data import SAMPLE_SURFACE_VARIABLES, SAMPLE_UPPER_AIR_VARIABLES

    prognostic = len(SAMPLE_UPPER_AIR_VARIABLES) * len(args.levels) + len(SAMPLE_SURFACE_VARIABLES)
    diagnostic = args.channels == 71  # tsi predicted (output only), else fed as forcing
    return {
        "model": {
            "type": "unet",
            # + tsi (forcing) + orography (static), or + orography only
            "in_channels": prognostic + (1 if diagnostic else 2),
            "out_channels": prognostic + (1 if diagnostic else 0),
            "image_height": args.grid[0],
            "image_width": args.grid[1],
            "base_channels": args.base_channels,
            "channel_mults": list(args.channel_mults),
            "norm_groups": args.norm_groups,
        },
        "data": {
            "path": args.store,
            "upper_air_variables": list(SAMPLE_UPPER_AIR_VARIABLES),
            "surface_variables": list(SAMPLE_SURFACE_VARIABLES),
            **({"diagnostic_variables": ["tsi"]} if diagnostic else {}),
            "dynamic_forcing_variables": [] if diagnostic else ["tsi"],
            "static_variables": ["orography"],
            "levels": list(args.levels),
            "time_slice": [0, args.times],
            "cache_limit_bytes": 0,  # read every step from the store, as at full ERA5 size
        },
        "trainer": {
            "parallelism": {"data": "none", "tensor": 1, "domain": domain},
            "seed": 42,
            "dist_timeout_s": 600,
        },
    }


def _checkpoint(args) -> Path:
    import torch

    from credit_parallel.models import build_model
    from credit_parallel.train.checkpoint import latest_checkpoint, save_checkpoint

    grid = f"{args.grid[0]}x{args.grid[1]}"
    directory = Path(args.out) / f"checkpoint_{args.channels}ch_{grid}_b{args.base_channels}"
    found = latest_checkpoint(directory) if directory.exists() else None
    if found is not None:
        return found
    torch.manual_seed(42)
    return save_checkpoint(directory, 1, build_model(_config(args, 1)["model"]))


def _rank(args) -> dict:
    import numpy as np
    import torch
    import torch.distributed as dist

    from credit_parallel.forecast import command, scores, store, weights  # noqa: F401

    build_arguments, run_forecast = command.build_arguments, command.run_forecast
    import matplotlib.pyplot  # noqa: F401 - imported before the baseline, as the libraries are

    torch.set_num_threads(1)
    # the baseline: the process with every library imported, before data and model exist
    rss_before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024.0
    if args.device == "cuda":
        torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", "0")))
    dist.init_process_group("nccl" if args.device == "cuda" else "gloo")
    world = dist.get_world_size()
    times = np.datetime64("2020-01-01T00") + np.arange(args.inits) * np.timedelta64(6, "h")
    ap = argparse.ArgumentParser()
    build_arguments(ap)
    flags = ap.parse_args(
        ["--config", "-", "--checkpoint", str(args.checkpoint), "--steps", str(args.steps)]
        + ["--output", str(Path(args.out) / f"domain{world}"), "--overwrite", "--init-times"]
        + [str(t) for t in times]
    )
    flags.progress = False
    command.fix_mmap_threshold()  # as the forecast command's worker does
    cpu = time.process_time()
    result = run_forecast(_config(args, world), flags, stream=io.StringIO())
    cpu = time.process_time() - cpu  # the whole run (setup, scores); the loop's share below
    peak = (
        torch.cuda.max_memory_allocated() / MIB
        if args.device == "cuda"
        else resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024.0 - rss_before
    )
    out = {
        "rank": dist.get_rank(),
        "world": world,
        "steps_per_s": result["steps"] / result["elapsed_s"],
        "elapsed_s": result["elapsed_s"],
        "write_share": result["write_blocked_s"] / result["elapsed_s"],
        "writer_busy_s": result["write_s"],
        "writer_mb_s": result["write_mb_s"],
        "written_mb": result["write_bytes"] / 1e6,
        "cpu_s": cpu,
        "peak_mib": peak,
        "baseline_mib": rss_before,  # ru_maxrss with the libraries imported (CPU)
    }
    print(RESULT_PREFIX + json.dumps(out), flush=True)
    dist.destroy_process_group()
    return out


def _launch(args, domain: int) -> list[dict]:
    argv = [
        sys.executable, "-m", "torch.distributed.run", "--standalone",
        f"--nproc-per-node={domain}", __file__, "--rank-worker", str(domain),
        *sys.argv[1:],
    ]  # fmt: skip
    env = dict(os.environ, OMP_NUM_THREADS="1")
    done = subprocess.run(argv, env=env, capture_output=True, text=True, check=False)
    results = [
        json.loads(line[len(RESULT_PREFIX) :])
        for line in done.stdout.splitlines()
        if line.startswith(RESULT_PREFIX)
    ]
    if done.returncode != 0 or len(results) != domain:
        raise RuntimeError(f"domain {domain} failed:\n{done.stdout[-3000:]}\n{done.stderr[-3000:]}")
    return sorted(results, key=lambda r: r["rank"])


def check_store(path, times: int, levels, grid, channels: int) -> None:
    """Refuse an existing store that is not the one asked for (grid, times, levels, variables)."""
    import xarray as xr

    from credit_parallel.data import SAMPLE_SURFACE_VARIABLES, SAMPLE_UPPER_AIR_VARIABLES

    path = Path(path)
    if not (path / "zarr.json").exists():
        return
    ds = xr.open_zarr(path, consolidated=False)
    wanted = {*SAMPLE_UPPER_AIR_VARIABLES, *SAMPLE_SURFACE_VARIABLES, "tsi", "orography"}
    found = {
        "grid": (ds.sizes.get("latitude"), ds.sizes.get("longitude")),
        "times": ds.sizes.get("time"),
        "levels": [float(v) for v in ds["level"].values] if "level" in ds else [],
    }
    asked = {"grid": tuple(grid), "times": times, "levels": [float(v) for v in levels]}
    differ = [k for k in asked if found[k] != asked[k]]
    missing = sorted(wanted - set(ds.data_vars))
    if differ or missing:
        what = "; ".join(f"{k} {found[k]} (asked {asked[k]})" for k in differ)
        what += f"; variables missing: {missing}" if missing else ""
        raise SystemExit(
            f"--store {path} holds another store than --channels {channels} asks for: {what}. "
            "Pass another --store (it is written when absent) or delete this one."
        )


def main(argv=None) -> int:
    args = parse_args(argv)
    sys.path.insert(0, str(Path(__file__).parent))
    from era5_025deg import write_store

    args.checkpoint = Path(args.out) / "checkpoint"
    if args.rank_worker is not None:
        args.checkpoint = _checkpoint(args)
        _rank(args)
        return 0
    check_store(args.store, args.times, args.levels, args.grid, args.channels)
    write_store(args.store, args.times, args.levels, tuple(args.grid))
    args.checkpoint = _checkpoint(args)
    started = time.perf_counter()
    table = {d: _launch(args, d) for d in args.domains}
    print(f"forecast at {args.grid[0]} x {args.grid[1]}, {args.channels} channels: "
          f"{args.inits} initial times x {args.steps} steps, U-Net base {args.base_channels} mults {args.channel_mults}, "
          f"{args.device}, one thread per rank ({time.perf_counter() - started:.0f} s)")  # fmt: skip
    print(
        "domain | rank | steps/s | peak MiB | write share (critical path) | writer busy s | "
        "writer MB/s | MB written | CPU s"
    )
    for d, rows in table.items():
        for r in rows:
            print(
                f"{d:6d} | {r['rank']:4d} | {r['steps_per_s']:7.3f} | {r['peak_mib']:8.0f} | "
                f"{100 * r['write_share']:26.1f}% | {r['writer_busy_s']:13.2f} | "
                f"{r['writer_mb_s']:11.0f} | {r['written_mb']:10.0f} | {r['cpu_s']:.1f}"
            )
    if 1 in table:
        base = max(r["peak_mib"] for r in table[1])
        for d in table:
            ratio = max(r["peak_mib"] for r in table[d]) / base
            print(f"peak memory per rank, domain {d} / domain 1: {ratio:.2f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
