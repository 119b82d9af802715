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

from credit_parallel.planner import make_plan
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


def _measure(domain: int, batch: int) -> int:
    """The largest rank's peak increase, measured in a fresh interpreter: ranks forked from a
    long-lived test process inherit its heap, whose free resident pages malloc reuses unseen."""
    env = dict(os.environ)
    src = os.path.dirname(os.path.dirname(os.path.abspath(__import__("credit_parallel").__file__)))
    env["PYTHONPATH"] = os.pathsep.join(p for p in (src, env.get("PYTHONPATH")) if p)
    out = subprocess.run(
        [sys.executable, __file__, str(domain), str(batch)],
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
        check=True,
    )
    return json.loads(out.stdout.strip().splitlines()[-1])


@pytest.mark.parametrize("domain", [1, 2])
def test_memory_estimate_growth_matches_measured_peak_growth_within_1_5(domain):
    measured = {b: _measure(domain, b) for b in (1, 3)}
    plans = {b: make_plan(_conf(domain, b), domain).memory for b in (1, 3)}
    grown = measured[3] - measured[1]
    estimated = plans[3].total_bytes - plans[1].total_bytes
    ratio = grown / estimated
    assert 1 / 1.5 <= ratio <= 1.5, (domain, grown, estimated, ratio)
    # the state does not grow with the batch; every activation part does
    assert plans[3].state_bytes == plans[1].state_bytes
    for part in ("activation_bytes", "backward_transient_bytes", "workspace_bytes", "batch_bytes"):
        assert getattr(plans[3], part) == 3 * getattr(plans[1], part) > 0, part


if __name__ == "__main__":  # one measurement: python test_plan_memory.py DOMAIN BATCH
    world, size = int(sys.argv[1]), int(sys.argv[2])
    print(json.dumps(max(run_on_ranks(_peak_increase, world, size, timeout=300))))
