"""The forecast store's compression and chunk shape, measured: one rank's steps of a 0.25-degree
forecast written through the forecast writer (``StepWriter`` -> tensorstore) per codec and row
chunk.

Fields: the first ``--fields`` time steps of a benchmark store (``benchmarks/forecast.py
--channels 71`` writes it: Z, T, U, V on 17 levels, SP, t2m, tsi at 721 x 1440 = 71 channels,
0.3 GB a step), each step a field plus a small noise (``--noise``, in units of each channel's
standard deviation: a model's output is not as smooth as the synthetic sample).  For each
compression (``none``, ``zstd:1``, ``zstd:3``, ``lz4:5`` = blosc lz4 with byte shuffle) and each
row chunk (``--row-chunks``: rows per chunk; 721 = one chunk per variable and step) it writes
``--steps`` steps into a fresh store and prints the writer's throughput (MB of float32 values
per second of busy time), the CPU time per GB (``time.process_time``: every thread of the
process, tensorstore's included: what the writes take from a loaded machine), the bytes on
disk per step relative to the raw values, and the files per step.

    PYTHONPATH=src .venv/bin/python benchmarks/forecast_write.py \\
        --store /tmp/credit_parallel_forecast_025/era5_71ch.zarr --steps 6
"""

from __future__ import annotations

import argparse
import os
import shutil
import sys
import time
from pathlib import Path

import numpy as np
import torch

__all__ = ["main"]


def parse_args(argv=None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--store", default="/tmp/credit_parallel_forecast_025/era5_71ch.zarr")
    parser.add_argument("--out", default="/tmp/credit_parallel_forecast_write")
    parser.add_argument("--steps", type=int, default=6)
    parser.add_argument("--fields", type=int, default=2)
    parser.add_argument("--noise", type=float, default=0.01)
    parser.add_argument("--codecs", nargs="+", default=["none", "zstd:1", "zstd:3", "lz4:5"])
    parser.add_argument("--row-chunks", type=int, nargs="+", default=[721, 181, 46])
    parser.add_argument("--in-flight", type=int, default=2)
    return parser.parse_args(argv)


def _fields(args):
    """``(fields, slices, variables, latitude, longitude, levels)`` of the benchmark store."""
    import xarray as xr

    from credit_parallel.forecast.store import StoreVariable

    ds = xr.open_zarr(args.store, consolidated=False)
    upper = [n for n in ("Z", "T", "U", "V") if n in ds]
    surface = [n for n in ("SP", "t2m", "tsi") if n in ds]
    steps, slices, c = [], [], 0
    for name in upper:
        slices.append((name, slice(c, c + ds.sizes["level"]), True))
        c += ds.sizes["level"]
    for name in surface:
        slices.append((name, slice(c, c + 1), False))
        c += 1
    rng = np.random.default_rng(0)
    for t in range(args.fields):
        parts = [ds[n].isel(time=t).values for n in upper]
        parts += [ds[n].isel(time=t).values[None] for n in surface]
        field = np.concatenate(parts).astype(np.float32)
        scale = field.std(axis=(1, 2), keepdims=True) * args.noise
        steps.append(field + (rng.standard_normal(field.shape) * scale).astype(np.float32))
    variables = [StoreVariable(n, True) for n in upper] + [StoreVariable(n, False) for n in surface]
    coords = (ds["latitude"].values, ds["longitude"].values, list(ds["level"].values))
    return steps, slices, variables, coords


def _run(args, fields, slices, variables, coords, codec: str, rows: int) -> dict:
    from credit_parallel.forecast.store import ForecastStore
    from credit_parallel.forecast.writer import StepWriter

    latitude, longitude, levels = coords
    path = Path(args.out) / f"{codec.replace(':', '')}_{rows}.zarr"
    shutil.rmtree(path, ignore_errors=True)
    kind, _, level = codec.partition(":")
    store = ForecastStore.create(
        path,
        variables=variables,
        init_times=np.array(["2020-01-01"], dtype="datetime64[ns]"),
        lead_times=np.arange(1, args.steps + 1) * np.timedelta64(6, "h"),
        latitude=latitude,
        longitude=longitude,
        levels=levels,
        row_chunk=rows,
        compression=None if kind == "none" else (kind, int(level)),
    )
    writer = StepWriter(store, slices, in_flight=args.in_flight)
    height = len(latitude)
    cpu, wall = time.process_time(), time.perf_counter()
    for k in range(args.steps):
        block = torch.from_numpy(fields[k % len(fields)]).unsqueeze(0)
        writer.submit(block, (0, k), [None], (0, height), None)
    writer.close()
    cpu, wall = time.process_time() - cpu, time.perf_counter() - wall
    raw = writer.bytes
    names = {v.name for v in variables}  # the data chunks (not the coordinates, not `complete`)
    files = [
        p
        for p in path.rglob("*")
        if p.is_file() and p.relative_to(path).parts[:2] in {(n, "c") for n in names}
    ]
    disk = sum(p.stat().st_size for p in files)
    shutil.rmtree(path)  # 0.3 GB a step: one configuration on disk at a time
    return {
        "codec": codec,
        "rows": rows,
        "mb_s": raw / 1e6 / max(writer.busy_s, 1e-9),
        "cpu_s_gb": cpu / (raw / 1e9),
        "wall_s": wall,
        "ratio": disk / raw,
        "files_per_step": len(files) / args.steps,
    }


def main(argv=None) -> int:
    args = parse_args(argv)
    torch.set_num_threads(1)
    fields, slices, variables, coords = _fields(args)
    step_mb = fields[0].nbytes / 1e6
    print(
        f"{len(fields[0])} channels x {fields[0].shape[1]} x {fields[0].shape[2]}: {step_mb:.0f} MB "
        f"a step, {args.steps} steps per row, {args.in_flight} in flight, {os.cpu_count()} cores"
    )
    print("codec  | rows/chunk | files/step | MB/s (busy) | CPU s per GB | on disk / raw")
    for rows in args.row_chunks:
        for codec in args.codecs:
            r = _run(args, fields, slices, variables, coords, codec, rows)
            print(
                f"{r['codec']:6s} | {r['rows']:10d} | {r['files_per_step']:10.0f} | "
                f"{r['mb_s']:11.0f} | {r['cpu_s_gb']:12.2f} | {r['ratio']:.3f}",
                flush=True,
            )
    return 0


if __name__ == "__main__":
    sys.exit(main())
