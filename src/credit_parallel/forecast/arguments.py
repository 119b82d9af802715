"""The flags of ``credit-parallel forecast`` (SPEC §7) and what is checked of them before any
rank starts: :func:`build_arguments` (shared by the CLI and the worker), :func:`apply_overrides`
(``--parallelism``, ``--members``) and :func:`preflight` (initial times, store, checkpoint)."""

from __future__ import annotations

import argparse
import copy
from pathlib import Path

from .fields import dataset_layout, store_variables

__all__ = ["apply_overrides", "build_arguments", "preflight"]


def preflight(conf: dict, args) -> None:
    """What can be checked in one process before any rank starts, each problem one line
    (``ValueError`` / ``CheckpointError``): the initial times against the dataset's time axis
    (history, forcing), the store (``--resume`` / ``--overwrite``) and the checkpoint's keys
    and shapes against the model (built on the meta device, no tensor read)."""
    from ..data.dataset import dataset_from_conf
    from .inputs import resolve_init_times
    from .store import STORE_NAME, check_existing_store
    from .weights import check_weights

    data = {k: v for k, v in conf["data"].items() if k not in ("time_slice", "valid_time_slice")}
    dataset = dataset_from_conf(
        {**conf, "data": data}, forecast_len=1, rows=(0, 0), cache_limit_bytes=0
    )
    times = resolve_init_times(
        dataset.times,
        init_times=args.init_times,
        init_range=args.init_range,
        steps=args.steps,
        history_len=dataset.history_len,
        needs_forcing=dataset.n_forcing > 0,
    )
    store = Path(args.output) / STORE_NAME
    layout = dataset_layout(dataset, getattr(args, "layout", None))
    check_existing_store(
        store,
        args.resume,
        args.overwrite,
        times,
        store_variables(dataset, layout),
        args.members,
        layout,
    )
    check_weights(conf["model"], args.checkpoint, ema=getattr(args, "ema", False))


def build_arguments(ap: argparse.ArgumentParser) -> None:
    """The flags of ``credit-parallel forecast`` (SPEC §7), shared by the CLI and the worker."""
    ap.add_argument("--config", required=True)
    ap.add_argument(
        "--checkpoint",
        required=True,
        help="step_* directory, a directory of them, or a miles-credit checkpoint file",
    )
    ap.add_argument("--steps", type=int, required=True, help="forecast steps (dataset time steps)")
    ap.add_argument("--output", required=True, help="DIR: DIR/forecast.zarr, scores, map")
    times = ap.add_mutually_exclusive_group(required=True)
    times.add_argument("--init-times", nargs="+", metavar="T", help="ISO initial times")
    times.add_argument(
        "--init-range",
        nargs=3,
        metavar=("START", "END", "STEP"),
        help="initial times START..END every STEP (hours, 6h, 1d)",
    )
    ap.add_argument("--members", type=int, default=1, help="ensemble members (default 1)")
    ap.add_argument(
        "--ema",
        action="store_true",
        help="forecast with the checkpoint's moving average of the weights (trainer.use_ema)",
    )
    ap.add_argument(
        "--parallelism",
        default=None,
        help="data=MODE,tensor=T,domain=N or domain=PxQ (lat x lon; also lat=P,lon=Q); overrides "
        "trainer.parallelism",
    )
    ap.add_argument(
        "--climatology",
        default=None,
        help="climatology file (default: the time mean of data.time_slice)",
    )
    ap.add_argument(
        "--resume", action="store_true", help="skip complete initial times of DIR/forecast.zarr"
    )
    ap.add_argument("--overwrite", action="store_true", help="replace DIR/forecast.zarr")
    ap.add_argument(
        "--layout",
        choices=("default", "weatherbench2"),
        default="default",
        help="the store's names: the dataset's (default), or WeatherBench 2's (time, "
        "prediction_timedelta, number; ERA5 long names; levels in hPa)",
    )


def apply_overrides(conf: dict, args) -> dict:
    """``conf`` with ``--parallelism`` applied (a copy); a CREDIT gen-2 config read as
    credit-parallel's keys first (its bridgescaler blocks: ``data.bridgescaler``)."""
    from ..layout.credit_gen2 import credit_gen2_conf
    from .inputs import parse_parallelism_flag

    conf = credit_gen2_conf(copy.deepcopy(conf))
    if args.parallelism:
        conf.setdefault("trainer", {})["parallelism"] = parse_parallelism_flag(args.parallelism)
    if isinstance(args.members, bool) or args.members < 1:
        raise ValueError(f"--members must be an integer >= 1, got {args.members!r}")
    return conf
