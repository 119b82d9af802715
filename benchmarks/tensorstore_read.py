"""Raw read rate of tensorstore on the loader-benchmark stores, to compare with zarr's.

Reads the rows ``benchmarks/zarr_read.py`` reads (the middle domain rank's rows of Z/T/U/V at
500/850 hPa, SP and t2m, every time step; domain 1 is all 721 rows, both poles) with
tensorstore's ``zarr3`` driver, written straight into one float32 ``(10, rows, W)`` sample
buffer per time step (``ts.array`` over the numpy buffer; no tensorstore cache), a warm-up pass
then ``--passes`` timed passes.  ``--mode concurrent`` issues the six variables' reads at once
and waits for all; ``sequential`` waits for each (what the project's zarr reader does).  Prints
MB per CPU second, wall MB/s and the CRC32 of time step 0's bytes, which must equal
``benchmarks/zarr_read.py``'s.  Needs only numpy and tensorstore (a project dependency):

    .venv/bin/python benchmarks/tensorstore_read.py
"""

from __future__ import annotations

import argparse
import time
import zlib
from pathlib import Path

import numpy as np
import tensorstore as ts

STORE = "/tmp/credit_parallel_loader_bench/era5_721x1440_t8_r16_raw.zarr"
UPPER = ("Z", "T", "U", "V")  # levels 500, 850 = store positions 0, 1
SURFACE = ("SP", "t2m")


def shard_range(length: int, n: int, rank: int) -> tuple[int, int]:
    """Rows of ``rank`` of ``n`` near-equal contiguous shards (credit_parallel.domain.rows)."""
    base, extra = divmod(length, n)
    start = rank * base + min(rank, extra)
    return start, start + base + (1 if rank < extra else 0)


def open_arrays(store: str) -> dict:
    spec = {"driver": "zarr3", "kvstore": {"driver": "file", "path": ""}}
    arrays = {}
    for name in UPPER + SURFACE:
        spec["kvstore"]["path"] = str(Path(store) / name)
        arrays[name] = ts.open(spec, read=True).result()
    return arrays


def read_step(arrays: dict, t: int, rows: tuple[int, int], out: np.ndarray, mode: str) -> None:
    """Time ``t``'s rows of the ten channels into ``out`` (channel order as the project's)."""
    r0, r1 = rows
    futures, channel = [], 0
    for name in UPPER + SURFACE:
        upper = name in UPPER
        source = arrays[name][t, 0:2, r0:r1, :] if upper else arrays[name][t, r0:r1, :]
        target = out[channel : channel + 2] if upper else out[channel]
        future = ts.array(target).write(source)
        if mode == "sequential":
            future.result()
        futures.append(future)
        channel += 2 if upper else 1
    for future in futures:
        future.result()


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--store", default=STORE)
    ap.add_argument("--domain", type=int, nargs="+", default=[1, 8])
    ap.add_argument("--mode", nargs="+", default=["concurrent", "sequential"])
    ap.add_argument("--passes", type=int, default=3)
    args = ap.parse_args(argv)
    arrays = open_arrays(args.store)
    n_times, height, width = arrays["SP"].shape
    print(f"# {args.store}")
    print("| reader | domain | rank | rows | mode | MB/CPU-s | wall MB/s | crc32(t=0) |")
    print("|---|---|---|---|---|---|---|---|")
    for domain in args.domain:
        rank = domain // 2
        rows = shard_range(height, domain, rank)
        for mode in args.mode:
            out = np.empty((10, rows[1] - rows[0], width), np.float32)
            read_step(arrays, 0, rows, out, mode)
            crc = zlib.crc32(out.tobytes())
            for t in range(n_times):  # warm-up pass
                read_step(arrays, t, rows, np.empty_like(out), mode)
            nbytes, wall, cpu = 0, time.perf_counter(), time.process_time()
            for _ in range(args.passes):
                for t in range(n_times):
                    out = np.empty_like(out)  # a fresh sample buffer, as the loader makes
                    read_step(arrays, t, rows, out, mode)
                    nbytes += out.nbytes
            wall, cpu = time.perf_counter() - wall, time.process_time() - cpu
            print(
                f"| tensorstore | {domain} | {rank} | {rows[1] - rows[0]} | {mode} | "
                f"{nbytes / 1e6 / cpu:.0f} | {nbytes / 1e6 / wall:.0f} | {crc:08x} |",
                flush=True,
            )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
