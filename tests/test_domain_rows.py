"""Exhaustive checks of the pure row algebra (``credit_parallel.domain.rows``) against brute force.

No processes: every function here is integer arithmetic on global row indices, so it is compared
with what torch itself does on small "index tensors" (``tensor_split``, ``F.pad``, ``F.conv1d`` /
``F.conv_transpose1d`` receptive fields found by autograd, ``F.interpolate``), and the exchange
plan is executed by a message-passing simulator to show it assembles exactly the requested window.
"""

from __future__ import annotations

import itertools
import warnings

import pytest
import torch
import torch.nn.functional as F
from hypothesis import given, settings
from hypothesis import strategies as st

from credit_parallel.domain.rows import (
    FILL,
    conv_output_length,
    conv_transpose_input_range,
    conv_transpose_output_length,
    conv_window,
    edge_source_row,
    interp_source_rows,
    plan_exchange,
    row_owner,
    same_padding,
    shard_range,
    shard_sizes,
    shard_start,
)

__all__: list[str] = []


# --------------------------------------------------------------------------- shard layout
def test_shard_layout_equals_tensor_split_for_all_small_heights_and_ranks():
    for length in range(1, 41):
        index = torch.arange(length)
        for n in range(1, 9):
            parts = torch.tensor_split(index, n)
            assert shard_sizes(length, n) == tuple(len(p) for p in parts), (length, n)
            for rank, part in enumerate(parts):
                start, stop = shard_range(length, n, rank)
                assert shard_start(length, n, rank) == start
                assert list(range(start, stop)) == part.tolist(), (length, n, rank)
                for row in part.tolist():
                    assert row_owner(length, n, row) == rank, (length, n, row)


def test_shard_sizes_differ_by_at_most_one_and_earlier_ranks_are_larger():
    for length, n in itertools.product(range(1, 41), range(1, 9)):
        sizes = shard_sizes(length, n)
        assert sum(sizes) == length
        assert list(sizes) == sorted(sizes, reverse=True)
        assert max(sizes) - min(sizes) <= 1
        if length >= n:
            assert min(sizes) >= 1


def test_fewer_rows_than_ranks_leaves_the_last_ranks_empty():
    assert shard_sizes(3, 4) == (1, 1, 1, 0)
    assert [shard_range(3, 4, r) for r in range(4)] == [(0, 1), (1, 2), (2, 3), (3, 3)]
    assert [row_owner(3, 4, g) for g in range(3)] == [0, 1, 2]


# --------------------------------------------------------------------------- boundary rules
def _pad_reference(index: torch.Tensor, before: int, after: int, mode: str) -> list[int]:
    """What F.pad reads for each padded position of a 1-D index tensor (-1 = zero fill)."""
    shifted = (index + 1).to(torch.float64)[None, None]  # +1 so that row 0 != fill value 0
    if mode == "zeros":
        padded = F.pad(shifted, (before, after))
    else:
        padded = F.pad(shifted, (before, after), mode=mode)
    return [int(v) - 1 for v in padded[0, 0].tolist()]


@pytest.mark.parametrize("mode", ["zeros", "reflect", "replicate", "circular"])
def test_edge_source_row_matches_f_pad_on_an_index_tensor(mode):
    for length in range(1, 15):
        index = torch.arange(length)
        for pad in range(0, 2 * length + 2):
            ours = None
            try:
                ours = [edge_source_row(p, length, mode) for p in range(-pad, length + pad)]
            except ValueError:
                pass
            try:
                ref = _pad_reference(index, pad, pad, mode)
            except (RuntimeError, ValueError, NotImplementedError):
                ref = None
            if mode == "reflect":
                # both refuse exactly when the padding reaches past the opposite edge
                assert (ours is None) == (ref is None), (length, pad)
            if ref is None:
                continue  # circular/replicate wrap further than F.pad allows: nothing to compare
            assert ours == ref, (mode, length, pad)
            if mode == "zeros":
                assert ours[:pad] == [FILL] * pad


def test_edge_source_row_rejects_unknown_mode_and_too_wide_reflection():
    with pytest.raises(ValueError, match="unknown padding mode"):
        edge_source_row(-1, 5, "mirror")
    with pytest.raises(ValueError, match=r"reflect padding of 5 rows.*5 rows"):
        edge_source_row(-5, 5, "reflect")


# --------------------------------------------------------------------------- convolution
def _reads(length_padded: int, kernel: int, stride: int, dilation: int) -> torch.Tensor:
    """Boolean [output row, padded-input position] dependency matrix of a conv, brute force:
    a ones-kernel conv applied to every one-hot input at once."""
    one_hot = torch.eye(length_padded, dtype=torch.float64)[:, None, :]
    w = torch.ones(1, 1, kernel, dtype=torch.float64)
    return (F.conv1d(one_hot, w, stride=stride, dilation=dilation)[:, 0, :] != 0).T


def _take(x: torch.Tensor, rows) -> torch.Tensor:
    """x[..., rows] along the last dim with FILL rows as zeros."""
    ext = torch.cat([x, x.new_zeros(*x.shape[:-1], 1)], -1)
    index = torch.tensor([g if g != FILL else x.shape[-1] for g in rows], dtype=torch.long)
    return ext.index_select(-1, index)


_CONV_CASES = [
    (k, s, pb, pa, d)
    for k in (1, 2, 3, 5)
    for s in (1, 2, 3)
    for d in (1, 2)
    for pb, pa in ((0, 0), (1, 1), (1, 2), (0, 3), same_padding(k, d))
]


def _max_err(a: torch.Tensor, b: torch.Tensor) -> float:
    assert a.shape == b.shape, (a.shape, b.shape)
    return float((a - b).abs().max()) if a.numel() else 0.0


def test_conv_window_is_exactly_the_receptive_field_and_reproduces_the_output():
    gen = torch.Generator().manual_seed(0)
    checked, worst = 0, 0.0
    for (k, s, pb, pa, d), length in itertools.product(_CONV_CASES, (1, 5, 13)):
        out_len = conv_output_length(length, k, s, pb, pa, d)
        padded_len = length + pb + pa
        if padded_len < d * (k - 1) + 1:
            continue  # no output at all
        x = torch.randn(1, 1, length, dtype=torch.float64, generator=gen)
        w = torch.randn(1, 1, k, dtype=torch.float64, generator=gen)
        ref = F.conv1d(F.pad(x, (pb, pa)), w, stride=s, dilation=d)
        assert ref.shape[-1] == out_len, (k, s, pb, pa, d, length)
        # dep[o]: padded-input positions output row o reads (brute force)
        dep = [torch.nonzero(row).flatten().tolist() for row in _reads(padded_len, k, s, d)]
        for n in range(1, min(out_len, 4) + 1):
            outputs = []
            for r in range(n):
                o0, o1 = shard_range(out_len, n, r)
                lo, hi = conv_window(o0, o1, kernel=k, stride=s, dilation=d, pad_before=pb)
                # exactly the receptive field at both ends (in unpadded coordinates)
                first = min(dep[o][0] for o in range(o0, o1)) - pb
                last = max(dep[o][-1] for o in range(o0, o1)) - pb
                assert (lo, hi) == (first, last + 1), (k, s, pb, pa, d, length, n, r)
                # a conv with no padding over the window gives exactly the owned output rows
                rows = [edge_source_row(p, length, "zeros") for p in range(lo, hi)]
                outputs.append(F.conv1d(_take(x, rows), w, stride=s, dilation=d))
                checked += 1
            worst = max(worst, _max_err(torch.cat(outputs, -1), ref))
    assert worst <= 1e-12
    assert checked > 1000


@pytest.mark.parametrize("mode", ["reflect", "replicate", "circular"])
def test_conv_window_with_boundary_modes_reproduces_padded_conv(mode):
    gen = torch.Generator().manual_seed(1)
    worst = 0.0
    for k, s, d, p, length in itertools.product(
        (1, 3, 4, 5), (1, 2), (1, 2), (0, 1, 2), (3, 5, 13)
    ):
        if mode == "reflect" and p >= length:
            continue
        if length + 2 * p < d * (k - 1) + 1:
            continue
        x = torch.randn(1, 1, length, dtype=torch.float64, generator=gen)
        w = torch.randn(1, 1, k, dtype=torch.float64, generator=gen)
        ref = F.conv1d(F.pad(x, (p, p), mode=mode), w, stride=s, dilation=d)
        out_len = conv_output_length(length, k, s, p, p, d)
        assert ref.shape[-1] == out_len
        for n in range(1, min(out_len, 4) + 1):
            outputs = []
            for r in range(n):
                o0, o1 = shard_range(out_len, n, r)
                lo, hi = conv_window(o0, o1, kernel=k, stride=s, dilation=d, pad_before=p)
                rows = [edge_source_row(q, length, mode) for q in range(lo, hi)]
                assert FILL not in rows
                outputs.append(F.conv1d(x[..., rows], w, stride=s, dilation=d))
            worst = max(worst, _max_err(torch.cat(outputs, -1), ref))
    assert worst <= 1e-12


def test_same_padding_matches_torch_same():
    gen = torch.Generator().manual_seed(2)
    for k, d, length in itertools.product(range(1, 7), (1, 2, 3), (6, 11)):
        x = torch.randn(1, 1, length, dtype=torch.float64, generator=gen)
        w = torch.randn(1, 1, k, dtype=torch.float64, generator=gen)
        before, after = same_padding(k, d)
        assert before + after == d * (k - 1) and after - before in (0, 1)
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")  # torch notes that even kernels copy the input
            ref = F.conv1d(x, w, padding="same", dilation=d)
        assert _max_err(F.conv1d(F.pad(x, (before, after)), w, dilation=d), ref) <= 1e-12


# --------------------------------------------------------------------------- transposed conv
def _convt_cases():
    for k, s, p, d in itertools.product((1, 2, 3, 4), (1, 2, 3), (0, 1, 2), (1, 3)):
        for op in range(max(s, d)):  # torch: output_padding < max(stride, dilation)
            yield k, s, p, op, d


def test_conv_transpose_input_range_is_exactly_the_contributing_rows():
    gen = torch.Generator().manual_seed(3)
    checked, empty, worst = 0, 0, 0.0
    for (k, s, p, op, d), length in itertools.product(_convt_cases(), (1, 4)):
        out_len = conv_transpose_output_length(length, k, s, p, op, d)
        if out_len < 1:
            continue
        x = torch.randn(1, 1, length, dtype=torch.float64, generator=gen)
        w = torch.randn(1, 1, k, dtype=torch.float64, generator=gen)
        ref = F.conv_transpose1d(x, w, stride=s, padding=p, output_padding=op, dilation=d)
        assert ref.shape[-1] == out_len, (k, s, p, op, d, length)
        # brute force: src[o] = input rows writing into output row o (ones-kernel, one-hot rows)
        one_hot = torch.eye(length, dtype=torch.float64)[:, None, :]
        contrib = F.conv_transpose1d(
            one_hot, torch.ones_like(w), stride=s, padding=p, output_padding=op, dilation=d
        )[:, 0, :]
        src = [torch.nonzero(col).flatten().tolist() for col in contrib.T]
        for n in range(1, min(out_len, 4) + 1):
            outputs = []
            for r in range(n):
                o0, o1 = shard_range(out_len, n, r)
                lo, hi = conv_transpose_input_range(
                    o0, o1, length, kernel=k, stride=s, padding=p, dilation=d
                )
                hit = sorted({i for o in range(o0, o1) for i in src[o]})
                case = (k, s, p, op, d, length, n, r)
                checked += 1
                if not hit:
                    assert lo == hi, case
                    empty += 1
                    outputs.append(x.new_zeros(1, 1, o1 - o0))
                    continue
                assert (lo, hi) == (hit[0], hit[-1] + 1), case
                # a transposed conv over the window alone reproduces the owned output rows:
                # its row t is global position lo*s + t - p (rows no input reaches are zero)
                y = F.conv_transpose1d(x[..., lo:hi], w, stride=s, dilation=d)
                t = torch.arange(o0, o1) + p - lo * s
                inside = (t >= 0) & (t < y.shape[-1])
                got = torch.where(inside, y[0, 0, t.clamp(0, y.shape[-1] - 1)], 0.0)
                outputs.append(got[None, None])
            worst = max(worst, _max_err(torch.cat(outputs, -1), ref))
    assert worst <= 1e-12
    assert checked > 1000 and empty > 0  # the "no input reaches" case is exercised


# --------------------------------------------------------------------------- interpolation
@pytest.mark.parametrize("dtype", [torch.float64, torch.float32])
def test_interp_source_rows_reproduce_f_interpolate(dtype):
    gen = torch.Generator().manual_seed(4)
    for in_len, out_len in itertools.product((3, 5, 7, 10), (2, 3, 6, 9, 14, 21)):
        x = torch.randn(1, 1, in_len, 1, dtype=dtype, generator=gen)
        for mode, align in (("nearest", None), ("bilinear", False), ("bilinear", True)):
            ref = F.interpolate(x, size=(out_len, 1), mode=mode, align_corners=align)[0, 0, :, 0]
            src = interp_source_rows(
                mode,
                in_len,
                out_len,
                0,
                out_len,
                align_corners=align,
                scale_factor=None,
                double=dtype == torch.float64,
            )
            col = x[0, 0, :, 0]
            if mode == "nearest":
                got = col[torch.as_tensor(src[0])]
                torch.testing.assert_close(got, ref, rtol=0, atol=0)
            else:
                i0, i1, lam = (torch.as_tensor(a) for a in src)
                lam = lam.to(dtype)
                got = (1 - lam) * col[i0] + lam * col[i1]
                tol = 1e-12 if dtype == torch.float64 else 1e-6
                torch.testing.assert_close(got, ref, rtol=0, atol=tol)


# --------------------------------------------------------------------------- exchange plans
def _simulate(length: int, n: int, windows: tuple) -> list[list[int]]:
    """Run the plans with real "messages" on an index tensor; return each rank's window."""
    plans = plan_exchange(length, n, windows)
    shards = [list(range(*shard_range(length, n, r))) for r in range(n)]
    mailbox = {}
    for r, plan in enumerate(plans):
        for peer, runs in plan.sends:
            msg = []
            for s, c in runs:
                assert 0 <= s and s + c <= len(shards[r]), "a rank sends rows it does not own"
                msg += shards[r][s : s + c]
            mailbox[(r, peer)] = msg
    assembled = []
    for r, plan in enumerate(plans):
        received = [mailbox.pop((peer, r)) for peer, _ in plan.recvs]
        for (peer, count), msg in zip(plan.recvs, received):
            assert len(msg) == count, f"rank {r} expects {count} rows from {peer}, gets {len(msg)}"
        out = []
        for seg in plan.segments:
            if seg[0] == "own":
                out += shards[r][seg[1] : seg[1] + seg[2]]
            elif seg[0] == "recv":
                out += received[seg[1]][seg[2] : seg[2] + seg[3]]
            else:
                out += [FILL] * seg[2]
        assert len(out) == plan.window_rows
        assembled.append(out)
    assert not mailbox, f"messages sent but never received: {sorted(mailbox)}"
    return assembled


def _check_plan(length: int, n: int, windows: tuple) -> None:
    plans = plan_exchange(length, n, windows)
    assert _simulate(length, n, windows) == [list(w) for w in windows]
    for r, plan in enumerate(plans):
        start, stop = shard_range(length, n, r)
        foreign = {g for g in windows[r] if g != FILL and not start <= g < stop}
        # exactly the distinct foreign rows are received, each once
        assert plan.rows_received == len(foreign), (length, n, r)
        for peer, count in plan.recvs:
            sent = dict(plans[peer].sends)[r]
            assert sum(c for _, c in sent) == count
        for peer, _ in plan.sends:
            assert any(q == r for q, _ in plans[peer].recvs)
    assert sum(p.rows_sent for p in plans) == sum(p.rows_received for p in plans)


def test_plan_exchange_for_conv_halos_of_all_small_layouts():
    # lengths below n included: the last ranks own no row and assemble halo rows only
    for length, n in itertools.product(range(1, 17), range(1, 6)):
        for before, after, mode in itertools.product(
            (0, 1, 3), (0, 2, 5), ("zeros", "circular", "replicate")
        ):
            windows = tuple(
                tuple(
                    edge_source_row(p, length, mode)
                    for p in range(
                        shard_range(length, n, r)[0] - before, shard_range(length, n, r)[1] + after
                    )
                )
                for r in range(n)
            )
            _check_plan(length, n, windows)


@settings(max_examples=120, deadline=None)
@given(
    st.integers(1, 6).flatmap(
        lambda n: st.tuples(
            st.just(n),
            st.integers(1, 30).flatmap(
                lambda length: st.tuples(
                    st.just(length),
                    st.lists(
                        st.lists(st.integers(-1, length - 1), max_size=2 * length),
                        min_size=n,
                        max_size=n,
                    ),
                )
            ),
        )
    )
)
def test_plan_exchange_property_any_windows_are_assembled_exactly(case):
    n, (length, windows) = case
    _check_plan(length, n, tuple(tuple(w) for w in windows))


def test_plan_exchange_rejects_bad_arguments():
    with pytest.raises(ValueError, match="one window per rank"):
        plan_exchange(10, 2, ((0,),))
    # 2 rows over 3 ranks is a layout (rank 2 empty), not an error
    assert all(not p.sends and not p.recvs for p in plan_exchange(2, 3, ((), (), ())))
    with pytest.raises(ValueError, match="outside"):
        plan_exchange(4, 2, ((4,), ()))
