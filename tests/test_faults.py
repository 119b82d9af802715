"""Fault injection on real gloo ranks, and NaN injection, against the real Trainer.

Each fault test forks ranks that train a domain x data parallel U-Net (``Trainer`` with
``trainer.dist_timeout_s`` short) inside ``credit_parallel.tools.forensics.run_worker`` — the code every
rank of ``credit-parallel train`` runs — and injects a fault on ONE rank at a given step:

* it raises in the middle of the forward (a pre-hook on the bottleneck block);
* it leaves with ``os._exit(3)`` in the middle of the backward (a hook on a gradient);
* it sleeps past the process-group timeout in the middle of the forward.

The parent watches every rank's own exit: every surviving rank must exit non-zero within the
timeout plus a margin of the fault, and the launcher's one-line report (``describe_failures``) must
name the faulty rank.  As torchrun does after a failure, the parent then stops what is still
running with SIGTERM.  The same three faults also go through the real command line
(``credit-parallel train`` -> torchrun -> ``run_worker``), injected through a ``sitecustomize``.

NaN injection: one rank's data is NaN at step k (under domain parallelism the NaN sits in that
rank's shard only); every rank must see the non-finite step k and apply ``trainer.nonfinite``
identically (``stop``: every rank raises NonFiniteError naming step k; ``skip``: every rank skips
step k, parameters unchanged by it and identical on all ranks).
"""

from __future__ import annotations

import json
import multiprocessing as mp
import os
import re
import signal
import subprocess
import sys
import textwrap
import time
from multiprocessing.connection import wait

import pytest
import torch

import credit_parallel
import credit_parallel.domain.convert  # noqa: F401
import credit_parallel.parallel.collectives  # noqa: F401 - warmed before forking, like the ones below
import credit_parallel.parallel.fsdp  # noqa: F401
import credit_parallel.planner  # noqa: F401
import credit_parallel.train.preflight  # noqa: F401
from credit_parallel.data import latitude_weights
from credit_parallel.layout.launch import group_timeout
from credit_parallel.parallel.composition import get_raw_model
from credit_parallel.testing import free_port, run_on_ranks
from credit_parallel.tools.forensics import STATUS_DIR_ENV, describe_failures, run_worker
from credit_parallel.train.trainer import NonFiniteError, Trainer

# the directory holding the credit_parallel under test, for the subprocesses' PYTHONPATH
PACKAGE_ROOT = os.path.dirname(os.path.dirname(os.path.abspath(credit_parallel.__file__)))

__all__: list[str] = []

H, W, C = 17, 16, 2
UNET = {
    "type": "unet",
    "in_channels": C,
    "out_channels": C,
    "image_height": H,
    "image_width": W,
    "base_channels": 4,
    "channel_mults": [1, 2],
    "norm_groups": 2,
    "mlp_ratio": 2,
}
MARGIN_S = 3.0  # exit within the timeout plus this (process teardown on a loaded machine)


class GridDataset:
    """In-memory samples ``{"x": (C, H, W), "y": (C, H, W)}``: consecutive random fields.

    ``poison_rank``/``poison_step``: on that global rank, the samples of that 1-based training
    step are NaN, counting ``batch_size`` reads per step from the last reset of ``reads``.
    """

    history_len = 1
    forecast_len = 1
    as_5d = False

    def __init__(self, n=8, *, batch_size=1, poison_rank=None, poison_step=None):
        gen = torch.Generator().manual_seed(0)
        self.fields = torch.randn(n + 1, C, H, W, generator=gen)
        self.lat_weights = latitude_weights(torch.linspace(90.0, -90.0, H))
        self.grid_shape = (H, W)
        self.channels_in = self.channels_out = self.channels_per_step = C
        self.variable_names = [f"v{i}" for i in range(C)]
        self.batch_size, self.reads = batch_size, 0
        self.poison_rank, self.poison_step = poison_rank, poison_step

    def __len__(self):
        return self.fields.shape[0] - 1

    def __getitem__(self, i):
        step = self.reads // self.batch_size + 1
        self.reads += 1
        x, y = self.fields[i].clone(), self.fields[i + 1].clone()
        rank = torch.distributed.get_rank() if torch.distributed.is_initialized() else 0
        if rank == self.poison_rank and step == self.poison_step:
            x.fill_(float("nan"))
        return {"x": x, "y": y}


def train_conf(data="ddp", domain=2, *, steps=4, nonfinite="stop", timeout_s=10.0):
    return {
        "model": dict(UNET),
        "trainer": {
            "parallelism": {"data": data, "tensor": 1, "domain": domain},
            "steps": steps,
            "batch_size": 1,
            "lr": 1e-2,
            "dtype": "float64",
            "nonfinite": nonfinite,
            "dist_timeout_s": timeout_s,
        },
    }


# --------------------------------------------------------------------------- fault injection
def install_trainer_fault(trainer, mode: str, step: int, fault_file: str | None = None, mark=None):
    """Arm ``mode`` ("raise" | "exit" | "sleep") for 1-based training step ``step`` on this rank.

    ``mark`` (a callable) or ``fault_file`` receive the wall time right before the fault.
    Also used by the command-line test, from a ``sitecustomize`` in the ranks of ``torchrun``.
    """
    block = get_raw_model(trainer.model).mid_block
    sleep_s = 3.0 * float(trainer.conf["trainer"]["dist_timeout_s"])

    def now_faulting():
        t = time.time()
        if mark is not None:
            mark(t)
        if fault_file is not None:
            with open(fault_file, "w") as fh:
                fh.write(repr(t))

    def at_fault_step() -> bool:
        return trainer.model.training and trainer.step + 1 == step

    if mode in ("raise", "sleep"):

        def pre_hook(module, args):
            if at_fault_step():
                now_faulting()
                if mode == "raise":
                    raise RuntimeError(f"injected fault in the forward of mid_block at step {step}")
                time.sleep(sleep_s)

        block.register_forward_pre_hook(pre_hook)
    elif mode == "exit":

        def forward_hook(module, args, out):
            if at_fault_step() and out.requires_grad:

                def die(grad):
                    now_faulting()
                    os._exit(3)

                out.register_hook(die)

        block.register_forward_hook(forward_hook)
    else:
        raise ValueError(f"unknown fault mode {mode!r}")


def _fault_rank_body(rank, world, timeout_s, mode, fault_rank, fault_step, fault_time):
    def main(argv):
        from credit_parallel.layout.launch import init_distributed_from_env

        init_distributed_from_env(timeout_s)
        trainer = Trainer(
            train_conf(timeout_s=timeout_s, steps=fault_step + 2), dataset=GridDataset()
        )
        groups = {
            "default": None,
            "domain": trainer.manager.domain_group,
            "dp": trainer.manager.data_parallel_group,
        }
        timeouts = {k: group_timeout(g).total_seconds() for k, g in groups.items()}
        with open(os.path.join(os.environ[STATUS_DIR_ENV], f"timeouts{rank}.json"), "w") as fh:
            json.dump(timeouts, fh)
        if rank == fault_rank:
            install_trainer_fault(
                trainer, mode, fault_step, mark=lambda t: setattr(fault_time, "value", t)
            )
        while trainer.step < trainer.tc.steps:
            trainer.train_step()
        torch.distributed.destroy_process_group()
        return 0

    return main


def _fork_rank(rank, world, port, status_dir, timeout_s, args, fault_time):
    os.environ.update(
        MASTER_ADDR="127.0.0.1",
        MASTER_PORT=str(port),
        RANK=str(rank),
        LOCAL_RANK=str(rank),
        WORLD_SIZE=str(world),
        LOCAL_WORLD_SIZE=str(world),
        **{STATUS_DIR_ENV: status_dir},
    )
    torch.set_num_threads(1)
    code = run_worker(_fault_rank_body(rank, world, timeout_s, *args, fault_time), [])
    os._exit(code)


def run_fault(tmp_path, mode, *, world=4, fault_rank=1, fault_step=2, timeout_s=10.0):
    """Fork ``world`` ranks, inject ``mode`` on ``fault_rank``; per-rank exit codes and exit times
    (seconds after the fault), and the launcher's one-line report."""
    ctx = mp.get_context("fork")
    status_dir = str(tmp_path / f"status-{mode}")
    os.makedirs(status_dir)
    fault_time = ctx.Value("d", 0.0)
    port = free_port()
    args = (mode, fault_rank, fault_step)
    procs = [
        ctx.Process(
            target=_fork_rank, args=(r, world, port, status_dir, timeout_s, args, fault_time)
        )
        for r in range(world)
    ]
    for p in procs:
        p.start()
    ended: dict[int, float] = {}
    sentinels = {p.sentinel: r for r, p in enumerate(procs)}
    survivors = set(range(world)) - {fault_rank}
    deadline = time.time() + 60.0 + timeout_s
    while sentinels and not survivors <= set(ended) and time.time() < deadline:
        for s in wait(list(sentinels), timeout=0.02):
            ended[sentinels.pop(s)] = time.time()
    for p in procs:  # what torchrun does after a failure: stop the rest
        if p.is_alive():
            os.kill(p.pid, signal.SIGTERM)
    for p in procs:
        p.join(10)
        if p.is_alive():
            p.kill()
            p.join()
    codes = {r: p.exitcode for r, p in enumerate(procs)}
    t0 = fault_time.value
    assert t0 > 0, f"the fault was never injected (exit codes {codes})"
    after = {r: round(ended[r] - t0, 2) for r in sorted(ended) if r in survivors}
    report = describe_failures(status_dir, world, {r: c for r, c in codes.items() if c})
    for r in range(world):  # every group of every rank got trainer.dist_timeout_s
        with open(os.path.join(status_dir, f"timeouts{r}.json")) as fh:
            assert json.load(fh) == dict.fromkeys(("default", "domain", "dp"), timeout_s)
    return codes, after, report


@pytest.mark.parametrize(
    "mode, timeout_s, expected",
    [
        ("raise", 10.0, "rank 1 of 4 failed first: RuntimeError: injected fault in the forward"),
        ("exit", 10.0, "rank 1 of 4 died without a Python error (rank 1: exit code 3"),
        ("sleep", 4.0, "rank 1 of 4 stopped responding (rank 1 was at test_faults.py"),
    ],
)
def test_fault_on_rank1_of_ddp2_domain2_every_survivor_exits_nonzero_within_timeout(
    tmp_path, mode, timeout_s, expected
):
    codes, after, report = run_fault(tmp_path, mode, timeout_s=timeout_s)
    print(f"\n{mode}: survivors' exit seconds after the fault {after}; exit codes {codes}")
    print(f"report: {report}")
    survivors = [0, 2, 3]
    assert sorted(after) == survivors, f"a surviving rank did not exit: {after}, codes {codes}"
    for r in survivors:
        assert codes[r] not in (0, None), f"rank {r} exited with {codes[r]}"
        assert after[r] <= timeout_s + MARGIN_S, f"rank {r} exited {after[r]} s after the fault"
    assert codes[1] == {"raise": 1, "exit": 3, "sleep": -signal.SIGTERM}[mode]
    if mode != "sleep":  # a dead peer is noticed at once, not after the timeout
        assert max(after.values()) < timeout_s
    else:  # a silent peer is noticed by the timeout
        assert min(after.values()) >= timeout_s - 0.5
    assert report.startswith(expected), report
    if mode != "sleep":
        assert "(ranks 0, 2, 3 then lost the connection in a collective)" in report, report
    else:  # rank 1's domain peer (0) and dp peer (3) time out; rank 2 may see them leave first
        assert re.search(r"ranks 0, (2, )?3 then timed out waiting in a collective", report), report


# --------------------------------------------------------------------------- the command line
SITECUSTOMIZE = """
import os
if os.environ.get("CP_FAULT_MODE") and os.environ.get("RANK") == os.environ.get("CP_FAULT_RANK"):
    import importlib.util
    import credit_parallel.train.trainer as _trainer

    _spec = importlib.util.spec_from_file_location("cp_fault_inject", {test_file!r})
    _faults = importlib.util.module_from_spec(_spec)
    _spec.loader.exec_module(_faults)
    _init = _trainer.Trainer.__init__

    def _armed_init(self, *args, **kwargs):
        _init(self, *args, **kwargs)
        _faults.install_trainer_fault(
            self, os.environ["CP_FAULT_MODE"], int(os.environ["CP_FAULT_STEP"]),
            fault_file=os.environ["CP_FAULT_FILE"],
        )

    _trainer.Trainer.__init__ = _armed_init
"""


CLI_CASES = {  # mode: (trainer.dist_timeout_s, start of the launcher's one-line report)
    "raise": (10.0, "credit-parallel: rank 1 of 2 failed first: RuntimeError: injected fault"),
    "exit": (10.0, "credit-parallel: rank 1 of 2 died without a Python error (rank 1: exit code 3"),
    "sleep": (6.0, "credit-parallel: rank 1 of 2 stopped responding (rank 1 was at"),
}


def _cli_config(root, store, timeout_s):
    import yaml

    conf = train_conf(data="none", domain=2, steps=4, timeout_s=timeout_s)
    conf["data"] = {
        "path": str(store),
        "upper_air_variables": ["T"],
        "surface_variables": ["t2m"],
        "levels": [500],
    }
    path = root / f"train_{timeout_s:g}.yaml"
    path.write_text(yaml.safe_dump(conf))
    return path


@pytest.fixture(scope="module")
def cli_runs(tmp_path_factory):
    """The three faults through ``credit-parallel train --nproc 2``, run concurrently (each
    command starts torchrun and two ranks that import torch: ~20 s apiece on a busy machine)."""
    import threading

    from credit_parallel.data import write_sample_dataset

    root = tmp_path_factory.mktemp("cli_faults")
    store = write_sample_dataset(root / "s.zarr", n_times=10, nlat=H, nlon=W, levels=(500,))
    (root / "site").mkdir()
    (root / "site" / "sitecustomize.py").write_text(
        textwrap.dedent(SITECUSTOMIZE.format(test_file=os.path.abspath(__file__)))
    )
    results = {}

    def run(mode, timeout_s):
        fault_file = root / f"fault_time_{mode}"
        env = dict(
            os.environ,
            # the sitecustomize, then the credit_parallel under test (not an installed copy)
            PYTHONPATH=os.pathsep.join([str(root / "site"), PACKAGE_ROOT]),
            CP_FAULT_MODE=mode,
            CP_FAULT_RANK="1",
            CP_FAULT_STEP="2",
            CP_FAULT_FILE=str(fault_file),
            OMP_NUM_THREADS="1",
        )
        cmd = [sys.executable, "-m", "credit_parallel.cli", "train", "--nproc", "2"]
        cmd += ["--config", str(_cli_config(root, store, timeout_s))]
        cmd += ["--output", str(root / f"out_{mode}")]
        proc = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=300)
        results[mode] = (proc, time.time(), fault_file)

    threads = [threading.Thread(target=run, args=(m, t)) for m, (t, _) in CLI_CASES.items()]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    return results


@pytest.mark.parametrize("mode", list(CLI_CASES))
def test_cli_train_reports_the_failing_rank_and_every_rank_stops_within_timeout(cli_runs, mode):
    timeout_s, expected = CLI_CASES[mode]
    proc, done, fault_file = cli_runs[mode]
    lines = [line for line in proc.stderr.splitlines() if line.startswith("credit-parallel: ")]
    assert proc.returncode != 0, proc.stderr[-3000:]
    assert fault_file.exists(), f"the fault was never injected:\n{proc.stderr[-3000:]}"
    after = done - float(fault_file.read_text())
    print(f"\ncli {mode}: command returned {after:.2f} s after the fault; {lines}")
    # torchrun returns once every rank has exited
    assert after <= timeout_s + MARGIN_S + 2.0, after
    assert len(lines) == 1 and lines[0].startswith(expected), proc.stderr[-3000:]
    # rank 0 either reported losing rank 1 or was stopped by torchrun first: named either way
    assert "rank 0 " in lines[0], lines[0]


# --------------------------------------------------------------------------- NaN injection
def _nan_worker(rank, world, policy, poison_rank, poison_step):
    conf = train_conf(steps=poison_step + 1, nonfinite=policy)
    data = GridDataset(poison_rank=poison_rank, poison_step=poison_step)
    trainer = Trainer(conf, dataset=data)
    data.reads = 0  # the up-front validation read a sample; count training reads only
    snapshots = [torch.cat([p.detach().reshape(-1) for p in trainer.model.parameters()]).clone()]
    try:
        while trainer.step < trainer.tc.steps:
            trainer.train_step()
            snapshots.append(
                torch.cat([p.detach().reshape(-1) for p in trainer.model.parameters()]).clone()
            )
    except NonFiniteError as err:
        return {"raised": str(err), "step": trainer.step, "history": trainer.history}
    return {"raised": None, "history": trainer.history, "snapshots": snapshots}


@pytest.mark.parametrize("poison_rank", [3, 0])
def test_nan_on_one_rank_at_step_3_stops_every_rank_at_step_3(poison_rank):
    results = run_on_ranks(_nan_worker, 4, "stop", poison_rank, 3, timeout=120, pg_timeout=30)
    for rank, res in enumerate(results):
        assert res["raised"] is not None, f"rank {rank} did not stop"
        assert "non-finite loss/gradient at step 3" in res["raised"], res["raised"]
        assert "trainer.nonfinite" in res["raised"]
        assert res["step"] == 2  # steps 1 and 2 done, step 3 refused
        assert [r["step"] for r in res["history"]] == [1, 2]


def test_nan_on_rank_3_at_step_3_is_skipped_identically_on_every_rank():
    results = run_on_ranks(_nan_worker, 4, "skip", 3, 3, timeout=120, pg_timeout=30)
    reference = results[0]["snapshots"]
    for rank, res in enumerate(results):
        flags = [bool(r.get("nonfinite")) for r in res["history"]]
        assert flags == [False, False, True, False], f"rank {rank}: {flags}"
        snaps = res["snapshots"]
        assert torch.equal(snaps[3], snaps[2]), f"rank {rank}: the skipped step changed weights"
        assert not torch.equal(snaps[4], snaps[3]), f"rank {rank}: training did not resume"
        for a, b in zip(snaps, reference):
            assert torch.equal(a, b), f"rank {rank} diverged from rank 0"
        assert all(torch.isfinite(s).all() for s in snaps)


# --------------------------------------------------------------------------- the one-line report
def _reports(tmp_path, **ranks):
    for key, (kind, message, comm, t) in ranks.items():
        rank = int(key.removeprefix("r"))
        (tmp_path / f"rank{rank}.json").write_text(
            json.dumps(
                {"rank": rank, "time": t, "type": kind, "message": message, "communication": comm}
            )
        )
    return str(tmp_path)


def test_report_names_one_line_when_every_rank_rejects_the_config(tmp_path):
    bad = ("ValueError", "the run cannot start: model.in_channels = 3 ...", False, 1.0)
    status = _reports(tmp_path, r0=bad, r1=bad, r2=bad)
    report = describe_failures(status, 3, {0: 1, 1: 1, 2: 1})
    assert (
        report
        == "all 3 ranks failed with ValueError: the run cannot start: model.in_channels = 3 ..."
    )


def test_report_prefers_the_real_error_over_the_later_connection_errors(tmp_path):
    lost = ("RuntimeError", "Connection closed by peer [127.0.0.1]:1234", True, 1.0)
    status = _reports(
        tmp_path,
        r0=lost,
        r1=("ExitStatus", "credit_parallel.tools.verify exited with status 1", False, 2.0),
        r2=lost,
    )
    report = describe_failures(status, 3, {0: 1, 1: 1, 2: 1})
    assert report == (
        "rank 1 of 3 failed first: ExitStatus: credit_parallel.tools.verify exited with status 1 "
        "(ranks 0, 2 then lost the connection in a collective)"
    )


def test_report_without_any_rank_report_still_lists_the_exit_codes(tmp_path):
    report = describe_failures(str(tmp_path), 2, {1: -9})
    assert report.startswith("rank 1 of 2 died without a Python error (rank 1: exit code -9")


# --------------------------------------------------------------------------- point-to-point bound
def _p2p_wait_worker(rank, world, what):
    """The default group created with a long timeout (the rendezvous bound), its collectives
    lowered to 1 s afterwards (as launch.init_distributed_from_env does): a peer that does not
    answer must end a point-to-point wait after 1 s too, not after the creation timeout."""
    import datetime

    import torch.distributed as dist
    import torch.distributed.distributed_c10d as c10d

    from credit_parallel.domain.exchange.halo import HaloExchange
    from credit_parallel.domain.manager import DomainParallelManager
    from credit_parallel.layout.launch import set_subgroup_timeout
    from credit_parallel.layout.mesh import build_device_mesh
    from credit_parallel.layout.small_collectives import sum_small_

    bound = datetime.timedelta(seconds=1)
    c10d._set_pg_timeout(bound)
    set_subgroup_timeout(bound)
    # the mesh of a domain-2 run on 2 ranks: its domain axis IS the default group
    mesh, _ = build_device_mesh({"data": "none", "domain": world}, device="cpu")
    manager = DomainParallelManager.from_device_mesh(mesh)
    assert manager.domain_group == dist.group.WORLD
    halo = HaloExchange(1, manager=manager)  # on both ranks
    x = torch.ones(1, 1, 4, 3)
    halo(x)  # learns the global height (a collective) on both ranks: then only the exchange
    if rank == 1:
        time.sleep(8.0)
        return None
    t0 = time.monotonic()
    try:
        if what == "small sum":
            sum_small_(torch.ones(4), None)
        else:
            halo(x)
    except RuntimeError as err:
        return time.monotonic() - t0, str(err)
    return time.monotonic() - t0, "no error"


@pytest.mark.parametrize("what", ["small sum", "halo exchange"])
def test_point_to_point_wait_ends_at_the_group_timeout_not_the_creation_timeout(what):
    elapsed, message = run_on_ranks(_p2p_wait_worker, 2, what, pg_timeout=30.0, timeout=60)[0]
    assert "Timed out" in message, message
    assert elapsed < 5.0, elapsed  # 1 s bound (+ slack), not the 30 s the group was created with
