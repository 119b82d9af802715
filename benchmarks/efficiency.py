"""Honest domain-parallel efficiency: against one process AND against a no-communication floor.

For each workload and domain size N it times, in ONE run with interleaved rounds (median over
rounds of the slowest rank's median step; a step = forward + backward + domain gradient sync):

* ``1p1t``  — the plain model on the whole grid, 1 process, 1 intra-op thread;
* ``1pNt``  — the same with N threads (only compared where N threads fit on the machine's
  cores; otherwise reported as oversubscribed, never as an efficiency);
* ``floor`` — N processes, each running the plain model built for ITS OWN rows (ordinary
  padding at the shard edges, no exchange, no collective): not the same function, just the
  floor that communication-free parallelism would reach;
* ``ours``  — N domain ranks through ``parallelize`` (exact), 1 thread each.

Efficiencies: ``E ours = T(1p1t) / (N T(ours))``, ``E floor = T(1p1t) / (N T(floor))``,
``ours/floor = T(floor) / T(ours)`` and ``E Nt = T(1pNt) / T(ours)``; every run that puts more
threads than cores on the machine is marked oversubscribed and gets no efficiency.

    .venv/bin/python benchmarks/efficiency.py --rounds 3 --steps 3 --warmup 1
    .venv/bin/python benchmarks/efficiency.py --workloads conv_stack/large,plain_unet --rounds 2
"""

from __future__ import annotations

import argparse
import os
import statistics
import time
from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch import nn

from credit_parallel.domain.rows import shard_range
from credit_parallel.tools.bench import Layout, build_conv_stack

__all__ = ["PlainUNet", "Workload", "default_workloads", "main", "parse_args", "time_workload"]


def _block(c_in: int, c_out: int, groups: int) -> list[nn.Module]:
    return [nn.Conv2d(c_in, c_out, 3, padding=1), nn.GroupNorm(groups, c_out), nn.SiLU()]


class PlainUNet(nn.Module):
    """3-level U-Net at one width C: [conv3x3, GroupNorm, SiLU] x 2 per level, stride-2 conv
    down, nearest up-sampling + conv up, skip concatenation (the issue's plain U-Net).  The
    height (of the grid and, for the floor, of every shard) must be divisible by 4."""

    # each down-sampling conv reads exactly the activation of its level's last norm (forward):
    # declared, so that norm's statistics travel with the conv's halo exchange (norm_halo.py)
    _domain_norm_act_conv = tuple(
        (f"down_blocks.{i}.4", f"down_blocks.{i}.5", f"downs.{i}") for i in range(8)
    )

    def __init__(self, channels: int = 32, groups: int = 8, levels: int = 3):
        super().__init__()
        c = channels
        self.down_blocks = nn.ModuleList(
            nn.Sequential(*_block(c, c, groups), *_block(c, c, groups)) for _ in range(levels)
        )
        self.downs = nn.ModuleList(
            nn.Conv2d(c, c, 3, stride=2, padding=1) for _ in range(levels - 1)
        )
        self.ups = nn.ModuleList(
            nn.Sequential(
                nn.Upsample(scale_factor=2, mode="nearest"), nn.Conv2d(c, c, 3, padding=1)
            )
            for _ in range(levels - 1)
        )
        self.up_blocks = nn.ModuleList(
            nn.Sequential(*_block(2 * c, c, groups), *_block(c, c, groups))
            for _ in range(levels - 1)
        )

    def forward(self, x):
        skips = []
        for i, block in enumerate(self.down_blocks):
            x = block(x)
            if i < len(self.downs):
                skips.append(x)
                x = self.downs[i](x)
        for up, block in zip(self.ups, self.up_blocks):
            skip = skips.pop()
            x = block(torch.cat([up(x), skip], dim=1))
        return x


@dataclass(frozen=True)
class Workload:
    """A model at one size; ``build(height)`` builds it for a grid of ``height`` rows."""

    name: str
    kind: str
    channels: int
    height: int
    width: int
    base: int = 32
    batch: int = 1

    def build(self, height: int) -> nn.Module:
        if self.kind == "conv_stack":
            return build_conv_stack(self.channels, 4, 8)
        if self.kind == "conv_chain":  # the conv stack without its norms: a chain of stencils
            c = self.channels
            return nn.Sequential(
                *(m for _ in range(4) for m in (nn.Conv2d(c, c, 3, padding=1), nn.SiLU()))
            )
        if self.kind == "plain_unet":
            return PlainUNet(self.channels)
        if self.kind == "unet":
            from credit_parallel.models import UNet

            return UNet(self.channels, self.channels, height, self.width, base_channels=self.base)
        if self.kind == "crossformer":
            from credit_parallel.models import CrossFormer

            dims = (self.base, 2 * self.base)
            return CrossFormer(self.channels, self.channels, height, self.width, dims=dims)
        raise ValueError(f"unknown workload kind {self.kind!r}")

    def describe(self) -> str:
        extra = f", base {self.base}" if self.kind in ("unet", "crossformer") else ""
        return f"{self.name}: C={self.channels}, {self.height}x{self.width}{extra}"


def default_workloads() -> list[Workload]:
    return [
        Workload("conv_stack/large", "conv_stack", 64, 192, 384),
        Workload("conv_stack/small", "conv_stack", 32, 96, 192),
        Workload("conv_chain/large", "conv_chain", 64, 192, 384),
        Workload("conv_chain/small", "conv_chain", 32, 96, 192),
        Workload("plain_unet", "plain_unet", 32, 192, 384),
        Workload("unet/small", "unet", 8, 33, 64, base=16),
        Workload("unet/large", "unet", 8, 97, 192, base=32),
        Workload("crossformer/small", "crossformer", 8, 32, 64, base=32),
        Workload("crossformer/large", "crossformer", 8, 96, 192, base=32),
    ]


def _time_steps(step, steps: int, warmup: int, world: int) -> float:
    for _ in range(warmup):
        step()
    times = []
    for _ in range(steps):
        if world > 1:
            dist.barrier()
        t0 = time.perf_counter()
        step()
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


def _inputs(w: Workload, rows: tuple):
    gen = torch.Generator().manual_seed(1)
    shape = (w.batch, w.channels, w.height, w.width)
    x, weights = torch.randn(shape, generator=gen), torch.randn(shape, generator=gen)
    a, b = rows
    # a training step's input: it needs no gradient (nor, under domain parallelism, the
    # exchange of one: issue 39's floor)
    return x[:, :, a:b].contiguous(), weights[:, :, a:b].contiguous(), shape


def _plain_worker(rank, world, w: Workload, threads: int, steps: int, warmup: int):
    """1p1t / 1pNt (world 1, whole grid) or the floor (world N, own rows, no communication)."""
    torch.set_num_threads(threads)
    rows = shard_range(w.height, world, rank)
    torch.manual_seed(0)
    model = w.build(rows[1] - rows[0])
    x, weights, shape = _inputs(w, rows)

    def step():
        model.zero_grad(set_to_none=True)
        ((model(x) * weights).sum() / (shape[0] * shape[1] * shape[2] * shape[3])).backward()

    return _time_steps(step, steps, warmup, world)


def domain_conf(w: Workload, world: int, chains=False) -> dict:
    """The config ``ours`` runs: domain ``world``; ``chains``: ``trainer.domain_halo_chains``."""
    conf = Layout(domain=world).conf(w.batch)
    conf["trainer"]["domain_halo_chains"] = chains
    return conf


def _domain_worker(
    rank, world, w: Workload, steps: int, warmup: int, overlap: bool = False, chains=False
):
    from credit_parallel.parallel.collectives import sync_domain_gradients
    from credit_parallel.parallel.composition import get_domain_manager, get_raw_model, parallelize
    from credit_parallel.parallel.grad_overlap import enable_overlapped_domain_grad_sync

    torch.manual_seed(0)
    model = parallelize(w.build(w.height), domain_conf(w, world, chains))
    manager = get_domain_manager(model)
    if overlap:
        enable_overlapped_domain_grad_sync(get_raw_model(model), manager=manager)
    x, weights, shape = _inputs(w, shard_range(w.height, world, rank))
    token = ("efficiency", w, shape)

    def step():
        manager.begin_forward(token)
        model.zero_grad(set_to_none=True)
        ((model(x) * weights).sum() / (shape[0] * shape[1] * shape[2] * shape[3])).backward()
        sync_domain_gradients(get_raw_model(model), manager, op="sum")

    return _time_steps(step, steps, warmup, world)


def time_workload(
    w: Workload, domain: int, *, rounds: int, steps: int, warmup: int, overlap: bool = False,
    chains=False,
) -> dict:  # fmt: skip
    """Seconds per step of each implementation: median over interleaved rounds of the slowest
    rank's median.  A failing implementation (e.g. a model the converter rejects) gives its
    error message instead of a time."""
    from credit_parallel.testing import run_on_ranks

    runs = {
        "1p1t": (_plain_worker, 1, (w, 1, steps, warmup)),
        f"1p{domain}t": (_plain_worker, 1, (w, domain, steps, warmup)),
        "floor": (_plain_worker, domain, (w, 1, steps, warmup)),
        "ours": (_domain_worker, domain, (w, steps, warmup)),
    }
    if overlap:  # the domain gradient all-reduce overlapped with the backward (grad_overlap)
        runs["ours ovl"] = (_domain_worker, domain, (w, steps, warmup, True))
    if chains:  # communication-avoiding halos (trainer.domain_halo_chains), same rounds
        runs["ours chains"] = (_domain_worker, domain, (w, steps, warmup, False, chains))
    samples: dict = {name: [] for name in runs}
    errors: dict = {}
    for _ in range(rounds):
        for name, (fn, world, args) in runs.items():
            if name in errors:
                continue
            try:
                samples[name].append(max(run_on_ranks(fn, world, *args, timeout=1800)))
            except Exception as exc:  # noqa: BLE001 - reported in the table
                errors[name] = str(exc).strip().splitlines()[-1][:160]
    return {name: errors.get(name) or statistics.median(samples[name]) for name in runs} | {
        "errors": errors
    }


def efficiencies(times: dict, domain: int, cores: int, loaded: bool = False) -> dict:
    """The efficiency columns; None where a figure is missing or a run oversubscribes.  On a
    ``loaded`` machine (other jobs hold the cores) the N-thread reference is oversubscribed
    too — its threads wait for each other at every parallel region — so it gets no figure."""

    def ok(name):
        return isinstance(times.get(name), float)

    oversubscribed = domain > cores
    out = {"oversubscribed": oversubscribed, "loaded": loaded}
    ref, ours, floor, ref_n = times["1p1t"], times["ours"], times["floor"], times[f"1p{domain}t"]
    fair = not oversubscribed
    out["E ours"] = ref / (domain * ours) if fair and ok("1p1t") and ok("ours") else None
    out["E floor"] = ref / (domain * floor) if fair and ok("1p1t") and ok("floor") else None
    out["ours/floor"] = floor / ours if fair and ok("floor") and ok("ours") else None
    fair_n = fair and not loaded
    out[f"E {domain}t"] = ref_n / ours if fair_n and ok(f"1p{domain}t") and ok("ours") else None
    return out


def parse_args(argv=None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    names = ",".join(w.name for w in default_workloads())
    parser.add_argument("--workloads", default=names, help=f"comma list of {names}")
    parser.add_argument("--domains", default="2", help="comma list of domain sizes")
    parser.add_argument("--rounds", type=int, default=3, help="interleaved rounds")
    parser.add_argument("--steps", type=int, default=3, help="timed steps per run")
    parser.add_argument("--warmup", type=int, default=1)
    parser.add_argument(
        "--overlap-grads",
        action="store_true",
        help="also time ours with the domain gradient all-reduce overlapped (grad_overlap)",
    )
    parser.add_argument(
        "--halo-chains",
        default="",
        help="also time ours with trainer.domain_halo_chains = this ('auto' or a length k)",
    )
    return parser.parse_args(argv)


def halo_chains_arg(value: str):
    """``--halo-chains`` as the trainer key reads it: '' off, 'auto', or an int."""
    if not value:
        return False
    return value if value == "auto" else int(value)


def _cell(value, fmt: str) -> str:
    if value is None:
        return "-"
    return format(value, fmt) if isinstance(value, float) else "error"


def main(argv=None) -> list[dict]:
    args = parse_args(argv)
    known = {w.name: w for w in default_workloads()}
    chosen = [n.strip() for n in args.workloads.split(",") if n.strip()]
    unknown = [n for n in chosen if n not in known]
    if unknown:
        raise SystemExit(f"--workloads: unknown {unknown}; known: {sorted(known)}")
    cores = os.cpu_count() or 1
    print(
        f"float32, 1 thread per rank, {args.rounds} interleaved rounds x {args.steps} steps "
        f"(+{args.warmup} warm-up); {cores} cores; load average before: {os.getloadavg()}"
    )
    head = (
        f"{'workload':<46}| d | {'1p1t ms':>8} | {'1pNt ms':>8} | {'floor ms':>8} | "
        f"{'ours ms':>8} | E ours | E floor | ours/floor | E Nt"
    )
    loaded = os.getloadavg()[0] > cores / 2
    if loaded:
        print(
            f"WARNING: load average {os.getloadavg()[0]:.1f} on {cores} cores: other jobs share "
            "the machine, the times below measure waiting for a core as much as the work; "
            "the N-thread reference gets no efficiency"
        )
    print(head)
    print("-" * len(head))
    rows = []
    for name in chosen:
        w = known[name]
        for domain in (int(d) for d in args.domains.split(",")):
            t = time_workload(
                w, domain, rounds=args.rounds, steps=args.steps, warmup=args.warmup,
                overlap=args.overlap_grads, chains=halo_chains_arg(args.halo_chains),
            )  # fmt: skip
            e = efficiencies(t, domain, cores, loaded)
            rows.append({"workload": name, "domain": domain, "times": t, "efficiency": e})
            ms = [
                _cell(t[k] * 1e3 if isinstance(t[k], float) else t[k], "8.1f")
                for k in ("1p1t", f"1p{domain}t", "floor", "ours")
            ]
            effs = [_cell(e[k], ".2f") for k in ("E ours", "E floor", "ours/floor", f"E {domain}t")]
            note = " (oversubscribed: more threads than cores)" if e["oversubscribed"] else ""
            print(
                f"{w.describe():<46}| {domain} | {ms[0]:>8} | {ms[1]:>8} | {ms[2]:>8} | "
                f"{ms[3]:>8} | {effs[0]:>6} | {effs[1]:>7} | {effs[2]:>10} | {effs[3]:>4}{note}"
            )
            if isinstance(t.get("ours ovl"), float):
                print(f"    ours with overlapped domain gradients: {t['ours ovl'] * 1e3:.1f} ms")
            if isinstance(t.get("ours chains"), float) and isinstance(t.get("floor"), float):
                print(
                    f"    ours with halo chains ({args.halo_chains}): {t['ours chains'] * 1e3:.1f}"
                    f" ms, ours/floor {t['floor'] / t['ours chains']:.2f}"
                )
            for impl, message in t["errors"].items():
                print(f"    {impl}: {message}")
    print(f"load average after: {os.getloadavg()}")
    return rows


if __name__ == "__main__":
    main()
