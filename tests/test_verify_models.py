"""``verify_layout`` on the three reference models: every layout the models allow is exact.

Each case builds the model from its config, runs it unsharded on the global batch and under the
layout (``trainer.parallelism``) on this rank's part, and compares output, input gradient and
every parameter gradient (``judge``: float64 max abs error <= 1e-10; float32 relative 1e-5 /
1e-4).  Cases are grouped into one worker call per world size (2, 3 and one 8-rank run).
A negative control (a module that claims ``_domain_local`` but averages over latitude) must FAIL,
so a verifier that compares the wrong things cannot pass silently.
"""

from __future__ import annotations

import pytest
import torch
import torch._dynamo  # noqa: F401  (imported once here so forked workers inherit it)
import torch.distributed.tensor  # noqa: F401
from torch import nn

import credit_parallel.parallel.composition  # noqa: F401
import credit_parallel.parallel.fsdp  # noqa: F401
import credit_parallel.parallel.tensor_parallel  # noqa: F401
from credit_parallel import validate_sharding_constraints
from credit_parallel.domain.rows import shard_sizes
from credit_parallel.models import MODEL_TYPES, build_model
from credit_parallel.testing import run_on_ranks
from credit_parallel.tools.verify import format_table, judge, verify_layout

__all__: list[str] = []

F64, F32 = torch.float64, torch.float32

# 17 rows: uneven shards at domain 2 (9/8) and 3 (6/6/5), poles included
UNET = {
    "type": "unet",
    "in_channels": 3,
    "out_channels": 3,
    "image_height": 17,
    "image_width": 16,
    "base_channels": 4,
    "channel_mults": [1, 2],
    "norm_groups": 2,
}
# at domain 2 each shard has 16 rows -> 8 / 4 rows at the two levels, multiples of the windows
# 4 / 2; at domain 3 (11/11/10) shard boundaries cut windows: warned, re-laid out, still exact
CROSSFORMER = {
    "type": "crossformer",
    "in_channels": 3,
    "out_channels": 3,
    "image_height": 32,
    "image_width": 32,
    "dims": [8, 16],
    "depths": [2, 2],
    "dim_head": 4,
    "window_sizes": [4, 2],
    "norm_groups": 2,
}
# Z = 4 levels on 16 x 16; after the 2x2 patch and the 2x down-sampling H is 8 then 4 rows
PANGU = {
    "type": "pangu",
    "upper_channels": 2,
    "surface_channels": 2,
    "levels": 4,
    "image_height": 16,
    "image_width": 16,
    "dim": 4,
    "norm_groups": 2,
}


class LatitudeMeanLiar(nn.Module):
    """Declares itself row-local but subtracts the latitude mean: wrong under H-sharding."""

    _domain_local = True

    def __init__(self, in_channels, out_channels, image_height, image_width):
        super().__init__()
        self.image_height, self.image_width = image_height, image_width
        self.conv = nn.Conv2d(in_channels, out_channels, 3, padding=1)

    def forward(self, x):
        y = self.conv(x)
        return y - y.mean(dim=-2, keepdim=True)


LIAR = {"type": "liar", "in_channels": 2, "out_channels": 2, "image_height": 9, "image_width": 8}


def _n_rows(model_conf):
    """Rows verify must report: outputs, input gradients and one per parameter."""
    model = build_model(model_conf)
    n_io = 4 if model_conf["type"] == "pangu" else 2
    return n_io + len(list(model.parameters()))


def _verify_cases(rank, world, cases):
    MODEL_TYPES["liar"] = LatitudeMeanLiar  # in the forked worker only
    out = []
    for model, parallelism, dtype in cases:
        conf = {"model": model, "trainer": {"parallelism": parallelism, "seed": 1}}
        rows = judge(verify_layout(conf, dtype=dtype, batch_size=2), dtype)
        out.append((model["type"], parallelism, dtype, rows))
    return out


def _assert_all_pass(results, world):
    for outs in zip(*results):  # the same case on every rank
        mtype, parallelism, dtype, rows = outs[0]
        assert all(o[3] == rows for o in outs), "ranks disagree on the verify table"
        failed = [r for r in rows if r[-1] != "PASS"]
        table = format_table(rows, parallelism, world, dtype)
        assert not failed, f"{mtype} {parallelism} {dtype}:\n{table}"
        model = {"unet": UNET, "crossformer": CROSSFORMER, "pangu": PANGU}[mtype]
        # plus, under tp, one row per replicated parameter: its gradient agrees across tp ranks
        spread = [r for r in rows if r[0].startswith("tp ranks agree on grad ")]
        assert bool(spread) == (parallelism.get("tensor", 1) > 1), table
        assert len(rows) - len(spread) == _n_rows(model), table
        assert any(r[2] > 0 for r in rows if r[0].startswith("grad ")), "all-zero gradients"


def test_verify_two_ranks_domain2_and_tp2_every_model_float64_and_unet_float32():
    cases = [
        (UNET, {"domain": 2}, F64),
        (UNET, {"tensor": 2}, F64),
        (UNET, {"domain": 2}, F32),
        (CROSSFORMER, {"domain": 2}, F64),
        (CROSSFORMER, {"tensor": 2}, F64),
        (PANGU, {"domain": 2}, F64),
        (PANGU, {"tensor": 2}, F64),
        (LIAR, {"domain": 2}, F64),
    ]
    results = run_on_ranks(_verify_cases, 2, cases, timeout=240)
    liar = [r[-1] for r in results]
    _assert_all_pass([r[:-1] for r in results], 2)
    for _, _, _, rows in liar:
        verdicts = {name: verdict for name, *_, verdict in rows}
        assert verdicts["output y"] == "FAIL", format_table(rows, {"domain": 2}, 2, F64)
        assert verdicts["input grad x"] == "FAIL"


def test_verify_three_ranks_uneven_domain3_unet_and_pangu():
    assert shard_sizes(17, 3) == (6, 6, 5) and shard_sizes(4, 3) == (2, 1, 1)  # uneven
    cases = [(UNET, {"domain": 3}, F64), (PANGU, {"domain": 3}, F64)]
    _assert_all_pass(run_on_ranks(_verify_cases, 3, cases, timeout=240), 3)


def test_crossformer_windows_cut_at_domain3_are_warned_yet_exact():
    model = build_model(CROSSFORMER)
    assert validate_sharding_constraints(model, 16) == []  # domain 2: 16 + 16 rows
    for local_h in shard_sizes(32, 3):  # domain 3: 11, 11, 10 rows cut the windows
        warnings = validate_sharding_constraints(model, local_h)
        assert warnings and all("level" in w for w in warnings), (local_h, warnings)
    # ... which the converter handles: windows re-laid out, long-distance groups regrouped
    _assert_all_pass(run_on_ranks(_verify_cases, 3, [(CROSSFORMER, {"domain": 3}, F64)]), 3)


def test_verify_four_ranks_domain4_and_two_axis_compositions():
    cases = [
        (UNET, {"domain": 4}, F64),  # 17 rows: 5/4/4/4, then 9 rows: 3/2/2/2
        (PANGU, {"domain": 4}, F64),
        (UNET, {"tensor": 2, "domain": 2}, F64),
        (CROSSFORMER, {"data": "ddp", "domain": 2}, F64),
    ]
    _assert_all_pass(run_on_ranks(_verify_cases, 4, cases, timeout=240), 4)


@pytest.mark.slow
def test_verify_eight_ranks_fsdp2_tp2_domain2_every_model_float64():
    layout = {"data": "fsdp2", "tensor": 2, "domain": 2}
    cases = [(UNET, layout, F64), (CROSSFORMER, layout, F64), (PANGU, layout, F64)]
    _assert_all_pass(run_on_ranks(_verify_cases, 8, cases, timeout=300), 8)
