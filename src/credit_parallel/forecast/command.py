"""Worker of ``credit-parallel forecast``: one process per rank (torchrun or the CLI's launcher),
or the whole job on one process.

Per rank: the dataset's rows of this domain rank over the whole store (``ERA5Dataset`` by rows),
the model built and parallelised as in training (``trainer.parallelism``, or ``--parallelism``)
with the checkpoint's weights (:mod:`.weights`), then the pending initial times spread over the
data-parallel groups (group ``g`` takes the ``g``-th, ``g + dp``-th, ... one per round).  Each
initial time rolls out on this rank's rows (:func:`.rollout.rollout`; the dynamic forcing of
each lead read by rows), each step is denormalised to physical units, its rows moved to the
ranks owning their chunks (:mod:`.chunks`, a neighbour exchange) and handed to the writer
(:class:`.writer.StepWriter`: the device-to-host copy and the chunk writes leave the critical
path; only tensor-parallel rank 0 of each domain position writes: its tp peers hold the same
rows) while the next step computes, and scored
against the dataset's truth where it has one (:class:`.scores.ScoreAccumulator`, exact global
sums).  After each round every rank flushes its writer, all meet at a barrier, and rank 0 marks
the round's initial times complete; a rank that dies leaves its peers waiting at most
``trainer.dist_timeout_s`` (every collective's bound), and the complete times intact.  A stop
signal on any rank (``trainer.stop_signals``: :mod:`credit_parallel.train.preemption`) stops
every rank before the next round, the finished initial times marked complete, and the worker
exits with status 75 (``--resume`` continues).

Everything that can be wrong with the input is checked before the store is created: initial
times (dataset, history, forcing), the checkpoint (keys and shapes), the store
(``--resume`` / ``--overwrite``), the layout.  Ensembles (``--members M``): the M members of an
initial time are spread over ``gcd(M, dp)`` dp groups (a slot; the slots take the initial times),
each running its share of the members as the batch of one rollout, perturbed by
:func:`.ensemble.perturb`; the CRPS and spread gather the members over the slot.

Rank 0 reports progress: a tqdm bar on a terminal, else one plain line per step
``forecast init T step k/N steps/s S writer_lag L steps B s`` (the writer's steps in flight and
the age of the oldest); its first line states the writer's steps in flight, the host memory
they cost and the chunks, its last line the share of the loop spent waiting for writes and the
writer's throughput.

Host memory: :func:`~.allocator.fix_mmap_threshold` (in the command's worker processes,
:func:`main`, and the benchmark's ranks; not in :func:`run_forecast`) fixes glibc's mmap
threshold at 1 MiB.  The flags and their up-front checks: :mod:`.arguments`.
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from pathlib import Path

import numpy as np
import torch
import torch.distributed as dist

from ..train.preemption import STOPPED_EXIT_CODE, StopRequest
from .allocator import MMAP_THRESHOLD, fix_mmap_threshold
from .arguments import apply_overrides, build_arguments, preflight
from .fields import Fields, Progress, dataset_layout, store_variables

# the flags and the up-front checks live in .arguments, the allocator in .allocator; their names
# stay importable from here (the CLI, the tests and the benchmarks import them from here)
__all__ = [
    "MMAP_THRESHOLD",
    "apply_overrides",
    "build_arguments",
    "fix_mmap_threshold",
    "main",
    "preflight",
    "run_forecast",
]

# a test hook: "RANK:ROUND" makes that rank fail at the start of that round (0-based)
FAIL_ENV = "CREDIT_PARALLEL_FORECAST_FAIL_AT"
# steps handed to the writer before the rollout waits for it (docs/forecast.md "Writing")
WRITES_IN_FLIGHT = 2


def _world() -> tuple[int, int]:
    if dist.is_available() and dist.is_initialized():
        return dist.get_rank(), dist.get_world_size()
    return 0, 1


def _barrier() -> None:
    if dist.is_available() and dist.is_initialized():
        dist.barrier()


def _forecast_dataset(conf: dict, domain_rank: int, domain_size):
    """This domain rank's rows (``domain_size`` = (P, Q): its tile) of the WHOLE store's time
    axis, one step per sample."""
    from ..data.dataset import dataset_from_conf

    data = {k: v for k, v in conf["data"].items() if k not in ("time_slice", "valid_time_slice")}
    return dataset_from_conf(
        {**conf, "data": data}, forecast_len=1, domain_shard=(domain_rank, domain_size)
    )


def _build_model(conf: dict, dims, device, dtype):
    from ..layout.run_config import TrainerConfig
    from ..models import build_model
    from ..parallel.composition import RecipeOptions
    from ..train.model_init import build_parallel_model

    tc = TrainerConfig.from_conf(conf)
    options = RecipeOptions.from_trainer(tc)
    model_conf = conf["model"]
    return build_parallel_model(
        lambda: build_model(model_conf).to(dtype),
        device=device,
        seed=tc.seed,
        dims=dims,
        options=options,
    )


def _groups(dims, rank: int, key) -> object:
    """This rank's group among the groups of ranks that share ``key(coords)`` (every rank
    creates every group, in the same order); None on one process."""
    if dims.world_size == 1:
        return None
    keys = [key(dims.coords(r)) for r in range(dims.world_size)]
    mine = None
    for k in sorted(set(keys)):
        group = dist.new_group([r for r in range(dims.world_size) if keys[r] == k])
        if k == keys[rank]:
            mine = group
    return mine


def _maybe_fail(rank: int, round_index: int) -> None:
    spec = os.environ.get(FAIL_ENV)
    if spec and spec == f"{rank}:{round_index}":
        raise RuntimeError(f"{FAIL_ENV}: rank {rank} stops at round {round_index} (test hook)")


class _Run:
    """One rank's forecast: the dataset rows, the model, the writer, the scores."""

    def __init__(self, conf: dict, args, stream):
        from ..layout.config import ParallelDims
        from ..layout.device import device_for_process_group
        from ..layout.run_config import TrainerConfig
        from ..parallel.composition import get_domain_manager
        from .inputs import resolve_init_times
        from .store import STORE_NAME, check_existing_store
        from .weights import load_forecast_weights

        self.conf, self.args, self.stream = conf, args, stream
        self.rank, world = _world()
        self.dims = ParallelDims.from_conf(conf, world)
        self.coords = self.dims.coords(self.rank)
        tc = TrainerConfig.from_conf(conf)
        self.seed, self.amp = tc.seed, tc.amp
        self.stop_signals = tc.stop_signals  # a clean stop between rounds (train/preemption.py)
        self.dtype = torch.float64 if tc.dtype == "float64" else torch.float32
        self.device = device_for_process_group()
        # latitude rows, or (P, Q) tiles of rows x columns (SPEC §3b)
        self.domain_split = self.dims.domain_shape if self.dims.is_2d else self.dims.domain
        self.dataset = _forecast_dataset(conf, self.coords["domain"], self.domain_split)
        self.times = resolve_init_times(
            self.dataset.times,
            init_times=args.init_times,
            init_range=args.init_range,
            steps=args.steps,
            history_len=self.dataset.history_len,
            needs_forcing=self.dataset.n_forcing > 0,
        )
        self.output = Path(args.output)
        self.store_path = self.output / STORE_NAME
        self.layout = dataset_layout(self.dataset, getattr(args, "layout", None))
        self.variables = store_variables(self.dataset, self.layout)
        check_existing_store(
            self.store_path,
            args.resume,
            args.overwrite,
            self.times,
            self.variables,
            args.members,
            self.layout,
        )
        self.model = _build_model(conf, self.dims, self.device, self.dtype)
        self.manifest = load_forecast_weights(
            self.model, args.checkpoint, ema=getattr(args, "ema", False)
        )
        self.manager = get_domain_manager(self.model)
        self.fields = Fields(self.dataset, self.device)
        self.rows, self.columns = self.dataset.rows, self.dataset.columns
        total = len(self.times.positions) * args.steps
        self.report = Progress(stream, total, self.rank == 0 and args.progress)
        # the members of an initial time over `split` dp groups (a slot), `per` members each
        from .ensemble import member_split

        self.split = member_split(args.members, self.dims.dp)
        self.slot, part = divmod(self.coords["dp"], self.split)
        per = args.members // self.split
        self.members = range(part * per, (part + 1) * per)
        self.slots = self.dims.dp // self.split
        _barrier()  # every rank checked the store before rank 0 touches it

    # ---------------------------------------------------------------- the store
    def open_store(self):
        from .chunks import chunk_length, row_chunk_length
        from .store import ForecastStore, config_attrs, remove_store

        args, ds = self.args, self.dataset
        (height, width), (p, q) = ds.grid_shape, self.dims.domain_shape
        if self.rank == 0 and (args.overwrite or not self.store_path.exists()):
            remove_store(self.store_path)
            ForecastStore.create(
                self.store_path,
                variables=self.variables,
                init_times=self.times.init_times,
                lead_times=self.times.lead_times,
                latitude=ds.latitude,
                longitude=ds.longitude,
                levels=ds.levels if ds.upper_air_variables else (),
                members=args.members,
                row_chunk=row_chunk_length(height, p),
                column_chunk=chunk_length(width, q) if q > 1 else None,
                attrs=config_attrs(
                    self.conf,
                    self.manifest.get("checkpoint", args.checkpoint),
                    {"ema": bool(self.manifest.get("ema", False))},  # the weights' moving average?
                ),
                layout=self.layout,
            )
        _barrier()
        self.store = ForecastStore.open(self.store_path, args.members)
        self._chunk_plan(*self.store.chunk_shape(self.variables[0].name)[-2:])

    def _chunk_plan(self, row_chunk: int, column_chunk: int) -> None:
        """This rank's parts of the chunk plan (:mod:`.chunks`) for the store's chunks (a
        ``--resume`` under another layout keeps the store's): the rows and columns it writes,
        and its exchange peers."""
        from ..domain.rows import shard_range
        from .chunks import axis_plan

        (height, width), (p, q) = self.dataset.grid_shape, self.dims.domain_shape
        lat, lon = divmod(self.coords["domain"], q)
        rows = [shard_range(height, p, i) for i in range(p)]
        self.row_part = axis_plan(height, rows, row_chunk)[lat]
        self.column_part = None
        if q > 1 or column_chunk < width:
            columns = [shard_range(width, q, j) for j in range(q)]
            self.column_part = axis_plan(width, columns, column_chunk)[lon]
        ranks = {}
        for r in range(self.dims.world_size):
            c = self.dims.coords(r)
            ranks[(c["dp"], c["tp"], c["domain"])] = r
        dp, tp = self.coords["dp"], self.coords["tp"]
        self.row_peer = lambda i: ranks[(dp, tp, i * q + lon)]
        self.column_peer = lambda j: ranks[(dp, tp, lat * q + j)]

    def owned_block(self, physical: torch.Tensor) -> torch.Tensor:
        """This rank's rows (columns) of a step -> the rows (columns) of the chunks it writes,
        float32 on the device (every domain peer calls it: a neighbour exchange)."""
        from .chunks import exchange

        block = physical.to(torch.float32)
        if self.column_part is not None:
            block = exchange(block, self.column_part, -1, self.column_peer)
        return exchange(block, self.row_part, -2, self.row_peer)

    def writer_line(self) -> str:
        """The first line: the writer's steps in flight, the host memory they cost, the chunks."""
        from .writer import writer_memory_bytes

        rows = self.row_part.owned
        columns = self.column_part.owned if self.column_part is not None else (0, None)
        width = self.dataset.grid_shape[1] if columns[1] is None else columns[1] - columns[0]
        channels = self.dataset.channels_out_per_step
        step = len(self.members) * channels * (rows[1] - rows[0]) * width * 4
        memory = writer_memory_bytes(step, WRITES_IN_FLIGHT)
        kind = "pinned" if self.device.type == "cuda" else "host"
        chunk = self.store.chunk_shape(self.variables[0].name)[-2:]
        return (
            f"forecast writer: {WRITES_IN_FLIGHT} steps in flight, {kind} buffers "
            f"{WRITES_IN_FLIGHT} x {step / 1e6:.1f} MB + tensorstore's copies: <= "
            f"{memory / 1e6:.1f} MB per rank; chunks {chunk[0]} rows x {chunk[1]} columns, "
            "one writer each"
        )

    def scores(self):
        from .scores import ScoreAccumulator, climatology

        clim = climatology(
            self.conf,
            domain_shard=(self.coords["domain"], self.domain_split),
            path=getattr(self.args, "climatology", None),
        )
        return ScoreAccumulator.for_dataset(
            self.dataset,
            list(self.times.lead_times),
            lat_weights_local=self.dataset.row_lat_weights.double(),
            climatology=clim.to(self.device),
            manager=self.manager,
            members=self.args.members,
            dp_group=_groups(self.dims, self.rank, lambda c: (c["tp"], c["domain"])),
            member_group=self._member_group(),
        )

    def _member_group(self):
        """The ranks holding the other members of this rank's initial times and rows."""
        split = self.split
        group = _groups(self.dims, self.rank, lambda c: (c["tp"], c["domain"], c["dp"] // split))
        return group if split > 1 else None

    # ---------------------------------------------------------------- one initial time
    def _tensor(self, array: np.ndarray) -> torch.Tensor:
        return torch.from_numpy(array).to(self.device, self.dtype).unsqueeze(0)

    def initial_state(self, position: int) -> tuple:
        from ..train.step import INPUT_KEYS

        ds = self.dataset
        sample = ds.compose_input(ds.read_steps(position - ds.history_len + 1, position + 1))
        sample = self.fields.units.model_input(sample)  # the run's preblocks (units.py)
        keys = next(k for k in INPUT_KEYS if all(name in sample for name in k))
        state = tuple(self._tensor(sample[k].numpy()) for k in keys)
        extra = ds.n_forcing + ds.n_static
        from .ensemble import member_states

        return member_states(state, self.members, self.seed, self.manager, extra, position)

    def forcing(self, position: int):
        ds, members = self.dataset, len(self.members)
        if ds.n_forcing == 0:
            return None

        def at(k: int) -> torch.Tensor:
            step = ds.read_steps(position + k, position + k + 1)[0, ds.forcing_channels]
            step = self.fields.units.model_forcing(step)
            return self._tensor(step).expand(members, -1, -1, -1)

        return at

    def forecast_one(self, i: int, real: bool, writer, acc, clock: dict) -> None:
        """Roll out initial time ``i``; write and score it when ``real`` (else the round's
        stand-in that keeps every dp group's collectives in step)."""
        from .rollout import rollout

        position, members = self.times.positions[i], self.args.members
        label = str(np.datetime64(self.times.init_times[i], "m"))
        steps = len(self.times.lead_times)
        writes = real and self.coords["tp"] == 0
        outputs = rollout(
            self.model,
            self.initial_state(position),
            steps,
            forcing=self.forcing(position),
            manager=self.manager,
            amp=self.amp,
            n_static=self.dataset.n_static,
            n_diagnostic=self.dataset.n_diagnostic,
        )
        from .stochastic import member_noise_steps  # a stochastic model's seeded members

        outputs = member_noise_steps(
            outputs, self.model, self.seed, self.members, position, self.device
        )
        ids = list(self.members) if members > 1 else [None]
        rows = self.row_part.owned
        columns = self.column_part.owned if self.column_part is not None else None
        empty = rows[0] == rows[1] or (columns is not None and columns[0] == columns[1])
        for k, out in enumerate(outputs, start=1):
            physical = self.fields.physical(out)  # (this rank's members, C, rows, W)
            if writes:
                block = self.owned_block(physical)
                if not empty:
                    writer.submit(block, (i, k - 1), ids, rows, columns)
            if real and k <= self.times.truth_steps[i]:
                truth = self.fields.truth(
                    self.dataset.read_steps(position + k, position + k + 1)[0], self.device
                )
                pred = physical if members == 1 else physical.unsqueeze(1)
                acc.add([label], k, pred, truth)
            clock["steps"] += 1
            rate = clock["steps"] / max(time.perf_counter() - clock["start"], 1e-9)
            if real:
                self.report.step(label, k, steps, rate, writer.lag, writer.behind_s)

    def score_stored(self, i: int, acc) -> None:
        """Score initial time ``i`` from what the store holds (a ``--resume`` run skipped it):
        this rank's rows of its members, read back, against the truth, as :meth:`forecast_one`
        scores a computed one (the scores cover every initial time of the store)."""
        members = self.args.members
        label = str(np.datetime64(self.times.init_times[i], "m"))
        position = self.times.positions[i]
        for k in range(1, self.times.truth_steps[i] + 1):
            physical = torch.stack(
                [
                    self.fields.from_store(
                        self.store,
                        (i, m, k - 1) if members > 1 else (i, k - 1),
                        self.rows,
                        self.device,
                        self.columns,
                        self.layout,
                    )
                    for m in self.members
                ]
            )
            truth = self.fields.truth(
                self.dataset.read_steps(position + k, position + k + 1)[0], self.device
            )
            acc.add([label], k, physical if members == 1 else physical.unsqueeze(1), truth)

    # ---------------------------------------------------------------- all of them
    def _complete(self, writer, fence: int, items: list) -> None:
        """Mark ``items`` complete once every rank has written its rows of them (its writer
        passed ``fence``, then a barrier)."""
        writer.wait(fence)
        _barrier()
        if self.rank == 0:
            self.store.mark_complete(items)

    def _stopped(self, writer, fences: list, pending: list, verdict) -> dict:
        """Every rank agreed to stop before round ``len(fences)``: the last round's rows are
        flushed and its initial times marked complete; no scores (``--resume`` continues)."""
        dp = self.slots
        if fences:
            self._complete(writer, fences[-1], pending[(len(fences) - 1) * dp : len(fences) * dp])
        finished = min(len(fences) * dp, len(pending))
        self.report.close()
        if self.rank == 0:  # said also without a progress report (why and where)
            print(
                f"forecast: stopping after {finished} of {len(pending)} initial time(s) "
                f"({verdict.reason}): those are complete in {self.store_path}; continue with "
                f"--resume (exit status {STOPPED_EXIT_CODE})",
                file=self.stream,
                flush=True,
            )
        computed = [str(self.times.init_times[i]) for i in pending[:finished]]
        return {"store": str(self.store_path), "computed": computed, "stopped": verdict.reason}

    def run(self) -> dict:
        from .writer import StepWriter, summary

        self.open_store()
        self.report.write(self.writer_line())
        done = self.store.complete_times()
        pending = [i for i in range(len(done)) if not done[i]]
        skipped = len(done) - len(pending)
        if skipped:
            self.report.write(f"resume: {skipped} initial time(s) already complete, skipped")
        acc = self.scores()
        slices = [(self.layout.store_name(n), c, u) for n, c, u in self.fields.slices]
        writer = StepWriter(self.store, slices, WRITES_IN_FLIGHT)
        dp, group = self.slots, self.slot  # one initial time per slot and round
        rounds = -(-len(pending) // dp)
        clock = {"steps": 0, "start": time.perf_counter()}
        fences: list[int] = []
        with StopRequest(self.stop_signals, device=self.device) as stop:
            try:
                for r in range(rounds):
                    verdict = stop.agreed() if r > 0 else None  # every rank, every round
                    if verdict is not None and verdict.stop:
                        return self._stopped(writer, fences, pending, verdict)
                    started = time.perf_counter()
                    _maybe_fail(self.rank, r)
                    j = r * dp + group
                    self.forecast_one(
                        pending[min(j, len(pending) - 1)], j < len(pending), writer, acc, clock
                    )
                    fences.append(writer.fence())
                    if r > 0:  # round r-1's rows are written while round r computed
                        self._complete(writer, fences[r - 1], pending[(r - 1) * dp : r * dp])
                    stop.timed(started)  # a SIGTERM'd rank is hung after 1 s + 2 rounds
                stop.finishing()
                if rounds:
                    self._complete(writer, fences[-1], pending[(rounds - 1) * dp :])
            finally:
                writer.close()
        elapsed = time.perf_counter() - clock["start"]
        skipped_items = [i for i in range(len(done)) if done[i]]
        for i in skipped_items[group::dp]:  # complete before this run: scored from the store
            self.score_stored(i, acc)
        rows = acc.result()
        self.report.close()
        return {
            "store": str(self.store_path),
            "computed": [str(self.times.init_times[i]) for i in pending],
            "skipped": skipped,
            "scores": rows,
            "elapsed_s": elapsed,
            "steps": clock["steps"],
            **summary(writer),
            "written_chunks": sorted(self.store.written_chunks),
        }


def _finish(run: _Run, result: dict, stream) -> None:
    """Rank 0: scores.csv / .json / .png, a map of the first variable at the last scored lead,
    and the summary lines."""
    from .scores import forecast_map, write_scores

    times, out = run.times, run.output
    steps = len(times.lead_times)
    if result["computed"] and times.scored_to < steps:
        print(
            f"scores: the dataset holds the truth up to lead {times.scored_to} of {steps} "
            "for these initial times; later leads are not scored",
            file=stream,
            flush=True,
        )
    if result["scores"]:
        paths = write_scores(out, result["scores"])
        print(f"scores in {', '.join(str(p) for p in paths.values())}", file=stream, flush=True)
        hours = [row["lead_time_hours"] for row in result["scores"]]
        shown = (min(hours), max(hours))  # the first and the last scored lead (all: the csv)
        for row in (r for r in result["scores"] if r["lead_time_hours"] in shown):
            level = "" if row["level"] is None else f" {row['level']}"
            acc = "" if row.get("acc") is None else f" acc {row['acc']:.4f}"
            print(
                f"  {row['variable']}{level} +{row['lead_time_hours']:g}h rmse "
                f"{row['rmse']:.5g}{acc}",
                file=stream,
            )
    lead = max(1, times.scored_to) if result["computed"] else 1
    png = forecast_map(  # forecast, truth and error of the first variable and initial time
        run.conf,
        run.dataset,
        run.layout,
        run.store_path,
        times.positions[0],
        lead,
        out / "map_{name}.png",
    )
    share = result["write_blocked_s"] / max(result["elapsed_s"], 1e-9)
    print(
        f"forecast: {len(result['computed'])} initial time(s) x {steps} steps in "
        f"{result['elapsed_s']:.1f} s; writes on the critical path {100 * share:.1f}% (writer "
        f"{result['write_mb_s']:.0f} MB/s); store {run.store_path}; map {png}",
        file=stream,
        flush=True,
    )


def run_forecast(conf: dict, args, *, stream=None) -> dict:
    """Forecast as ``args`` says (the flags of ``credit-parallel forecast``: ``checkpoint``,
    ``steps``, ``output``, ``init_times`` / ``init_range``, ``members``, ``resume``,
    ``overwrite``, ``progress``) under ``conf``'s layout; every rank calls it.  Returns this
    rank's summary (store path, initial times computed, scores rows, timings)."""
    stream = stream if stream is not None else sys.stdout
    run = _Run(conf, args, stream)
    result = run.run()
    if run.rank == 0 and not result.get("stopped"):
        _finish(run, result, stream)
    _barrier()
    return result


def _resume_after_restart(args) -> None:
    """A worker group restarted by torchrun (``--max-restarts``) continues the store its first
    start began: ``--resume`` (complete initial times kept), never ``--overwrite``."""
    from ..layout.launch import elastic_restart_count

    restarts = elastic_restart_count()
    if restarts:
        args.resume, args.overwrite = True, False
        if os.environ.get("RANK", "0") == "0":
            print(f"elastic restart {restarts}: continuing the store (--resume)", flush=True)


def main(argv=None) -> int:
    from ..layout.config import load_config
    from ..layout.launch import init_distributed_from_env, under_launcher

    ap = argparse.ArgumentParser(prog="python -m credit_parallel.forecast.command")
    build_arguments(ap)
    args = ap.parse_args(argv)
    args.progress = True
    _resume_after_restart(args)
    conf = apply_overrides(load_config(args.config), args)
    torch.set_num_threads(max(1, int(os.environ.get("OMP_NUM_THREADS", "1"))))
    if under_launcher():
        from ..train.preflight import dist_timeout_s

        init_distributed_from_env(timeout_s=dist_timeout_s(conf))
    fix_mmap_threshold()  # the worker process's whole allocator: not in run_forecast's callers'
    result = run_forecast(conf, args)
    if dist.is_initialized():
        dist.destroy_process_group()
    return STOPPED_EXIT_CODE if result.get("stopped") else 0


if __name__ == "__main__":
    sys.exit(main())
