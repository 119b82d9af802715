"""0.25 degrees end to end: a small U-Net trained on the full 721 x 1440 grid on 1 and on 4 CPU ranks.

1. Writes (if absent) a zarr store in the ERA5 / WeatherBench layout on the 0.25-degree grid
   (``credit_parallel.data.write_sample_dataset``: dims ``(time, level, latitude, longitude)``,
   latitude 90 .. -90 with both poles, 6-hourly), chunked one time step x 16 latitude rows
   (``RECOMMENDED_LAT_CHUNK``, docs/data.md) and uncompressed, so that a domain rank fetches its
   rows plus at most one chunk per shard edge and the bytes it reads are decoded bytes.  Default: 6 times, levels 500/850 hPa -> 10 channels, about 250 MB.
2. Trains ``--steps`` steps (after one untimed step) of a small variant of the bundled
   ``era5_025deg_unet.yaml`` U-Net (``--base-channels``, ``--channel-mults``; fp32, no activation
   checkpointing, batch 1) under {fsdp2, tensor 1, domain 1} on 1 rank and {fsdp2, tensor 1,
   domain 4} on 4 ranks, each rank launched by torchrun with one intra-op thread and reading its
   rows through ``build_train_loader`` (``--workers`` DataLoader workers).
3. Prints per rank: rows, peak RSS of the rank's main process (``ru_maxrss``) and its increase over
   the RSS before data and model existed, peak RSS of its loader workers, parameter / optimizer
   bytes held by the rank, bytes read per sample (counted by ``ByteCountingStore`` on one sample
   read in the rank's main process; the workers read the same rows the same way), the step-1
   loss (the layouts must agree) and the step times.  Then ``credit-parallel plan``'s per-rank
   memory estimate for the same small configuration at world sizes 1 and 4 next to the measured
   increase (ratio), and the plan of the bundled configuration at ``--plan-world-sizes``.

    PYTHONPATH=src .venv/bin/python benchmarks/era5_025deg.py --steps 3

The library calls used are the public ones (``parallelize``, ``get_domain_manager``,
``sync_domain_gradients``, ``build_train_loader``, ``register_row_batch``); the loss is the
latitude-weighted MSE share written out here, so the script does not depend on the trainer.
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import resource
import statistics
import subprocess
import sys
import time
from pathlib import Path

__all__ = ["main", "parse_args", "small_config", "write_store"]

BUNDLED_CONFIG = "era5_025deg_unet.yaml"
RESULT_PREFIX = "ERA5_025DEG_RESULT "
LAYOUTS = {
    1: {"data": "fsdp2", "tensor": 1, "domain": 1},
    4: {"data": "fsdp2", "tensor": 1, "domain": 4},
}
MIB = 2**20


def parse_args(argv=None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--store", default="/tmp/credit_parallel_era5_025deg/era5_025deg_r16.zarr")
    parser.add_argument("--times", type=int, default=6, help="time steps written to the store")
    parser.add_argument("--levels", type=float, nargs="+", default=[500.0, 850.0])
    parser.add_argument("--steps", type=int, default=3, help="timed steps after one untimed")
    parser.add_argument("--base-channels", type=int, default=8)
    parser.add_argument("--channel-mults", type=int, nargs="+", default=[1, 2])
    parser.add_argument("--norm-groups", type=int, default=4)
    parser.add_argument("--workers", type=int, default=1, help="DataLoader workers per rank")
    parser.add_argument("--ranks", type=int, nargs="+", default=[1, 4], choices=sorted(LAYOUTS))
    parser.add_argument("--plan-world-sizes", type=int, nargs="+", default=[16, 64, 256])
    parser.add_argument(
        "--grid", type=int, nargs=2, default=[721, 1440], help="rows and columns (smoke tests)"
    )
    parser.add_argument("--rank-worker", type=int, default=None, help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    args.argv = list(sys.argv[1:] if argv is None else argv)
    return args


def write_store(path, times: int, levels, grid=(721, 1440)) -> Path:
    """The 0.25-degree store at ``path`` (written only when absent), 16 rows per chunk."""
    from credit_parallel.data import write_sample_dataset
    from credit_parallel.data.rechunk import RECOMMENDED_LAT_CHUNK

    path = Path(path)
    if not (path / "zarr.json").exists():
        path.parent.mkdir(parents=True, exist_ok=True)
        start = time.perf_counter()
        write_sample_dataset(
            path,
            n_times=times,
            nlat=grid[0],
            nlon=grid[1],
            levels=tuple(levels),
            time_chunk=1,
            lat_chunk=RECOMMENDED_LAT_CHUNK,
            compress=False,
        )
        print(f"wrote {path} in {time.perf_counter() - start:.0f} s")
    return path


def small_config(store, parallelism: dict, args) -> dict:
    """The bundled ERA5 config with a small model and the benchmark store."""
    from credit_parallel.data import SAMPLE_SURFACE_VARIABLES, SAMPLE_UPPER_AIR_VARIABLES

    conf = _bundled_config()
    channels = len(SAMPLE_UPPER_AIR_VARIABLES) * len(args.levels) + len(SAMPLE_SURFACE_VARIABLES)
    conf["model"].update(
        in_channels=channels,
        out_channels=channels,
        base_channels=args.base_channels,
        channel_mults=list(args.channel_mults),
        norm_groups=args.norm_groups,
        image_height=args.grid[0],
        image_width=args.grid[1],
    )
    conf["data"] = {
        "path": str(store),
        "upper_air_variables": list(SAMPLE_UPPER_AIR_VARIABLES),
        "surface_variables": list(SAMPLE_SURFACE_VARIABLES),
        "levels": list(args.levels),
        "history_len": 1,
        "forecast_len": 1,
        "num_workers": args.workers,
        "cache_limit_bytes": 0,  # read every sample from the store, as at full ERA5 size
    }
    conf["trainer"].update(
        parallelism=dict(parallelism),
        amp=False,
        activation_checkpoint=False,
        batch_size=1,
        grad_accum=1,
        seed=42,
    )
    return conf


def _bundled_config() -> dict:
    import yaml

    import credit_parallel

    path = Path(credit_parallel.__file__).parent / "configs" / BUNDLED_CONFIG
    return yaml.safe_load(path.read_text())


# ---------------------------------------------------------------------------- one rank
def _rss_mib(who=resource.RUSAGE_SELF) -> float:
    return resource.getrusage(who).ru_maxrss / 1024.0  # KiB on Linux


def _local_bytes(tensors) -> int:
    total = 0
    for t in tensors:
        t = t.to_local() if hasattr(t, "to_local") else t
        total += t.numel() * t.element_size()
    return total


def _loss_share(pred, target, row_weights, global_height: int):
    """sum over this rank's rows of w_h (pred - target)^2 / (B * C * H_global * W)."""
    diff = (pred - target) ** 2 * row_weights.to(pred.dtype).view(-1, 1)
    return diff.sum() / (diff.numel() // diff.shape[-2] * global_height)


def _train_rank(args) -> dict:
    import torch
    import torch.distributed as dist

    from credit_parallel.data import build_train_loader, register_row_batch
    from credit_parallel.layout.mesh import data_parallel_coords
    from credit_parallel.models import build_model
    from credit_parallel.parallel.collectives import sync_domain_gradients
    from credit_parallel.parallel.composition import get_domain_manager, parallelize

    torch.set_num_threads(1)
    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    rss_before = _rss_mib()
    conf = small_config(args.store, LAYOUTS[world], args)
    torch.manual_seed(conf["trainer"]["seed"])  # identical initial weights in every layout
    model = parallelize(build_model(conf["model"]), conf)
    manager = get_domain_manager(model)
    domain_rank = manager.domain_rank if manager is not None else 0
    domain_size = manager.domain_world_size if manager is not None else 1
    dp_rank, dp_size = data_parallel_coords(conf)
    loader = build_train_loader(
        conf,
        dp_rank=dp_rank,
        dp_size=dp_size,
        domain_rank=domain_rank,
        domain_size=domain_size,
        device="cpu",
    )
    dataset = loader.dataset
    dataset.reset_bytes_read()
    dataset[0]  # the read a worker does for one sample, counted here in the main process
    bytes_per_sample = dataset.bytes_read
    height = dataset.grid_shape[0]
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    batches = iter(loader)
    losses, step_s, wait_s = [], [], []
    for _ in range(args.steps + 1):
        start = time.perf_counter()
        batch = next(batches)
        waited = time.perf_counter() - start
        register_row_batch(batch, height, manager=manager)
        optimizer.zero_grad(set_to_none=True)
        share = _loss_share(model(batch["x"]), batch["y"], dataset.row_lat_weights, height)
        share.backward()
        if manager is not None:
            sync_domain_gradients(model, manager, op="sum")
        optimizer.step()
        loss = share.detach().clone()
        dist.all_reduce(loss)  # dp = tp = 1 here: the shares of the domain ranks add up
        step_s.append(time.perf_counter() - start)
        wait_s.append(waited)
        losses.append(float(loss))
    # the loader holds its persistent workers: dropping both joins them, so RUSAGE_CHILDREN
    # (children waited for) covers the workers
    del batches, loader
    gc.collect()
    optimizer_bytes = _local_bytes(
        v for s in optimizer.state.values() for v in s.values() if torch.is_tensor(v) and v.dim()
    )
    result = {
        "rank": rank,
        "world": world,
        "rows": list(dataset.rows),
        "rss_before_mib": rss_before,
        "rss_peak_mib": _rss_mib(),
        "workers_rss_peak_mib": _rss_mib(resource.RUSAGE_CHILDREN),
        "param_bytes": _local_bytes(model.parameters()),
        "optimizer_bytes": optimizer_bytes,
        "bytes_per_sample": bytes_per_sample,
        "losses": losses,
        "step_s": step_s[1:],
        "data_wait_s": wait_s[1:],
    }
    dist.destroy_process_group()
    return result


# ---------------------------------------------------------------------------- the driver
def _launch(world: int, args) -> list[dict]:
    command = [
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--standalone",
        f"--nproc-per-node={world}",
        str(Path(__file__).resolve()),
        "--rank-worker",
        str(world),
        *args.argv,
    ]
    env = dict(os.environ, OMP_NUM_THREADS="1")
    run = subprocess.run(command, env=env, capture_output=True, text=True, check=False)
    # ranks share the pipe and a rank's line may arrive in pieces: parse every result object
    # wherever it starts, not line by line
    decoder = json.JSONDecoder()
    results = [decoder.raw_decode(piece)[0] for piece in run.stdout.split(RESULT_PREFIX)[1:]]
    if run.returncode or len(results) != world:
        sys.stderr.write(run.stdout[-4000:] + run.stderr[-8000:])
        raise SystemExit(f"the {world}-rank run failed (exit {run.returncode})")
    return sorted(results, key=lambda r: r["rank"])


def _print_runs(runs: dict) -> None:
    print(
        "\n== Measured (CPU ranks, one intra-op thread each; a shared machine: times polluted) =="
    )
    print(
        "ranks rank rows        peak RSS MiB  +over start  workers MiB*  params MiB  AdamW MiB"
        "  read/sample MiB  step s (median)  data wait s  step-1 loss"
    )
    print("* a forked worker's RSS counts the pages it shares with its rank (torch, the dataset)")
    for world, results in runs.items():
        for r in results:
            rows = f"[{r['rows'][0]}:{r['rows'][1]})"
            print(
                f"{world:<5} {r['rank']:<4} {rows:<11} {r['rss_peak_mib']:>12.0f}"
                f"  {r['rss_peak_mib'] - r['rss_before_mib']:>11.0f}"
                f"  {r['workers_rss_peak_mib']:>11.0f}  {r['param_bytes'] / MIB:>10.3f}"
                f"  {r['optimizer_bytes'] / MIB:>9.3f}  {r['bytes_per_sample'] / MIB:>15.2f}"
                f"  {statistics.median(r['step_s']):>15.2f}"
                f"  {statistics.median(r['data_wait_s']):>11.3f}  {r['losses'][0]:.9g}"
            )


def _print_plan_comparison(runs: dict, args) -> None:
    from credit_parallel.planner import make_plan

    print("\n== credit-parallel plan (estimate per rank) vs measured increase of peak RSS ==")
    print(
        "ranks  plan params+grads+AdamW MiB  plan activations MiB  plan total MiB  measured MiB  measured/plan"
    )
    for world, results in runs.items():
        conf = small_config(args.store, LAYOUTS[world], args)
        memory = make_plan(conf, world, device="cpu").memory  # measured on the CPU
        state = memory.param_bytes + memory.grad_bytes + memory.optimizer_bytes
        measured = max(r["rss_peak_mib"] - r["rss_before_mib"] for r in results)
        total = memory.total_bytes / MIB
        print(
            f"{world:<6} {state / MIB:>27.3f}  {memory.activation_bytes / MIB:>19.0f}"
            f"  {total:>14.0f}  {measured:>12.0f}  {measured / total:>13.2f}"
        )


def _print_bundled_plans(args) -> None:
    from credit_parallel.planner import make_plan

    conf = _bundled_config()
    block = conf["trainer"]["parallelism"]
    print(f"\n== Bundled {BUNDLED_CONFIG} ({block}) per rank, from credit-parallel plan ==")
    print("world  dp  params MiB  grads MiB  AdamW MiB  activations MiB  total MiB")
    for world in args.plan_world_sizes:
        plan = make_plan(conf, world)
        m = plan.memory
        print(
            f"{world:<6} {plan.dp:<3} {m.param_bytes / MIB:>10.1f} {m.grad_bytes / MIB:>10.1f}"
            f" {m.optimizer_bytes / MIB:>10.1f} {m.activation_bytes / MIB:>16.0f}"
            f" {m.total_bytes / MIB:>10.0f}"
        )


def main(argv=None) -> int:
    args = parse_args(argv)
    if args.rank_worker is not None:
        sys.stdout.write(RESULT_PREFIX + json.dumps(_train_rank(args)) + "\n")  # one write
        sys.stdout.flush()
        return 0
    store = write_store(args.store, args.times, args.levels, args.grid)
    print(
        f"store {store}: {args.grid[0]} x {args.grid[1]}, {args.times} times, levels {args.levels}"
    )
    runs = {world: _launch(world, args) for world in args.ranks}
    _print_runs(runs)
    _print_plan_comparison(runs, args)
    _print_bundled_plans(args)
    return 0


if __name__ == "__main__":
    sys.exit(main())
