"""Multi-rank test harness: run a function on N local gloo ranks, or under a fake process group.

``run_on_ranks(fn, world_size, *args)`` forks ``world_size`` workers (fork costs ~0.2 s per run,
spawn ~11 s because each rank re-imports torch), gives each a fresh TCP rendezvous port, one
intra-op thread and an initialised gloo process group, calls ``fn(rank, world_size, *args)``
and returns the per-rank results in rank order.  A worker that raises has its traceback re-raised
in the caller; a run that exceeds ``timeout`` kills every worker and raises ``TimeoutError``
naming the ranks that did not finish.

``fake_process_group(rank, world_size)`` initialises torch's "fake" backend so layout code can be
exercised at world sizes such as 512 without any process.
"""

from __future__ import annotations

import contextlib
import datetime
import os
import pickle
import socket
import time
import traceback
from collections.abc import Callable

import torch
import torch.distributed as dist
import torch.multiprocessing as tmp

from .train.step import TrainStep

__all__ = [
    "RankFailure",
    "assert_parity",
    "domain_parity_errors",
    "fake_process_group",
    "free_port",
    "run_on_ranks",
]


class RankFailure(RuntimeError):
    """One or more ranks raised; the message carries each failing rank's traceback."""


def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _dumps(obj) -> bytes:
    # plain pickle: results come from our own forked workers through a pipe, never from a file
    return pickle.dumps(obj, protocol=pickle.HIGHEST_PROTOCOL)


def _worker(fn, rank, world_size, port, pg_timeout, args, kwargs, conn):
    status, payload = "ok", None
    try:
        torch.set_num_threads(1)
        os.environ.update(
            MASTER_ADDR="127.0.0.1",
            MASTER_PORT=str(port),
            RANK=str(rank),
            LOCAL_RANK=str(rank),
            WORLD_SIZE=str(world_size),
            LOCAL_WORLD_SIZE=str(world_size),
        )
        dist.init_process_group(
            "gloo",
            init_method=f"tcp://127.0.0.1:{port}",
            rank=rank,
            world_size=world_size,
            timeout=datetime.timedelta(seconds=pg_timeout),
        )
        # every rank has joined the full mesh before any of them can fail and exit; otherwise
        # a fast failure on one rank shows up as a connection error on a slower one
        dist.barrier()
        payload = fn(rank, world_size, *args, **kwargs)
    except BaseException:  # noqa: BLE001 - everything is reported to the parent
        status, payload = "error", traceback.format_exc()
    try:
        conn.send_bytes(_dumps((rank, status, payload)))
    except BaseException:  # noqa: BLE001
        conn.send_bytes(_dumps((rank, "error", "result not picklable:\n" + traceback.format_exc())))
    finally:
        conn.close()
    if status == "ok":
        with contextlib.suppress(Exception):
            # rank 0 hosts the rendezvous store: it must not leave while another rank still
            # talks to it (e.g. creating a group); the parent kills everyone once all results
            # are in, so this cannot hang when some other rank failed
            dist.barrier()
            dist.destroy_process_group()
    os._exit(0)


def run_on_ranks(
    fn: Callable,
    world_size: int,
    *args,
    timeout: float = 120.0,
    pg_timeout: float | None = None,
    **kwargs,
) -> list:
    """Run ``fn(rank, world_size, *args, **kwargs)`` on ``world_size`` forked gloo ranks.

    Returns the list of per-rank return values (moved through pickle, so tensors are
    fine).  Raises :class:`RankFailure` with every failing rank's traceback, or
    ``TimeoutError`` after ``timeout`` seconds (all workers are killed).
    """
    ctx = tmp.get_context("fork")
    port = free_port()
    pg_timeout = pg_timeout if pg_timeout is not None else max(10.0, timeout)
    procs, conns = [], []
    for rank in range(world_size):
        recv, send = ctx.Pipe(duplex=False)
        p = ctx.Process(
            target=_worker,
            args=(fn, rank, world_size, port, pg_timeout, args, kwargs, send),
            # not daemonic: a rank may start DataLoader worker processes (a daemonic process
            # cannot have children); the finally block below kills and joins every rank
            daemon=False,
        )
        p.start()
        send.close()
        procs.append(p)
        conns.append(recv)

    results: dict[int, tuple[str, object]] = {}
    deadline = time.monotonic() + timeout
    pending = dict(enumerate(conns))
    try:
        while pending and time.monotonic() < deadline:
            for rank, conn in list(pending.items()):
                if conn.poll(0.01):
                    try:
                        r, status, payload = pickle.loads(conn.recv_bytes())
                    except EOFError:
                        r, status, payload = rank, "error", "worker exited without a result"
                    results[r] = (status, payload)
                    del pending[rank]
                elif not procs[rank].is_alive() and not conn.poll(0):
                    results[rank] = (
                        "error",
                        f"worker exited with code {procs[rank].exitcode} and no result",
                    )
                    del pending[rank]
            failed = [r for r, (s, _) in results.items() if s != "ok"]
            if failed and pending:
                # Give surviving ranks a moment to fail on their own (bounded by pg_timeout),
                # but never wait for the whole test timeout once one rank is known to be dead.
                deadline = min(deadline, time.monotonic() + 5.0)
    finally:
        for p in procs:
            if p.is_alive():
                p.kill()
        for p in procs:
            p.join(timeout=5)

    failed = sorted(r for r, (s, _) in results.items() if s != "ok")
    if failed:
        parts = [f"--- rank {r} ---\n{results[r][1]}" for r in failed]
        raise RankFailure(f"rank(s) {failed} of {world_size} failed:\n" + "\n".join(parts))
    if pending:
        raise TimeoutError(
            f"rank(s) {sorted(pending)} of {world_size} did not finish within {timeout:.0f} s "
            "(killed); a rank is probably blocked in a collective"
        )
    return [results[r][1] for r in range(world_size)]


@contextlib.contextmanager
def fake_process_group(rank: int, world_size: int):
    """Initialise torch's in-process "fake" backend (no communication happens)."""
    from torch.testing._internal.distributed.fake_pg import FakeStore

    dist.init_process_group("fake", store=FakeStore(), rank=rank, world_size=world_size)
    try:
        yield
    finally:
        dist.destroy_process_group()


def _as_tuple(v):
    return tuple(v) if isinstance(v, (tuple, list)) else (v,)


def domain_parity_errors(
    build,
    inputs,
    manager,
    *,
    convert=None,
    shard_dim: int = -2,
    seed: int = 0,
    grad_seed: int = 1234,
):
    """Compare a domain-parallel copy of ``build()`` with the single-process module, on this rank.

    ``inputs``: the GLOBAL input tensor (or a tuple of them), identical on every rank.  The
    reference runs unsharded in this process; the copy is converted (default:
    ``convert_to_domain_parallel``), fed this rank's shards, and its loss is
    ``sum(output * G)`` over this rank's rows for a fixed random ``G``, so input and parameter
    gradients are the sharded/summed versions of the reference ones.  Returns a dict of
    ``{"output": err, "input_grad": err, "param:<name>": err, ...}`` where each err is
    ``(max_abs_error, max_abs_reference)`` — identical on every rank.  ``shard_dim``: the
    dimension of every input and output sharded over the domain ranks (under a lat x lon
    manager, ``manager.is_tiled``, the last dim is split over the longitude ranks too).
    """
    import copy

    from .domain.rows import shard_range
    from .domain.sharding import gather_tensor

    torch.manual_seed(seed)
    ref = build()
    par = copy.deepcopy(ref)
    if convert is None:
        from .domain.convert import convert_to_domain_parallel

        par = convert_to_domain_parallel(par, manager)
    else:
        par = convert(par, manager) or par
    xs = tuple(t.detach().clone().requires_grad_(t.is_floating_point()) for t in _as_tuple(inputs))
    # the library's one step with the loss sum(output * G) for a random G drawn on first use
    adjoint = _RandomAdjoint(grad_seed)
    _, y_ref = TrainStep(ref, adjoint, shard_inputs=False).forward_backward_tensors(xs, ())
    weights = adjoint.weights

    n, r = manager.domain_world_size, manager.domain_rank

    def local(t):
        d = shard_dim % t.dim()
        if getattr(manager, "is_tiled", False):  # a lat x lon tile: rows and columns (SPEC §3b)
            from .domain.tiles import tile_range

            shape, coords = manager.domain_shape, manager.domain_coords
            (a, b), (c0, c1) = tile_range(t.shape[d], t.shape[-1], shape, coords)
            return t.narrow(d, a, b - a).narrow(-1, c0, c1 - c0)
        a, b = shard_range(t.shape[d], n, r)
        return t.narrow(d, a, b - a)

    manager.begin_forward(("parity", tuple(tuple(t.shape) for t in xs)))
    xl = tuple(local(t.detach()).clone().requires_grad_(t.is_floating_point()) for t in xs)
    local_weights = tuple(local(w) for w in weights)
    step = TrainStep(par, _weighted_sum, manager=manager, shard_inputs=False)
    _, y_par = step.forward_backward_tensors(xl, local_weights)

    errors = {}
    for i, (yp, yr) in enumerate(zip(y_par, y_ref)):
        full = gather_tensor(yp.detach(), shard_dim, manager)
        if full.shape != yr.shape:
            raise AssertionError(
                f"output {i}: gathered shape {tuple(full.shape)} != reference {tuple(yr.shape)}"
            )
        errors[f"output{i}" if len(y_ref) > 1 else "output"] = _err(full, yr)
    for i, (xp, xr) in enumerate(zip(xl, xs)):
        if xr.grad is None:
            continue
        full = gather_tensor(xp.grad, shard_dim, manager)
        errors[f"input_grad{i}" if len(xs) > 1 else "input_grad"] = _err(full, xr.grad)
    ref_params = dict(ref.named_parameters())
    for name, p in par.named_parameters():
        g = p.grad
        rg = ref_params[name].grad
        # the skip must be the same on every rank (the all_reduce below): a rank that holds no
        # rows of a module gives its parameters zero gradients (attention/relayout._no_rows)
        # where a rank running it leaves a parameter the module never reads at None
        if rg is None and g is None and n == 1:
            continue
        g = torch.zeros_like(ref_params[name]) if g is None else g.detach().clone()
        if n > 1:
            dist.all_reduce(g, group=manager.domain_group)
        errors[f"param:{name}"] = _err(g, rg if rg is not None else torch.zeros_like(g))
    return errors


def _weighted_sum(outputs: tuple, weights: tuple) -> torch.Tensor:
    return sum((y * w).sum() for y, w in zip(outputs, weights))


class _RandomAdjoint:
    """Loss ``sum(output * G)`` with G drawn from ``seed`` in the outputs' shapes on first call."""

    def __init__(self, seed: int):
        self.generator = torch.Generator().manual_seed(seed)
        self.weights = None

    def __call__(self, outputs: tuple, _targets: tuple) -> torch.Tensor:
        if self.weights is None:
            self.weights = tuple(
                torch.randn(y.shape, generator=self.generator, dtype=y.dtype).to(y.device)
                for y in outputs
            )
        return _weighted_sum(outputs, self.weights)


def _err(a: torch.Tensor, b: torch.Tensor) -> tuple[float, float]:
    a, b = a.detach().double(), b.detach().double()
    if b.numel() == 0:  # an empty parameter (a model's placeholder): nothing to differ
        return 0.0, 0.0
    return float((a - b).abs().max()), float(b.abs().max())


def assert_parity(
    errors: dict, dtype=torch.float64, *, abs_tol=1e-10, rel_out=1e-5, rel_param=1e-4
) -> None:
    """Apply the project's tolerances to :func:`domain_parity_errors` output."""
    bad = []
    for key, (err, scale) in errors.items():
        if dtype == torch.float64:
            ok = err <= abs_tol
        else:
            tol = rel_param if key.startswith("param:") else rel_out
            ok = err <= tol * max(scale, 1e-30)
        if not ok:
            bad.append(f"{key}: max abs err {err:.3e} (reference max {scale:.3e})")
    if bad:
        raise AssertionError("domain parity failed:\n  " + "\n  ".join(bad))
