"""Compile cost (issue 33): no recompiles after the first step in every compile variant, and ONE
graph for the whole model where FSDP2 does not apply (a one-rank shard group, SPEC §4).

On one rank with ``{data: fsdp2, amp: true}`` (no ``fully_shard`` there, bf16 autocast), a U-Net
with three resolution levels (its blocks are called at three shapes, what made FSDP2's per-unit
frames recompile per shape and go dynamic): ``torch.compile(parallelize(m))`` and
``parallelize(torch.compile(m))`` capture one graph with no break; those and
``trainer.compile`` (``compile_blocks``: a graph per block) capture nothing new in steps 2-3.
Dynamo's own counters (``torch._dynamo.utils.counters``) count the graphs and the breaks.
"""

from __future__ import annotations

import pytest
import torch
import torch._dynamo  # noqa: F401  (imported once here so forked workers inherit it)

from credit_parallel import parallelize
from credit_parallel.models.unet import UNet
from credit_parallel.testing import run_on_ranks

__all__: list[str] = []

VARIANTS = ("compile(parallelize)", "parallelize(compile)", "trainer.compile")
BACKEND = "aot_eager"  # dynamo's graphs and guards are the backend's input: inductor's too


def _worker(rank, world):
    from torch._dynamo.utils import counters

    from credit_parallel.parallel import compile as compile_mod

    compile_mod.compile_blocks.__kwdefaults__["backend"] = BACKEND  # trainer.compile's backend
    out = {}
    for variant in VARIANTS:
        torch._dynamo.reset()
        counters.clear()
        torch.manual_seed(0)
        model = UNet(4, 4, 24, 32, base_channels=4, channel_mults=(1, 2, 2), norm_groups=2)
        conf = {"trainer": {"parallelism": {"data": "fsdp2", "tensor": 1, "domain": 1}}}
        conf["trainer"].update(amp=True, compile=variant == "trainer.compile")
        if variant == "compile(parallelize)":
            model = torch.compile(parallelize(model, conf), backend=BACKEND)
        elif variant == "parallelize(compile)":
            model = parallelize(torch.compile(model, backend=BACKEND), conf)
        else:
            model = parallelize(model, conf)
        opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
        x = torch.randn(2, 4, 24, 32, generator=torch.Generator().manual_seed(1))
        seen = []
        for _ in range(3):
            model(x).float().square().mean().backward()
            opt.step()
            opt.zero_grad(set_to_none=True)
            seen.append((counters["stats"]["unique_graphs"], sum(counters["graph_break"].values())))
        out[variant] = seen
    return out


@pytest.mark.slow  # three compiles: 20-40 s on the loaded 2-core machine
def test_no_recompile_after_the_first_step_and_one_graph_without_fsdp2():
    (out,) = run_on_ranks(_worker, 1, timeout=600)
    for variant, seen in out.items():
        graphs, breaks = seen[0]
        assert graphs >= 1, (variant, seen)
        assert seen[1:] == [seen[0]] * 2, f"{variant}: recompiled after the first step: {seen}"
        if variant != "trainer.compile":
            assert (graphs, breaks) == (1, 0), (variant, seen)
