import time

import pytest
import torch
import torch.distributed as dist

from credit_parallel.testing import RankFailure, run_on_ranks


def _sum_ranks(rank, world):
    t = torch.tensor([rank], dtype=torch.float64)
    dist.all_reduce(t)
    return {"rank": rank, "sum": t, "threads": torch.get_num_threads()}


def test_results_come_back_in_rank_order_with_tensors():
    out = run_on_ranks(_sum_ranks, 3)
    assert [o["rank"] for o in out] == [0, 1, 2]
    assert all(o["sum"].item() == 3.0 and o["threads"] == 1 for o in out)


def _raise_on_one(rank, world):
    if rank == 1:
        raise KeyError("boom on rank one")
    return rank


def test_worker_traceback_is_reraised():
    with pytest.raises(RankFailure, match=r"(?s)rank\(s\) \[1\].*KeyError.*boom on rank one"):
        run_on_ranks(_raise_on_one, 2)


def _hang(rank, world):
    if rank == 0:
        time.sleep(60)
    return rank


def test_hung_rank_is_killed_after_timeout():
    t0 = time.monotonic()
    with pytest.raises(TimeoutError, match=r"rank\(s\) \[0\]"):
        run_on_ranks(_hang, 2, timeout=3)
    assert time.monotonic() - t0 < 15
