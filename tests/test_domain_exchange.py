"""HaloExchange / exchange_rows on 2, 3 and 4 gloo ranks against the single-process slicing.

Each worker builds the global tensor, shards it, exchanges, and compares the window with the
global tensor's rows ``[start - before, stop + after)`` padded by the boundary rule (zeros beyond
the poles, or reflect / replicate / circular computed by ``F.pad`` on the global tensor).  The
backward is compared with autograd of the same slicing on the global tensor (the adjoint), and
every exchange must be ONE batched post in forward and one in backward.  Many cases run
inside one ``run_on_ranks`` call to keep the runtime low.
"""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F

from credit_parallel.domain.exchange.halo import HaloExchange, exchange_rows
from credit_parallel.domain.exchange.replay import _Posts
from credit_parallel.domain.exchange.traffic import exchange_stats, record_exchange_stats
from credit_parallel.domain.manager import DomainParallelManager, get_domain_parallel_manager
from credit_parallel.domain.rows import FILL, shard_range
from credit_parallel.testing import RankFailure, run_on_ranks

__all__: list[str] = []


def _reference_window(x: torch.Tensor, start: int, stop: int, before: int, after: int, mode: str):
    """Rows [start-before, stop+after) of the global x (dim -2) padded by ``mode``, by F.pad.

    F.pad limits the padding to the tensor size (reflect: < size); a wider circular halo is
    built by repeating the tensor around the ring, which is what circular means."""
    h = x.shape[-2]
    if mode == "zeros":
        padded = F.pad(x, (0, 0, before, after))
    elif mode == "circular" and max(before, after) > h:
        reps = max(before, after) // h + 1
        ring = torch.cat([x] * (2 * reps + 1), dim=-2)
        padded = ring.narrow(-2, reps * h - before, h + before + after)
    else:
        padded = F.pad(x, (0, 0, before, after), mode=mode)
    return padded[..., start : stop + before + after, :]


class _CountP2P:
    """Counts the batched posts of the exchange while installed: the calls of the replayed
    exchange's post (``exchange/replay.py``) that posted messages, each ONE
    ``batch_isend_irecv`` or, on gloo, every message posted once on the group), and any
    ``batch_isend_irecv`` made elsewhere."""

    def __init__(self):
        self.calls = 0
        self._orig = dist.batch_isend_irecv, _Posts.post

    def __enter__(self):
        batch, post = self._orig
        inside = []

        def counted_batch(ops):
            self.calls += not inside
            return batch(ops)

        def counted_post(posts, *args):
            inside.append(True)
            try:
                out = post(posts, *args)
            finally:
                inside.pop()
            self.calls += bool(out[0])
            return out

        dist.batch_isend_irecv, _Posts.post = counted_batch, counted_post
        return self

    def __exit__(self, *exc):
        dist.batch_isend_irecv, _Posts.post = self._orig


def _halo_cases(world):
    """(global height, before, after, mode) cases: even/uneven H, symmetric and asymmetric,
    halos wider than a neighbour's shard (multi-hop), all modes."""
    cases = []
    for h in (4 * world, 4 * world + 1, 4 * world - 1, world + 1):
        for before, after in ((1, 1), (2, 0), (0, 3), (2, 1)):
            for mode in ("zeros", "reflect", "replicate", "circular"):
                if mode == "reflect" and max(before, after) >= h:
                    continue
                cases.append((h, before, after, mode))
    # multi-hop: the halo is wider than the shards it crosses
    cases += [(7, 3, 3, m) for m in ("zeros", "reflect", "replicate", "circular")]
    cases += [(world, 2, 2, m) for m in ("zeros", "replicate", "circular")]
    cases += [(world + 1, 5, 4, "circular")]  # wraps more than once around the ring
    return [c for c in cases if c[0] >= world]


def _halo_worker(rank, world):
    torch.set_default_dtype(torch.float64)
    mgr = DomainParallelManager(world, world)
    results = []
    for h, before, after, mode in _halo_cases(world):
        gen = torch.Generator().manual_seed(h * 100 + before * 10 + after)
        x = torch.randn(2, 3, h, 5, generator=gen)
        grads = [torch.randn(2, 3, h + before + after, 5, generator=gen) for _ in range(world)]
        start, stop = shard_range(h, world, rank)
        # reference: every rank's window as a slicing of the global tensor; the adjoint is
        # autograd of the sum of all ranks' windows against their output gradients
        xg = x.clone().requires_grad_(True)
        ref_windows = []
        loss = 0.0
        for r in range(world):
            a, b = shard_range(h, world, r)
            win = _reference_window(xg, a, b, before, after, mode)
            ref_windows.append(win)
            loss = loss + (win * grads[r][..., : win.shape[-2], :]).sum()
        loss.backward()

        halo = HaloExchange((before, after), dim=-2, manager=mgr, mode=mode)
        xl = x[..., start:stop, :].clone().requires_grad_(True)
        with record_exchange_stats(), _CountP2P() as count:
            win = halo(xl)
            fwd_calls = count.calls
            (win * grads[rank][..., : win.shape[-2], :]).sum().backward()
            bwd_calls = count.calls - fwd_calls
        results.append(
            {
                "case": (h, before, after, mode),
                "shape_ok": win.shape[-2] == stop - start + before + after,
                "forward": float((win - ref_windows[rank]).abs().max()),
                "grad": float((xl.grad - xg.grad[..., start:stop, :]).abs().max()),
                "fwd_calls": fwd_calls,
                "bwd_calls": bwd_calls,
                "stats_calls": exchange_stats.p2p_calls,
                "trim": float(
                    (HaloExchange.trim(win, before, after) - x[..., start:stop, :]).abs().max()
                ),
            }
        )
    return results


@pytest.mark.parametrize("world", [2, 3, 4])
def test_halo_exchange_matches_global_slicing_forward_and_adjoint(world):
    results = run_on_ranks(_halo_worker, world)
    bad = []
    for rank, per_rank in enumerate(results):
        for res in per_rank:
            case = res["case"]
            if not res["shape_ok"] or res["forward"] > 1e-10 or res["grad"] > 1e-10:
                bad.append((rank, case, res["forward"], res["grad"]))
            if res["trim"] != 0.0:
                bad.append((rank, case, "trim", res["trim"]))
            # exactly one batched P2P call per direction (every case has width > 0)
            if (res["fwd_calls"], res["bwd_calls"], res["stats_calls"]) != (1, 1, 2):
                bad.append((rank, case, "calls", res["fwd_calls"], res["bwd_calls"]))
    assert not bad, bad
    assert len(results[0]) > 40


def _multihop_worker(rank, world):
    """H=7 on 4 ranks (shards 2,2,2,1) with width 3: rank 3's halo spans two ranks above."""
    torch.set_default_dtype(torch.float64)
    mgr = DomainParallelManager(world, world)
    x = torch.arange(7.0).view(1, 1, 7, 1)
    start, stop = shard_range(7, world, rank)
    win = HaloExchange(3, manager=mgr)(x[..., start:stop, :])
    return win.flatten().tolist()


def test_halo_wider_than_neighbour_shard_is_served_from_further_ranks():
    windows = run_on_ranks(_multihop_worker, 4)
    z = 0.0
    assert windows == [
        [z, z, z, 0.0, 1.0, 2.0, 3.0, 4.0],
        [z, 0.0, 1.0, 2.0, 3.0, 4.0, 5.0, 6.0],
        [1.0, 2.0, 3.0, 4.0, 5.0, 6.0, z, z],
        [3.0, 4.0, 5.0, 6.0, z, z, z],
    ]


def _exchange_rows_worker(rank, world):
    """exchange_rows with arbitrary windows (repeats, FILL, rows from every rank), dim 1 of 3-D,
    and a fill value; forward and adjoint against index_select on the global tensor."""
    torch.set_default_dtype(torch.float64)
    mgr = DomainParallelManager(world, world)
    h = 11
    windows = (
        (10, 0, FILL, 5, 5, 1),
        (3, 2, 1, 0, FILL, FILL),
        (9, 8, 7, 6, 4),
        (),  # an empty window (this rank still sends its rows)
    )[:world]
    gen = torch.Generator().manual_seed(7)
    x = torch.randn(3, h, 4, generator=gen)
    grads = [torch.randn(3, len(w), 4, generator=gen) for w in windows]
    xg = x.clone().requires_grad_(True)
    ext = torch.cat([xg, torch.full((3, 1, 4), 2.5)], 1)  # the fill row
    loss = 0.0
    refs = []
    for w, g in zip(windows, grads):
        idx = torch.tensor([r if r != FILL else h for r in w], dtype=torch.long)
        ref = ext.index_select(1, idx)
        refs.append(ref)
        loss = loss + (ref * g).sum()
    loss.backward()
    a, b = shard_range(h, world, rank)
    xl = x[:, a:b].clone().requires_grad_(True)
    with _CountP2P() as count:
        out = exchange_rows(xl, windows, h, 1, mgr, fill_value=2.5)
        (out * grads[rank]).sum().backward()
    return (
        float((out - refs[rank]).abs().max()) if out.numel() else 0.0,
        float((xl.grad - xg.grad[:, a:b]).abs().max()),
        tuple(out.shape),
        count.calls,
    )


@pytest.mark.parametrize("world", [3, 4])
def test_exchange_rows_arbitrary_windows_forward_and_adjoint(world):
    results = run_on_ranks(_exchange_rows_worker, world)
    for rank, (fwd, grad, _shape, calls) in enumerate(results):
        assert fwd <= 1e-12 and grad <= 1e-12, (rank, fwd, grad)
        assert calls == 2, (rank, calls)
    assert results[-1][2][1] == (0 if world == 4 else 5)


def _float32_worker(rank, world):
    mgr = DomainParallelManager(world, world)
    gen = torch.Generator().manual_seed(3)
    h = 13
    x = torch.randn(2, 4, h, 6, generator=gen)
    grads = torch.randn(world, 2, 4, h + 4, 6, generator=gen)
    xg = x.clone().requires_grad_(True)
    loss = 0.0
    for r in range(world):
        a, b = shard_range(h, world, r)
        loss = (
            loss
            + (_reference_window(xg, a, b, 2, 2, "reflect") * grads[r][..., : b - a + 4, :]).sum()
        )
    loss.backward()
    a, b = shard_range(h, world, rank)
    xl = x[..., a:b, :].clone().requires_grad_(True)
    win = HaloExchange(2, manager=mgr, mode="reflect")(xl)
    (win * grads[rank][..., : b - a + 4, :]).sum().backward()
    ref = _reference_window(x, a, b, 2, 2, "reflect")
    return (
        float((win - ref).abs().max() / ref.abs().max()),
        float((xl.grad - xg.grad[..., a:b, :]).abs().max() / xg.grad.abs().max()),
        win.dtype,
    )


def test_halo_exchange_float32_spot_check():
    for rel_fwd, rel_grad, dtype in run_on_ranks(_float32_worker, 3):
        assert dtype == torch.float32
        assert rel_fwd <= 1e-5 and rel_grad <= 1e-5


def _zero_width_worker(rank, world):
    mgr = DomainParallelManager(world, world)
    x = torch.randn(1, 2, 5, 3)
    with _CountP2P() as count:
        y = HaloExchange(0, manager=mgr)(x)
    return bool(torch.equal(y, x)), count.calls


def test_zero_width_halo_is_identity_without_p2p():
    assert run_on_ranks(_zero_width_worker, 2) == [(True, 0), (True, 0)]


def _reflect_too_wide_worker(rank, world):
    mgr = DomainParallelManager(world, world)
    a, b = shard_range(5, world, rank)
    HaloExchange(5, manager=mgr, mode="reflect")(torch.zeros(1, 1, b - a, 2))


def test_reflect_halo_wider_than_the_globe_is_an_error_on_every_rank():
    with pytest.raises(RankFailure, match=r"(?s)rank\(s\) \[0, 1\].*reflect padding of 5 rows"):
        run_on_ranks(_reflect_too_wide_worker, 2, timeout=60)


def test_halo_exchange_arguments_and_trim_are_checked():
    with pytest.raises(ValueError, match="halo_width must be >= 0"):
        HaloExchange((-1, 2))
    with pytest.raises(ValueError, match="mode"):
        HaloExchange(1, mode="mirror")
    halo = HaloExchange((1, 2))
    assert (halo.halo_before, halo.halo_after) == (1, 2)
    x = torch.arange(10.0).view(1, 1, 5, 2)
    assert torch.equal(HaloExchange.trim(x, 1, 2), x[:, :, 1:3])
    assert torch.equal(HaloExchange.trim(x, 2, 0, dim=-1), x[..., 2:2])
    with pytest.raises(ValueError, match="cannot trim 3\\+3 rows"):
        HaloExchange.trim(x, 3, 3)
    if get_domain_parallel_manager() is None:
        with pytest.raises(RuntimeError, match="no DomainParallelManager"):
            HaloExchange(1)(x)


# --------------------------------------------------------------------------- side stream
def _side_stream_worker(rank, world):
    mgr = DomainParallelManager(world, world)
    x = torch.randn(2, 3, 11, 4, generator=torch.Generator().manual_seed(3), dtype=torch.float64)
    a, b = shard_range(11, world, rank)
    windows = tuple(
        tuple(range(max(0, s - 2), min(11, e + 1)))
        for s, e in (shard_range(11, world, r) for r in range(world))
    )
    out = []
    for side in (False, True):
        xl = x[:, :, a:b].clone().requires_grad_()
        mgr.begin_forward(("side", side))
        y = exchange_rows(xl, windows, 11, 2, mgr, side_stream=side)
        (y * y).sum().backward()
        out.append((y.detach(), xl.grad))
    return all(torch.equal(p, q) for p, q in zip(out[0], out[1]))


def test_side_stream_exchange_degrades_to_the_same_path_on_cpu():
    from credit_parallel.domain.exchange.streams import comm_stream_for

    stream = comm_stream_for("cpu")
    assert not stream.active and stream is comm_stream_for(torch.device("cpu"))
    with stream.posting():  # a no-op context
        t = torch.ones(2)
    stream.keep([t])
    stream.handoff([t])
    stream.join()
    assert run_on_ranks(_side_stream_worker, 3) == [True] * 3


def _replay_worker(rank, world, mode):
    """Two forwards and backwards of one layer's exchange at one shape: the messages are planned
    once (the same replay objects) and the second call's windows and gradients equal the first's
    bit for bit; another shape plans anew."""
    from credit_parallel.domain.exchange import replay

    torch.set_default_dtype(torch.float64)
    built = []
    for cls in (replay.ForwardMessages, replay.BackwardMessages):
        init = cls.__init__

        def counted(self, *args, _init=init, _name=cls.__name__):
            built.append(_name)
            _init(self, *args)

        cls.__init__ = counted
    mgr = DomainParallelManager(world, world)
    halo = HaloExchange(2, manager=mgr, mode=mode)
    outs, programs = [], []
    for h in (9, 9, 11):
        start, stop = shard_range(h, world, rank)
        x = torch.arange(float(2 * h)).view(1, 2, h, 1)[:, :, start:stop].clone()
        x.requires_grad_(True)
        before = len(built)
        win = halo(x)
        (win * torch.arange(float(win.numel())).view_as(win)).sum().backward()
        programs.append(sorted(built[before:]))
        outs.append((win.detach().clone(), x.grad.clone()))
    same = all(torch.equal(a, b) for a, b in zip(outs[0], outs[1]))
    return programs, same


@pytest.mark.parametrize("mode", ["circular", "zeros"])
def test_an_exchange_is_planned_once_per_shape_and_replayed_exactly(mode):
    # circular at 2 ranks: a peer's rows arrive in two pieces (the generic gradient split);
    # zeros: each received run is one window piece (the gathered gradient of BackwardMessages)
    new = ["BackwardMessages", "ForwardMessages"]
    for programs, same in run_on_ranks(_replay_worker, 2, mode):
        assert programs == [new, [], new]
        assert same


def test_a_nan_fill_reuses_one_program():
    """The replay cache keys a fill by its bits: two calls with a NaN fill (a fresh float each,
    never equal to another NaN) build one program; -0.0 and 0.0 two (they fill differently)."""
    from credit_parallel.domain.exchange import replay

    built = []

    class Program:
        def __init__(self, specs, shapes, peers, group, device):
            built.append(specs[0][2])

    plan = object()
    try:
        for fill in (float("nan"), float("nan"), 0.0, -0.0, 0.0):
            replay._cached(Program, [(plan, -2, fill)], [(1, 2, 3, 4)], (0,), None, "cpu")
        replay._cached(
            Program, [(plan, -2, float("nan"))] * 2, [(1, 2, 3, 4)] * 2, (0,), None, "cpu"
        )
        replay._cached(
            Program, [(plan, -2, float("nan"))] * 2, [(1, 2, 3, 4)] * 2, (0,), None, "cpu"
        )
    finally:
        for key in [k for k in replay._CACHE if k[0] == "Program"]:
            del replay._CACHE[key]
    assert len(built) == 4, built
    assert built[0] != built[0] and built[1:3] == [0.0, -0.0] and built[3] != built[3]
    assert str(built[2]) == "-0.0"


def test_exchange_host_benchmark_measures_both_versions_in_the_same_ranks():
    import importlib.util
    import sys
    from pathlib import Path

    root = Path(__file__).resolve().parents[1]
    path = root / "benchmarks" / "exchange_host.py"
    spec = importlib.util.spec_from_file_location("exchange_host_benchmark", path)
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module
    spec.loader.exec_module(module)
    import credit_parallel

    src = Path(credit_parallel.__file__).resolve().parents[1]
    args = ["--rounds", "1", "--calls", "2", "--warmup", "1", "--baseline", str(src)]
    results = module.main(args)
    baseline = [key for key in results if key[0] == "credit_parallel_baseline"]
    ours = [key for key in results if key[0] == "credit_parallel"]
    # the baseline: every variant but a2a (this version's path); ours: split, window, exchange, a2a
    assert len(baseline) == len(module.VARIANTS) - 1 and len(ours) == 4
    assert all(value > 0 for times in results.values() for value in times)


def _batched_path_worker(rank, world):
    """The NCCL path of the replayed posts (one ``dist.batch_isend_irecv`` of reused
    ``P2POp``s, their tensors rebound per call), forced on gloo, which runs it too: the halo
    cases and the arbitrary windows give what the direct path gives, twice (the replay)."""
    import torch.distributed as dist

    from credit_parallel.domain.exchange import replay

    calls = []
    real = dist.batch_isend_irecv

    def counted(ops):
        calls.append(len(ops))
        assert all(op.tensor is not replay._PLACEHOLDER for op in ops)
        return real(ops)

    replay.batches_p2p = lambda pg, device: True
    replay._CACHE.clear()
    dist.batch_isend_irecv = counted
    try:
        first = _halo_worker(rank, world), _exchange_rows_worker(rank, world)
        again = _halo_worker(rank, world), _exchange_rows_worker(rank, world)
    finally:
        dist.batch_isend_irecv = real
    return first, again, len(calls)


@pytest.mark.parametrize("world", [3, 4])
def test_the_batched_p2p_path_nccl_takes_is_exact_on_gloo(world):
    for (halo, rows), (halo2, rows2), batched in run_on_ranks(_batched_path_worker, world):
        for res in halo + halo2:
            assert res["shape_ok"] and res["forward"] <= 1e-10 and res["grad"] <= 1e-10, res
        for fwd, grad, _shape, _calls in (rows, rows2):
            assert fwd <= 1e-12 and grad <= 1e-12
        assert batched >= 2 * len(halo), batched  # every exchange went through the batch
