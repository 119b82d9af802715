"""The loader-only number: samples/s and MB/s of one rank's ``build_train_loader``, no model.

A GPU waits for data when the loader delivers fewer samples per second than the model consumes;
this measures the loader alone, so it can be set against the step rate of ``bench`` (or of a
training log, whose ``data_wait_ms`` says how long each step waited).  Every sample is read from
the store (``cache_limit_bytes=0``).  MB/s counts the decoded float32 bytes of the rank's ``x``
and ``y``; ``read_ratio`` is the chunk bytes one sample fetched from the store over exactly those
bytes (1.0 plus the over-read at the rank's shard edges on an uncompressed store).  With no
workers, ``mb_per_cpu_s`` is the same bytes over the CPU time the reading process used (all its
threads): a per-core rate that holds on a machine other jobs load.

Used by ``credit-parallel bench --loader STORE`` and ``benchmarks/loader.py``.
"""

from __future__ import annotations

import time
import warnings

from ...data.loader import build_train_loader
from ...data.store import LEVEL_NAMES, find_dim, open_store
from ...domain.rows import shard_range

__all__ = ["format_loader_line", "loader_conf", "measure_loader", "store_variables"]


def store_variables(path) -> tuple[list[str], list[str]]:
    """(upper-air, surface) variable names of the store: those with a level dim, the rest."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        ds, _ = open_store(path, "bench --loader")
    level = find_dim(ds.dims, LEVEL_NAMES)
    upper = [name for name, v in ds.data_vars.items() if level is not None and level in v.dims]
    surface = [name for name, v in ds.data_vars.items() if name not in upper and v.ndim == 3]
    ds.close()
    return upper, surface


def loader_conf(path, workers: int, batch_size: int = 1, upper=None, surface=None) -> dict:
    """A config reading every variable of ``path`` (or those given), never cached."""
    if upper is None or surface is None:
        upper, surface = store_variables(path)
    return {
        "trainer": {"batch_size": batch_size, "seed": 0},
        "data": {
            "path": str(path),
            "upper_air_variables": list(upper),
            "surface_variables": list(surface),
            "num_workers": workers,
            "cache_limit_bytes": 0,
        },
    }


def measure_loader(
    conf: dict, *, domain: int = 1, rank: int | None = None, batches: int = 6
) -> dict:
    """Time ``batches`` batches of domain rank ``rank`` (default the middle one) after one
    warm-up batch (which starts the workers); also the bytes one sample reads in-process."""
    rank = domain // 2 if rank is None else rank
    workers = int(conf["data"]["num_workers"])
    height = None

    def loader(num_workers: int, run_conf: dict = conf):
        return build_train_loader(
            run_conf, dp_rank=0, dp_size=1, domain_rank=rank, domain_size=domain, device="cpu",
            num_workers=num_workers,
        )  # fmt: skip

    # the probe reads through zarr (same chunks counted as tensorstore's): a tensorstore read in
    # this process would make the workers forked below fall back to zarr (data/chunk_reader.py)
    probe_conf = {**conf, "data": {**conf["data"], "reader": "zarr"}}
    probe = loader(0, probe_conf).dataset
    height = probe.grid_shape[0]
    probe.reset_bytes_read()
    sample = probe[0]
    sample_bytes = (sample["x"].numel() + sample["y"].numel()) * 4
    read_ratio = probe.bytes_read / sample_bytes
    del probe
    stream = iter(loader(workers))
    first = next(stream)
    batch = first["x"].shape[0]
    start, cpu = time.perf_counter(), time.process_time()
    for _ in range(batches):
        next(stream)
    elapsed, cpu = time.perf_counter() - start, time.process_time() - cpu
    del stream
    rate = batches * batch / elapsed
    rows = shard_range(height, domain, rank)
    return {
        "domain": domain,
        "rank": rank,
        "rows": rows[1] - rows[0],
        "workers": workers,
        "samples_per_s": rate,
        "mb_per_s": rate * sample_bytes / 1e6,
        "read_ratio": read_ratio,
        # in-process reads: MB per CPU second of this process (all its threads), the rate of one
        # dedicated core, which a loaded machine's wall clock does not show
        "mb_per_cpu_s": batches * batch * sample_bytes / 1e6 / cpu if workers == 0 else None,
    }


def format_loader_line(path, result: dict) -> str:
    return (
        f"loader {path}: domain {result['domain']} rank {result['rank']} ({result['rows']} rows), "
        f"{result['workers']} workers: {result['samples_per_s']:.2f} samples/s, "
        f"{result['mb_per_s']:.0f} MB/s decoded, read/ideal {result['read_ratio']:.3f}"
        + (
            f", {result['mb_per_cpu_s']:.0f} MB per CPU second"
            if result["mb_per_cpu_s"] is not None
            else ""
        )
    )
