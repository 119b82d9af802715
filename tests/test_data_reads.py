"""How a rank reads its rows: chunk requests and bytes per rows-per-chunk, the direct zarr read
against the xarray read, ``rechunk_store``, and the device prefetcher's stream ordering.

* bytes and chunk requests per rank and sample are exactly the chunks its rows touch: its
  ``rows_r / H`` share of the globe plus at most one chunk per shard edge, at 1, 4, 8 and 33
  rows per chunk and domain 1, 3 and 8 (H = 33);
* zarr decoding straight into the sample buffer gives bitwise the values of the xarray read
  (ascending-latitude store, levels out of store order, a float64 store that takes the xarray
  path), in row mode and in whole-globe mode;
* ``rechunk_store`` copies values, coordinates and statistics and writes the asked chunks;
* ``DevicePrefetcher`` with an injected stream object: each batch's copy is issued on the side
  stream ahead of its use, the consumer waits for the side stream and records every tensor before
  it gets the batch, the batches are the loader's in order; without streams it is a plain move.
"""

from __future__ import annotations

import multiprocessing
import os
import time

import numpy as np
import pytest
import torch
import xarray as xr
import zarr

from credit_parallel.data import ERA5Dataset, build_train_loader, write_sample_dataset
from credit_parallel.data.prefetch import DevicePrefetcher
from credit_parallel.data.rechunk import rechunk_store
from credit_parallel.domain.rows import shard_range
from credit_parallel.train.trainer import Trainer
from sample_conf import tiny_unet_conf

UPPER = ["Z", "T", "U", "V"]
SURFACE = ["SP", "t2m"]
H, W = 33, 16
LEVELS = 2


@pytest.fixture(scope="module")
def base(tmp_path_factory):
    path = tmp_path_factory.mktemp("reads") / "r1.zarr"
    return write_sample_dataset(
        path, n_times=5, nlat=H, nlon=W, time_chunk=1, lat_chunk=1, compress=False
    )


@pytest.fixture(scope="module")
def chunked(base, tmp_path_factory):
    root = tmp_path_factory.mktemp("rechunked")
    return {
        rows: rechunk_store(base, root / f"r{rows}.zarr", lat_chunk=rows, compress=False)
        for rows in (4, 8, 33)
    } | {1: base}


@pytest.mark.parametrize("reader", ["zarr", "tensorstore"])
@pytest.mark.parametrize("rows_per_chunk", [1, 4, 8, 33])
@pytest.mark.parametrize("n", [1, 3, 8])
def test_a_rank_reads_the_chunks_its_rows_touch_and_no_more(chunked, rows_per_chunk, n, reader):
    path = chunked[rows_per_chunk]
    channels = len(UPPER) * LEVELS + len(SURFACE)
    window = 2  # history 1 + forecast 1
    row_bytes = W * 4
    globe_bytes = window * channels * H * row_bytes
    for rank in range(n):
        start, stop = shard_range(H, n, rank)
        part = ERA5Dataset(
            path, UPPER, SURFACE, domain_shard=(rank, n), cache_limit_bytes=0, reader=reader
        )
        assert part.reader == reader
        part.reset_bytes_read()
        part[1]
        touched = -(-stop // rows_per_chunk) - start // rows_per_chunk  # chunks along latitude
        counter = part.read_counter
        # one chunk per (time, chunk of rows) per variable: levels travel in the same chunk
        for name in UPPER + SURFACE:
            assert counter.chunk_reads[name] == window * touched, name
        assert part.bytes_read == window * channels * touched * rows_per_chunk * row_bytes
        # the rank's share of the globe plus at most one chunk per shard edge
        share = globe_bytes * (stop - start) / H
        assert part.bytes_read <= share + 2 * window * channels * rows_per_chunk * row_bytes
        if rows_per_chunk == 1:
            assert part.bytes_read == share


def _rewritten(base, tmp_path, name: str, transform):
    """A copy of the store ``base`` (and its stats store) as ``name``, its dataset passed through
    ``transform`` and written without the original encodings."""
    ds = transform(xr.open_zarr(base, chunks=None, consolidated=False)).load()
    for var in ds.variables:
        ds[var].encoding.clear()
    path = tmp_path / f"{name}.zarr"
    ds.to_zarr(path, consolidated=False)
    stats = xr.open_zarr(
        str(base).replace(".zarr", "_stats.zarr"), chunks=None, consolidated=False
    ).load()
    stats.to_zarr(tmp_path / f"{name}_stats.zarr", consolidated=False)
    return path


def _ascending(base, tmp_path):
    return _rewritten(
        base, tmp_path, "ascending", lambda ds: ds.isel(latitude=slice(None, None, -1))
    )


def _float64(base, tmp_path):
    return _rewritten(
        base,
        tmp_path,
        "f64",
        lambda ds: ds.assign({n: ds[n].astype(np.float64) for n in ds.data_vars}),
    )


@pytest.mark.parametrize("kind", ["plain", "ascending", "float64"])
@pytest.mark.parametrize("rows", [None, (5, 17)])
def test_direct_zarr_reads_equal_the_xarray_reads(base, tmp_path, kind, rows):
    path = {"plain": lambda: base, "ascending": _ascending, "float64": _float64}[kind]
    path = path() if kind == "plain" else path(base, tmp_path)
    for levels in ([500, 850], [850, 500]):
        direct = ERA5Dataset(path, UPPER, SURFACE, levels=levels, rows=rows, cache_limit_bytes=0)
        assert bool(direct._direct) == (kind != "float64")  # float64 takes the xarray path
        fallback = ERA5Dataset(path, UPPER, SURFACE, levels=levels, rows=rows, cache_limit_bytes=0)
        fallback._direct = {}
        for index in (0, 2):
            a, b = direct[index], fallback[index]
            assert torch.equal(a["x"], b["x"]) and torch.equal(a["y"], b["y"])
    # and the direct read is the cached (whole selection read once) one
    cached = ERA5Dataset(path, UPPER, SURFACE, rows=rows)
    assert cached.cached
    lazy = ERA5Dataset(path, UPPER, SURFACE, rows=rows, cache_limit_bytes=0)
    assert torch.equal(cached[2]["x"], lazy[2]["x"])


def test_row_loader_batches_are_the_globe_rows_at_8_rows_per_chunk_domain3(chunked):
    path = chunked[8]
    conf = {
        "data": {"path": str(path), "upper_air_variables": UPPER, "surface_variables": SURFACE},
        "trainer": {"batch_size": 2, "seed": 1},
    }
    globe = next(iter(build_train_loader(
        conf, dp_rank=0, dp_size=1, domain_rank=0, domain_size=1, device="cpu", num_workers=0
    )))  # fmt: skip
    for rank in range(3):
        batch = next(iter(build_train_loader(
            conf, dp_rank=0, dp_size=1, domain_rank=rank, domain_size=3, device="cpu",
            num_workers=0,
        )))  # fmt: skip
        start, stop = shard_range(H, 3, rank)  # the rows shard_batch cuts (tensor_split)
        for key in ("x", "y"):
            assert torch.equal(batch[key], globe[key][..., start:stop, :])


def _loader_conf(path, reader, as_5d=False):
    return {
        "data": {
            "path": str(path), "upper_air_variables": UPPER, "surface_variables": SURFACE,
            "levels": [850, 500], "reader": reader, "cache_limit_bytes": 0, "as_5d": as_5d,
        },
        "trainer": {"batch_size": 2, "seed": 3},
    }  # fmt: skip


@pytest.mark.parametrize("rows_per_chunk", [1, 8])
@pytest.mark.parametrize("as_5d", [False, True])
def test_tensorstore_reads_are_bitwise_the_zarr_reads_and_the_globe_rows(
    chunked, rows_per_chunk, as_5d
):
    # levels out of store order (tensorstore's orthogonal index), domain 1, 3 (11 rows each)
    # and 4 (9, 8, 8, 8: uneven), the first and last ranks holding the poles
    path = chunked[rows_per_chunk]

    def first_batch(reader, rank, size):
        loader = build_train_loader(
            _loader_conf(path, reader, as_5d), dp_rank=0, dp_size=1, domain_rank=rank,
            domain_size=size, device="cpu", num_workers=0,
        )  # fmt: skip
        assert loader.dataset.reader == reader
        return next(iter(loader))

    globe = first_batch("zarr", 0, 1)
    for size in (1, 3, 4):
        for rank in range(size):
            ts_batch, zarr_batch = (
                first_batch("tensorstore", rank, size),
                first_batch("zarr", rank, size),
            )
            # the rows shard_batch cuts (torch.tensor_split along latitude)
            cut = torch.tensor_split(torch.arange(H), size)[rank]
            start, stop = int(cut[0]), int(cut[-1]) + 1
            assert (start, stop) == shard_range(H, size, rank)
            for key, value in globe.items():
                if value.dim() < 4:
                    assert torch.equal(ts_batch[key], value), key
                    continue
                assert torch.equal(ts_batch[key], zarr_batch[key]), (size, rank, key)
                assert torch.equal(ts_batch[key], value[..., start:stop, :]), (size, rank, key)
    assert float(globe["x" if not as_5d else "x_upper"].abs().sum()) > 0


def test_reader_fallback_for_a_zarr_v2_store_and_the_zarr_key(base, tmp_path):
    ds = xr.open_zarr(base, chunks=None, consolidated=False).load()
    for name in ds.variables:
        ds[name].encoding.clear()
    v2 = tmp_path / "v2.zarr"
    ds.to_zarr(v2, consolidated=False, zarr_format=2)
    stats = xr.open_zarr(
        str(base).replace(".zarr", "_stats.zarr"), chunks=None, consolidated=False
    ).load()
    for name in stats.variables:
        stats[name].encoding.clear()
    stats.to_zarr(tmp_path / "v2_stats.zarr", consolidated=False, zarr_format=2)
    assert zarr.open_group(v2, mode="r").metadata.zarr_format == 2
    auto = ERA5Dataset(v2, UPPER, SURFACE, rows=(3, 20), cache_limit_bytes=0)
    assert auto.reader == "zarr" and auto._direct  # zarr still decodes straight into the buffer
    ts_v3 = ERA5Dataset(base, UPPER, SURFACE, rows=(3, 20), cache_limit_bytes=0)
    assert ts_v3.reader == "tensorstore"  # auto on a local v3 store
    assert torch.equal(auto[1]["x"], ts_v3[1]["x"]) and torch.equal(auto[1]["y"], ts_v3[1]["y"])
    pinned = ERA5Dataset(base, UPPER, SURFACE, rows=(3, 20), cache_limit_bytes=0, reader="zarr")
    assert pinned.reader == "zarr" and torch.equal(pinned[1]["x"], ts_v3[1]["x"])
    with pytest.raises(
        ValueError, match=r"data\.reader: tensorstore cannot read.*not a local zarr v3 store"
    ):
        ERA5Dataset(v2, UPPER, SURFACE, cache_limit_bytes=0, reader="tensorstore")
    with pytest.raises(ValueError, match=r"data\.reader must be one of"):
        ERA5Dataset(base, UPPER, SURFACE, cache_limit_bytes=0, reader="fast")


def _fork_read(path, queue):
    from credit_parallel.data import chunk_reader

    dataset = ERA5Dataset(path, UPPER, SURFACE, domain_shard=(1, 3), cache_limit_bytes=0)
    sample = dataset[2]
    queue.put((sample["x"].numpy(), chunk_reader._started_in == os.getpid()))


def _fresh_process(path, queue):
    """In a process that has not used tensorstore: a forked child reads through tensorstore;
    after this process has read through it, a forked child reads through zarr (no abort)."""
    fork = multiprocessing.get_context("fork")
    results = []
    for _ in range(2):
        child_queue = fork.Queue()
        child = fork.Process(target=_fork_read, args=(path, child_queue))
        child.start()
        results.append(child_queue.get(timeout=120))
        child.join(timeout=120)
        results.append(child.exitcode)
        own = ERA5Dataset(path, UPPER, SURFACE, domain_shard=(1, 3), cache_limit_bytes=0)
        results.append(own[2]["x"].numpy())  # this process now runs tensorstore's threads
    queue.put(results)


def test_a_forked_worker_reads_through_tensorstore_unless_its_parent_used_it(chunked):
    path = chunked[8]
    spawn = multiprocessing.get_context("spawn")
    queue = spawn.Queue()
    process = spawn.Process(target=_fresh_process, args=(path, queue))
    process.start()
    (x1, ts1), code1, own1, (x2, ts2), code2, own2 = queue.get(timeout=300)
    process.join(timeout=60)
    assert process.exitcode == 0 and code1 == 0 and code2 == 0
    assert ts1 and not ts2  # the second child's parent had used tensorstore: zarr
    reference = ERA5Dataset(path, UPPER, SURFACE, domain_shard=(1, 3), reader="zarr")
    for x in (x1, own1, x2, own2):
        assert np.array_equal(x, reference[2]["x"].numpy())


def test_rechunk_store_copies_values_with_the_asked_chunks(base, chunked):
    source = xr.open_zarr(base, chunks=None, consolidated=False).load()
    copy = xr.open_zarr(chunked[8], chunks=None, consolidated=False).load()
    xr.testing.assert_identical(source, copy)
    group = zarr.open_group(chunked[8], mode="r")
    assert group["T"].chunks == (1, LEVELS, 8, W)
    assert group["SP"].chunks == (1, 8, W)
    assert group["T"].compressors == ()
    stats = str(chunked[8]).replace(".zarr", "_stats.zarr")
    xr.testing.assert_identical(
        xr.open_zarr(stats, chunks=None, consolidated=False).load(),
        xr.open_zarr(
            str(base).replace(".zarr", "_stats.zarr"), chunks=None, consolidated=False
        ).load(),
    )


def test_rechunk_store_refuses_an_existing_target_and_bad_chunks(base, chunked, tmp_path):
    with pytest.raises(FileExistsError, match="overwrite"):
        rechunk_store(base, chunked[8], lat_chunk=8)
    with pytest.raises(ValueError, match="lat_chunk"):
        rechunk_store(base, tmp_path / "x.zarr", lat_chunk=0)
    with pytest.raises(FileNotFoundError, match="no zarr store"):
        rechunk_store(tmp_path / "missing.zarr", tmp_path / "y.zarr")


# ---- the device prefetcher ------------------------------------------------------------------
class _FakeStreams:
    """Stands in for CudaStreams: logs every operation in order."""

    def __init__(self):
        self.side, self._current = "side", "main"
        self.log: list[tuple] = []
        self.active = "main"

    def current(self):
        return self._current

    def context(self, stream):
        streams = self

        class _Context:
            def __enter__(self):
                streams.log.append(("enter", stream))
                streams.active = stream

            def __exit__(self, *exc):
                streams.log.append(("exit", stream))
                streams.active = "main"

        return _Context()

    def wait(self, consumer, producer):
        self.log.append(("wait", consumer, producer))

    def record(self, tensor, stream):
        self.log.append(("record", int(tensor.flatten()[0]), stream))


def _host_batches(log, active):
    for k in range(100):
        log.append(("host", k, active()))
        yield {"x": torch.full((2, 3), float(k)), "time_index": torch.tensor(k), "name": "b"}


@pytest.mark.parametrize("depth", [1, 2])
def test_prefetcher_copies_ahead_on_the_side_stream_and_orders_the_consumer(depth):
    streams = _FakeStreams()
    hosts = _host_batches(streams.log, lambda: streams.active)
    prefetcher = DevicePrefetcher(hosts, "cpu", torch.float64, depth, streams=streams)
    for k in range(4):
        streams.log.append(("step", k))
        batch = next(prefetcher)
        assert batch["x"].dtype == torch.float64 and batch["time_index"].dtype == torch.int64
        assert torch.equal(batch["x"], torch.full((2, 3), float(k), dtype=torch.float64))
        assert batch["name"] == "b"
        log = streams.log[streams.log.index(("step", k)) :]
        # before the batch is handed out: the consumer waits for the side stream, then records
        # each of its tensors on itself
        assert log.index(("wait", "main", "side")) < log.index(("record", k, "main"))
        # the coming batches are already in flight (issued before this batch is returned)
        issued = [entry[1] for entry in streams.log if entry[0] == "host"]
        assert issued == list(range(k + 1 + depth))
    # every host batch was taken inside a side-stream context, so its copy ran there
    hosts_taken = [entry for entry in streams.log if entry[0] == "host"]
    assert all(entry[2] == "main" for entry in hosts_taken)  # the loader is read outside
    enters = [i for i, entry in enumerate(streams.log) if entry == ("enter", "side")]
    assert len(enters) == len(hosts_taken)
    assert prefetcher.wait_s >= 0.0


def test_prefetcher_hands_out_every_batch_of_a_finite_source():
    streams = _FakeStreams()
    batches = [{"x": torch.full((1,), float(k))} for k in range(3)]
    prefetcher = DevicePrefetcher(batches, "cpu", None, depth=2, streams=streams)
    assert [float(b["x"]) for b in prefetcher] == [0.0, 1.0, 2.0]


def test_prefetcher_without_streams_moves_each_batch_when_asked():
    log = []
    prefetcher = DevicePrefetcher(_host_batches(log, lambda: None), "cpu", None, depth=3)
    assert prefetcher._streams is None  # the CPU has no streams
    for k in range(3):
        assert torch.equal(next(prefetcher)["x"], torch.full((2, 3), float(k)))
        assert [entry[1] for entry in log] == list(range(k + 1))  # nothing read ahead
    with pytest.raises(ValueError, match="data.device_prefetch"):
        DevicePrefetcher([], "cpu", depth=-1)


# ---- the commands ---------------------------------------------------------------------------
def test_rechunk_command_and_bench_loader_number(base, tmp_path, capsys):
    from credit_parallel import cli

    out = tmp_path / "cli.zarr"
    assert cli.main(["rechunk", str(base), str(out), "--lat-chunk", "4", "--no-compress"]) == 0
    assert zarr.open_group(out, mode="r")["T"].chunks == (1, LEVELS, 4, W)
    assert cli.main(["rechunk", str(base), str(out)]) != 0  # exists: one-line refusal
    assert "overwrite" in capsys.readouterr().err
    code = cli.main(
        ["bench", "--loader", str(out), "--loader-workers", "0", "--loader-domain", "3"]
    )
    text = capsys.readouterr().out
    assert code == 0 and "domain 3 rank 1 (11 rows), 0 workers" in text
    rate = float(text.split(" samples/s")[0].split()[-1])
    assert rate > 0 and "read/ideal 1.455" in text  # rows 11..21 in chunks of 4: 8..23 read


# ---- starvation visible ---------------------------------------------------------------------
class _SlowDataset(torch.utils.data.Dataset):
    """Each sample takes ``delay`` seconds more to read."""

    def __init__(self, inner, delay: float):
        self.inner, self.delay = inner, delay

    def __len__(self):
        return len(self.inner)

    def __getattr__(self, name):
        if name == "inner":
            raise AttributeError(name)
        return getattr(self.inner, name)

    def __getitem__(self, i):
        time.sleep(self.delay)
        return self.inner[i]


def test_the_step_record_reports_the_time_spent_waiting_for_data(base):
    trainer_keys = {"parallelism": {"data": "none", "tensor": 1, "domain": 1}, "steps": 2}
    conf = tiny_unet_conf(base, H, W, time_slice=[0, 5], trainer={**trainer_keys, "batch_size": 2})
    inner = ERA5Dataset(base, conf["data"]["upper_air_variables"],
                        conf["data"]["surface_variables"], time_slice=(0, 5))  # fmt: skip
    for delay in (0.0, 0.1):
        trainer = Trainer(conf, dataset=_SlowDataset(inner, delay))
        for _ in range(2):
            record = trainer.train_step()
            wait = record["data_wait_ms"] / 1e3
            assert 0.0 <= record["data_wait_frac"] <= 1.0
            if delay:  # two samples read in this process, each 0.1 s late
                assert wait >= 2 * delay and record["data_wait_frac"] > 0.05
            else:
                assert wait < 0.2
