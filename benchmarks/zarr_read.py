"""Raw read rate of the project's zarr reader at several ``async.concurrency`` values.

Reads one rank's rows of all 10 channels (Z/T/U/V at 500/850 hPa, SP, t2m) of every time step of
a loader-benchmark store (``benchmarks/loader.py`` writes them) with ``ERA5Dataset._read`` (one
zarr request per variable decoded into the sample buffer; ``normalize=False``, no cache), a
warm-up pass then ``--passes`` timed passes.  Prints MB per CPU second (decoded float32 bytes over
the process CPU time, all threads) and wall MB/s, and a checksum (CRC32 of the float32 bytes of
time step 0) that ``benchmarks/tensorstore_read.py`` must reproduce.

    PYTHONPATH=src .venv/bin/python benchmarks/zarr_read.py --concurrency 1 4 10 32
"""

from __future__ import annotations

import argparse
import time
import zlib

import zarr

from credit_parallel.data import ERA5Dataset

STORE = "/tmp/credit_parallel_loader_bench/era5_721x1440_t8_r16_raw.zarr"


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--store", default=STORE)
    ap.add_argument("--domain", type=int, nargs="+", default=[1, 8])
    ap.add_argument("--concurrency", type=int, nargs="+", default=[1, 4, 10, 32])
    ap.add_argument("--passes", type=int, default=3)
    args = ap.parse_args(argv)
    print(f"# {args.store}")
    print("| reader | domain | rank | rows | concurrency | MB/CPU-s | wall MB/s | crc32(t=0) |")
    print("|---|---|---|---|---|---|---|---|")
    for domain in args.domain:
        rank = domain // 2
        ds = ERA5Dataset(
            args.store, ["Z", "T", "U", "V"], ["SP", "t2m"], levels=[500, 850],
            normalize=False, cache_limit_bytes=0, domain_shard=(rank, domain),
        )  # fmt: skip
        n_times = ds._time_positions.size
        for concurrency in args.concurrency:
            with zarr.config.set({"async.concurrency": concurrency}):
                crc = zlib.crc32(ds._read(0, 1).tobytes())
                for t in range(n_times):  # warm-up pass
                    ds._read(t, t + 1)
                nbytes, wall, cpu = 0, time.perf_counter(), time.process_time()
                for _ in range(args.passes):
                    for t in range(n_times):
                        nbytes += ds._read(t, t + 1).nbytes
                wall, cpu = time.perf_counter() - wall, time.process_time() - cpu
            print(
                f"| zarr {zarr.__version__} | {domain} | {rank} | {ds.rows[1] - ds.rows[0]} | "
                f"{concurrency} | {nbytes / 1e6 / cpu:.0f} | {nbytes / 1e6 / wall:.0f} | "
                f"{crc:08x} |",
                flush=True,
            )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
