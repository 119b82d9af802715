"""Loader-only throughput: samples/s and MB/s of ``build_train_loader`` (no model).

Sweeps rows per chunk, compression, domain size (the rank's rows) and DataLoader workers over
0.25-degree stores (721 x 1440 by default; ``--times`` steps of Z/T/U/V at 500/850 hPa + SP +
t2m = 10 channels; 41.5 MB per time step).  The stores are written once under ``--dir`` (the
1-row uncompressed one by ``write_sample_dataset``, the others copied from it by
``rechunk_store`` when this checkout has it) and reused by later runs.  Every sample is read
from the store (``cache_limit_bytes=0``); the operating system's page cache is warm after the
first pass, so this measures the reading and decoding, not the disk.

MB/s counts the decoded float32 bytes of the rank's ``x`` and ``y``.  ``read/ideal``: the chunk
bytes one sample read from the store (``num_workers=0``, counted by the store) over the bytes of
exactly the rank's rows (uncompressed stores: 1.0 plus the chunk over-read at the shard edges).

    PYTHONPATH=src .venv/bin/python benchmarks/loader.py --rows-per-chunk 1 16 --workers 0 1
"""

from __future__ import annotations

import argparse
import time
from pathlib import Path

import numpy as np

from credit_parallel.data import write_sample_dataset
from credit_parallel.data.loader import build_train_loader
from credit_parallel.domain.rows import shard_range

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


def config(path: Path, workers: int, batch_size: int) -> dict:
    return {
        "trainer": {"batch_size": batch_size, "seed": 0},
        "data": {
            "path": str(path),
            "upper_air_variables": list(UPPER),
            "surface_variables": list(SURFACE),
            "levels": list(LEVELS),
            "num_workers": workers,
            "cache_limit_bytes": 0,  # read every sample from the store
        },
    }


def read_ratio(path: Path, args, domain: int, rank: int) -> float:
    """Chunk bytes one sample reads over the bytes of exactly the rank's rows (in-process)."""
    loader = build_train_loader(
        config(path, 0, 1), dp_rank=0, dp_size=1, domain_rank=rank, domain_size=domain,
        device="cpu", num_workers=0,
    )  # fmt: skip
    dataset = loader.dataset
    dataset.reset_bytes_read()
    sample = dataset[0]
    ideal = sample["x"].numel() * 4 + sample["y"].numel() * 4
    return dataset.bytes_read / ideal


def measure(path: Path, args, domain: int, rank: int, workers: int) -> tuple[float, float]:
    """(samples/s, MB/s) of the rank's loader over ``--batches`` batches after one warm-up."""
    loader = build_train_loader(
        config(path, workers, args.batch_size), dp_rank=0, dp_size=1, domain_rank=rank,
        domain_size=domain, device="cpu", num_workers=workers,
    )  # fmt: skip
    batches = iter(loader)
    first = next(batches)  # starts the workers
    sample_bytes = (first["x"][0].numel() + first["y"][0].numel()) * 4
    start = time.perf_counter()
    for _ in range(args.batches):
        next(batches)
    elapsed = time.perf_counter() - start
    del batches, loader
    rate = args.batches * args.batch_size / elapsed
    return rate, rate * sample_bytes / 1e6


def main(argv=None) -> int:
    args = parse_args(argv)
    height = args.grid[0]
    compress = {"off": [False], "on": [True], "both": [False, True]}[args.compress]
    print(
        f"# grid {args.grid[0]}x{args.grid[1]}, {args.times} times, 10 channels, "
        f"batch {args.batch_size}, {args.batches} timed batches"
    )
    print("| rows/chunk | codec | domain | rank rows | workers | samples/s | MB/s | MB/s/worker "
          "| read/ideal |")  # fmt: skip
    print("|---|---|---|---|---|---|---|---|---|")
    for rows in args.rows_per_chunk:
        for packed in compress:
            path = ensure_store(args, rows, packed)
            for domain in args.domain:
                rank = domain // 2 if args.rank is None else min(args.rank, domain - 1)
                start, stop = shard_range(height, domain, rank)
                ratio = read_ratio(path, args, domain, rank)
                for workers in args.workers:
                    rate, mbs = measure(path, args, domain, rank, workers)
                    print(
                        f"| {rows} | {'zstd' if packed else 'none'} | {domain} | "
                        f"{stop - start} | {workers} | {rate:.2f} | {mbs:.0f} | "
                        f"{mbs / max(workers, 1):.0f} | {ratio:.3f} |",
                        flush=True,
                    )
    return 0


if __name__ == "__main__":
    np.seterr(all="ignore")
    raise SystemExit(main())
