"""Benchmark: the HOST time of one domain conv's halo exchange per call (issue 26 item 4).

At domain N (default 2), 1 intra-op thread per rank, a tiny input (default 1 x 4 x 16 x 32,
float32: the transfer is negligible, what remains is Python and dispatch), it measures the CPU
time of the calling thread (``time.thread_time``: time blocked in gloo's waits does not count)
per call, forward and backward separately, of:

* ``split``    — a ``DomainParallelConv2d`` (3x3, padding 1) on its default path
  (``split_conv.SplitConv``: the shard's call plus boundary strips);
* ``window``   — the same layer with ``split_halo=False`` (the exchange assembles the window,
  then the plain conv runs on it);
* ``exchange`` — the exchange alone (``exchange.halo.exchange_planned`` of the layer's plan,
  the window returned, no conv);
* ``a2a``      — the same exchange through one functional ``all_to_all_single``
  (``exchange/functional.py``, ``exchange_path("all_to_all")``: the compiler-visible path);
  this version only, not a baseline's;
* ``plain``    — the plain ``nn.Conv2d`` on the shard alone (no exchange): the floor the two
  layer rows are compared with;
* ``gloo``     — the transport alone: per direction, one send and one receive of the halo's
  size posted on the process group and waited for, no library code (what no exchange path
  can go below; on this shared machine it moves with the load);
* ``floor``    — the least a differentiable exchange in Python does: a bare
  ``torch.autograd.Function`` with the layer's messages hard-wired (per peer one
  ``narrow_copy`` + ``send``, one ``new_empty`` + ``recv``, the waits, one ``new_full`` for the
  fill rows and one ``cat``; backward: the own rows' gradient copied, the received rows'
  gradients sent back, the returned ones added), no library code: ``exchange`` minus ``floor``
  is what the library's bookkeeping still costs.

The host cost of the exchange in a layer is ``layer - plain`` (the convolution itself
subtracted).  Backward is ``torch.autograd.grad`` of the output with respect to the input,
weight and bias (of the window with respect to the input for ``exchange``).  Rounds interleave
the variants; per variant the median over rounds of each rank's microseconds per call, the
slowest rank reported.

    PYTHONPATH=src .venv/bin/python benchmarks/exchange_host.py --rounds 5 --calls 200
"""

from __future__ import annotations

import argparse
import contextlib
import importlib
import os
import re
import shutil
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch
from torch import nn

from credit_parallel.domain.rows import shard_range

__all__ = ["VARIANTS", "main"]

VARIANTS = ("split", "window", "exchange", "a2a", "plain", "gloo", "floor")


def _build(variant: str, conv: nn.Conv2d, mgr, package: str):
    """``(forward(x), backward(y, x))`` of one variant on this rank, with the library
    ``package`` (``credit_parallel`` or the baseline's copy)."""
    exchange_planned = importlib.import_module(f"{package}.domain.exchange.halo").exchange_planned
    conv_module = importlib.import_module(f"{package}.domain.layers.conv")
    DomainParallelConv2d = conv_module.DomainParallelConv2d  # noqa: N806

    params = list(conv.parameters())
    if variant == "gloo":
        return _transport(mgr)
    if variant == "floor":
        return _floor(DomainParallelConv2d(conv, manager=mgr), mgr)
    if variant == "plain":
        return conv, lambda y, x: torch.autograd.grad(y, [x, *params], torch.ones_like(y))
    layer = DomainParallelConv2d(conv, manager=mgr)
    layer.configure(split_halo=variant == "split")
    if variant not in ("exchange", "a2a"):
        return layer, lambda y, x: torch.autograd.grad(y, [x, *params], torch.ones_like(y))
    path = "all_to_all" if variant == "a2a" else "p2p"
    if variant == "a2a":
        exchange_path = importlib.import_module(
            f"{package}.domain.exchange.functional"
        ).exchange_path
    else:
        exchange_path = lambda _: contextlib.nullcontext()  # noqa: E731

    def exchange(x):
        length = mgr.global_length(layer, x.shape[2])
        call = layer._call_geometry(length, mgr.domain_world_size, mgr.domain_rank)
        with exchange_path(path):
            return exchange_planned([x], [(call.plan, 2, 0.0)], mgr)[0]

    return exchange, lambda y, x: torch.autograd.grad(y, [x], torch.ones_like(y))


def _transport(mgr):
    """One raw send + receive of one halo row's size per direction, on the domain group."""
    group, rank = mgr.domain_group, mgr.domain_rank
    peer = 1 - rank if rank < 2 else rank  # ranks 0 and 1 swap; others send to themselves

    def swap(x):
        row = x.detach().narrow(2, 0, 1).contiguous()
        buf = torch.empty_like(row)
        for work in (group.send([row], peer, 0), group.recv([buf], peer, 0)):
            work.wait()
        return buf

    return swap, lambda y, x: swap(x)


def _floor(layer, mgr):
    """The bare Function of the ``floor`` variant for ``layer``'s plan (its first call's
    geometry; one run per peer, as a 3x3 conv's halo is)."""
    group, peers = mgr.domain_group, mgr.domain_ranks
    rank = lambda q: torch.distributed.get_group_rank(group, peers[q])  # noqa: E731
    state = {}

    def geometry(x):
        length = mgr.global_length(layer, x.shape[2])
        plan = layer._call_geometry(length, mgr.domain_world_size, mgr.domain_rank).plan
        shape = list(x.shape)
        sends = [(rank(q), runs[0][0], runs[0][1]) for q, runs in plan.sends]
        recvs = [(rank(q), shape[:2] + [c] + shape[3:]) for q, c in plan.recvs]
        pieces, pos, owns = [], 0, []
        for seg in plan.segments:
            pieces.append((seg[0], seg[1], shape[:2] + [seg[-1]] + shape[3:]))
            if seg[0] == "own":
                owns.append((pos, seg[-1]))
            pos += seg[-1]
        back = [(rank(q), pieces_at(plan, i), c) for i, (q, c) in enumerate(plan.recvs)]
        return sends, recvs, pieces, owns[0], back

    def pieces_at(plan, i):
        pos = 0
        for seg in plan.segments:
            if seg[0] == "recv" and seg[1] == i:
                return pos
            pos += seg[-1]

    class Floor(torch.autograd.Function):
        @staticmethod
        def forward(ctx, x):
            sends, recvs, pieces, _, _ = state["geo"]
            bufs = [x.new_empty(shape) for _, shape in recvs]
            works = [group.recv([b], r, 0) for (r, _), b in zip(recvs, bufs)]
            works += [group.send([x.narrow_copy(2, s, c)], r, 0) for r, s, c in sends]
            for w in works:
                w.wait()
            parts = []
            for kind, a, shape in pieces:
                if kind == "own":
                    parts.append(x)
                elif kind == "recv":
                    parts.append(bufs[a])
                else:
                    parts.append(x.new_full(shape, 0.0))
            return torch.cat(parts, 2)

        @staticmethod
        def backward(ctx, g):
            sends, recvs, _, (p, c), back = state["geo"]
            grad = g.narrow_copy(2, p, c)
            bufs = [g.new_empty([*g.shape[:2], c_, *g.shape[3:]]) for _, _, c_ in sends]
            works = [group.recv([b], r, 0) for (r, _, _), b in zip(sends, bufs)]
            works += [group.send([g.narrow_copy(2, at, n)], r, 0) for r, at, n in back]
            for w in works:
                w.wait()
            for (_, s, n), b in zip(sends, bufs):
                grad.narrow(2, s, n).add_(b)
            return grad

    def forward(x):
        if "geo" not in state:
            state["geo"] = geometry(x)
        length = mgr.global_length(layer, x.shape[2])  # as the exchange variant does per call
        layer._call_geometry(length, mgr.domain_world_size, mgr.domain_rank)
        return Floor.apply(x)

    return forward, lambda y, x: torch.autograd.grad(y, [x], torch.ones_like(y))


def _per_call_us(forward, backward, x, calls: int, mgr, token) -> tuple[float, float]:
    """Thread CPU microseconds per forward and per backward call, over ``calls`` calls (each
    the one call of its layer in a forward: ``begin_forward`` before it, untimed)."""
    fwd = bwd = 0.0
    for _ in range(calls):
        mgr.begin_forward(token)
        t0 = time.thread_time()
        y = forward(x)
        t1 = time.thread_time()
        backward(y, x)
        t2 = time.thread_time()
        fwd += t1 - t0
        bwd += t2 - t1
    return 1e6 * fwd / calls, 1e6 * bwd / calls


def _worker(rank, world, shape, rounds: int, calls: int, warmup: int, packages: tuple):
    import torch.distributed as dist

    torch.set_num_threads(1)
    torch.manual_seed(0)
    token = ("exchange_host", shape)
    a, b = shard_range(shape[2], world, rank)
    x = torch.randn(shape)[:, :, a:b].clone().requires_grad_()
    runs = {}
    for package in packages:
        manager = importlib.import_module(f"{package}.domain.manager")
        mgr = manager.DomainParallelManager(world, world)
        for v in VARIANTS:
            if v in ("plain", "gloo", "floor") and package != packages[0]:
                continue  # no library code: measured once
            if v == "a2a" and package != "credit_parallel":
                continue  # this version's path only
            conv = nn.Conv2d(shape[1], shape[1], 3, padding=1)
            runs[package, v] = (*_build(v, conv, mgr, package), mgr)
    for fwd, bwd, mgr in runs.values():
        _per_call_us(fwd, bwd, x, warmup, mgr, token)
    times: dict = {key: ([], []) for key in runs}
    for _ in range(rounds):
        for key, (fwd, bwd, mgr) in runs.items():
            dist.barrier()
            f, bw = _per_call_us(fwd, bwd, x, calls, mgr, token)
            times[key][0].append(f)
            times[key][1].append(bw)
    return {
        key: (statistics.median(f), statistics.median(bw), min(f), min(bw))
        for key, (f, bw) in times.items()
    }


def _baseline_package(src: str) -> tuple[str, Path]:
    """A copy of ``src``/credit_parallel importable as ``credit_parallel_baseline`` (every
    occurrence of the name replaced: imports, custom-op namespaces), on ``sys.path``; returns
    the name and the temporary directory holding it."""
    root = Path(tempfile.mkdtemp(prefix="exchange_host_"))
    for path in (Path(src) / "credit_parallel").rglob("*"):
        target = root / "credit_parallel_baseline" / path.relative_to(Path(src) / "credit_parallel")
        if path.is_dir():
            target.mkdir(parents=True, exist_ok=True)
        elif path.suffix == ".py":
            target.parent.mkdir(parents=True, exist_ok=True)
            text = path.read_text()
            target.write_text(re.sub(r"\bcredit_parallel\b", "credit_parallel_baseline", text))
    sys.path.insert(0, str(root))
    return "credit_parallel_baseline", root


def main(argv=None) -> dict:

    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--domain", type=int, default=2)
    parser.add_argument("--shape", default="1,4,16,32", help="global input B,C,H,W")
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--calls", type=int, default=200)
    parser.add_argument("--warmup", type=int, default=20)
    parser.add_argument(
        "--baseline",
        default=None,
        help="a src/ directory holding another version of credit_parallel (e.g. `git archive "
        "<commit> src | tar -x -C DIR`, then DIR/src): measured in the same ranks, rounds "
        "interleaved with this version's",
    )
    args = parser.parse_args(argv)
    shape = tuple(int(v) for v in args.shape.split(","))
    packages, copy = ("credit_parallel",), None
    if args.baseline:
        name, copy = _baseline_package(args.baseline)
        packages = (name, "credit_parallel")
    try:
        return _report(args, shape, packages)
    finally:
        if copy is not None:
            sys.path.remove(str(copy))
            shutil.rmtree(copy, ignore_errors=True)


def _report(args, shape: tuple, packages: tuple) -> dict:
    """Run the ranks and print the table (and the ratios against the baseline)."""
    from credit_parallel.testing import run_on_ranks

    print(
        f"domain {args.domain}, input {shape}, 1 thread per rank, {args.calls} calls x "
        f"{args.rounds} rounds; load average before: {os.getloadavg()}"
    )
    per_rank = run_on_ranks(
        _worker, args.domain, shape, args.rounds, args.calls, args.warmup, packages, timeout=1800
    )
    results = {k: tuple(max(r[k][i] for r in per_rank) for i in range(4)) for k in per_rank[0]}
    plain = results[packages[0], "plain"]
    print("thread CPU us per call, slowest rank: median over rounds (min over rounds)")
    print(
        f"{'version':<24}| {'variant':<9}| fwd             | bwd             | fwd-plain | bwd-plain"
    )
    for (package, v), (f, b, fmin, bmin) in results.items():
        extra = ""
        if v not in ("plain", "exchange", "a2a", "gloo", "floor"):
            extra = f"{f - plain[0]:9.1f} | {b - plain[1]:9.1f}"
        print(f"{package:<24}| {v:<9}| {f:6.1f} ({fmin:6.1f}) | {b:6.1f} ({bmin:6.1f}) | {extra}")
    ex, a2a = results.get(("credit_parallel", "exchange")), results.get(("credit_parallel", "a2a"))
    if ex and a2a:
        print(
            f"a2a / exchange (the functional all-to-all over today's P2P path): fwd "
            f"{a2a[0] / ex[0]:.2f} ({a2a[2] / ex[2]:.2f}), bwd {a2a[1] / ex[1]:.2f} "
            f"({a2a[3] / ex[3]:.2f})"
        )
    if args.baseline:
        print("after / before (this version over the baseline), same ranks, interleaved rounds:")
        print("median (min over rounds); 'over gloo': minus the raw transport's time")
        floor = results[packages[0], "gloo"]
        least = results[packages[0], "floor"]
        for v in ("split", "window", "exchange"):
            old, new = results[packages[0], v], results[packages[1], v]
            ratio = [new[i] / old[i] for i in range(4)]
            over = [(new[i] - floor[i]) / (old[i] - floor[i]) for i in range(4)]
            print(
                f"{v:<9}: fwd {ratio[0]:.2f} ({ratio[2]:.2f}), bwd {ratio[1]:.2f} ({ratio[3]:.2f});"
                f" over gloo: fwd {over[0]:.2f} ({over[2]:.2f}), bwd {over[1]:.2f} ({over[3]:.2f})"
            )
        old, new = results[packages[0], "exchange"], results[packages[1], "exchange"]
        print(
            "floor / before (the bare Function, the least any exchange here can cost): "
            f"fwd {least[0] / old[0]:.2f} ({least[2] / old[2]:.2f}), "
            f"bwd {least[1] / old[1]:.2f} ({least[3] / old[3]:.2f}); exchange - floor, us: "
            f"fwd {new[0] - least[0]:.1f}, bwd {new[1] - least[1]:.1f}"
        )
    print(f"load average after: {os.getloadavg()}")
    return results


if __name__ == "__main__":
    main()
