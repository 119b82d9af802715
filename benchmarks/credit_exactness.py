"""Measure what miles-credit 2026.2 computes against one process, beside credit-parallel, on CPU
gloo ranks in float64 (figures for docs/credit.md; prints, asserts nothing).

Cases:

* native TP (``apply_native_tensor_parallel``) of ``wxformer_next.Transformer`` (dim 16, depth 2,
  dim_head 4) at tp = 2 and 4: the largest relative error of the position-bias (``dpb.*``)
  gradients and of every other gradient, CREDIT and ours;
* CREDIT's legacy column module ``TpColLinear``: the relative error of the input gradient (its
  backward has no all-reduce over tp), CREDIT and ours (``credit_parallel.TpColLinear``);
* CREDIT's domain-parallel convolutions at domain 2 and 3 on H = 16 (even) and 13 (uneven):
  the relative forward / input-gradient / weight-gradient error, or CREDIT's refusal.

    PYTHONPATH=src:tests .venv/bin/python benchmarks/credit_exactness.py

(``tests`` on the path: miles-credit's model files import packages that are only placeholders
here, see tests/miles_credit.py.)
"""

from __future__ import annotations

import copy

import torch
from torch import nn
from torch.distributed.device_mesh import init_device_mesh

from credit_parallel import (
    DomainParallelConv2d,
    DomainParallelConvTranspose2d,
    DomainParallelManager,
    TpColLinear,
    apply_tensor_parallel,
    gather_tensor,
    shard_tensor,
)
from credit_parallel.testing import run_on_ranks
from miles_credit import import_credit

__all__ = ["main"]


def _rel(a, b) -> float:
    return float((a - b).abs().max() / b.abs().max().clamp_min(1e-300))


def _full(t):
    return t.full_tensor() if hasattr(t, "full_tensor") else t


def _transformer():
    wx = import_credit("credit.models.wxformer.wxformer_next")
    torch.manual_seed(0)
    return wx.Transformer(
        16, local_window_size=2, global_window_size=2, depth=2, dim_head=4
    ).double()


def _tp_worker(rank, world, which):
    credit_tp = import_credit("credit.parallel.tensor_parallel")
    model, reference = _transformer(), _transformer()
    mesh = init_device_mesh("cpu", (world,), mesh_dim_names=("tp",))
    if which == "credit":
        credit_tp.apply_native_tensor_parallel(model, mesh)
    else:
        apply_tensor_parallel(model, mesh)
    g = torch.Generator().manual_seed(1)
    x = torch.randn(2, 16, 8, 4, dtype=torch.float64, generator=g)
    w = torch.randn(2, 16, 8, 4, dtype=torch.float64, generator=g)
    (model(x) * w).sum().backward()
    (reference(x) * w).sum().backward()
    ref = dict(reference.named_parameters())
    # errors relative to the largest reference gradient of the group (a gradient that is zero
    # in exact arithmetic, the last dpb bias before the softmax, has no relative error)
    err = {"dpb": 0.0, "other": 0.0}
    scale = {"dpb": 0.0, "other": 0.0}
    for name, p in model.named_parameters():
        group = "dpb" if ".dpb." in name else "other"
        err[group] = max(err[group], float((_full(p.grad) - ref[name].grad).abs().max()))
        scale[group] = max(scale[group], float(ref[name].grad.abs().max()))
    return err["dpb"] / scale["dpb"], err["other"] / scale["other"]


def _col_worker(rank, world):
    credit_tp = import_credit("credit.parallel.tensor_parallel")
    torch.set_default_dtype(torch.float64)
    group = init_device_mesh("cpu", (world,), mesh_dim_names=("tp",)).get_group()
    torch.manual_seed(0)
    layer = nn.Linear(8, 8)
    g = torch.Generator().manual_seed(1)
    x = torch.randn(3, 8, generator=g)
    grad_out = torch.randn(3, 8, generator=g)
    xr = x.clone().requires_grad_()
    (layer(xr) * grad_out).sum().backward()
    local = grad_out.tensor_split(world, dim=-1)[rank]
    out = []
    for module in (credit_tp.TpColLinear(copy.deepcopy(layer), group), TpColLinear(layer, group)):
        xp = x.clone().requires_grad_()
        (module(xp) * local).sum().backward()
        out.append(_rel(xp.grad, xr.grad))
    return out


def _conv_cases():
    return [
        ("Conv2d k3 s1 p1", lambda: nn.Conv2d(2, 3, 3, padding=1), "conv"),
        ("Conv2d k3 s2 p1", lambda: nn.Conv2d(2, 3, 3, stride=2, padding=1), "conv"),
        ("Conv2d k4 s2 p1", lambda: nn.Conv2d(2, 3, 4, stride=2, padding=1), "conv"),
        ("ConvTranspose2d k2 s2", lambda: nn.ConvTranspose2d(2, 3, 2, stride=2), "convt"),
        ("ConvTranspose2d k4 s2 p1", lambda: nn.ConvTranspose2d(2, 3, 4, 2, padding=1), "convt"),
    ]


def _run_layer(layer, x, w, shard, gather, group):
    """Forward on the shard, each rank's loss its own rows (the domain-parallel loss), input
    gradient gathered, weight gradient summed over the domain group."""
    xl = shard(x).detach().requires_grad_()
    y_local = layer(xl)
    y = gather(y_local.detach())
    if y.shape != w.shape:
        return y, None, None
    (y_local * shard(w)).sum().backward()
    weight = next(layer.parameters())
    gw = _full(weight.grad).clone()
    torch.distributed.all_reduce(gw, group=group)
    return y, gather(xl.grad), gw


def _domain_worker(rank, world, height):
    credit_dp = import_credit("credit.domain_parallel")
    torch.set_default_dtype(torch.float64)
    ours_mgr = DomainParallelManager(world, world)
    theirs_mgr = credit_dp.initialize_domain_parallel(world, world)
    rows = []
    for name, make, kind in _conv_cases():
        torch.manual_seed(0)
        conv = make()
        x = torch.randn(1, 2, height, 6, generator=torch.Generator().manual_seed(2))
        xr = x.clone().requires_grad_()
        y_ref = conv(xr)
        w = torch.randn(y_ref.shape, generator=torch.Generator().manual_seed(5))
        (y_ref * w).sum().backward()
        ref = (y_ref.detach(), xr.grad, conv.weight.grad)
        result = {}
        for who in ("credit", "ours"):
            c = copy.deepcopy(conv)
            c.zero_grad()
            try:
                if who == "credit":
                    cls = (
                        credit_dp.DomainParallelConv2d
                        if kind == "conv"
                        else credit_dp.DomainParallelConvTranspose2d
                    )
                    layer = cls(c)
                    shard = lambda t: credit_dp.shard_tensor(t, -2, theirs_mgr)  # noqa: E731
                    gather = lambda t: credit_dp.gather_tensor(t, -2, theirs_mgr)  # noqa: E731
                    group = theirs_mgr.domain_group
                else:
                    cls = DomainParallelConv2d if kind == "conv" else DomainParallelConvTranspose2d
                    layer = cls(c, manager=ours_mgr)
                    shard = lambda t: shard_tensor(t, -2, ours_mgr)  # noqa: E731
                    gather = lambda t: gather_tensor(t, -2, ours_mgr)  # noqa: E731
                    group = ours_mgr.domain_group
                y, gx, gw = _run_layer(layer, x, w, shard, gather, group)
                if gx is None:
                    result[who] = f"output shape {tuple(y.shape)} != {tuple(ref[0].shape)}"
                else:
                    errors = (_rel(y, ref[0]), _rel(gx, ref[1]), _rel(gw, ref[2]))
                    result[who] = "fwd {:.1e}  dx {:.1e}  dw {:.1e}".format(*errors)
            except Exception as err:  # CREDIT refuses or fails: report it
                result[who] = f"{type(err).__name__}: {str(err).splitlines()[0][:70]}"
        rows.append((name, result["credit"], result["ours"]))
    return rows


def main() -> None:
    print("== native TP, wxformer_next.Transformer (dim 16, depth 2, dim_head 4), float64 ==")
    print("tp  | CREDIT dpb.* grad rel err | CREDIT other | ours dpb.* | ours other")
    for tp in (2, 4):
        c_dpb, c_other = run_on_ranks(_tp_worker, tp, "credit", timeout=600)[0]
        o_dpb, o_other = run_on_ranks(_tp_worker, tp, "ours", timeout=600)[0]
        print(f"{tp}   | {c_dpb:.2e} | {c_other:.2e} | {o_dpb:.2e} | {o_other:.2e}")
    print("\n== column module TpColLinear(8 -> 8), input gradient rel err, float64, tp 2 ==")
    theirs, ours = run_on_ranks(_col_worker, 2)[0]
    print(f"CREDIT {theirs:.2e} | ours {ours:.2e}")
    for world in (2, 3):
        for height in (16, 13):
            print(f"\n== domain conv, domain {world}, H = {height}, rel err (CREDIT | ours) ==")
            for name, theirs, ours in run_on_ranks(_domain_worker, world, height, timeout=600)[0]:
                print(f"{name:26s} | {theirs} | {ours}")


if __name__ == "__main__":
    main()
