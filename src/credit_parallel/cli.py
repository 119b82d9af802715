"""The ``credit-parallel`` command line."""

from __future__ import annotations

import argparse
import sys

__all__ = ["main"]


def _cmd_mesh_demo(args) -> int:
    from .launch import launch_local

    return launch_local(
        args.nproc,
        "credit_parallel.mesh_demo",
        ["--data", args.data, "--tensor", str(args.tensor), "--domain", str(args.domain)],
    )


def build_parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(
        prog="credit-parallel",
        description="Exact data, tensor and domain parallelism for weather models.",
    )
    sub = ap.add_subparsers(dest="command", required=True)
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
    except (ValueError, FileNotFoundError, RuntimeError) as exc:
        print(f"credit-parallel {args.command}: error: {exc}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
