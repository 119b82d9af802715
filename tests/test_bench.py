"""``credit-parallel bench`` smoke run, and the cost model against what a run measures.

One small suite (tiny conv stack and U-Net; domain 1 and 2 with overlap on and off; dp 2 x
domain 2 for the stack, tp 2 for the U-Net)
runs once per test session on gloo CPU ranks; the tests then check, row by row, that the halo
bytes a step sends equal the cost model's prediction and the theoretical minimum, that every
exchange is one batched call, that the collectives per step by kind equal
``predicted_collectives``, and that the measured saved-for-backward bytes agree with the cost
model's activation estimate.  ``run_bench`` itself writes its table, JSON, PNG and Markdown page.
"""

from __future__ import annotations

import argparse
import json

import pytest

from credit_parallel.tools.bench import (
    KINDS,
    Layout,
    default_models,
    evaluate_targets,
    format_table,
    run_bench,
    run_suite,
)

__all__: list[str] = []


@pytest.fixture(scope="module")
def rows():
    conv, unet = default_models(quick=True)
    conv_layouts = [Layout(), Layout(domain=2), Layout(dp=2, domain=2)]
    unet_layouts = [Layout(), Layout(domain=2), Layout(tp=2)]
    return run_suite([conv], conv_layouts, steps=1, warmup=1, log=lambda s: None) + run_suite(
        [unet], unet_layouts, steps=1, warmup=1, log=lambda s: None
    )


def test_suite_covers_models_layouts_and_overlap_settings(rows):
    seen = {(r.model, r.layout, r.overlap) for r in rows}
    assert ("conv_stack/tiny", "dp1 tp1 d2", True) in seen
    assert ("conv_stack/tiny", "dp1 tp1 d2", False) in seen
    assert ("unet/tiny", "dp1 tp2 d1", None) in seen  # tp only where the model declares it
    assert not any(r.model == "conv_stack/tiny" and r.tp > 1 for r in rows)
    assert ("conv_stack/tiny", "dp2 tp1 d2", True) in seen
    assert ("unet/tiny", "dp1 tp1 d2", False) in seen
    for r in rows:
        assert r.step_s > 0 and r.reference_s > 0 and r.efficiency > 0
        assert len(r.step_s_per_rank) == r.ranks


def test_halo_bytes_equal_prediction_and_minimum(rows):
    domain_rows = [r for r in rows if r.domain > 1]
    assert domain_rows
    for r in domain_rows:
        assert r.halo_bytes == r.halo_bytes_predicted == r.halo_bytes_minimum > 0, r
        assert r.halo_bytes_forward + r.halo_bytes_backward == r.halo_bytes
        if r.model == "conv_stack/tiny":  # 2 equal convs: the first's input needs no gradient
            assert r.halo_bytes_backward == r.halo_bytes_forward / 2 > 0
        assert r.p2p_per_exchange == 1.0
    for r in rows:
        if r.domain == 1:
            assert r.halo_bytes == 0 and r.collectives["p2p"] == 0


def test_collectives_by_kind_equal_the_cost_model(rows):
    for r in rows:
        for kind in KINDS:
            assert r.collectives[kind] == r.collectives_predicted[kind], (r.model, r.layout, kind)
    # one statistics all-gather per GroupNorm call in forward (its adjoint all-reduce backward),
    # except for a norm followed by a conv: its statistics travel with the conv's exchange
    conv = next(r for r in rows if r.model == "conv_stack/tiny" and r.domain == 2)
    assert conv.collectives["all_gather"] == 1  # 2 blocks, the first norm linked to conv 2
    assert conv.collectives["all_reduce"] == 1 + 1  # norm adjoint + one gradient bucket


def test_saved_activation_bytes_agree_with_the_cost_model(rows):
    for r in rows:
        # the estimate traces what autograd saves on meta (plus halo rows and the inputs); the
        # measurement also holds what the loss saves: within a third of each other here
        ratio = r.saved_bytes / r.saved_predicted_bytes
        assert 0.75 <= ratio <= 1.4, (r.model, r.layout, ratio)
        assert r.peak_bytes >= r.saved_bytes > 0
    for r in rows:
        if r.domain == 2 and r.dp == 1 and r.model == "conv_stack/tiny":
            # 12 of 24 rows plus a halo row per side and conv: close to half the 1-rank bytes
            assert 0.95 <= r.saved_ratio <= 1.2, r.saved_ratio


def test_overlap_ran_and_targets_are_evaluated(rows):
    targets = evaluate_targets(rows, target_model="conv_stack/tiny")
    by_name = {t["target"].split(" (")[0]: t for t in targets}
    assert by_name["halo bytes per step equal to the theoretical minimum"]["met"]
    assert by_name["one batched call per exchange"]["met"]
    assert all("figures" in t for t in targets)
    table = format_table(rows)
    assert table.count("\n") == len(rows) + 1
    assert "conv_stack/tiny" in table and " on " in table and " off " in table


def test_run_bench_writes_table_json_png_and_markdown(tmp_path, capsys):
    args = argparse.Namespace(
        quick=True,
        output=str(tmp_path / "bench"),
        models="conv_stack/tiny",
        layouts="1x1x1,1x1x2",
        steps=1,
        warmup=1,
        no_memory=True,
        docs=str(tmp_path / "performance.md"),
    )
    assert run_bench(args) == 0
    out = capsys.readouterr().out
    assert "model/size" in out and "dp1 tp1 d2" in out and "[met] one batched call" in out
    data = json.loads((tmp_path / "bench" / "bench.json").read_text())
    assert {r["layout"] for r in data["rows"]} == {"dp1 tp1 d1", "dp1 tp1 d2"}
    assert data["machine"]["cores"] >= 1 and data["loadavg_before"]
    assert (tmp_path / "bench" / "bench.png").stat().st_size > 1000
    page = (tmp_path / "performance.md").read_text()
    assert "## Targets" in page and "credit-parallel bench" in page


def test_bench_rejects_unknown_models_and_bad_layouts(tmp_path):
    base = dict(quick=True, output=str(tmp_path), steps=1, warmup=0, no_memory=True, docs=None)
    with pytest.raises(ValueError, match="unknown"):
        run_bench(argparse.Namespace(models="mlp/huge", layouts=None, **base))
    with pytest.raises(ValueError, match="dp x tp x domain"):
        run_bench(argparse.Namespace(models=None, layouts="2-2", **base))


def test_bench_profile_prints_one_table_per_model_and_layout(capsys):
    args = argparse.Namespace(
        quick=True,
        output=None,
        models="conv_stack/tiny",
        layouts="1x1x2",
        steps=1,
        warmup=1,
        no_memory=True,
        docs=None,
        profile=True,
    )
    assert run_bench(args) == 0
    out = capsys.readouterr().out
    assert "dp1 tp1 d2" in out and "window ms" in out and "comm ms" in out
    rows = {line.split("|")[0].strip(): line for line in out.splitlines() if "|" in line}
    # the conv stack's convolutions exchange halos and its norms reduce statistics
    assert {"conv", "group norm", "all"} <= set(rows)
    comm_ms = float(rows["all"].split("|")[4])
    assert comm_ms > 0.0
