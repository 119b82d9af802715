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
from credit_parallel.tools.verify import format_table, judge, summarize, verify_layout

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
        # the default table: outputs and input gradients as they are, one row per group
        summary = summarize(rows)
        n_io = 4 if mtype == "pangu" else 2
        assert [r[0] for r in summary[:n_io]] == [r[0] for r in rows[:n_io]]
        grads = [r for r in rows if r[0].startswith("grad ")]
        assert summary[n_io][0].startswith(f"grad: {len(grads)} parameters, worst ")
        # the worst: the largest absolute error in float64, the largest relative one in float32
        worst = max(grads, key=lambda r: r[1] if dtype == F64 else r[1] / max(r[2], 1e-30))
        assert summary[n_io][:4] == (summary[n_io][0], *worst[1:4])
        assert summary[n_io][0].endswith(worst[0][len("grad ") :])
        assert len(summary) == n_io + 1 + bool(spread), summary
        if spread:
            assert summary[-1][0].startswith(f"tp ranks agree on grad: {len(spread)} parameters")
        assert all(r[-1] == "PASS" for r in summary)


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


# --------------------------------------------------------------------------- the summary table
_RAW = [
    ("output y", 1e-12, 1.0, "out"),
    ("input grad x", 2e-12, 1.0, "out"),
    ("grad a.weight", 3e-12, 1.0, "param"),
    ("grad b.weight", 5e-9, 2.0, "param"),
    ("grad c.bias", 4e-8, 0.5, "param"),
    ("tp ranks agree on grad a.weight", 0.0, 1.0, "param"),
    ("tp ranks agree on grad c.bias", 1e-13, 0.5, "param"),
]


def test_verify_summary_folds_each_parameter_group_and_keeps_its_worst_fail():
    rows = judge(_RAW, F64)
    summary = summarize(rows)
    assert [r[0] for r in summary] == [
        "output y",
        "input grad x",
        "grad: 3 parameters, worst c.bias",
        "tp ranks agree on grad: 2 parameters, worst c.bias",
    ]
    assert summary[:2] == rows[:2]
    # two of three gradients FAIL (abs > 1e-10): the group fails and shows the worst one's numbers
    assert summary[2][1:] == (4e-8, 0.5, "abs <= 1e-10", "FAIL (2 of 3)")
    assert summary[3][1:] == (1e-13, 0.5, "abs <= 1e-10", "PASS")
    table = format_table(rows, {"tensor": 2}, 2, F64, full=False)
    lines = table.splitlines()
    assert len(lines) == 2 + 4 + 2  # header, columns, 4 rows, counts, the --all hint
    assert lines[-2] == "5 passed, 2 failed"  # every check counted, not the rows shown
    assert "7 checks in 4 rows" in lines[-1] and "--all" in lines[-1]
    full = format_table(rows, {"tensor": 2}, 2, F64, full=True).splitlines()
    assert len(full) == 2 + 7 + 1 and full[-1] == "5 passed, 2 failed"
    assert [line.split()[-1] for line in full[2:-1]].count("FAIL") == 2


def test_verify_summary_worst_is_relative_under_float32_and_all_pass_stays_pass():
    raw = [
        ("grad a.weight", 1e-6, 1e-3, "param"),  # relative 1e-3: FAIL at rel 1e-4
        ("grad b.weight", 1e-5, 1.0, "param"),  # larger abs error, relative 1e-5: PASS
    ]
    (row,) = summarize(judge(raw, torch.float32))
    assert row[0] == "grad: 2 parameters, worst a.weight" and row[-1] == "FAIL (1 of 2)"
    passing = [("grad a.weight", 1e-9, 1e-3, "param"), ("grad b.weight", 1e-7, 1.0, "param")]
    (row,) = summarize(judge(passing, torch.float32))
    assert row[0] == "grad: 2 parameters, worst a.weight" and row[-1] == "PASS"  # 1e-6 > 1e-7


def _verify_main_worker(rank, world, path, extra):
    import contextlib
    import io

    from credit_parallel.tools import verify

    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        status = verify.main(["--config", path, *extra])
    return status, out.getvalue()


def test_verify_main_prints_the_summary_by_default_and_every_row_with_all(tmp_path):
    import yaml

    conf = {"model": UNET, "trainer": {"parallelism": {"tensor": 2}, "seed": 1, "batch_size": 2}}
    path = tmp_path / "tp2.yaml"
    path.write_text(yaml.safe_dump(conf))
    (status, summary), _ = run_on_ranks(_verify_main_worker, 2, str(path), [])
    (status_all, full), _ = run_on_ranks(_verify_main_worker, 2, str(path), ["--all"])
    assert status == status_all == 0  # the exit status does not depend on the table's form
    n_params = len(list(build_model(UNET).parameters()))
    rows = [line for line in summary.splitlines()[2:] if line.endswith(("PASS", "FAIL"))]
    full_rows = [line for line in full.splitlines()[2:] if line.endswith(("PASS", "FAIL"))]
    assert [r.split(":")[0].split()[0] for r in rows] == ["output", "input", "grad", "tp"]
    spread = [r for r in full_rows if r.startswith("tp ranks agree on grad ")]
    assert len(full_rows) == 2 + n_params + len(spread) and spread
    assert f"grad: {n_params} parameters, worst " in summary
    assert f"tp ranks agree on grad: {len(spread)} parameters, worst " in summary
    counts = f"{len(full_rows)} passed, 0 failed"
    assert counts in summary and counts in full and "--all lists every row" not in full
