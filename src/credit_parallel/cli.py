"""The ``credit-parallel`` command line: train, forecast, verify, plan, sample-data, rechunk, bench,
mesh-demo.

Every command has ``--help``; exit status 0 on success and non-zero with a one-line reason on
any error.  ``train``/``forecast``/``verify`` start ``--nproc`` local ranks through PyTorch's elastic
launcher (torchrun) unless they already run under one (torchrun / SLURM), in which case they
run as the worker directly.
"""

from __future__ import annotations

import argparse
import glob
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
    from .layout.config import domain_degrees, load_config, parse_parallelism_conf
    from .layout.mesh import dp_world_size

    conf = load_config(config)
    block = parse_parallelism_conf(conf)
    lat, lon = domain_degrees(block["domain"])
    n = nproc if nproc is not None else block["tensor"] * lat * lon
    if n < 1:
        raise CLIError(f"--nproc must be >= 1, got {n}")
    dp_world_size(block, n)  # ValueError naming tensor/domain when the layout does not fit
    return conf, n


def _choose_device(args, nproc: int) -> str:
    """Resolve ``--device`` for ``nproc`` local ranks BEFORE any rank starts (a ``cuda`` run with
    fewer visible GPUs than ranks stops here naming both counts) and hand the choice to the
    ranks (and to this process, for a one-rank run) through the environment."""
    from .layout.device import DEVICE_ENV, choose_device
    from .layout.launch import under_launcher

    requested = getattr(args, "device", "auto") or "auto"
    if under_launcher():  # torchrun / SLURM started the ranks: each resolves for its node
        os.environ[DEVICE_ENV] = requested
        return requested
    device = choose_device(requested, nproc)
    os.environ[DEVICE_ENV] = device
    return device


def _sample_data_command(conf: dict) -> str:
    """The ``sample-data`` command that writes the data a (demo) config reads: its grid, its
    times and its path."""
    model, data = conf.get("model") or {}, conf.get("data") or {}
    cmd = ["credit-parallel", "sample-data"]
    nlat, nlon = model.get("image_height"), model.get("image_width")
    if nlat is not None and int(nlat) != 33:
        cmd += ["--nlat", str(nlat)]
    if nlon is not None and int(nlon) != 64:
        cmd += ["--nlon", str(nlon)]
    ends = [int(s[1]) for s in (data.get("time_slice"), data.get("valid_time_slice")) if s]
    if ends and max(ends) > 240:
        cmd += ["--times", str(max(ends))]
    if data.get("path") != DEFAULT_SAMPLE_PATH:
        cmd += ["--output", str(data.get("path"))]
    return " ".join(cmd)


def _run_worker(
    module: str, nproc: int, worker_args: list[str], conf: dict, max_restarts: int = 0
) -> int:
    from .layout.config import ParallelDims
    from .layout.launch import under_launcher
    from .tools.launcher import launch_local

    trivial = ParallelDims.from_conf(conf, nproc).is_trivial and not max_restarts
    if under_launcher() or trivial:
        if under_launcher():
            from .tools.forensics import run_worker

            # per-rank failure reports and a prompt exit, as under the CLI's own launcher
            return run_worker(module, worker_args)
        mod = __import__(module, fromlist=["main"])
        return int(mod.main(worker_args) or 0)
    return launch_local(nproc, module, worker_args, max_restarts=max_restarts)


def _max_restarts(args) -> int:
    """``--max-restarts N``: torchrun's elastic agent restarts every local rank after a failure,
    up to N times.  Under an outer launcher (torchrun, SLURM) restarting is that launcher's job
    (torchrun --max-restarts, a requeue); the flag then only means resuming automatically."""
    n = getattr(args, "max_restarts", 0) or 0
    from .layout.launch import under_launcher

    if n and under_launcher() and os.environ.get("RANK") == "0":
        print(
            f"credit-parallel {args.command}: --max-restarts {n}: this job's launcher starts "
            "the ranks, restarts are its own (torchrun --max-restarts, a requeue); resuming "
            "automatically",
            file=sys.stderr,
        )
    return n


def _restarts(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        value = -1
    if value < 0:
        raise argparse.ArgumentTypeError(f"must be an integer >= 0, got {text}")
    return value


def _add_restart_argument(p: argparse.ArgumentParser, resumes: str) -> None:
    p.add_argument(
        "--max-restarts",
        type=_restarts,
        default=0,
        metavar="N",
        help="when a rank dies, restart every rank up to N times (torchrun's elastic agent); "
        f"the restarted ranks {resumes}",
    )


def _cmd_train(args) -> int:
    args.config = resolve_config(args.config)
    conf, n = _load_and_check(args.config, args.nproc)
    path = (conf.get("data") or {}).get("path")
    missing = None
    if path:
        from .data.multistore import missing_store

        missing = missing_store(path)  # a store, a glob of stores or a list
    if missing and isinstance(path, str) and not glob.has_magic(path):  # one demo store
        raise CLIError(f"{missing} (create the demo data with `{_sample_data_command(conf)}`)")
    if missing:  # a list or a glob of stores: no demo data to write
        raise CLIError(missing)
    _choose_device(args, n)
    from .layout.launch import under_launcher

    if not under_launcher():
        # fail in seconds, before any rank starts, with every problem at once
        from .train.preflight import validate_run

        problems = validate_run(conf, n)
        if problems:
            raise CLIError(f"{len(problems)} problem(s) in {args.config}: " + " | ".join(problems))
    extra = ["--config", args.config, "--output", args.output]
    if args.steps is not None:
        extra += ["--steps", str(args.steps)]
    restarts = _max_restarts(args)
    resume = args.resume if args.resume is not None or not restarts else "auto"
    if resume == "auto":  # the newest complete checkpoint in the run's save_dir, if any
        extra += ["--resume", "auto"]
    elif resume is not None:
        if not os.path.isdir(resume):
            raise CLIError(
                f"--resume {resume!r} is not a checkpoint directory (--resume auto: the newest "
                "checkpoint of this run, or a fresh start)"
            )
        extra += ["--resume", os.path.abspath(resume)]
    return _run_worker("credit_parallel.train.main", n, extra, conf, restarts)


def _cmd_forecast(args) -> int:
    """Check what can be checked without the model (layout, initial times, store, checkpoint
    path) in this process, then run the forecast worker on ``--nproc`` ranks."""
    from .forecast.command import apply_overrides
    from .layout.config import domain_degrees, load_config, parse_parallelism_conf
    from .layout.mesh import dp_world_size

    args.config = resolve_config(args.config)
    conf = apply_overrides(load_config(args.config), args)  # --parallelism first
    block = parse_parallelism_conf(conf)
    lat, lon = domain_degrees(block["domain"])  # domain=PxQ: P * Q ranks
    n = args.nproc if args.nproc is not None else block["tensor"] * lat * lon
    if n < 1:
        raise CLIError(f"--nproc must be >= 1, got {n}")
    dp_world_size(block, n)  # ValueError naming tensor/domain when the layout does not fit
    if not os.path.exists(args.checkpoint):
        raise CLIError(f"--checkpoint {args.checkpoint!r} does not exist")
    from .layout.launch import under_launcher

    if not under_launcher():  # fail in seconds, before any rank starts, with one line
        from .forecast.command import preflight

        preflight(conf, args)
    _choose_device(args, n)
    extra = [
        "--config",
        args.config,
        "--checkpoint",
        os.path.abspath(args.checkpoint),
        "--steps",
        str(args.steps),
        "--output",
        args.output,
        "--members",
        str(args.members),
    ]
    if args.init_times:
        extra += ["--init-times", *args.init_times]
    else:
        extra += ["--init-range", *args.init_range]
    for flag in ("parallelism", "climatology", "layout"):
        if getattr(args, flag):
            extra += [f"--{flag}", getattr(args, flag)]
    extra += [f"--{flag}" for flag in ("resume", "overwrite") if getattr(args, flag)]
    restarts = _max_restarts(args)
    return _run_worker("credit_parallel.forecast.command", n, extra, conf, restarts)


def _cmd_verify(args) -> int:
    args.config = resolve_config(args.config)
    conf, n = _load_and_check(args.config, args.nproc)
    _choose_device(args, n)
    extra = ["--config", args.config, "--dtype", args.dtype] + (["--all"] if args.all else [])
    return _run_worker("credit_parallel.tools.verify", n, extra, conf)


def _cmd_plan(args) -> int:
    from .layout.config import load_config
    from .planner import format_plan, make_plan

    if args.world_size < 1:
        raise CLIError(f"--world-size must be >= 1, got {args.world_size}")
    conf = load_config(resolve_config(args.config))
    plan = make_plan(conf, args.world_size, device=args.device)
    print(format_plan(plan))
    from .planner.inference import format_layout_fits, layout_fits

    # the smallest domain whose training step and forecast fit an 80 GB GPU (issue 32)
    print(format_layout_fits(layout_fits(conf, args.world_size), args.world_size))
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


def _cmd_rechunk(args) -> int:
    from .data.rechunk import rechunk_store

    path = rechunk_store(
        args.source,
        args.output,
        lat_chunk=args.lat_chunk,
        time_chunk=args.time_chunk,
        compress=not args.no_compress,
        overwrite=args.overwrite,
    )
    print(
        f"wrote {path}: chunks of {args.time_chunk} time x {args.lat_chunk} rows (see docs/data.md)"
    )
    return 0


def _cmd_bench(args) -> int:
    from .tools.bench import run_bench

    return int(run_bench(args) or 0)


def _cmd_mesh_demo(args) -> int:
    from .layout.config import parse_domain_option
    from .layout.mesh import dp_world_size
    from .tools.launcher import launch_local

    domain = parse_domain_option(args.domain)
    block = {"data": args.data, "tensor": args.tensor, "domain": domain}
    dp_world_size(block, args.nproc)  # one-line ValueError before any rank starts
    return launch_local(
        args.nproc,
        "credit_parallel.tools.mesh_demo",
        ["--data", args.data, "--tensor", str(args.tensor), "--domain", str(args.domain)],
    )


DEVICE_HELP = (
    "auto (default): CUDA with NCCL when this node has at least as many visible GPUs as local "
    "ranks, else gloo ranks on the CPU; cuda: refuse to start with fewer GPUs than ranks; cpu"
)


def _add_device_argument(p: argparse.ArgumentParser) -> None:
    p.add_argument("--device", choices=("auto", "cuda", "cpu"), default="auto", help=DEVICE_HELP)


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
        metavar="PATH|auto",
        help="continue from this checkpoint (a step_* directory, or a directory of them; "
        "written under any layout) into --output; auto: from this run's newest complete "
        "checkpoint (trainer.save_dir), or a fresh start when there is none",
    )
    _add_restart_argument(p, "continue from the newest complete checkpoint (implies --resume auto)")
    _add_device_argument(p)
    p.set_defaults(func=_cmd_train)

    p = sub.add_parser(
        "forecast", help="roll a checkpoint out from initial times into DIR/forecast.zarr, scored"
    )
    from .forecast.command import build_arguments

    build_arguments(p)
    p.add_argument(
        "--nproc", type=int, default=None, help="local ranks to start (default tensor*domain)"
    )
    _add_restart_argument(p, "continue the store as --resume does")
    _add_device_argument(p)
    p.set_defaults(func=_cmd_forecast)

    p = sub.add_parser("verify", help="compare the layout with a single-process run on one batch")
    p.add_argument("--config", required=True, help=CONFIG_HELP)
    p.add_argument("--nproc", type=int, default=None)
    p.add_argument("--dtype", choices=("float64", "float32"), default="float64")
    p.add_argument(
        "--all",
        action="store_true",
        help="print every row (one per parameter gradient and per tp-replicated parameter); "
        "default: one row per group, its worst parameter named",
    )
    _add_device_argument(p)
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
    p.add_argument(
        "--device",
        choices=("auto", "cuda", "cpu"),
        default="auto",
        help="the device type the memory is counted for (only the convolution workspace "
        "differs: cuDNN's bounded workspace on cuda, im2col columns on cpu); auto (default): "
        "cuda when this machine sees a GPU, else cpu; the report shows the other's total too",
    )
    p.set_defaults(func=_cmd_plan)

    _add_tool_commands(sub)
    return ap


def _add_tool_commands(sub) -> None:
    """The commands around the run: sample data, rechunking, the benchmark, the mesh demo."""
    p = sub.add_parser(
        "sample-data", help="write the small ERA5-like demo dataset (33 x 64, both poles)"
    )
    p.add_argument("--output", default=DEFAULT_SAMPLE_PATH)
    p.add_argument("--times", type=int, default=240)
    p.add_argument("--nlat", type=int, default=33)
    p.add_argument("--nlon", type=int, default=64)
    p.add_argument("--seed", type=int, default=0)
    p.set_defaults(func=_cmd_sample_data)

    from .data.rechunk import RECOMMENDED_LAT_CHUNK

    p = sub.add_parser("rechunk", help="copy an ERA5 zarr store into the row chunks training reads")
    p.add_argument("source", help="the zarr store to copy (its _stats.zarr is copied along)")
    p.add_argument("output", help="the new store")
    p.add_argument("--lat-chunk", type=int, default=RECOMMENDED_LAT_CHUNK, help="rows per chunk")
    p.add_argument("--time-chunk", type=int, default=1, help="time steps per chunk")
    p.add_argument("--no-compress", action="store_true", help="write uncompressed chunks")
    p.add_argument("--overwrite", action="store_true", help="replace an existing output store")
    p.set_defaults(func=_cmd_rechunk)

    p = sub.add_parser("bench", help="step time, halo bytes, collectives and memory per layout")
    from .tools.bench import add_bench_arguments

    add_bench_arguments(p)
    p.set_defaults(func=_cmd_bench)

    p = sub.add_parser("mesh-demo", help="start N CPU ranks and print each rank's mesh coordinates")
    p.add_argument("--nproc", type=int, default=4)
    p.add_argument("--data", default="fsdp2")
    p.add_argument("--tensor", default="2")
    p.add_argument(
        "--domain", default="1", help="domain ranks: D (latitude only) or PxQ (lat x lon)"
    )
    p.set_defaults(func=_cmd_mesh_demo)


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
