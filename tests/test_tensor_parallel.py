"""Tensor parallelism: plan building, errors, and exactness against the single-process model.

Every parity test seeds the model identically on each rank, keeps an unconverted deep copy as the
reference in the same worker, and compares forward output, input gradient and every parameter
gradient (DTensor gradients gathered with ``full_tensor()``).
"""

from __future__ import annotations

import copy
import math

import pytest
import torch
import torch._dynamo  # noqa: F401  (see below)
import torch.distributed.checkpoint as dcp
import torch.nn as nn
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import DTensor, Replicate, Shard
from torch.distributed.tensor.parallel import ColwiseParallel

from credit_parallel import apply_tensor_parallel, build_device_mesh
from credit_parallel.parallel.tensor_parallel import (
    ColwiseProjectionParallel,
    RowwiseProjectionParallel,
    TensorParallelProjection,
    build_tensor_parallel_plan,
    tp_replicated_parameters,
)
from credit_parallel.testing import run_on_ranks

__all__: list[str] = []

# DTensor imports torch._dynamo lazily on first use; importing it here, in the parent, lets every
# forked rank inherit it instead of paying seconds per rank for the import.


# ------------------------------------------------------------------------------------------
# TP-ready model blocks.
# ------------------------------------------------------------------------------------------


class LinearMLP(nn.Module):
    """Pre-norm residual MLP: Linear (col) -> GELU -> Linear (row)."""

    _tp_col = "ff.0"
    _tp_row = "ff.2"

    def __init__(self, dim=8, hidden=16, bias=True):
        super().__init__()
        self.norm = nn.LayerNorm(dim)
        self.ff = nn.Sequential(
            nn.Linear(dim, hidden, bias=bias), nn.GELU(), nn.Linear(hidden, dim, bias=bias)
        )

    def forward(self, x):
        return x + self.ff(self.norm(x))


class ConvMLP(nn.Module):
    """A 3x3 stem (replicated) then 1x1 conv (col) -> SiLU -> 1x1 conv (row), residual."""

    _tp_col = ["mlp.0"]
    _tp_row = ("mlp.2",)

    def __init__(self, channels=4, hidden=8, bias=True):
        super().__init__()
        self.stem = nn.Conv2d(channels, channels, 3, padding=1)
        self.mlp = nn.Sequential(
            nn.Conv2d(channels, hidden, 1, bias=bias),
            nn.SiLU(),
            nn.Conv2d(hidden, channels, 1, bias=bias),
        )

    def forward(self, x):
        h = self.stem(x)
        return h + self.mlp(h)


class FusedAttention(nn.Module):
    """Self-attention with a fused q|k|v projection.

    TP-ready: the head count is derived from the projection width at run time
    (``heads = width // head_dim``), so after conversion each tp rank runs heads/tp whole heads.
    """

    _tp_col = "to_qkv"
    _tp_row = "proj"
    _tp_fused = {"to_qkv": 3}

    def __init__(self, dim=32, head_dim=8):
        super().__init__()
        self.head_dim = head_dim
        self._tp_head_dim = head_dim
        self.to_qkv = nn.Linear(dim, 3 * dim)
        self.proj = nn.Linear(dim, dim)

    def forward(self, x):  # (B, N, dim)
        q, k, v = self.to_qkv(x).chunk(3, dim=-1)
        heads = q.shape[-1] // self.head_dim

        def split_heads(t):
            return t.unflatten(-1, (heads, self.head_dim)).transpose(1, 2)

        q, k, v = split_heads(q), split_heads(k), split_heads(v)
        scores = (q @ k.transpose(-2, -1)) / math.sqrt(self.head_dim)
        out = scores.softmax(dim=-1) @ v
        return self.proj(out.transpose(1, 2).flatten(-2))


class AttentionBlock(nn.Module):
    def __init__(self, dim=32, head_dim=8):
        super().__init__()
        self.norm = nn.LayerNorm(dim)
        self.attn = FusedAttention(dim, head_dim)

    def forward(self, x):
        return x + self.attn(self.norm(x))


class GatedConvMLP(nn.Module):
    """Fused 1x1 conv k|v (2 parts) -> k * sigmoid(v) -> 1x1 conv (row).

    The gate pairs channel c of k with channel c of v, so it is only right when every tp rank
    holds the same channel slice of both parts.
    """

    _tp_col = "to_kv"
    _tp_row = "out"
    _tp_fused = {"to_kv": 2}

    def __init__(self, channels=4, hidden=8):
        super().__init__()
        self.to_kv = nn.Conv2d(channels, 2 * hidden, 1)
        self.out = nn.Conv2d(hidden, channels, 1)

    def forward(self, x):
        k, v = self.to_kv(x).chunk(2, dim=1)
        return self.out(k * torch.sigmoid(v))


class UnfusedAttentionBlock(AttentionBlock):
    """Negative control: the same weights split as if q|k|v were one block (heads mixed)."""

    def __init__(self, dim=32, head_dim=8):
        super().__init__(dim, head_dim)
        self.attn._tp_fused = {"to_qkv": 1}


CASES = {
    "linear_bias": (lambda: LinearMLP(bias=True), (3, 4, 8)),
    "linear_nobias": (lambda: LinearMLP(bias=False), (3, 4, 8)),
    "conv1x1_bias": (lambda: ConvMLP(bias=True), (2, 4, 5, 6)),
    "conv1x1_nobias": (lambda: ConvMLP(bias=False), (2, 4, 5, 6)),
    "fused_qkv_attention": (lambda: AttentionBlock(dim=32, head_dim=8), (2, 5, 32)),
    "fused_kv_conv1x1": (lambda: GatedConvMLP(), (2, 4, 3, 5)),
    "unfused_attention_control": (lambda: UnfusedAttentionBlock(dim=32, head_dim=8), (2, 5, 32)),
}


# ------------------------------------------------------------------------------------------
# Workers.
# ------------------------------------------------------------------------------------------


def _tp_mesh(layout):
    """(tp submesh, dp rank) for the 1-D "tp2" layout or the (2, 2) "dp2xtp2" layout."""
    if layout == "tp2":
        _, sub = build_device_mesh({"data": "none", "tensor": 2, "domain": 1}, device="cpu")
        return sub["tp"], 0
    _, sub = build_device_mesh({"data": "fsdp2", "tensor": 2, "domain": 1}, device="cpu")
    return sub["tp"], sub["dp"].get_local_rank()


def _max_err(a, b, relative):
    err = (a.detach() - b.detach()).abs().max().item()
    return err / b.detach().abs().max().item() if relative else err


def _full(t):
    return t.full_tensor() if isinstance(t, DTensor) else t


def _parity_worker(rank, world, case, layout, dtype):
    tp_mesh, dp_rank = _tp_mesh(layout)
    factory, shape = CASES[case]
    torch.manual_seed(0)
    model = factory().to(dtype)
    reference = copy.deepcopy(model)
    apply_tensor_parallel(model, tp_mesh)

    # Inputs differ between dp ranks and agree within a tp group (the sampler contract).
    gen = torch.Generator().manual_seed(100 + dp_rank)
    x = torch.randn(shape, generator=gen, dtype=dtype)
    x_ref = x.clone().requires_grad_(True)
    x = x.requires_grad_(True)
    out_ref = reference(x_ref)
    out = model(x)
    grad_out = torch.randn(out_ref.shape, generator=gen, dtype=dtype)
    out_ref.backward(grad_out)
    out.backward(grad_out)

    relative = dtype == torch.float32
    ref_params = dict(reference.named_parameters())
    param_errors, dtensor_params = {}, {}
    for name, param in model.named_parameters():
        assert param.grad is not None, name
        if isinstance(param, DTensor):
            assert isinstance(param.grad, DTensor), name
            assert param.grad.placements == param.placements, name
            dtensor_params[name] = (tuple(param.to_local().shape), tuple(param.placements))
        param_errors[name] = _max_err(_full(param.grad), ref_params[name].grad, relative)
    assert set(param_errors) == set(ref_params)
    return {
        "out": _max_err(out, out_ref, relative),
        "input_grad": _max_err(x.grad, x_ref.grad, relative),
        "params": param_errors,
        "dtensor_params": dtensor_params,
        "output_type": type(out).__name__,
        "reference_sum": out_ref.sum().item(),
    }


def _check_parity(results, out_tol, param_tol):
    for res in results:
        assert res["output_type"] == "Tensor"  # plain tensors leave a tp pair
        assert res["dtensor_params"], "nothing was converted"
        assert res["out"] <= out_tol, res
        assert res["input_grad"] <= out_tol, res
        assert max(res["params"].values()) <= param_tol, res


PARITY_CASES = [c for c in CASES if c != "unfused_attention_control"]


# ------------------------------------------------------------------------------------------
# Parity: 2 tp ranks, and (2, 2) dp x tp on 4 ranks.
# ------------------------------------------------------------------------------------------


@pytest.mark.parametrize("case", PARITY_CASES)
def test_tp2_float64_matches_single_process(case):
    results = run_on_ranks(_parity_worker, 2, case, "tp2", torch.float64)
    _check_parity(results, 1e-10, 1e-10)


@pytest.mark.parametrize("case", PARITY_CASES)
def test_dp2_x_tp2_mesh_float64_matches_single_process(case):
    results = run_on_ranks(_parity_worker, 4, case, "dp2xtp2", torch.float64)
    _check_parity(results, 1e-10, 1e-10)
    # Ranks (0, 1) and (2, 3) are tp groups: same batch within a group, another across dp.
    sums = [res["reference_sum"] for res in results]
    assert sums[0] == sums[1] and sums[2] == sums[3] and sums[0] != sums[2]


def test_tp2_float32_fused_attention_within_relative_tolerance():
    results = run_on_ranks(_parity_worker, 2, "fused_qkv_attention", "tp2", torch.float32)
    _check_parity(results, 1e-5, 1e-4)


def test_tp2_float32_conv1x1_within_relative_tolerance():
    results = run_on_ranks(_parity_worker, 2, "conv1x1_bias", "tp2", torch.float32)
    _check_parity(results, 1e-5, 1e-4)


def test_fused_attention_heads_kept_whole_and_mixing_them_is_detected():
    # The per-part split keeps each head on one rank; the same weights split as one block mix
    # q, k and v across ranks and visibly change the result (so the parity test can fail).
    results = run_on_ranks(_parity_worker, 2, "unfused_attention_control", "tp2", torch.float64)
    assert all(res["out"] > 1e-3 for res in results), results
    local = results[0]["dtensor_params"]
    assert local["attn.to_qkv.weight"] == ((48, 32), (Shard(0),))
    assert local["attn.proj.weight"] == ((32, 16), (Shard(1),))


# ------------------------------------------------------------------------------------------
# Parameters: names, shapes, placements, local slices; row bias added once.
# ------------------------------------------------------------------------------------------


def _layout_worker(rank, world, case):
    tp_mesh, _ = _tp_mesh("tp2")
    factory, shape = CASES[case]
    torch.manual_seed(0)
    model = factory().double()
    original = {k: v.clone() for k, v in model.state_dict().items()}
    apply_tensor_parallel(model, tp_mesh)
    state = model.state_dict()
    info = {"keys": list(state), "original_keys": list(original), "params": {}}
    for name, value in state.items():
        if isinstance(value, DTensor):
            info["params"][name] = {
                "global_shape": tuple(value.shape),
                "original_shape": tuple(original[name].shape),
                "full_equal": torch.equal(value.full_tensor(), original[name]),
                "local": value.to_local().clone(),
                "placements": tuple(value.placements),
                "mesh_dims": value.device_mesh.mesh_dim_names,
            }
        else:
            assert torch.equal(value, original[name]), name
    info["replicated"] = [n for n, _ in tp_replicated_parameters(model)]
    info["original"] = original
    info["types"] = {n: type(m).__name__ for n, m in model.named_modules()}
    return info


@pytest.mark.parametrize("case", ["linear_bias", "conv1x1_bias", "fused_qkv_attention"])
def test_state_dict_keys_and_full_shapes_unchanged(case):
    for t, info in enumerate(run_on_ranks(_layout_worker, 2, case)):
        assert info["keys"] == info["original_keys"]
        assert info["params"], "nothing was converted"
        for name, p in info["params"].items():
            assert p["global_shape"] == p["original_shape"], name
            assert p["full_equal"], name
            assert p["mesh_dims"] == ("tp",), name
            full = info["original"][name]
            if p["placements"] == (Replicate(),):
                assert name.endswith("bias") and torch.equal(p["local"], full)
            elif p["placements"] == (Shard(1),):
                assert torch.equal(p["local"], full.chunk(2, dim=1)[t]), name
            else:
                assert p["placements"] == (Shard(0),), name
                assert torch.equal(p["local"], full.chunk(2, dim=0)[t]), name


def test_layouts_per_layer_kind():
    info = run_on_ranks(_layout_worker, 2, "linear_bias")[0]
    assert info["params"]["ff.0.weight"]["placements"] == (Shard(0),)
    assert info["params"]["ff.0.bias"]["placements"] == (Shard(0),)
    assert info["params"]["ff.2.weight"]["placements"] == (Shard(1),)
    assert info["params"]["ff.2.bias"]["placements"] == (Replicate(),)
    assert info["types"]["ff.0"] == "Linear"  # column nn.Linear: PyTorch's ColwiseParallel
    assert info["types"]["ff.2"] == "TensorParallelProjection"
    assert sorted(info["replicated"]) == ["norm.bias", "norm.weight"]
    info = run_on_ranks(_layout_worker, 2, "conv1x1_bias")[0]
    assert info["types"]["mlp.0"] == info["types"]["mlp.2"] == "TensorParallelProjection"
    assert info["params"]["mlp.0.weight"]["local"].shape == (4, 4, 1, 1)
    assert info["params"]["mlp.2.weight"]["local"].shape == (4, 4, 1, 1)
    assert info["params"]["mlp.2.bias"]["placements"] == (Replicate(),)
    assert sorted(info["replicated"]) == ["stem.bias", "stem.weight"]


def _bare_pair(layer_type, width, hidden):
    """col -> GELU -> row with no residual, declared on the instance."""
    pair = nn.Sequential(layer_type(width, hidden), nn.GELU(), layer_type(hidden, width))
    pair._tp_col, pair._tp_row = "0", "2"
    return pair


def _bias_once_worker(rank, world, case):
    # tp = 3: bias shares bias/3 summed over the ranks are not bit-equal to the bias itself.
    tp_mesh = init_device_mesh("cpu", (3,), mesh_dim_names=("tp",))
    torch.manual_seed(0)
    if case == "linear":
        model, shape = _bare_pair(nn.Linear, 48, 12).double(), (2, 4, 48)
    else:
        model, shape = _bare_pair(lambda i, o: nn.Conv2d(i, o, 1), 48, 12).double(), (2, 48, 3, 4)
    bias = 0.1 * torch.randn(48, dtype=torch.float64)
    third = bias / 3
    shares_differ = not torch.equal(third + third + third, bias)
    with torch.no_grad():
        for p in model.parameters():
            p.zero_()
        model[2].bias.copy_(bias)
    reference = copy.deepcopy(model)
    apply_tensor_parallel(model, tp_mesh)
    x = torch.randn(shape, dtype=torch.float64)
    # Only the row bias is non-zero: the converted pair must add it exactly once.
    return shares_differ, torch.equal(model(x), reference(x))


@pytest.mark.parametrize("case", ["linear", "conv1x1"])
def test_row_bias_added_once_at_tp3(case):
    for shares_differ, equal in run_on_ranks(_bias_once_worker, 3, case):
        assert shares_differ  # the check below can tell "once" from "in three shares"
        assert equal


# ------------------------------------------------------------------------------------------
# Checkpoints move between tp sizes (DCP), FSDP2 on top of TP.
# ------------------------------------------------------------------------------------------


def _dcp_save_worker(rank, world, path):
    tp_mesh, _ = _tp_mesh("tp2")
    torch.manual_seed(0)
    model = AttentionBlock(dim=32, head_dim=8).double()
    apply_tensor_parallel(model, tp_mesh)
    dcp.save(model.state_dict(), checkpoint_id=path)


def _dcp_load_tp4_worker(rank, world, path):
    tp_mesh = init_device_mesh("cpu", (4,), mesh_dim_names=("tp",))
    torch.manual_seed(0)
    reference = AttentionBlock(dim=32, head_dim=8).double()
    torch.manual_seed(1)  # different weights: everything must come from the checkpoint
    model = AttentionBlock(dim=32, head_dim=8).double()
    apply_tensor_parallel(model, tp_mesh)
    state = model.state_dict()
    dcp.load(state, checkpoint_id=path)
    model.load_state_dict(state)
    x = torch.randn(2, 5, 32, generator=torch.Generator().manual_seed(3), dtype=torch.float64)
    return _max_err(model(x), reference(x), relative=False)


def test_dcp_checkpoint_from_tp2_loads_unsharded_and_at_tp4(tmp_path):
    path = str(tmp_path / "ckpt")
    run_on_ranks(_dcp_save_worker, 2, path)
    torch.manual_seed(0)
    original = AttentionBlock(dim=32, head_dim=8).double().state_dict()
    loaded = {k: torch.zeros_like(v) for k, v in original.items()}
    dcp.load(loaded, checkpoint_id=path, no_dist=True)
    for key, value in original.items():
        assert torch.equal(loaded[key], value), key
    assert max(run_on_ranks(_dcp_load_tp4_worker, 4, path)) <= 1e-10


def _fsdp2_worker(rank, world, case):
    from torch.distributed.fsdp import fully_shard

    _, sub = build_device_mesh({"data": "fsdp2", "tensor": 2, "domain": 1}, device="cpu")
    factory, shape = CASES[case]
    torch.manual_seed(0)
    model = factory().double()
    reference = copy.deepcopy(model)
    originals = {k: v.clone() for k, v in model.state_dict().items()}
    apply_tensor_parallel(model, sub["tp"])
    tp_params = {n for n, p in model.named_parameters() if isinstance(p, DTensor)}
    fully_shard(model, mesh=sub["dp"])

    def batch(dp_rank):
        gen = torch.Generator().manual_seed(200 + dp_rank)
        x = torch.randn(shape, generator=gen, dtype=torch.float64)
        return x, torch.randn(reference(x).shape, generator=gen, dtype=torch.float64)

    x, grad_out = batch(sub["dp"].get_local_rank())
    x.requires_grad_(True)
    out = model(x)
    out.backward(grad_out)
    x_ref = x.detach().clone().requires_grad_(True)
    out_err = _max_err(out, reference(x_ref), relative=False)
    (reference(x_ref) * grad_out).sum().backward()
    input_err = _max_err(x.grad, x_ref.grad, relative=False)
    # FSDP2 averages parameter gradients over dp: the reference is the mean over both batches.
    reference.zero_grad()
    for dp_rank in range(2):
        xr, gr = batch(dp_rank)
        (reference(xr) * gr / 2).sum().backward()
    errors, meshes = {}, {}
    ref_params = dict(reference.named_parameters())
    for name, param in model.named_parameters():
        assert torch.equal(param.full_tensor(), originals[name]), name
        meshes[name] = param.device_mesh.mesh_dim_names
        errors[name] = _max_err(param.grad.full_tensor(), ref_params[name].grad, relative=False)
    return out_err, input_err, errors, meshes, tp_params


@pytest.mark.parametrize("case", ["linear_bias", "conv1x1_bias", "fused_qkv_attention"])
def test_fsdp2_over_dp_on_top_of_tp_matches_single_process(case):
    for out_err, input_err, errors, meshes, tp_params in run_on_ranks(_fsdp2_worker, 4, case):
        assert out_err <= 1e-10 and input_err <= 1e-10
        assert max(errors.values()) <= 1e-10, errors
        assert tp_params and set(errors) > tp_params
        for name, dims in meshes.items():
            assert dims == (("dp", "tp") if name in tp_params else ("dp",)), name


# ------------------------------------------------------------------------------------------
# Plan building (no process group) and errors.
# ------------------------------------------------------------------------------------------


class Block(nn.Module):
    _tp_col = ["ff.0"]
    _tp_row = ["ff.2"]

    def __init__(self):
        super().__init__()
        self.attn = FusedAttention(dim=32, head_dim=8)
        self.ff = nn.Sequential(nn.Linear(32, 64), nn.GELU(), nn.Linear(64, 32))


class Net(nn.Module):
    _tp_col = "head.0"
    _tp_row = "head.2"

    def __init__(self):
        super().__init__()
        self.layers = nn.ModuleList([Block(), Block()])
        self.head = nn.Sequential(nn.Conv2d(32, 16, 1), nn.SiLU(), nn.Conv2d(16, 8, 1))


def test_plan_uses_full_paths_and_one_style_per_layer_kind():
    plan = build_tensor_parallel_plan(Net(), 2)
    expected = {
        "layers.0.ff.0": ColwiseParallel,
        "layers.0.ff.2": RowwiseProjectionParallel,
        "layers.0.attn.to_qkv": ColwiseProjectionParallel,
        "layers.0.attn.proj": RowwiseProjectionParallel,
        "layers.1.ff.0": ColwiseParallel,
        "layers.1.ff.2": RowwiseProjectionParallel,
        "layers.1.attn.to_qkv": ColwiseProjectionParallel,
        "layers.1.attn.proj": RowwiseProjectionParallel,
        "head.0": ColwiseProjectionParallel,
        "head.2": RowwiseProjectionParallel,
    }
    assert {k: type(v) for k, v in plan.items()} == expected
    assert plan["layers.0.attn.to_qkv"].parts == 3
    assert plan["head.0"].parts == 1


def test_instance_attribute_overrides_class_declaration():
    net = Net()
    net.layers[1]._tp_col = []
    net.layers[1]._tp_row = []
    plan = build_tensor_parallel_plan(net, 2)
    assert "layers.1.ff.0" not in plan and "layers.1.attn.to_qkv" in plan


def _net_with(path, layer, net=None):
    net = Net() if net is None else net
    parent_path, _, leaf = path.rpartition(".")
    setattr(net.get_submodule(parent_path), leaf, layer)
    return net


@pytest.mark.parametrize(
    "layer, message",
    [
        (nn.Conv2d(32, 16, 3, padding=1), "kernel_size=(3, 3)"),
        (nn.Conv2d(32, 16, 1, stride=2), "stride=(2, 2)"),
        (nn.Conv2d(32, 16, 1, padding=1), "padding=(1, 1)"),
        (nn.Conv2d(32, 16, 1, groups=2), "groups=2"),
        (nn.Conv2d(32, 16, 1, dilation=2), "dilation=(2, 2)"),
    ],
)
def test_unsupported_conv_target_names_path_and_reason(layer, message):
    with pytest.raises(
        ValueError, match=r"'head\.0'.*" + message.replace("(", r"\(").replace(")", r"\)")
    ):
        build_tensor_parallel_plan(_net_with("head.0", layer), 2)


def test_wrong_layer_type_is_type_error_naming_path():
    with pytest.raises(TypeError, match=r"'head\.2'.*LayerNorm"):
        build_tensor_parallel_plan(_net_with("head.2", nn.LayerNorm(16)), 2)

    class ScaledLinear(nn.Linear):
        def forward(self, x):
            return 2 * super().forward(x)

    with pytest.raises(TypeError, match=r"'layers\.0\.ff\.2'.*ScaledLinear with its own forward"):
        build_tensor_parallel_plan(_net_with("layers.0.ff.2", ScaledLinear(64, 32)), 2)


def test_unconverted_model_lists_every_parameter_as_tp_replicated():
    model = LinearMLP()
    assert [n for n, _ in tp_replicated_parameters(model)] == [
        n for n, _ in model.named_parameters()
    ]


def test_indivisible_widths_name_path():
    with pytest.raises(
        ValueError, match=r"'head\.0'.*out_channels = 16 is not divisible by the tp size 3"
    ):
        build_tensor_parallel_plan(Net(), 3)
    with pytest.raises(
        ValueError, match=r"'head\.2'.*in_channels = 6 is not divisible by the tp size 4"
    ):
        net = _net_with("head.0", nn.Conv2d(32, 8, 1))
        build_tensor_parallel_plan(_net_with("head.2", nn.Conv2d(6, 8, 1), net), 4)
    with pytest.raises(ValueError, match=r"'layers\.0\.ff\.0'.*out_features = 10"):
        build_tensor_parallel_plan(_net_with("layers.0.ff.0", nn.Linear(32, 10)), 4)


def test_missing_path_is_value_error_naming_full_path():
    net = Net()
    net.layers[0]._tp_row = ["ff.3"]
    with pytest.raises(ValueError, match=r"'layers\.0\.ff\.3'.*does not exist"):
        build_tensor_parallel_plan(net, 2)


def test_undeclared_fused_projection_is_refused():
    net = Net()
    net.layers[1].attn._tp_fused = {}
    with pytest.raises(ValueError, match=r"'layers\.1\.attn\.to_qkv'.*_tp_fused"):
        build_tensor_parallel_plan(net, 2)

    class KV(nn.Module):
        _tp_col = "to_kv"

        def __init__(self):
            super().__init__()
            self.to_kv = nn.Linear(8, 16)

    with pytest.raises(ValueError, match=r"'to_kv'.*looks like a fused projection"):
        build_tensor_parallel_plan(KV(), 2)


def test_heads_not_divisible_by_tp_are_refused():
    # 32 / head_dim 8 = 4 heads: tp 2 keeps 2 whole heads per rank, tp 8 would split them.
    build_tensor_parallel_plan(FusedAttention(32, 8), 4)
    with pytest.raises(
        ValueError, match=r"'to_qkv'.*gives 4 per rank, not a multiple of head_dim 8"
    ):
        build_tensor_parallel_plan(FusedAttention(32, 8), 8)
    # 3 heads of 8: tp 2 gives 12 columns of each part per rank.
    with pytest.raises(ValueError, match=r"head_dim 8"):
        build_tensor_parallel_plan(FusedAttention(24, 8), 2)


def test_bad_declarations_are_refused():
    net = Net()
    net.layers[0]._tp_col = 3
    with pytest.raises(TypeError, match=r"_tp_col of module 'layers\.0'"):
        build_tensor_parallel_plan(net, 2)
    net = Net()
    net.layers[0]._tp_row = ["ff.2", "ff.0"]
    with pytest.raises(ValueError, match=r"'layers\.0\.ff\.0' is declared twice"):
        build_tensor_parallel_plan(net, 2)
    net = Net()
    net.layers[0].attn._tp_fused = {"proj": 2, "to_qkv": 3}
    with pytest.raises(ValueError, match=r"names 'proj', which is not one of its column targets"):
        build_tensor_parallel_plan(net, 2)


def _all_or_nothing_worker(rank, world):
    tp_mesh, _ = _tp_mesh("tp2")
    torch.manual_seed(0)
    net = Net()
    net.head[2] = nn.Conv2d(16, 8, 3)  # the last target is bad; the others are fine
    try:
        apply_tensor_parallel(net, tp_mesh)
    except ValueError as err:
        message = str(err)
    else:
        message = None
    converted = [n for n, p in net.named_parameters() if isinstance(p, DTensor)]
    untouched = apply_tensor_parallel(LinearMLP(), None)
    size_one = init_device_mesh("cpu", (2, 1), mesh_dim_names=("dp", "tp"))["tp"]
    untouched_1 = apply_tensor_parallel(LinearMLP(), size_one)
    try:
        apply_tensor_parallel(LinearMLP(), init_device_mesh("cpu", (1, 2)))
    except ValueError as err:
        two_d = str(err)
    else:
        two_d = None
    return {
        "message": message,
        "converted": converted,
        "untouched": [type(p).__name__ for p in untouched.parameters()],
        "untouched_1": [type(p).__name__ for p in untouched_1.parameters()],
        "two_d": two_d,
    }


def test_checks_run_before_any_change_and_size_one_mesh_is_a_no_op():
    for res in run_on_ranks(_all_or_nothing_worker, 2):
        assert res["message"] is not None and "'head.2'" in res["message"]
        assert res["converted"] == []
        assert set(res["untouched"]) == {"Parameter"}
        assert set(res["untouched_1"]) == {"Parameter"}
        assert res["two_d"] is not None and "1-D" in res["two_d"]


def test_projection_module_refuses_fused_row():
    with pytest.raises(ValueError, match="only a column-parallel projection can be fused"):
        TensorParallelProjection(nn.Linear(4, 4), None, "row", parts=2)


# ------------------------------------------------------------------------------------------
# The styles in torch's own parallelize_module (a plain plan dict, layers changed in place).
# ------------------------------------------------------------------------------------------


class _PlanNet(nn.Module):
    _tp_col = ("mlp.0", "ff.0")
    _tp_row = ("mlp.2", "ff.2")

    def __init__(self):
        super().__init__()
        self.mlp = nn.Sequential(nn.Conv2d(4, 8, 1), nn.GELU(), nn.Conv2d(8, 4, 1))
        self.ff = nn.Sequential(nn.Linear(6, 12), nn.Tanh(), nn.Linear(12, 6))

    def forward(self, x):
        return self.ff(self.mlp(x))


def _plan_dict_worker(rank, world):
    from torch.distributed.tensor.parallel import parallelize_module

    torch.set_default_dtype(torch.float64)
    tp_mesh = init_device_mesh("cpu", (world,), mesh_dim_names=("tp",))
    torch.manual_seed(0)
    ref = _PlanNet()
    ours, torchs = copy.deepcopy(ref), copy.deepcopy(ref)
    conv_before = torchs.mlp[0]
    apply_tensor_parallel(ours, tp_mesh)
    plan = {
        "mlp.0": ColwiseProjectionParallel(),
        "mlp.2": RowwiseProjectionParallel(),
        "ff.0": ColwiseParallel(use_local_output=True),
        "ff.2": RowwiseProjectionParallel(),
    }
    assert parallelize_module(torchs, tp_mesh, plan) is torchs
    x = torch.randn(2, 4, 3, 6, generator=torch.Generator().manual_seed(1))
    out = {}
    for name, model in (("ref", ref), ("ours", ours), ("torch", torchs)):
        xi = x.clone().requires_grad_(True)
        y = model(xi)
        (y * torch.linspace(-1, 1, y.numel()).view_as(y)).sum().backward()
        grads = {
            n: (p.grad.full_tensor() if isinstance(p.grad, DTensor) else p.grad)
            for n, p in model.named_parameters()
        }
        out[name] = (y.detach(), xi.grad, grads, list(model.state_dict()))
    return {
        "out": out,
        "in_place": torchs.mlp[0] is conv_before
        and isinstance(conv_before, TensorParallelProjection),
        "is_conv": isinstance(conv_before, nn.Conv2d),
        "placements": {n: tuple(p.placements) for n, p in torchs.named_parameters()},
    }


def test_styles_in_torch_parallelize_module_plan_dict_match_apply_tensor_parallel():
    for res in run_on_ranks(_plan_dict_worker, 2):
        assert res["in_place"] and res["is_conv"]
        ref_y, ref_xg, ref_g, ref_keys = res["out"]["ref"]
        for name in ("ours", "torch"):
            y, xg, grads, keys = res["out"][name]
            assert keys == ref_keys
            assert float((y - ref_y).abs().max()) <= 1e-12, name
            assert float((xg - ref_xg).abs().max()) <= 1e-12, name
            for n, g in grads.items():
                assert float((g - ref_g[n]).abs().max()) <= 1e-12, (name, n)
        # torch's walker and ours give bit-identical numbers
        assert torch.equal(res["out"]["ours"][0], res["out"]["torch"][0])
        assert res["placements"]["mlp.0.weight"] == (Shard(0),)
        assert res["placements"]["mlp.2.bias"] == (Replicate(),)
