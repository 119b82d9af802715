"""Loader-only throughput: samples/s and MB/s of ``build_train_loader`` (no model).

Sweeps rows per chunk, compression, domain size (the rank's rows) and DataLoader workers over
0.25-degree stores (721 x 1440 by default; ``--times`` steps of Z/T/U/V at 500/850 hPa + SP +
t2m = 10 channels; 41.5 MB per time step).  The stores are written once under ``--dir`` (the
1-row uncompressed one by ``write_sample_dataset``, the others copied from it by
``rechunk_store`` when this checkout has it) and reused by later runs.  Every sample is read
from the store (``cache_limit_bytes=0``); the operating system's page cache is warm after the
first pass, so this measures the reading and decoding, not the disk.

MB/s counts the decoded float32 bytes of the rank's ``x`` and ``y``; MB/CPU-s (no workers only)
the same bytes over the CPU time of the reading process, the rate one dedicated core reaches.  ``read/ideal``: the chunk
bytes one sample read from the store (``num_workers=0``, counted by the store) over the bytes of
exactly the rank's rows (uncompressed stores: 1.0 plus the chunk over-read at the shard edges).

    PYTHONPATH=src .venv/bin/python benchmarks/loader.py --rows-per-chunk 1 16 --workers 0 1

``--reader zarr tensorstore`` compares the chunk readers (``data.reader``; default ``auto``).
Workers forked after this process has read through tensorstore (an earlier ``--workers 0``
row) read through zarr (tensorstore cannot run in such a fork): sweep workers > 0 in a run of
their own, without ``--workers 0``.
"""

from __future__ import annotations

import argparse
import itertools
import time
from pathlib import Path

import numpy as np

from credit_parallel.data import write_sample_dataset
from credit_parallel.tools.bench.loader import loader_conf, measure_loader

LEVELS = (500, 850)
UPPER = ("Z", "T", "U", "V")
SURFACE = ("SP", "t2m")


def parse_args(argv=None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--dir", default="/tmp/credit_parallel_loader_bench")
    ap.add_argument("--grid", type=int, nargs=2, default=[721, 1440])
    ap.add_argument("--times", type=int, default=8)
    ap.add_argument("--rows-per-chunk", type=int, nargs="+", default=[1, 8, 16, 32, 91, 721])
    ap.add_argument("--compress", choices=["off", "on", "both"], default="off")
    ap.add_argument("--domain", type=int, nargs="+", default=[1, 8])
    ap.add_argument("--rank", type=int, default=None, help="domain rank (default: the middle)")
    ap.add_argument("--workers", type=int, nargs="+", default=[0, 1, 2])
    ap.add_argument("--batches", type=int, default=6, help="timed batches per configuration")
    ap.add_argument("--batch-size", type=int, default=1)
    ap.add_argument(
        "--reader", nargs="+", default=["auto"], choices=["auto", "tensorstore", "zarr"],
        help="data.reader values to compare (the chunk reader, data/chunk_reader.py)",
    )  # fmt: skip
    return ap.parse_args(argv)


def store_path(args, rows: int, compress: bool) -> Path:
    h, w = args.grid
    return (
        Path(args.dir) / f"era5_{h}x{w}_t{args.times}_r{rows}_{'zstd' if compress else 'raw'}.zarr"
    )


def ensure_store(args, rows: int, compress: bool) -> Path:
    path = store_path(args, rows, compress)
    if (path / "zarr.json").exists():
        return path
    base = store_path(args, 1, False)
    start = time.perf_counter()
    if not (base / "zarr.json").exists():
        write_sample_dataset(
            base,
            n_times=args.times,
            nlat=args.grid[0],
            nlon=args.grid[1],
            levels=LEVELS,
            time_chunk=1,
            lat_chunk=1,
            compress=False,
        )
    if path != base:
        try:
            from credit_parallel.data.rechunk import rechunk_store
        except ImportError:  # a checkout without rechunk_store: write the store directly
            write_sample_dataset(
                path,
                n_times=args.times,
                nlat=args.grid[0],
                nlon=args.grid[1],
                levels=LEVELS,
                time_chunk=1,
                lat_chunk=rows,
                compress=compress,
            )
        else:
            rechunk_store(base, path, lat_chunk=rows, time_chunk=1, compress=compress)
    print(f"# wrote {path.name} in {time.perf_counter() - start:.0f} s", flush=True)
    return path


def main(argv=None) -> int:
    args = parse_args(argv)
    compress = {"off": [False], "on": [True], "both": [False, True]}[args.compress]
    print(
        f"# grid {args.grid[0]}x{args.grid[1]}, {args.times} times, 10 channels, "
        f"batch {args.batch_size}, {args.batches} timed batches"
    )
    print("| rows/chunk | codec | domain | rank rows | reader | workers | samples/s | MB/s "
          "| MB/s/worker | read/ideal | MB/CPU-s |")  # fmt: skip
    print("|---|---|---|---|---|---|---|---|---|---|---|")
    for rows in args.rows_per_chunk:
        for packed in compress:
            path = ensure_store(args, rows, packed)
            for domain in args.domain:
                rank = None if args.rank is None else min(args.rank, domain - 1)
                for reader, workers in itertools.product(args.reader, args.workers):
                    conf = loader_conf(path, workers, args.batch_size, UPPER, SURFACE)
                    conf["data"]["levels"] = list(LEVELS)
                    conf["data"]["reader"] = reader
                    r = measure_loader(conf, domain=domain, rank=rank, batches=args.batches)
                    print(
                        f"| {rows} | {'zstd' if packed else 'none'} | {domain} | {r['rows']} | "
                        f"{reader} | {workers} | {r['samples_per_s']:.2f} | {r['mb_per_s']:.0f} | "
                        f"{r['mb_per_s'] / max(workers, 1):.0f} | {r['read_ratio']:.3f} | "
                        f"{'-' if r['mb_per_cpu_s'] is None else format(r['mb_per_cpu_s'], '.0f')} |",
                        flush=True,
                    )
    return 0


if __name__ == "__main__":
    np.seterr(all="ignore")
    raise SystemExit(main())
