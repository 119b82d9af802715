"""The tolerance that applies under amp: a layout against one process, both under bf16 autocast.

    PYTHONPATH=src .venv/bin/python benchmarks/amp_tolerance.py [--domain 2]

Runs ``verify_layout`` (the demo U-Net at 33 x 64, random batch of 2, float32) on ``domain``
gloo ranks twice, without and with CPU bf16 autocast around both the single-process reference
and the layout, and prints the largest relative error per kind (output, input gradient,
parameter gradients).  The float32 tolerances of ``verify`` (1e-5 / 1e-4) hold without amp;
under amp the figures are bf16 rounding (order 1e-2), documented in ``verify``'s docstring.
"""

from __future__ import annotations

import argparse

import torch

from credit_parallel.testing import run_on_ranks

CONF_MODEL = {
    "type": "unet", "in_channels": 8, "out_channels": 8, "image_height": 33, "image_width": 64,
    "base_channels": 16, "channel_mults": [1, 2, 2], "norm_groups": 4,
}  # fmt: skip


def _worker(rank, world, amp):
    from credit_parallel.tools.verify import verify_layout

    conf = {
        "model": dict(CONF_MODEL),
        "trainer": {"parallelism": {"data": "none", "tensor": 1, "domain": world}},
    }
    ctx = torch.autocast("cpu", dtype=torch.bfloat16, enabled=amp)
    with ctx:
        rows = verify_layout(conf, dtype=torch.float32, batch_size=2)
    out = {}
    for name, err, ref, kind in rows:
        key = "param" if kind == "param" else ("output" if name.startswith("output") else "input")
        out[key] = max(out.get(key, 0.0), err / max(ref, 1e-30))
    return out


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--domain", type=int, default=2)
    args = ap.parse_args(argv)
    torch.set_num_threads(1)
    for amp in (False, True):
        errs = run_on_ranks(_worker, args.domain, amp, timeout=900)[0]
        label = "bf16 autocast" if amp else "float32      "
        print(
            f"{label}: max relative error output {errs['output']:.2e}, input grad "
            f"{errs['input']:.2e}, parameter grads {errs['param']:.2e}"
        )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
