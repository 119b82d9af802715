"""The planner's per-rank memory estimate against a measured peak: a small U-Net trained for two
steps (AdamW) on 1 and 2 domain ranks, peak resident memory read from the kernel (``VmHWM`` after
resetting it through ``/proc/self/clear_refs``).  The framework's own per-process memory (torch's
kernels and caches, the same at any batch) is not in the estimate, so the test compares the
growth from batch 1 to batch 3: measured growth / estimated growth must lie within a factor 1.5."""

import gc
import json
import os
import subprocess
import sys

import pytest
import torch

from credit_parallel.planner import format_plan, make_plan
from credit_parallel.testing import run_on_ranks

UNET = {
    "type": "unet",
    "in_channels": 4,
    "out_channels": 4,
    "image_height": 96,
    "image_width": 128,
    "base_channels": 16,
    "channel_mults": [1, 2, 2],
    "norm_groups": 4,
    "mlp_ratio": 2,
}


def _conf(domain: int, batch: int) -> dict:
    parallelism = {"data": "none", "tensor": 1, "domain": domain}
    return {"model": UNET, "trainer": {"parallelism": parallelism, "batch_size": batch}}


def _status_bytes(key: str) -> int:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(key + ":"):
                return int(line.split()[1]) * 1024
    raise KeyError(key)


def _peak_increase(rank, world, batch):
    """Peak resident bytes above the start of this rank: model, optimizer, data, two steps."""
    from credit_parallel.data import register_row_batch
    from credit_parallel.domain.rows import shard_sizes
    from credit_parallel.models import build_model
    from credit_parallel.parallel.composition import get_domain_manager, parallelize

    torch.set_num_threads(1)
    gc.collect()
    start = _status_bytes("VmRSS")
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")  # reset the peak (VmHWM) to the current resident size
    torch.manual_seed(0)
    model = parallelize(build_model(UNET), _conf(world, batch))
    manager = get_domain_manager(model)
    height, width = UNET["image_height"], UNET["image_width"]
    rows = shard_sizes(height, world)[rank]
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    for _ in range(2):  # the second step holds the AdamW moments
        batch_ = {k: torch.randn(batch, 4, rows, width) for k in ("x", "y")}
        if manager is not None:
            register_row_batch(batch_, height, manager=manager)
        optimizer.zero_grad(set_to_none=True)
        loss = ((model(batch_["x"]) - batch_["y"]) ** 2).mean()
        loss.backward()
        optimizer.step()
        del batch_, loss
    return _status_bytes("VmHWM") - start


_CASES = ((1, 1), (1, 3), (2, 1), (2, 3))  # (domain, batch)


@pytest.fixture(scope="module")
def measured() -> dict:
    """``{(domain, batch): the largest rank's peak increase}``, measured in ONE fresh interpreter
    that forks the ranks of each case in turn: ranks forked from a long-lived test process
    inherit its heap, whose free resident pages malloc reuses unseen, while this interpreter
    only imports and forks (its heap is the same at every fork; the ranks import and train)."""
    env = dict(os.environ)
    src = os.path.dirname(os.path.dirname(os.path.abspath(__import__("credit_parallel").__file__)))
    env["PYTHONPATH"] = os.pathsep.join(p for p in (src, env.get("PYTHONPATH")) if p)
    out = subprocess.run(
        [sys.executable, __file__, json.dumps(_CASES)],
        env=env,
        capture_output=True,
        text=True,
        timeout=600,
        check=True,
    )
    peaks = json.loads(out.stdout.strip().splitlines()[-1])
    return {case: peak for case, peak in zip(_CASES, peaks, strict=True)}


@pytest.mark.parametrize("domain", [1, 2])
def test_memory_estimate_growth_matches_measured_peak_growth_within_1_5(domain, measured):
    # measured on the CPU: the im2col columns PyTorch's CPU convolution allocates count
    plans = {b: make_plan(_conf(domain, b), domain, device="cpu").memory for b in (1, 3)}
    grown = measured[(domain, 3)] - measured[(domain, 1)]
    estimated = plans[3].total_bytes - plans[1].total_bytes
    ratio = grown / estimated
    assert 1 / 1.5 <= ratio <= 1.5, (domain, grown, estimated, ratio)
    # the state does not grow with the batch; every activation part does
    assert plans[3].state_bytes == plans[1].state_bytes
    for part in ("activation_bytes", "backward_transient_bytes", "workspace_bytes", "batch_bytes"):
        assert getattr(plans[3], part) == 3 * getattr(plans[1], part) > 0, part


# --------------------------------------------------------------------------- conv workspace
def _largest_cpu_allocation(model: torch.nn.Module, x: torch.Tensor) -> int:
    """The largest single buffer ``aten::empty`` allocates in a forward + backward on the CPU."""
    with torch.profiler.profile(
        activities=[torch.profiler.ProfilerActivity.CPU], profile_memory=True
    ) as prof:
        model(x).sum().backward()
    return max(e.cpu_memory_usage for e in prof.events() if e.name == "aten::empty")


_CONV_CASES = {
    # (conv, im2col bytes at batch 2 on 32 x 40, float64): C_in/groups x kernel x positions
    "5x5": (lambda: torch.nn.Conv2d(4, 6, 5, padding=2), 2 * 4 * 25 * 32 * 40 * 8),
    "grouped": (lambda: torch.nn.Conv2d(4, 8, 5, padding=2, groups=2), 2 * 2 * 25 * 32 * 40 * 8),
    "strided": (lambda: torch.nn.Conv2d(4, 8, 4, stride=4), 2 * 4 * 16 * 8 * 10 * 8),
    "1x1": (lambda: torch.nn.Conv2d(4, 8, 1), 0),  # a view of the input: no columns
}


def _conv_plan(conv, device):
    conf = {"trainer": {"parallelism": {"data": "none", "tensor": 1, "domain": 1}, "batch_size": 2}}
    model = torch.nn.Sequential(conv).double()
    return make_plan(conf, 1, model=model, input_shapes=[(4, 32, 40)], device=device)


@pytest.mark.parametrize("case", sorted(_CONV_CASES))
def test_cpu_conv_workspace_is_the_im2col_buffer_pytorch_allocates(case):
    make, columns = _CONV_CASES[case]
    torch.manual_seed(0)
    conv = make().double()
    memory = _conv_plan(conv, "cpu").memory
    assert memory.workspace_device == "cpu"
    assert memory.workspace_bytes == memory.im2col_bytes == columns
    # float64 runs PyTorch's slow_conv2d: its largest buffer is the whole batch's columns (or,
    # for the 1x1 kernel, the output)
    x = torch.randn(2, 4, 32, 40, dtype=torch.float64, requires_grad=True)
    out_bytes = conv(x).numel() * 8
    assert _largest_cpu_allocation(conv, x) == max(columns, out_bytes)


def test_cuda_conv_workspace_counts_cudnns_bounded_workspace_and_says_which():
    make, columns = _CONV_CASES["5x5"]
    cpu, cuda = _conv_plan(make(), "cpu"), _conv_plan(make(), "cuda")
    assert cuda.memory.workspace_device == "cuda" and cuda.memory.workspace_bytes == 0
    assert cuda.memory.im2col_bytes == columns
    assert cpu.memory.total_bytes - cuda.memory.total_bytes == columns
    assert cuda.memory.total_on("cpu") == cpu.memory.total_bytes
    assert cpu.memory.total_on("cuda") == cuda.memory.total_bytes
    gpu_text, cpu_text = format_plan(cuda), format_plan(cpu)
    (line,) = [x for x in gpu_text.splitlines() if x.startswith("conv workspace")]
    assert "0 B  counted for cuda: cuDNN's workspace is bounded by the memory free" in line
    assert "im2col columns, 1.95 MiB (--device cpu)" in line
    (line,) = [x for x in cpu_text.splitlines() if x.startswith("conv workspace")]
    assert "1.95 MiB  counted for cpu: the largest convolution's im2col columns" in line
    assert "peak of a step on cuda; with --device cpu:" in gpu_text
    assert "peak of a step on cpu; with --device cuda:" in cpu_text


def test_plan_device_auto_follows_the_visible_gpus(monkeypatch):
    import credit_parallel.layout.device as device
    from credit_parallel.planner.make import resolve_plan_device

    monkeypatch.setattr(device, "visible_gpu_count", lambda: 0)
    assert resolve_plan_device("auto") == "cpu"
    monkeypatch.setattr(device, "visible_gpu_count", lambda: 4)
    assert resolve_plan_device("auto") == "cuda" and resolve_plan_device("cpu") == "cpu"
    with pytest.raises(ValueError, match="auto, cuda, cpu"):
        resolve_plan_device("tpu")


def test_plan_command_counts_for_the_device_it_is_given(capsys):
    from credit_parallel.cli import main

    assert main(["plan", "--config", "demo", "--world-size", "2", "--device", "cuda"]) == 0
    out = capsys.readouterr().out
    assert "counted for cuda" in out and "peak of a step on cuda" in out
    assert main(["plan", "--config", "demo", "--world-size", "2", "--device", "cpu"]) == 0
    assert "counted for cpu" in capsys.readouterr().out


if __name__ == "__main__":  # python test_plan_memory.py '[[DOMAIN, BATCH], ...]'
    cases = json.loads(sys.argv[1])
    print(json.dumps([max(run_on_ranks(_peak_increase, w, b, timeout=300)) for w, b in cases]))
