"""Where the time of a domain-parallel training step goes, per layer kind, on 1 and 2 ranks.

For the conv stack (4 x [conv3x3, GroupNorm(8), SiLU], C=64, 192x384) and the bundled U-Net
(97x192, base 32) it runs training steps (forward, globally normalised loss, backward, domain
gradient sync; 1 intra-op thread per rank) through ``parallelize`` and prints, per layer kind,
compute, window assembly, time blocked in communication and framework overhead per step
(:func:`credit_parallel.tools.profile.profile_step`; mean over the ranks).

    .venv/bin/python benchmarks/profile_step.py --models conv_stack/large,unet/large --domains 1,2
"""

from __future__ import annotations

import argparse

import torch

from credit_parallel.tools.bench import Layout, default_models
from credit_parallel.tools.profile import format_profile, mean_profile, profile_step

__all__ = ["main", "parse_args", "profile_worker"]


def parse_args(argv=None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--models", default="conv_stack/large,unet/large")
    parser.add_argument("--domains", default="1,2", help="comma list of domain sizes")
    parser.add_argument("--steps", type=int, default=3, help="profiled steps")
    parser.add_argument("--warmup", type=int, default=2)
    parser.add_argument(
        "--overlap-grads",
        action="store_true",
        help="the domain gradient all-reduce overlapped with the backward (grad_overlap)",
    )
    return parser.parse_args(argv)


def profile_worker(rank, world, spec, steps: int, warmup: int, overlap: bool = False):
    """One rank: the model through ``parallelize`` at domain ``world``, its step profiled."""
    from credit_parallel.domain.rows import shard_range
    from credit_parallel.parallel.collectives import sync_domain_gradients
    from credit_parallel.parallel.composition import get_domain_manager, get_raw_model, parallelize

    torch.manual_seed(0)
    model = spec.build()
    if world > 1:
        model = parallelize(model, Layout(domain=world).conf(spec.batch))
    manager = get_domain_manager(model)
    if overlap:
        from credit_parallel.parallel.grad_overlap import enable_overlapped_domain_grad_sync

        enable_overlapped_domain_grad_sync(get_raw_model(model), manager=manager)
    shape = (spec.batch, *spec.input_shape)
    gen = torch.Generator().manual_seed(1)
    x, weights = torch.randn(shape, generator=gen), torch.randn(shape, generator=gen)
    a, b = shard_range(spec.height, world, rank)
    x_local = x[:, :, a:b].contiguous().requires_grad_()
    w_local = weights[:, :, a:b].contiguous()
    token = ("profile", spec, shape)

    def step():
        if manager is not None:
            manager.begin_forward(token)
        model.zero_grad(set_to_none=True)
        ((model(x_local) * w_local).sum() / weights.numel()).backward()
        sync_domain_gradients(get_raw_model(model), manager, op="sum")

    return profile_step(step, model, steps=steps, warmup=warmup)


def main(argv=None) -> dict:
    from credit_parallel.testing import run_on_ranks

    args = parse_args(argv)
    known = {m.label: m for m in default_models(False) + default_models(True)}
    results = {}
    for label in [m.strip() for m in args.models.split(",") if m.strip()]:
        if label not in known:
            raise SystemExit(f"--models: unknown {label!r}; known: {sorted(known)}")
        spec = known[label]
        for domain in (int(d) for d in args.domains.split(",")):
            profiles = run_on_ranks(
                profile_worker,
                domain,
                spec,
                args.steps,
                args.warmup,
                args.overlap_grads,
                timeout=900,
            )
            merged = mean_profile(profiles)
            results[(label, domain)] = merged
            title = (
                f"{spec.describe()}; domain {domain}, float32, 1 thread per rank, "
                f"mean of {domain} rank(s), {args.steps} profiled steps"
                + ("; domain gradients overlapped" if args.overlap_grads else "")
            )
            print(format_profile(merged, title))
            print()
    return results


if __name__ == "__main__":
    main()
