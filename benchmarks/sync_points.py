"""Synchronisation points per training step: the planner's count, and a real step's.

1. For the workloads of ``benchmarks/efficiency.py`` at ``--domains`` (planner only, no
   process): the points per step by part (``planner.sync_points``: halo exchanges, norm
   statistics, domain gradient all-reduce, ...) with the domain gradients reduced after the
   backward ("before") and overlapped with it (``grad_overlap``, "after").
2. For ``--check`` workloads at domain ``--check-domain`` (gloo ranks): one real step each way,
   counting (``tools.bench``'s collective counter and ``small_collectives``' record) the
   all-reduces issued during forward + backward and the blocking ones issued after the backward
   (the domain gradient reduction), next to what the planner predicts.

A domain is ``N`` (N latitude rows) or ``PxQ`` (P x Q lat x lon tiles), in ``--domains`` and
``--check-domain`` alike:

    PYTHONPATH=src .venv/bin/python benchmarks/sync_points.py --domains 2,4,8,2x2,4x2 \
        --check unet/large --check-domain 2x2
"""

from __future__ import annotations

import argparse

import torch

__all__ = ["main", "parse_args", "planned_points"]


def parse_args(argv=None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument(
        "--workloads", default="conv_stack/large,conv_stack/small,plain_unet,unet/large"
    )
    parser.add_argument("--domains", default="2,4,8")
    parser.add_argument("--check", default="conv_stack/large,unet/large")
    parser.add_argument("--check-domain", default="2", help="N rows or PxQ tiles")
    parser.add_argument(
        "--halo-chains",
        default="",
        help="trainer.domain_halo_chains for the plan and the real step ('auto' or a length)",
    )
    parser.add_argument(
        "--plan-device",
        default="cpu",
        choices=("cpu", "cuda"),
        help="the device whose chain costs the planner table uses (the --check rows: cpu)",
    )
    return parser.parse_args(argv)


def _workloads() -> dict:
    from efficiency import default_workloads

    return {w.name: w for w in default_workloads()}


def parse_domain(text) -> tuple[int, object]:
    """``(ranks, trainer.parallelism.domain)`` of ``"N"`` (rows) or ``"PxQ"`` (tiles)."""
    text = str(text).strip().lower()
    if "x" in text:
        p, q = (int(v) for v in text.split("x"))
        return p * q, {"lat": p, "lon": q} if q > 1 else p
    return int(text), int(text)


def _conf(w, domain, chains=False) -> tuple[int, dict]:
    """``(ranks, config)`` of workload ``w`` on ``domain`` (``parse_domain``'s text)."""
    from efficiency import domain_conf

    world, block = parse_domain(domain)
    conf = domain_conf(w, world, chains)
    conf["trainer"]["parallelism"]["domain"] = block
    return world, conf


def planned_points(w, domain, chains=False, device: str = "cpu") -> tuple[dict, dict, dict]:
    """(plan.collectives, points before, points after) of workload ``w`` at ``domain`` (N rows
    or "PxQ" tiles; ``chains``: ``trainer.domain_halo_chains``, cut for ``device``'s chain
    costs)."""
    from credit_parallel.planner.make import make_plan
    from credit_parallel.planner.sync_points import sync_points_per_step

    world, conf = _conf(w, domain, chains)
    conf["model"] = {"type": w.kind}
    plan = make_plan(
        conf,
        world,
        model=w.build(w.height),
        input_shapes=[(w.channels, w.height, w.width)],
        device=device,
    )
    if plan.violations:
        raise SystemExit(f"{w.name} at domain {domain}: {plan.violations}")
    return (
        plan.collectives,
        sync_points_per_step(plan.collectives),
        sync_points_per_step(plan.collectives, overlapped_domain_grads=True),
    )


def _step_worker(rank, world, w, overlap: bool, chains=False, domain=None):
    from credit_parallel.domain.exchange.traffic import record_exchange_stats
    from credit_parallel.domain.sharding import shard_tensor
    from credit_parallel.layout.small_collectives import record_small_collectives
    from credit_parallel.parallel.collectives import sync_domain_gradients
    from credit_parallel.parallel.composition import get_domain_manager, get_raw_model, parallelize
    from credit_parallel.parallel.grad_overlap import enable_overlapped_domain_grad_sync
    from credit_parallel.tools.bench.measure import _collective_counter

    torch.manual_seed(0)
    model = parallelize(w.build(w.height), _conf(w, domain or world, chains)[1])
    manager = get_domain_manager(model)
    raw = get_raw_model(model)
    if overlap:
        enable_overlapped_domain_grad_sync(raw, manager=manager)
    x = torch.randn(
        w.batch, w.channels, w.height, w.width, generator=torch.Generator().manual_seed(1)
    )
    # this rank's rows (its tile on P x Q), a training step's input: no gradient
    x = shard_tensor(x, 2, manager).contiguous()
    token = ("sync", w.name)

    def forward_backward():
        manager.begin_forward(token)
        model.zero_grad(set_to_none=True)
        model(x).square().mean().backward()

    for _ in range(2):  # warm-up: heights cached, overlapped buckets rebuilt
        forward_backward()
        sync_domain_gradients(raw, manager, op="sum")
    during, after = _collective_counter(), _collective_counter()
    with during, record_small_collectives() as small_during, record_exchange_stats() as ex:
        forward_backward()
    with after, record_small_collectives() as small_after:
        sync_domain_gradients(raw, manager, op="sum")
    d = dict(during.counts + small_during)
    f = dict(after.counts + small_after)
    return {
        "p2p": ex.p2p_calls,
        "all_gather": d.get("all_gather", 0),
        "all_reduce_during": d.get("all_reduce", 0),
        "all_reduce_after": f.get("all_reduce", 0),
    }


def main(argv=None) -> None:
    args = parse_args(argv)
    known = _workloads()
    from efficiency import halo_chains_arg

    chains = halo_chains_arg(args.halo_chains)
    if chains:
        print(f"trainer.domain_halo_chains: {chains!r} (table: {args.plan_device} chain costs)")
    print("planner: synchronisation points per step (halo + norm + domain gradient [+ tp, data])")
    print(f"{'workload':<18}|   d | halo | norm | grad before | grad after | total before | after")
    for name in [n.strip() for n in args.workloads.split(",") if n.strip()]:
        for domain in (d.strip() for d in args.domains.split(",")):
            _, before, after = planned_points(known[name], domain, chains, args.plan_device)
            print(
                f"{name:<18}| {domain:>3} | {before['halo']:>4} | {before['norm']:>4} | "
                f"{before['domain_grad']:>11} | {after['domain_grad']:>10} | "
                f"{before['total']:>12} | {after['total']:>5}"
            )
    from credit_parallel.testing import run_on_ranks

    d = args.check_domain
    world = parse_domain(d)[0]
    print(
        f"\nreal step at domain {d} (the busiest rank; collectives counted during fwd+bwd / after bwd)"
    )
    for name in [n.strip() for n in args.check.split(",") if n.strip()]:
        coll, before, after = planned_points(known[name], d, chains)
        for overlap in (False, True):
            ranks = run_on_ranks(_step_worker, world, known[name], overlap, chains, d, timeout=900)
            got = {key: max(r[key] for r in ranks) for key in ranks[0]}  # the busiest rank
            grad_blocking = got["all_reduce_after"] + (
                1 if overlap and got["all_reduce_during"] > coll["domain_all_reduce_norm"] else 0
            )
            planned = after if overlap else before
            print(
                f"{name:<18} overlap={overlap!s:<5}: p2p {got['p2p']} (plan {coll['domain_p2p']}), "
                f"all-gather {got['all_gather']} (plan {coll['domain_all_gather']}), "
                f"all-reduce during bwd {got['all_reduce_during']} "
                f"(norm plan {coll['domain_all_reduce_norm']}"
                f"{' + grad buckets ' + str(coll['domain_grad_all_reduce']) if overlap else ''}), "
                f"blocking grad points after bwd {grad_blocking} (plan {planned['domain_grad']})"
            )


if __name__ == "__main__":
    main()
