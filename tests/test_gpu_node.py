"""The first hour on a GPU node, proven on a machine without one: the device choice, the launcher
refusal, ``device_id`` under NCCL, verify's determinism settings and the bundled demos' data.

No GPU exists here, so the GPU count is injected (``visible_gpu_count``), ``init_process_group``
and ``torch.cuda.set_device`` are replaced by recorders, and the CUDA-only settings are flags
torch keeps on a CPU build as well.
"""

from __future__ import annotations

import datetime
import os
import re
import shlex

import pytest
import torch
import yaml

from credit_parallel import cli
from credit_parallel.layout import device as device_mod
from credit_parallel.layout import launch
from credit_parallel.layout.device import (
    DEVICE_ENV,
    choose_device,
    deterministic_kernels,
    device_for_process_group,
)
from credit_parallel.tools import verify

__all__: list[str] = []


@pytest.fixture(autouse=True)
def _clean_env(monkeypatch):
    for key in (DEVICE_ENV, "RANK", "WORLD_SIZE", "MASTER_ADDR", "LOCAL_WORLD_SIZE"):
        monkeypatch.delenv(key, raising=False)


# --------------------------------------------------------------------------- the choice
@pytest.mark.parametrize(
    "requested, ranks, gpus, expected",
    [
        ("auto", 1, 0, "cpu"),
        ("auto", 1, 1, "cuda"),
        ("auto", 4, 4, "cuda"),
        ("auto", 4, 8, "cuda"),
        ("auto", 4, 1, "cpu"),  # the README's --nproc 4 on a one-GPU machine: gloo ranks
        ("cpu", 2, 8, "cpu"),
        ("cuda", 2, 2, "cuda"),
    ],
)
def test_device_choice(requested, ranks, gpus, expected):
    assert choose_device(requested, ranks, gpus) == expected


def test_cuda_with_fewer_gpus_than_ranks_names_both_counts_and_the_ways_out():
    with pytest.raises(ValueError) as info:
        choose_device("cuda", 4, 1)
    msg = str(info.value)
    assert "4 local rank(s)" in msg and "1 visible GPU(s)" in msg
    assert "--nproc 1" in msg and "--device cpu" in msg
    with pytest.raises(ValueError, match="--device must be one of"):
        choose_device("gpu", 1, 1)


def test_no_process_group_follows_the_command_lines_choice(monkeypatch):
    assert device_for_process_group() == torch.device("cpu")
    monkeypatch.setenv(DEVICE_ENV, "cuda")
    monkeypatch.setenv("LOCAL_RANK", "0")
    assert device_for_process_group() == torch.device("cuda", 0)
    monkeypatch.setenv(DEVICE_ENV, "cpu")
    assert device_for_process_group() == torch.device("cpu")


# --------------------------------------------------------------------------- the launcher
def _verify_config(tmp_path, domain=2):
    conf = {
        "model": {
            "type": "unet",
            "in_channels": 2,
            "out_channels": 2,
            "image_height": 8,
            "image_width": 8,
        },
        "trainer": {"parallelism": {"data": "none", "tensor": 1, "domain": domain}},
    }
    path = tmp_path / "c.yaml"
    path.write_text(yaml.safe_dump(conf))
    return str(path)


def _no_launch(monkeypatch):
    started = []
    import credit_parallel.tools.launcher as launcher_mod

    def fake_launch(nproc, module, args, **options):
        started.append((nproc, module, os.environ.get(DEVICE_ENV)))
        return 0

    monkeypatch.setattr(launcher_mod, "launch_local", fake_launch)
    return started


def test_nproc_above_the_gpu_count_stops_before_any_rank_starts(tmp_path, monkeypatch, capsys):
    started = _no_launch(monkeypatch)
    monkeypatch.setattr(device_mod, "visible_gpu_count", lambda: 1)
    config = _verify_config(tmp_path)
    rc = cli.main(["verify", "--config", config, "--nproc", "2", "--device", "cuda"])
    err = capsys.readouterr().err.strip()
    assert rc == 2 and started == []
    assert len(err.splitlines()) == 1
    assert "2 local rank(s)" in err and "1 visible GPU(s)" in err and "--device cpu" in err
    # train refuses the same way (its data path exists, so the device is the only problem)
    data = tmp_path / "data.zarr"
    data.mkdir()
    conf = yaml.safe_load(open(config))
    conf["data"] = {"path": str(data)}
    (tmp_path / "t.yaml").write_text(yaml.safe_dump(conf))
    rc = cli.main(
        ["train", "--config", str(tmp_path / "t.yaml"), "--nproc", "2", "--device", "cuda"]
    )
    assert rc == 2 and started == [] and "1 visible GPU(s)" in capsys.readouterr().err


@pytest.mark.parametrize("gpus, expected", [(1, "cpu"), (2, "cuda")])
def test_auto_hands_the_choice_to_the_ranks(tmp_path, monkeypatch, gpus, expected):
    started = _no_launch(monkeypatch)
    monkeypatch.setattr(device_mod, "visible_gpu_count", lambda: gpus)
    assert cli.main(["verify", "--config", _verify_config(tmp_path), "--nproc", "2"]) == 0
    assert started == [(2, "credit_parallel.tools.verify", expected)]


def test_every_device_command_has_the_option():
    parser = cli.build_parser()
    for argv in (["train", "--config", "x"], ["verify", "--config", "x"], ["bench"]):
        assert parser.parse_args(argv).device == "auto"
        assert parser.parse_args([*argv, "--device", "cpu"]).device == "cpu"
    with pytest.raises(SystemExit):
        parser.parse_args(["train", "--config", "x", "--device", "tpu"])


def test_bench_suite_refuses_cuda_and_names_the_gpu_check(capsys):
    assert cli.main(["bench", "--device", "cuda"]) == 2
    assert "bench --gpu" in capsys.readouterr().err


# --------------------------------------------------------------------------- the process group
def _recorded_init(monkeypatch, gpus, requested, local_rank, local_world):
    """``local_world=None``: no LOCAL_WORLD_SIZE (a launcher other than torchrun, e.g. srun)."""
    calls = {"init": [], "set_device": []}
    monkeypatch.setattr(launch.dist, "is_initialized", lambda: False)
    monkeypatch.setattr(
        launch.dist, "init_process_group", lambda *a, **k: calls["init"].append((a, k))
    )
    monkeypatch.setattr(launch, "set_subgroup_timeout", lambda timeout: None)
    monkeypatch.setattr(device_mod, "visible_gpu_count", lambda: gpus)
    monkeypatch.setattr(device_mod.torch.cuda, "set_device", calls["set_device"].append)
    monkeypatch.setenv(DEVICE_ENV, requested)
    monkeypatch.setenv("LOCAL_RANK", str(local_rank))
    if local_world is not None:
        monkeypatch.setenv("LOCAL_WORLD_SIZE", str(local_world))
    monkeypatch.setenv("WORLD_SIZE", "64")  # many nodes: never compared with one node's GPUs
    launch.init_distributed_from_env(60, rendezvous_timeout_s=60)
    return calls


@pytest.mark.parametrize("local_world", [4, None])
def test_nccl_gets_device_id_and_set_device_once(monkeypatch, local_world):
    calls = _recorded_init(
        monkeypatch, gpus=4, requested="auto", local_rank=3, local_world=local_world
    )
    ((args, kwargs),) = calls["init"]
    assert args == ("nccl",) and kwargs["device_id"] == torch.device("cuda", 3)
    assert kwargs["timeout"] == datetime.timedelta(seconds=60)
    assert calls["set_device"] == [torch.device("cuda", 3)]


@pytest.mark.parametrize(
    "gpus, requested, local_world",
    [(0, "auto", 2), (1, "auto", 2), (8, "cpu", 2), (1, "auto", None)],
)
def test_gloo_gets_no_device(monkeypatch, gpus, requested, local_world):
    calls = _recorded_init(
        monkeypatch, gpus=gpus, requested=requested, local_rank=1, local_world=local_world
    )
    ((args, kwargs),) = calls["init"]
    assert args == ("gloo",) and "device_id" not in kwargs and calls["set_device"] == []


def test_one_place_sets_the_cuda_device():
    root = os.path.dirname(os.path.dirname(device_mod.__file__))  # the whole package
    hits = []
    for folder, _, files in os.walk(root):
        for name in files:
            if name.endswith(".py"):
                path = os.path.join(folder, name)
                if "cuda.set_device(" in open(path).read():
                    hits.append(os.path.relpath(path, root))
    assert hits == [os.path.join("layout", "device.py")]


# --------------------------------------------------------------------------- verify on CUDA
def test_verify_pins_determinism_on_cuda_and_restores_it(monkeypatch):
    from credit_parallel.layout.compat import tf32_settings

    cudnn = torch.backends.cudnn
    monkeypatch.setattr(cudnn, "benchmark", True)
    monkeypatch.delenv("CUBLAS_WORKSPACE_CONFIG", raising=False)
    before = tf32_settings()
    assert torch.are_deterministic_algorithms_enabled() is False
    with deterministic_kernels(torch.device("cuda", 0)) as note:
        assert set(tf32_settings().values()) <= {"ieee", False}
        assert torch.are_deterministic_algorithms_enabled()
        assert torch.is_deterministic_algorithms_warn_only_enabled()
        assert cudnn.deterministic is True and cudnn.benchmark is False
        assert os.environ["CUBLAS_WORKSPACE_CONFIG"] == ":4096:8"
        assert "TF32 off" in note and "deterministic algorithms" in note
    assert tf32_settings() == before
    assert torch.are_deterministic_algorithms_enabled() is False
    assert cudnn.benchmark is True and cudnn.deterministic is False
    assert "CUBLAS_WORKSPACE_CONFIG" not in os.environ


def test_legacy_tf32_flags_are_used_where_fp32_precision_is_missing(monkeypatch):
    """torch releases without ``fp32_precision``: the ``allow_tf32`` flags are set and restored."""
    import types

    matmul = types.SimpleNamespace(allow_tf32=True)
    monkeypatch.setattr(torch.backends.cuda, "matmul", matmul)
    monkeypatch.setattr(torch.backends.cudnn, "conv", None, raising=False)
    monkeypatch.setattr(torch.backends.cudnn, "allow_tf32", True)
    with deterministic_kernels("cuda"):
        assert matmul.allow_tf32 is False and torch.backends.cudnn.allow_tf32 is False
    assert matmul.allow_tf32 is True and torch.backends.cudnn.allow_tf32 is True


def test_cpu_verify_changes_nothing():
    before = (torch.are_deterministic_algorithms_enabled(), torch.backends.cudnn.benchmark)
    with deterministic_kernels("cpu") as note:
        assert note is None
        assert (
            torch.are_deterministic_algorithms_enabled(),
            torch.backends.cudnn.benchmark,
        ) == before


def test_verify_header_names_device_and_determinism():
    rows = verify.judge([("output y", 0.0, 1.0, "out")], torch.float32)
    table = verify.format_table(
        rows, {"domain": 1}, 1, torch.float32, torch.device("cuda", 0), "TF32 off (matmul, cuDNN)"
    )
    header = table.splitlines()[0]
    assert "on cuda:0" in header and "determinism: TF32 off" in header


# --------------------------------------------------------------------------- the demos' data
DEMOS = sorted(
    name[: -len(".yaml")]
    for name in os.listdir(os.path.join(os.path.dirname(cli.__file__), "configs"))
    if name.startswith("demo_") and name.endswith(".yaml")
)


@pytest.mark.parametrize("demo", DEMOS)
def test_each_demo_runs_after_the_command_its_error_names(demo, tmp_path, monkeypatch, capsys):
    from credit_parallel.data.dataset import dataset_from_conf
    from credit_parallel.layout.config import load_config

    monkeypatch.chdir(tmp_path)
    assert cli.main(["train", "--config", demo, "--steps", "1"]) == 2
    err = capsys.readouterr().err
    command = re.search(r"`(credit-parallel sample-data[^`]*)`", err)
    assert command, err
    argv = shlex.split(command.group(1))[1:]
    assert cli.main(argv) == 0
    conf = load_config(cli.resolve_config(demo))
    model = conf["model"]
    for split in ("train", "valid"):
        ds = dataset_from_conf(conf, split)
        sample = ds[len(ds) - 1]
        assert sample["x"].shape[-2:] == (model["image_height"], model["image_width"])
        assert sample["x"].shape[0] == model["in_channels"], split


# --------------------------------------------------------------------------- the node check
def _variants_worker(rank, world):
    from credit_parallel.tools.bench.overhead import VARIANTS, build_step

    block = {
        "type": "crossformer", "in_channels": 2, "out_channels": 2, "image_height": 16,
        "image_width": 16, "dims": [8, 16], "depths": [1, 1], "dim_head": 4,
    }  # fmt: skip
    ran = []
    for variant in VARIANTS:
        step = build_step(variant, block, torch.device("cpu"), amp=False)
        step()
        step()
        ran.append(variant)
    return sorted(ran)


def test_every_overhead_variant_runs_a_step_on_one_rank():
    from credit_parallel.testing import run_on_ranks
    from credit_parallel.tools.bench.overhead import VARIANTS

    assert run_on_ranks(_variants_worker, 1) == [sorted(VARIANTS)]


def test_node_check_reports_the_environment_and_one_table_shape():
    from credit_parallel.tools.bench import node_check

    line = node_check.environment_line("cpu")
    assert line.startswith("environment: no GPU") and torch.__version__ in line
    rows = [("unet", "8x8", "plain", "1.0", "-", "-"), ("unet", "8x8", "library", "2.0", "-", "-")]
    table = node_check.format_rows(rows).splitlines()
    assert table[0].split()[:3] == ["model", "size", "variant"] and len(table) == 3
    assert node_check.main(["--bad"]) == 2


def test_node_check_rows_come_as_measured_and_a_compiler_failure_is_a_row(monkeypatch, capsys):
    """A variant the compiler rejects (as inductor did on the H200 before the layout fix)
    becomes "failed" in the table; the eager rows were printed before any compile started."""
    from credit_parallel.tools.bench import node_check
    from credit_parallel.tools.bench.overhead import Figure

    def fake_measure(block, variants, *, compiled=False, **kw):
        if compiled and variants == ("library",):
            raise AssertionError("expected size 64==64, stride 16==1 at dim=1\nmore")
        return [Figure(v, 2.0 if compiled else 1.0, None, []) for v in variants]

    monkeypatch.setattr(node_check, "measure_variants", fake_measure)
    monkeypatch.setattr(node_check, "compile_available", lambda: True)
    emitted = []
    rows = node_check.step_rows(
        "cpu", "cpu", steps=1, warmup=0, rounds=1, domains=[], emit=emitted.append
    )
    n = len(node_check.TABLE_VARIANTS)
    # per model: the eager rows first, then one row per compiled variant, as measured
    assert [r[2] for r in emitted[: n + 2]] == [*node_check.TABLE_VARIANTS, "plain", "library"]
    assert [r[5] for r in emitted[:n]] == ["(next)"] * n
    by_variant = {r[2]: r for r in rows if r[0] == "crossformer"}
    assert by_variant["plain"][3:] == ("1.0", "-", "2.0")
    assert by_variant["library"][3:] == ("1.0", "-", "failed")
    assert by_variant["torch fsdp2 root"][5] == "-"
    assert (
        "compiled library failed: AssertionError: expected size 64==64" in capsys.readouterr().out
    )
