"""The planner's forecast memory and "the smallest layout that fits": the activations alive at once
under ``no_grad`` (hand-counted models, at the busiest domain rank's rows), the forecast's bytes
from the memory parts, the first candidate within the budget, and ``plan``'s section."""

from __future__ import annotations

import pytest
from torch import nn

from credit_parallel import cli
from credit_parallel.layout.config import load_config
from credit_parallel.planner.cost import MemoryEstimate
from credit_parallel.planner.inference import (
    forecast_bytes,
    inference_live_elements,
    layout_fits,
    smallest_fitting,
)

__all__: list[str] = []


class _Skip(nn.Module):
    """y = a(x); z = c(b(y)); z + y: y stays alive while b and c run (a U-Net's skip)."""

    def __init__(self):
        super().__init__()
        self.a = nn.Conv2d(1, 4, 3, padding=1)
        self.b = nn.Conv2d(4, 4, 3, padding=1)
        self.c = nn.Conv2d(4, 4, 3, padding=1)

    def forward(self, x):
        y = self.a(x)
        return self.c(self.b(y)) + y


@pytest.mark.parametrize(("n", "rows"), [(1, 8), (2, 4), (3, 3), (8, 1)])
def test_live_activations_of_a_chain_and_a_skip_at_the_busiest_ranks_rows(n, rows):
    chain = nn.Sequential(nn.Conv2d(1, 4, 3, padding=1), nn.ReLU(), nn.Conv2d(4, 2, 3, padding=1))
    field = 4 * rows * 8  # one 4-channel field at this rank's rows (8 rows split over n)
    # the ReLU's output beside its input (the model input is not counted)
    assert inference_live_elements(chain.to("meta"), [(1, 8, 8)], {8}, n) == 2 * field
    # y, b(y) and c(b(y)) at once
    assert inference_live_elements(_Skip().to("meta"), [(1, 8, 8)], {8}, n) == 3 * field
    # on a lat x lon tile: its columns too (8 columns over 2)
    assert inference_live_elements(_Skip().to("meta"), [(1, 8, 8)], {8}, n, 2) == 3 * field // 2


def test_forecast_bytes_are_parameters_live_activations_batch_halos_and_workspace():
    memory = MemoryEstimate(
        param_bytes=1000,
        grad_bytes=1000,
        optimizer_bytes=2000,
        activation_bytes=50_000,
        param_bytes_unsharded=4000,
        fsdp_largest_unit_bytes=300,
        activation_dtype_bytes=2,
        backward_transient_bytes=7000,
        workspace_bytes=11,
        batch_bytes=900,
        exchange_bytes=40,
    )
    assert forecast_bytes(memory, 500) == 1000 + 300 + 500 * 2 + 900 + 40 + 11
    assert forecast_bytes(memory, 500, batch_size=3) == 1000 + 300 + 3 * 1000 + 900 + 40 + 11
    # no gradients, no optimizer state, no saved activations: below the training step
    assert forecast_bytes(memory, 500) < memory.total_bytes


def test_smallest_fitting_is_the_first_candidate_within_the_budget():
    candidates = [(1, 90), (2, 50), (4, 30), (8, 30)]
    assert smallest_fitting(candidates, 100) == (1, 90)
    assert smallest_fitting(candidates, 90) == (1, 90)  # at the budget fits
    assert smallest_fitting(candidates, 89) == (2, 50)
    assert smallest_fitting(candidates, 30) == (4, 30)
    assert smallest_fitting(candidates, 29) is None
    assert smallest_fitting([], 10) is None


def test_layout_fits_finds_the_smallest_domain_of_the_demo_unet(tmp_path, capsys):
    conf = load_config(cli.resolve_config("demo_unet"))
    conf["trainer"]["parallelism"] = {"data": "none", "tensor": 1, "domain": 1}
    every = layout_fits(conf, 4, budget=0)  # nothing fits: every candidate is planned
    assert every["training"] is None and every["forecast"] is None
    (d1, t1, f1), (d2, t2, f2), (d4, t4, f4) = every["candidates"]
    assert (d1, d2, d4) == (1, 2, 4)
    assert t1 > t2 > t4 and f1 > f2 > f4 and all(f < t for _, t, f in every["candidates"])
    # a budget between domain 1's and domain 2's training step: the training fits at 2
    budget = (t1 + t2) // 2
    fits = layout_fits(conf, 4, budget=budget)
    assert fits["training"] == (2, t2)
    assert f1 <= budget and fits["forecast"] == (1, f1)  # the forecast fits at domain 1
    assert [c[0] for c in fits["candidates"]] == [1, 2]  # planned until both fit
    # plan prints the section
    assert cli.main(["plan", "--config", "demo_unet", "--world-size", "2"]) == 0
    out = capsys.readouterr().out
    assert "== Smallest layout that fits an 80 GB GPU" in out
    assert "training step  domain 1" in out and "forecast step  domain 1" in out
