"""The ``credit-parallel`` command line: train, verify, plan, sample-data, bench, mesh-demo.

Every command has ``--help``; exit status 0 on success and non-zero with a one-line reason on
any error.  ``train``/``verify`` start ``--nproc`` local ranks through PyTorch's elastic
launcher (torchrun) unless they already run under one (torchrun / SLURM), in which case they
run as the worker directly.
"""

from __future__ import annotations

import argparse
import os
import sys

__all__ = ["main", "resolve_config"]

DEFAULT_SAMPLE_PATH = "data/sample.zarr"


class CLIError(Exception):
    """A user-facing error: printed as one line, exit status 2."""


CONFIG_ALIASES = {"demo": "demo_unet"}
CONFIG_HELP = "YAML config (model, data, trainer), or a bundled one by name: demo, demo_unet, ..."


def _bundled_configs() -> dict[str, str]:
    from importlib.resources import files

    found = {
        p.name[: -len(".yaml")]: str(p)
        for p in files(__package__).joinpath("configs").iterdir()
        if p.name.endswith(".yaml")
    }
    for alias, name in CONFIG_ALIASES.items():
        if name in found:
            found[alias] = found[name]
    return found


def resolve_config(config: str) -> str:
    """``config`` itself when it is a file; else a bundled config by name (``demo``,
    ``demo_unet``, ...); else ``config`` unchanged (``load_config`` reports it missing)."""
    if os.path.isfile(config):
        return config
    return _bundled_configs().get(config, config)


def _load_and_check(config: str, nproc: int | None) -> tuple[dict, int]:
    from .config import load_config, parse_parallelism_conf
    from .mesh import dp_world_size

    conf = load_config(config)
    block = parse_parallelism_conf(conf)
    n = nproc if nproc is not None else block["tensor"] * block["domain"]
    if n < 1:
        raise CLIError(f"--nproc must be >= 1, got {n}")
    dp_world_size(block, n)  # ValueError naming tensor/domain when the layout does not fit
    return conf, n


def _run_worker(module: str, nproc: int, worker_args: list[str], conf: dict) -> int:
    from .config import ParallelDims
    from .launch import under_launcher
    from .tools.launcher import launch_local

    if under_launcher() or ParallelDims.from_conf(conf, nproc).is_trivial:
        if under_launcher():
            from .tools.forensics import run_worker

            # per-rank failure reports and a prompt exit, as under the CLI's own launcher
            return run_worker(module, worker_args)
        mod = __import__(module, fromlist=["main"])
        return int(mod.main(worker_args) or 0)
    return launch_local(nproc, module, worker_args)


def _cmd_train(args) -> int:
    args.config = resolve_config(args.config)
    conf, n = _load_and_check(args.config, args.nproc)
    path = (conf.get("data") or {}).get("path")
    if path and not os.path.exists(path):
        raise CLIError(
            f"data.path {path!r} does not exist (create the demo data with `credit-parallel sample-data`)"
        )
    from .launch import under_launcher

    if not under_launcher():
        # fail in seconds, before any rank starts, with every problem at once
        from .preflight import validate_run

        problems = validate_run(conf, n)
        if problems:
            raise CLIError(f"{len(problems)} problem(s) in {args.config}: " + " | ".join(problems))
    extra = ["--config", args.config, "--output", args.output]
    if args.steps is not None:
        extra += ["--steps", str(args.steps)]
    if args.resume is not None:
        if not os.path.isdir(args.resume):
            raise CLIError(f"--resume {args.resume!r} is not a checkpoint directory")
        extra += ["--resume", os.path.abspath(args.resume)]
    return _run_worker("credit_parallel.train.main", n, extra, conf)


def _cmd_verify(args) -> int:
    args.config = resolve_config(args.config)
    conf, n = _load_and_check(args.config, args.nproc)
    extra = ["--config", args.config, "--dtype", args.dtype]
    return _run_worker("credit_parallel.verify", n, extra, conf)


def _cmd_plan(args) -> int:
    from .config import load_config
    from .planner import format_plan, make_plan

    if args.world_size < 1:
        raise CLIError(f"--world-size must be >= 1, got {args.world_size}")
    conf = load_config(resolve_config(args.config))
    plan = make_plan(conf, args.world_size)
    print(format_plan(plan))
    if args.compile:
        from .planner.compile_report import compile_breaks, format_compile_breaks

        print(format_compile_breaks(compile_breaks(conf)))
    return 1 if plan.violations and args.strict else 0


def _cmd_sample_data(args) -> int:
    from .data import write_sample_dataset

    path = write_sample_dataset(
        args.output, n_times=args.times, nlat=args.nlat, nlon=args.nlon, seed=args.seed
    )
    print(
        f"wrote sample dataset {path} ({args.times} times, {args.nlat} x {args.nlon}, both poles) and its statistics"
    )
    return 0


def _cmd_bench(args) -> int:
    from .tools.bench import run_bench

    return int(run_bench(args) or 0)


def _cmd_mesh_demo(args) -> int:
    from .mesh import dp_world_size
    from .tools.launcher import launch_local

    block = {"data": args.data, "tensor": args.tensor, "domain": args.domain}
    dp_world_size(block, args.nproc)  # one-line ValueError before any rank starts
    return launch_local(
        args.nproc,
        "credit_parallel.mesh_demo",
        ["--data", args.data, "--tensor", str(args.tensor), "--domain", str(args.domain)],
    )


class _OneLineErrorParser(argparse.ArgumentParser):
    """argparse with its usage errors on ONE line (the contract: a one-line reason, exit 2);
    sub-command parsers inherit it through ``add_subparsers``."""

    def error(self, message: str):
        self.exit(2, f"{self.prog}: error: {message} (see {self.prog} --help)\n")


def build_parser() -> argparse.ArgumentParser:
    ap = _OneLineErrorParser(
        prog="credit-parallel",
        description="Exact data, tensor and domain (latitude) parallelism for weather models.",
    )
    sub = ap.add_subparsers(dest="command", required=True, metavar="COMMAND")

    p = sub.add_parser("train", help="train the configured model under its parallel layout")
    p.add_argument("--config", required=True, help=CONFIG_HELP)
    p.add_argument(
        "--nproc", type=int, default=None, help="local ranks to start (default tensor*domain)"
    )
    p.add_argument(
        "--output", default="outputs/train", help="metrics, loss curve and checkpoints go here"
    )
    p.add_argument("--steps", type=int, default=None, help="override trainer.steps")
    p.add_argument(
        "--resume",
        default=None,
        metavar="PATH",
        help="continue from this checkpoint (a step_* directory, or a directory of them; "
        "written under any layout) into --output",
    )
    p.set_defaults(func=_cmd_train)

    p = sub.add_parser("verify", help="compare the layout with a single-process run on one batch")
    p.add_argument("--config", required=True, help=CONFIG_HELP)
    p.add_argument("--nproc", type=int, default=None)
    p.add_argument("--dtype", choices=("float64", "float32"), default="float64")
    p.set_defaults(func=_cmd_verify)

    p = sub.add_parser(
        "plan", help="mesh, rows per rank, halos, memory and violations, without processes"
    )
    p.add_argument("--config", required=True, help=CONFIG_HELP)
    p.add_argument("--world-size", type=int, required=True)
    p.add_argument("--strict", action="store_true", help="exit 1 when a constraint is violated")
    p.add_argument(
        "--compile", action="store_true", help="list the graph breaks per compiled block"
    )
    p.set_defaults(func=_cmd_plan)

    p = sub.add_parser(
        "sample-data", help="write the small ERA5-like demo dataset (33 x 64, both poles)"
    )
    p.add_argument("--output", default=DEFAULT_SAMPLE_PATH)
    p.add_argument("--times", type=int, default=240)
    p.add_argument("--nlat", type=int, default=33)
    p.add_argument("--nlon", type=int, default=64)
    p.add_argument("--seed", type=int, default=0)
    p.set_defaults(func=_cmd_sample_data)

    p = sub.add_parser("bench", help="step time, halo bytes, collectives and memory per layout")
    from .tools.bench import add_bench_arguments

    add_bench_arguments(p)
    p.set_defaults(func=_cmd_bench)

    p = sub.add_parser("mesh-demo", help="start N CPU ranks and print each rank's mesh coordinates")
    p.add_argument("--nproc", type=int, default=4)
    p.add_argument("--data", default="fsdp2")
    p.add_argument("--tensor", default="2")
    p.add_argument("--domain", default="1")
    p.set_defaults(func=_cmd_mesh_demo)
    return ap


def main(argv=None) -> int:
    args = build_parser().parse_args(argv)
    try:
        return int(args.func(args) or 0)
    except (CLIError, ValueError, OSError, RuntimeError, KeyError, TypeError) as exc:
        reason = " ".join(str(exc).split()) or type(exc).__name__
        print(f"credit-parallel {args.command}: error: {reason}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
