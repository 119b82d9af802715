"""Operating a run: plain log lines in batch jobs, ``--resume PATH``, a quiet verify.

* stdout not a terminal (a batch job's log file): one plain line per logged step
  ``step N loss X grad_norm G lr L samples/s S data_wait_ms D data_wait_frac F`` with the numbers of the step's record, no
  progress bar; on a terminal the bar and no plain lines.
* ``train --resume PATH`` continues a run saved under domain 2 (2 ranks) in a new run
  directory on 1 process, and its steps equal an uninterrupted single-process run (float64,
  max abs error <= 1e-10); a bad PATH is a one-line error.
* ``verify`` under {fsdp2, tensor 2} on 4 ranks gathers 2-D sharded gradients, for which
  DTensor logs "N sequential all_gather operations"; that warning is filtered (with a reason,
  see credit_parallel.tools.verify) while torch did try to emit it.
"""

from __future__ import annotations

import io
import logging
import re

import pytest
import torch
import torch._dynamo  # noqa: F401  (imported once here so forked workers inherit it)
import torch.distributed.tensor  # noqa: F401
import yaml

from credit_parallel import cli
from credit_parallel.data import write_sample_dataset
from credit_parallel.testing import run_on_ranks
from credit_parallel.train import main as train_main
from credit_parallel.train.trainer import Trainer
from sample_conf import unet_run_conf

__all__: list[str] = []

TOL = 1e-10
H, W = 17, 32
LINE = re.compile(
    r"^step (\d+) loss (\S+) grad_norm (\S+) lr (\S+) samples/s (\S+) "
    r"data_wait_ms (\S+) data_wait_frac (\S+)$",
    re.MULTILINE,
)


@pytest.fixture(scope="module")
def store(tmp_path_factory):
    path = tmp_path_factory.mktemp("ops") / "s.zarr"
    return str(write_sample_dataset(path, n_times=30, nlat=H, nlon=W))


def _conf(store, parallelism=None, **trainer):
    base = {"steps": 4, "batch_size": 2, "lr": 0.01, "seed": 3, "dtype": "float64"}
    return unet_run_conf(
        store, H, W, time_slice=[0, 28], parallelism=parallelism, **{**base, **trainer}
    )


class _Terminal(io.StringIO):
    def isatty(self) -> bool:
        return True


def test_batch_job_prints_one_plain_line_per_logged_step(store, tmp_path):
    stream = io.StringIO()
    result = train_main.run_training(_conf(store, log_every=2), tmp_path / "run", stream=stream)
    text = stream.getvalue()
    assert "\r" not in text and "it/s" not in text and "step/s" not in text
    lines = LINE.findall(text)
    assert [int(n) for n, *_ in lines] == [2, 4]
    for (n, loss, grad_norm, lr, rate, wait, frac), record in zip(lines, result["history"][1::2]):
        assert int(n) == record["step"]
        assert float(loss) == pytest.approx(record["loss"], rel=1e-5)
        assert float(grad_norm) == pytest.approx(record["grad_norm"], rel=1e-5)
        assert float(lr) == pytest.approx(record["lr"], rel=1e-5)
        assert float(rate) > 0
        assert float(wait) == pytest.approx(record["data_wait_ms"], abs=0.05)
        assert 0 < float(wait) and 0 < float(frac) == pytest.approx(
            record["data_wait_frac"], abs=0.005
        )


def test_terminal_gets_the_progress_bar_and_no_plain_lines(store, tmp_path):
    stream = _Terminal()
    train_main.run_training(_conf(store, steps=2), tmp_path / "run", stream=stream)
    text = stream.getvalue()
    assert "train:" in text and "2/2" in text
    assert not LINE.findall(text)


def _save_domain2(rank, world, store, out):
    conf = _conf(store, {"data": "none", "tensor": 1, "domain": 2}, checkpoint_every=2)
    train_main.run_training(conf, out, progress=False)
    return True


def test_resume_path_from_a_domain2_run_into_a_new_run_directory(store, tmp_path):
    first = tmp_path / "first"
    run_on_ranks(_save_domain2, 2, store, first, timeout=240)
    checkpoint = first / "checkpoints" / "step_00000002"
    assert checkpoint.is_dir()
    config = tmp_path / "conf.yaml"
    config.write_text(yaml.safe_dump(_conf(store, checkpoint_every=2)))
    second = tmp_path / "second"
    argv = ["--config", str(config), "--output", str(second), "--resume", str(checkpoint)]
    assert train_main.main(argv) == 0

    reference = Trainer(_conf(store))
    expected = [reference.train_step() for _ in range(4)][2:]
    metrics = yaml.safe_load((second / "metrics.json").read_text())["train"]
    assert [r["step"] for r in metrics] == [3, 4]
    for got, want in zip(metrics, expected):
        for key in ("loss", "grad_norm", "lr"):
            assert abs(got[key] - want[key]) <= TOL, (got["step"], key)
    # the new run writes its own checkpoints; the old run directory is left as it was
    assert (second / "checkpoints" / "step_00000004").is_dir()
    assert sorted(p.name for p in (first / "checkpoints").iterdir()) == [
        "step_00000002",
        "step_00000004",
    ]

    # a directory of checkpoints resumes from the newest one (step 4 of 6)
    config.write_text(yaml.safe_dump(_conf(store, steps=6)))
    third = tmp_path / "third"
    argv = ["--config", str(config), "--output", str(third), "--resume", str(first / "checkpoints")]
    assert train_main.main(argv) == 0
    steps = [r["step"] for r in yaml.safe_load((third / "metrics.json").read_text())["train"]]
    assert steps == [5, 6]


def test_resume_from_a_directory_without_checkpoints_is_a_clear_error(store, tmp_path):
    trainer = Trainer(_conf(store))
    with pytest.raises(Exception, match="no complete checkpoint"):
        trainer.resume_from(tmp_path)


def test_cli_resume_of_a_missing_path_is_a_one_line_error(store, tmp_path, capsys):
    config = tmp_path / "conf.yaml"
    config.write_text(yaml.safe_dump(_conf(store)))
    missing = str(tmp_path / "nope")
    code = cli.main(["train", "--config", str(config), "--nproc", "1", "--resume", missing])
    err = capsys.readouterr().err.strip()
    assert code == 2 and "--resume" in err and "nope" in err and "\n" not in err


def _verify_worker(rank, world):
    from torch.distributed.tensor import _redistribute

    from credit_parallel.tools.verify import judge, verify_layout

    records = []
    handler = logging.Handler()
    handler.emit = records.append
    logging.getLogger("torch.distributed.tensor._redistribute").addHandler(handler)
    conf = {
        "model": {
            "type": "unet",
            "in_channels": 4,
            "out_channels": 4,
            "image_height": 8,
            "image_width": 8,
            "base_channels": 4,
            "channel_mults": [1, 2],
            "norm_groups": 2,
        },
        "trainer": {"parallelism": {"data": "fsdp2", "tensor": 2, "domain": 1}, "batch_size": 1},
    }
    rows = judge(verify_layout(conf, dtype=torch.float64), torch.float64)
    messages = [r.getMessage() for r in records if "sequential" in r.getMessage()]
    return {
        "passed": all(r[-1] == "PASS" for r in rows),
        "sequential_warnings": messages,
        "torch_tried_to_warn": len(_redistribute._warned_flatten_issues) > 0,
    }


def test_verify_fsdp2_tp2_passes_without_the_sequential_all_gather_warning():
    for out in run_on_ranks(_verify_worker, 4, timeout=240):
        assert out["passed"]
        assert out["torch_tried_to_warn"], "the case no longer provokes the warning"
        assert out["sequential_warnings"] == []
