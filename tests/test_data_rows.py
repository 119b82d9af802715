"""Data by rows: each domain rank reads only its latitude rows, through a DataLoader whose order
is a pure function of (seed, micro-batch, dp rank).

The reference of every row test is the whole-globe path (``ERA5Dataset(rows=None)``, float64
normalisation rounded once to float32) sharded by ``shard_batch``.  The row path normalises in
float32; per element it differs from the reference by at most
``2**-22 * (|normalised| + |mean| / std)`` (four float32 roundings: the mean, the subtraction, the
division and the reference's own rounding; the std's rounding is within the division's bound),
and it is bitwise equal to the same rows of a float32 whole-globe read (``rows=(0, H)``).
"""

from __future__ import annotations

import numpy as np
import pytest
import torch
import xarray as xr
from torch.utils.data import default_collate

from credit_parallel import data_parallel_coords
from credit_parallel.data import (
    DistributedDPSampler,
    ERA5Dataset,
    StepBatchSampler,
    batch_to_device,
    build_train_loader,
    register_row_batch,
    write_sample_dataset,
)
from credit_parallel.domain.manager import DomainParallelManager
from credit_parallel.domain.rows import shard_range
from credit_parallel.domain.sharding import shard_batch
from credit_parallel.testing import run_on_ranks
from credit_parallel.train.loss import local_lat_weights

UPPER = ["Z", "T", "U", "V"]
SURFACE = ["SP", "t2m"]
H, W = 33, 64
FLOAT32_ROUNDINGS = 2.0**-22  # 4 unit roundoffs of float32


@pytest.fixture(scope="module")
def store(tmp_path_factory):
    return write_sample_dataset(tmp_path_factory.mktemp("rows") / "sample.zarr", n_times=20)


@pytest.fixture(scope="module")
def row_chunked_store(tmp_path_factory):
    # one time step x one row per chunk, uncompressed: a chunk read is exactly its decoded bytes
    path = tmp_path_factory.mktemp("rowchunks") / "rows.zarr"
    return write_sample_dataset(path, n_times=8, time_chunk=1, lat_chunk=1, compress=False)


def _conf(path, **trainer):
    return {
        "data": {"path": str(path), "upper_air_variables": UPPER, "surface_variables": SURFACE},
        "trainer": {"batch_size": 2, "seed": 5, **trainer},
    }


def _float32_bound(reference: torch.Tensor, dataset: ERA5Dataset, steps: int) -> torch.Tensor:
    """Elementwise bound of |row path - reference| for x or y of ``steps`` time steps."""
    offset = np.tile(np.abs(dataset.channel_mean) / dataset.channel_std, steps)
    offset = torch.as_tensor(offset, dtype=torch.float64).view(-1, 1, 1)
    return FLOAT32_ROUNDINGS * (reference.double().abs() + offset)


# ---- the dataset in row mode (no process group) ----------------------------------------------
@pytest.mark.parametrize("n", [2, 3])
def test_row_reads_uneven_h33_are_bitwise_rows_of_a_float32_globe_read(store, n):
    globe32 = ERA5Dataset(store, UPPER, SURFACE, rows=(0, H), cache_limit_bytes=0)
    reference = ERA5Dataset(store, UPPER, SURFACE)
    for rank in range(n):
        start, stop = shard_range(H, n, rank)
        part = ERA5Dataset(store, UPPER, SURFACE, domain_shard=(rank, n), cache_limit_bytes=0)
        assert part.rows == (start, stop) and part.sample_grid_shape == (stop - start, W)
        for index in (0, 7):
            sample = part[index]
            assert torch.equal(sample["x"], globe32[index]["x"][:, start:stop])
            assert torch.equal(sample["y"], globe32[index]["y"][:, start:stop])
            ref = reference[index]["x"][:, start:stop]
            err = (sample["x"].double() - ref.double()).abs()
            assert bool((err <= _float32_bound(ref, part, 1)).all())
        assert torch.equal(part.row_lat_weights, reference.lat_weights[start:stop])


def test_row_reads_of_an_ascending_latitude_store_are_north_first(store, tmp_path):
    source = xr.open_zarr(store, consolidated=False).load()
    ascending = tmp_path / "ascending.zarr"
    source.isel(latitude=slice(None, None, -1)).to_zarr(ascending, consolidated=False)
    normal = ERA5Dataset(store, ["Z"], ["t2m"], normalize=False, rows=(0, H))
    for rows in ((0, 11), (11, 22), (22, 33)):
        flipped = ERA5Dataset(ascending, ["Z"], ["t2m"], normalize=False, rows=rows)
        assert torch.equal(flipped[3]["x"], normal[3]["x"][:, rows[0] : rows[1]])


def test_row_reads_5d_layout_keeps_rows_on_dim_minus_2(store):
    part = ERA5Dataset(store, UPPER, SURFACE, as_5d=True, rows=(4, 13))
    whole = ERA5Dataset(store, UPPER, SURFACE, as_5d=True, rows=(0, H))
    for key in ("x_upper", "x_surface", "y_upper", "y_surface"):
        assert torch.equal(part[2][key], whole[2][key][..., 4:13, :])


def test_row_arguments_are_validated(store):
    with pytest.raises(ValueError, match="rows must be"):
        ERA5Dataset(store, ["T"], rows=(5, 40))
    with pytest.raises(ValueError, match="rows must be"):
        ERA5Dataset(store, ["T"], rows=(6, 5))
    with pytest.raises(ValueError, match="not both"):
        ERA5Dataset(store, ["T"], rows=(0, 5), domain_shard=(0, 2))
    with pytest.raises(ValueError, match="domain_shard"):
        ERA5Dataset(store, ["T"], domain_shard=(3, 3))


def test_a_rank_without_rows_reads_empty_samples_when_domain_exceeds_h33(row_chunked_store):
    part = ERA5Dataset(
        row_chunked_store, ["Z"], ["t2m"], domain_shard=(33, 34), cache_limit_bytes=0
    )
    part.reset_bytes_read()
    assert part.rows == (33, 33) and part[0]["x"].shape == (3, 0, W)
    assert part.bytes_read == 0 and part.row_lat_weights.shape == (0,)


# ---- bytes read per rank per sample ------------------------------------------------------------
@pytest.mark.parametrize("n", [2, 3])
def test_bytes_read_per_rank_per_sample_are_its_share_of_a_globe_read(row_chunked_store, n):
    """Counted at the storage layer (ByteCountingStore): chunk bytes of the data variables
    fetched while reading samples; metadata and coordinates are read once at open and are not
    part of a sample's read.  Uncompressed one-row chunks, so the share is exact."""
    per_step = (len(UPPER) * 2 + len(SURFACE)) * W * 4  # channels x columns x float32, per row
    window = 2  # history_len 1 + forecast_len 1
    globe = ERA5Dataset(row_chunked_store, UPPER, SURFACE, cache_limit_bytes=0)
    globe.reset_bytes_read()
    globe[3]
    assert globe.bytes_read == window * H * per_step
    total = 0
    for rank in range(n):
        part = ERA5Dataset(
            row_chunked_store, UPPER, SURFACE, domain_shard=(rank, n), cache_limit_bytes=0
        )
        part.reset_bytes_read()
        loader = build_train_loader(
            _conf(row_chunked_store),
            dp_rank=0,
            dp_size=1,
            domain_rank=rank,
            domain_size=n,
            device="cpu",
            num_workers=0,
            dataset=part,
        )
        batches = iter(loader)
        for _ in range(3):
            next(batches)
        rows = part.rows[1] - part.rows[0]
        # nothing else: no metadata, no coordinate array, only the variables' chunks
        assert part.read_counter.metadata_bytes == 0
        assert set(part.read_counter.chunk_bytes) == set(UPPER + SURFACE)
        per_sample = part.bytes_read / (3 * 2)
        assert per_sample == window * rows * per_step
        assert per_sample * H == globe.bytes_read * rows  # rows / H of the whole-globe read
        total += per_sample
    assert total == globe.bytes_read


def test_stores_chunked_by_whole_globe_make_every_rank_fetch_whole_chunks(tmp_path):
    """The limit of row reads, stated: with one chunk per time step covering all rows (how many
    ERA5 stores are chunked), a rank decodes and fetches the whole chunk to get its rows."""
    path = write_sample_dataset(tmp_path / "globe.zarr", n_times=4, time_chunk=1, compress=False)
    globe = ERA5Dataset(path, ["T"], cache_limit_bytes=0)
    part = ERA5Dataset(path, ["T"], rows=(0, 11), cache_limit_bytes=0)
    for ds in (globe, part):
        ds.reset_bytes_read()
        ds[0]
    assert part.bytes_read == globe.bytes_read == 2 * 2 * H * W * 4


# ---- sample order --------------------------------------------------------------------------------
def test_step_batch_sampler_is_the_dp_sampler_epoch_by_epoch():
    sampler = StepBatchSampler(23, 3, 1, 2, seed=4)
    epochs = DistributedDPSampler(23, 1, 2, seed=4)
    assert sampler.batches_per_epoch == 11 // 3
    for m in range(10):
        epoch, j = divmod(m, 3)
        epochs.set_epoch(epoch)
        assert sampler.batch_indices(m) == list(epochs)[3 * j : 3 * j + 3]
    sampler.set_epoch(2)
    assert list(sampler) == [sampler.batch_indices(m) for m in (6, 7, 8)]


def test_step_batch_sampler_started_at_k_continues_the_order_from_k():
    from_zero = StepBatchSampler(17, 2, 0, 3, seed=9, num_batches=12)
    resumed = StepBatchSampler(17, 2, 0, 3, seed=9, start_batch=5, num_batches=7)
    assert list(resumed) == list(from_zero)[5:]  # crosses two epoch boundaries (2 per epoch)


def test_step_batch_sampler_deterministic_by_seed_disjoint_over_dp():
    def first_epoch(rank, seed):
        return [i for b in StepBatchSampler(30, 2, rank, 3, seed=seed, num_batches=5) for i in b]

    assert first_epoch(1, 3) == first_epoch(1, 3)
    assert first_epoch(1, 3) != first_epoch(1, 4)
    shares = [set(first_epoch(r, 3)) for r in range(3)]
    assert sum(len(s) for s in shares) == len(set.union(*shares)) == 30
    with pytest.raises(ValueError, match="batch_size 11"):
        StepBatchSampler(30, 11, 0, 3)


def test_loader_started_at_step_k_yields_the_batches_from_k_on(store):
    conf = _conf(store, grad_accum=2)
    args = dict(dp_rank=1, dp_size=2, domain_rank=1, domain_size=3, device="cpu", num_workers=0)
    from_zero = iter(build_train_loader(conf, **args))
    resumed = iter(build_train_loader(conf, start_step=3, **args))
    reference = [next(from_zero) for _ in range(10)]
    for expected in reference[6:]:  # step 3 x grad_accum 2 = micro-batch 6
        batch = next(resumed)
        assert torch.equal(batch["time_index"], expected["time_index"])
        assert torch.equal(batch["x"], expected["x"]) and torch.equal(batch["y"], expected["y"])


def test_loader_with_worker_processes_yields_the_same_batches(row_chunked_store):
    conf = _conf(row_chunked_store)
    args = dict(dp_rank=0, dp_size=1, domain_rank=2, domain_size=3, device="cpu")
    serial = iter(build_train_loader(conf, num_workers=0, **args))
    dataset = ERA5Dataset(
        row_chunked_store, UPPER, SURFACE, domain_shard=(2, 3), cache_limit_bytes=0
    )
    parallel = build_train_loader(conf, num_workers=2, dataset=dataset, **args)
    assert parallel.num_workers == 2 and parallel.prefetch_factor == 2
    assert not parallel.pin_memory  # CPU target: nothing to pin for
    batches = iter(parallel)
    for _ in range(5):
        a, b = next(serial), next(batches)
        assert torch.equal(a["x"], b["x"]) and torch.equal(a["time_index"], b["time_index"])
    assert dataset.bytes_read == 0  # the workers read, in their own processes


def test_loader_pins_host_memory_only_for_a_cuda_target(store):
    conf = _conf(store)
    args = dict(dp_rank=0, dp_size=1, domain_rank=0, domain_size=1, num_workers=0)
    assert build_train_loader(conf, device=torch.device("cuda", 0), **args).pin_memory
    assert not build_train_loader(conf, device="cpu", **args).pin_memory
    wrong_rows = ERA5Dataset(store, ["T"], domain_shard=(1, 2))
    with pytest.raises(ValueError, match=r"owns rows \(0, 17\) of 33"):
        build_train_loader(conf, device="cpu", dataset=wrong_rows, **{**args, "domain_size": 2})


class _InMemory(torch.utils.data.Dataset):
    """A whole-globe dataset with no ``grid_shape`` and no row reading: 4-D and 5-D samples."""

    def __init__(self):
        gen = torch.Generator().manual_seed(0)
        self.fields = torch.randn(6, 3, 2, H, 5, generator=gen, dtype=torch.float64)
        self.lat_weights = torch.linspace(0.5, 1.5, H, dtype=torch.float64)

    def __len__(self):
        return 5

    def __getitem__(self, i):
        return {"x": self.fields[i, :, 0], "z": self.fields[i], "y": self.fields[i + 1, :, 0]}


@pytest.mark.parametrize("n", [2, 3])
def test_whole_globe_datasets_are_cut_to_the_rank_rows_by_row_view(store, n):
    sources = [ERA5Dataset(store, UPPER, SURFACE), _InMemory()]  # float64 reference path
    for source in sources:
        for rank in range(n):
            start, stop = shard_range(H, n, rank)
            loader = build_train_loader(
                _conf(store), dp_rank=0, dp_size=1, domain_rank=rank, domain_size=n,
                device="cpu", num_workers=0, dataset=source,
            )  # fmt: skip
            assert loader.dataset.rows == (start, stop)
            assert torch.equal(loader.dataset.row_lat_weights, source.lat_weights[start:stop])
            batches = iter(loader)
            for m in range(2):
                batch = next(batches)
                whole = default_collate([source[i] for i in loader.batch_sampler.batch_indices(m)])
                for key, value in whole.items():
                    if value.dim() >= 4:
                        assert torch.equal(batch[key], value[..., start:stop, :]), key


def test_batch_to_device_casts_floating_tensors_only(store):
    batch = next(iter(build_train_loader(
        _conf(store), dp_rank=0, dp_size=1, domain_rank=0, domain_size=2, device="cpu",
        num_workers=0,
    )))  # fmt: skip
    moved = batch_to_device(batch, torch.device("cpu"), dtype=torch.float64)
    assert moved["x"].dtype == torch.float64 and moved["time_index"].dtype == torch.int64
    assert torch.equal(moved["x"], batch["x"].double())


# ---- against shard_batch on real domain ranks -------------------------------------------------
def _rows_vs_shard_batch_worker(rank, world, path, as_5d):
    mgr = DomainParallelManager(world, world)
    conf = _conf(path)
    conf["data"]["as_5d"] = as_5d
    loader = build_train_loader(
        conf,
        dp_rank=0,
        dp_size=1,
        domain_rank=mgr.domain_rank,
        domain_size=world,
        device="cpu",
        num_workers=0,
    )
    row_ds = loader.dataset
    reference = ERA5Dataset(path, UPPER, SURFACE, as_5d=as_5d)
    globe32 = ERA5Dataset(path, UPPER, SURFACE, as_5d=as_5d, rows=(0, H))
    assert torch.equal(row_ds.row_lat_weights, local_lat_weights(reference.lat_weights, mgr))
    batches = iter(loader)
    for m in range(3):
        batch = next(batches)
        indices = loader.batch_sampler.batch_indices(m)
        assert batch["time_index"].tolist() == indices  # time_slice unset: index = time position
        sharded = shard_batch(default_collate([reference[i] for i in indices]), manager=mgr)
        token_of_shard_batch = mgr._token
        register_row_batch(batch, H, manager=mgr)
        assert mgr._token == token_of_shard_batch
        exact = shard_batch(default_collate([globe32[i] for i in indices]), manager=mgr)
        for key, value in batch.items():
            if value.dim() < 4:
                continue
            assert torch.equal(value, exact[key]), key
            ref = sharded[key].double()
            err = (value.double() - ref).abs()
            steps = 1
            if value.dim() == 5:  # (B, vars x steps, Z, H, W): bound per variable and level
                offset = np.abs(row_ds.channel_mean) / row_ds.channel_std
                upper = offset[: row_ds.n_upper_channels].reshape(len(UPPER), -1)
                offset = torch.as_tensor(np.tile(upper, (value.shape[1] // len(UPPER), 1)))
                bound = FLOAT32_ROUNDINGS * (ref.abs() + offset[None, :, :, None, None])
            else:
                channels = value.shape[1]
                per_step = np.abs(row_ds.channel_mean) / row_ds.channel_std
                per_step = per_step[row_ds.n_upper_channels :] if as_5d else per_step
                steps = channels // per_step.size
                offset = torch.as_tensor(np.tile(per_step, steps)).view(1, -1, 1, 1)
                bound = FLOAT32_ROUNDINGS * (ref.abs() + offset)
            assert bool((err <= bound).all()), key
    return float(err.max())


@pytest.mark.parametrize("n", [2, 3])
def test_row_loader_batches_equal_shard_batch_of_globe_batch_uneven_h33(store, n):
    errors = run_on_ranks(_rows_vs_shard_batch_worker, n, store, False)
    assert max(errors) < 1e-5  # float32 rounding of values of order 1, not an offset row


def test_row_loader_5d_batches_equal_shard_batch_and_register_its_token_domain3(store):
    run_on_ranks(_rows_vs_shard_batch_worker, 3, store, True)


def _register_mismatch_worker(rank, world, path):
    mgr = DomainParallelManager(world, world)
    batch = {"x": torch.zeros(1, 2, 17, 4)}  # rank 0 of 33 rows over 2 owns 17, rank 1 owns 16
    if rank == 0:
        register_row_batch(batch, H, manager=mgr)
        registered = mgr._token
        shard_batch({"x": torch.zeros(1, 2, H, 4)}, manager=mgr)
        return registered == mgr._token
    with pytest.raises(ValueError, match="owns 16 of 33 rows"):
        register_row_batch(batch, H, manager=mgr)
    return True


def test_register_row_batch_rejects_another_ranks_rows_domain2(store):
    assert run_on_ranks(_register_mismatch_worker, 2, store) == [True, True]


def _order_worker(rank, world, path, parallelism):
    conf = _conf(path)
    conf["trainer"]["parallelism"] = parallelism
    dp_rank, dp_size = data_parallel_coords(conf)
    domain = int(parallelism["domain"])
    loader = build_train_loader(
        conf,
        dp_rank=dp_rank,
        dp_size=dp_size,
        domain_rank=rank % domain,
        domain_size=domain,
        device="cpu",
        num_workers=0,
    )
    batches = iter(loader)
    taken = [next(batches) for _ in range(4)]
    return dp_rank, [b["time_index"].tolist() for b in taken], taken[0]["x"]


def test_loader_order_same_over_domain_ranks_disjoint_over_dp_4_ranks(store):
    parallelism = {"data": "ddp", "tensor": 1, "domain": 2}
    results = run_on_ranks(_order_worker, 4, store, parallelism)
    assert [r[0] for r in results] == [0, 0, 1, 1]
    assert results[0][1] == results[1][1] and results[2][1] == results[3][1]
    # 19 samples over 2 dp ranks: 9 each per epoch, 4 batches of 2 fit in the first epoch
    first = {i for b in results[0][1] for i in b}
    second = {i for b in results[2][1] for i in b}
    assert len(first) == len(second) == 8 and not first & second


def test_loader_same_rows_over_tp_ranks_tensor2_domain2(store):
    parallelism = {"data": "none", "tensor": 2, "domain": 2}
    results = run_on_ranks(_order_worker, 4, store, parallelism)
    assert all(r[1] == results[0][1] for r in results)
    # global rank g: domain coord g % 2, tp coord g // 2; same domain coord -> same rows
    assert torch.equal(results[0][2], results[2][2]) and torch.equal(results[1][2], results[3][2])
    assert results[0][2].shape[-2] == 17 and results[1][2].shape[-2] == 16


# ---- training from row batches is exact ----------------------------------------------------------
def _train_conf(path, domain):
    return {
        "model": {
            "type": "unet",
            "in_channels": 10,
            "out_channels": 10,
            "image_height": H,
            "image_width": W,
            "base_channels": 4,
            "channel_mults": [1, 2],
            "norm_groups": 2,
        },
        "data": {"path": str(path), "upper_air_variables": UPPER, "surface_variables": SURFACE},
        "trainer": {
            "batch_size": 2,
            "grad_accum": 2,
            "seed": 1,
            "parallelism": {"data": "none", "tensor": 1, "domain": domain},
        },
    }


def _train_from_rows(rank, world, path, steps):
    """A bare training loop on row batches: register the token, loss share over the rank's rows
    divided by the global count, domain gradients summed, AdamW; float64 throughout."""
    from credit_parallel.models import build_model
    from credit_parallel.parallel.collectives import sync_domain_gradients
    from credit_parallel.parallel.composition import get_domain_manager, parallelize

    conf = _train_conf(path, world)
    torch.manual_seed(0)
    model = parallelize(build_model(conf["model"]).double(), conf)
    manager = get_domain_manager(model)
    loader = build_train_loader(
        conf,
        dp_rank=0,
        dp_size=1,
        domain_rank=rank,
        domain_size=world,
        device=torch.device("cpu"),
        num_workers=0,
    )
    weights = loader.dataset.row_lat_weights.double().view(-1, 1)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
    batches = iter(loader)
    for _ in range(steps):
        optimizer.zero_grad(set_to_none=True)
        for _ in range(2):  # grad_accum micro-batches
            batch = batch_to_device(next(batches), torch.device("cpu"), dtype=torch.float64)
            register_row_batch(batch, H, manager=manager)
            diff = (model(batch["x"]) - batch["y"]) ** 2 * weights
            (diff.sum() / (diff.numel() // diff.shape[-2] * H) / 2).backward()
        if manager is not None:
            sync_domain_gradients(model, manager, op="sum")
        optimizer.step()
    return {k: v.detach() for k, v in model.state_dict().items()}


def test_training_on_row_batches_uneven_h33_domain2_matches_single_process(store):
    reference = _train_from_rows(0, 1, store, 3)  # domain 1: rows (0, 33), no process group
    for per_rank in run_on_ranks(_train_from_rows, 2, store, 3):
        assert per_rank.keys() == reference.keys()
        for key, value in reference.items():
            assert float((per_rank[key] - value).abs().max()) <= 1e-10, key
