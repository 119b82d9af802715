"""miles-credit's ``nextgen_wxformer`` (``NextGenWXFormer``) under domain parallelism
(``domain/adapters/nextgen.py``), against the model on one process (float64, 1e-10: output,
input gradient and every parameter gradient).

The grid is 45 x 44: the encoder's stages are 22 x 22, 11 x 11, 5 x 5 and 2 x 2, so the decoder's
interpolations to the skip sizes (4 -> 5 rows and columns, 20 -> 21 rows, the last 44 -> 45
rows) are real ones, the shards are uneven (23 / 22 rows; 15 rows each over 3 ranks, where rank
2 owns none of the bottleneck's 2 rows), and with ``col_attn_stride`` 2 or 3 the pooled rows and
columns of a rank do not start where its shard starts.  Spectral norm is on (CREDIT's default)
and both frames go through the level embedding and column attention.
"""

from __future__ import annotations

import functools

import pytest
import torch
import torch.distributed as dist
from torch import nn

from credit_parallel import get_domain_manager, parallelize, shard_batch, sync_domain_gradients
from credit_parallel.domain.convert import convert_to_domain_parallel
from credit_parallel.domain.manager import DomainParallelManager, TiledDomainManager
from credit_parallel.testing import domain_parity_errors, run_on_ranks
from miles_credit import import_credit

TOL = 1e-10
H, W = 45, 44
FRAMES, IN_CHANNELS = 2, 2 * 3 + 1 + 1  # channels x levels + surface + input-only, per frame


def _nextgen(stride=1, decoder=False, dim=(4, 8, 16, 32), spectral_norm=True):
    wx = import_credit("credit.models.wxformer.wxformer_next")
    return wx.NextGenWXFormer(
        image_height=H,
        image_width=W,
        frames=FRAMES,
        channels=2,
        surface_channels=1,
        input_only_channels=1,
        output_only_channels=1,
        levels=3,
        dim=dim,
        depth=(1, 1, 1, 1),
        dim_head=4,
        global_window_size=(2, 1, 1, 1),
        local_window_size=(2, 1, 1, 1),
        cross_embed_kernel_sizes=((2, 4),) * 4,
        cross_embed_strides=(2, 2, 2, 2),
        col_attn_heads=1,
        col_attn_stride=stride,
        decoder_col_attn=decoder,
        num_spectral_nodes=3,
        use_spectral_norm=spectral_norm,
    ).double()


def _input():
    torch.manual_seed(0)
    return torch.randn(1, IN_CHANNELS, FRAMES, H, W, dtype=torch.float64)


def _forms(model) -> set[str]:
    names = set()
    for m in model.modules():
        while m is not None:
            names.add(type(m).__name__)
            m = m.__dict__.get("wrapped")
    return names


def _worker(rank, world, shape, cases):
    manager = TiledDomainManager(world, shape) if shape else DomainParallelManager(world, world)
    out = []
    for kwargs in cases:
        build = functools.partial(_nextgen, **kwargs)
        errors = domain_parity_errors(build, _input(), manager)
        out.append((kwargs, errors, _forms(convert_to_domain_parallel(build(), manager))))
    return out


def _assert_exact(errors, what):
    for key, (err, ref) in errors.items():
        assert err <= TOL, (what, key, err, ref)
    assert errors["output"][1] > 0 and errors["input_grad"][1] > 0, what
    for name in ("agg_w", "scatter_w", "mlp.0.weight_orig", "norm.weight"):
        (key,) = [
            k for k in errors if k.startswith("param:spectral_bottleneck.") and k.endswith(name)
        ]
        assert errors[key][1] > 0, (what, key)  # the bottleneck's gradients are real ones
    assert sum(ref > 0 for key, (_, ref) in errors.items() if key.startswith("param:")) >= 60


ADAPTERS = {"DomainNextGenWXFormer", "DomainSpectralBottleneck", "DomainColumnAttention"}


@pytest.mark.parametrize(
    "world, case",
    [(2, {}), (3, {"stride": 2, "decoder": True})],
    ids=["domain2_stride1", "domain3_stride2_decoder"],
)
def test_nextgen_wxformer_exact_on_uneven_latitude_shards(world, case):
    for results in run_on_ranks(_worker, world, None, [case]):
        for kwargs, errors, forms in results:
            _assert_exact(errors, (world, kwargs))
            assert ADAPTERS <= forms and "DomainGatherModule" not in forms


def test_nextgen_wxformer_exact_on_2x2_tiles():
    """Rows 23 / 22 and columns 22 / 22; ``col_attn_stride`` 3 pools 15 x 14 points whose
    rows (8 / 7) and columns (7 / 7) start at input rows 24 and columns 21 on the second tiles."""
    case = {"stride": 3, "decoder": True}
    for results in run_on_ranks(_worker, 4, (2, 2), [case]):
        for kwargs, errors, forms in results:
            _assert_exact(errors, ((2, 2), kwargs))
            assert ADAPTERS <= forms


def _bottleneck_worker(rank, world):
    wx = import_credit("credit.models.wxformer.wxformer_next")

    def build():
        return nn.Sequential(nn.Conv2d(2, 8, 3, padding=1), wx.SpectralGNNBottleneck(8, 7, 6, 5))

    x = torch.randn(2, 2, 7, 6, dtype=torch.float64, generator=torch.Generator().manual_seed(3))
    torch.set_default_dtype(torch.float64)
    return domain_parity_errors(build, x, DomainParallelManager(world, world))


def test_spectral_gnn_bottleneck_in_any_model_is_exact_at_domain_3():
    """7 rows over 3 ranks (3 / 2 / 2): each rank's columns of agg_w, one all-reduce of
    (B, C, K), its rows of scatter_w; the GroupNorm is the converted one."""
    errors = run_on_ranks(_bottleneck_worker, 3)[0]
    for key, (err, ref) in errors.items():
        assert err <= TOL and ref > 0, (key, err, ref)
    assert {"param:1.agg_w", "param:1.scatter_w"} <= errors.keys()


# --------------------------------------------------------------------------- composed
def _full(t):
    return t.full_tensor() if hasattr(t, "full_tensor") else t


def _reference(dim):
    torch.manual_seed(0)
    model = _nextgen(stride=2, decoder=True, dim=dim)
    x = _input().requires_grad_()
    weights = torch.randn(
        1, 8, 1, H, W, dtype=torch.float64, generator=torch.Generator().manual_seed(5)
    )
    out = model(x)
    (out * weights).sum().backward()
    return out.detach(), {n: p.grad.clone() for n, p in model.named_parameters()}, weights


def _composed_worker(rank, world, block, dim):
    torch.manual_seed(0)
    model = _nextgen(stride=2, decoder=True, dim=dim)
    conf = {"trainer": {"parallelism": block}}
    model = parallelize(model, conf)
    mgr = get_domain_manager(model)
    _, _, weights = _reference(dim)
    local = shard_batch({"x": _input(), "w": weights}, manager=mgr)
    out = model(local["x"])
    (out * local["w"]).sum().backward()
    sync_domain_gradients(model, mgr, op="sum")
    grads = {n: _full(p.grad).detach().clone() for n, p in model.named_parameters()}
    from credit_parallel import gather_tensor

    full = gather_tensor(out.detach(), -2, mgr)
    q = dict(model.named_parameters())["layers.0.1.layers.0.0.to_q.weight_orig"]
    dist.barrier()
    return full, grads, q.device_mesh.mesh_dim_names, q.to_local().shape


def test_nextgen_wxformer_tp2_x_domain2_under_fsdp2_matches_single_process():
    """tensor 2 x domain 2 with FSDP2 over the domain ranks (dp 1 x domain 2), spectral norm
    split over tp: output and every parameter gradient equal one process's."""
    dim = (8, 16, 32, 64)  # 2 heads of 4 in the first stage: divisible by tp 2
    ref_out, ref_grads, _ = _reference(dim)
    block = {"data": "fsdp2", "tensor": 2, "domain": 2}
    for out, grads, mesh_dims, q_local in run_on_ranks(
        _composed_worker, 4, block, dim, timeout=600
    ):
        # the query projection: split over tp (4 of 8 rows) and FSDP2 over domain (2 of 4)
        assert tuple(mesh_dims) == ("dp_domain", "tp") and q_local == (2, 8), (mesh_dims, q_local)
        assert (out - ref_out).abs().max() <= TOL
        assert grads.keys() == ref_grads.keys()
        for name, grad in grads.items():
            assert (grad - ref_grads[name]).abs().max() <= TOL, name


# --------------------------------------------------------------------------- a CREDIT config
def _nextgen_config(store: str, domain: int) -> dict:
    """CREDIT's 0.25-degree gen-2 example on the sample store (tests/test_credit_examples.py)
    with its model block a ``nextgen_wxformer`` one (CREDIT's keys, spectral norm on)."""
    from test_credit_examples import _on_sample

    conf = _on_sample(store, {"data": "none", "tensor": 1, "domain": domain})
    conf["model"] = {
        "type": "nextgen_wxformer",
        "image_height": 32,
        "image_width": 64,
        "frames": 1,
        "channels": 3,
        "levels": 2,
        "surface_channels": 2,
        "input_only_channels": 3,
        "output_only_channels": 0,
        "dim": [4, 8, 16, 32],
        "depth": [1, 1, 1, 1],
        "dim_head": 4,
        "global_window_size": [2, 2, 2, 1],
        "local_window_size": 2,
        "cross_embed_kernel_sizes": [[2, 4], [2, 4], [2, 4], [2, 4]],
        "cross_embed_strides": [2, 2, 2, 2],
        "col_attn_heads": 1,
        "col_attn_stride": 2,
        "decoder_col_attn": True,
        "num_spectral_nodes": 4,
    }
    return conf


@pytest.fixture(scope="module")
def store(tmp_path_factory):
    from credit_parallel.data import write_sample_dataset

    import_credit("credit.trainers.utils")  # miles-credit's inject_flat_var_keys
    import_credit("credit.models.wxformer.wxformer_next")
    path = tmp_path_factory.mktemp("data") / "s.zarr"
    return str(write_sample_dataset(path, n_times=16, nlat=32, nlon=64))


def _config_worker(rank, world, store):
    from test_credit_examples import _train

    return _train(_nextgen_config(store, world))


@pytest.mark.slow
def test_a_nextgen_wxformer_config_trains_2_steps_at_domain_2_as_on_one_process(store):
    from test_credit_examples import _assert_trained_alike, _train

    ref_records, ref_params = _train(_nextgen_config(store, 1))
    records, params = run_on_ranks(_config_worker, 2, store, timeout=400)[0]
    _assert_trained_alike(records, params, ref_records, ref_params)
    assert any(name.endswith("spectral_bottleneck.agg_w") for name in params)


# --------------------------------------------------------------------------- plan
def test_plan_shows_the_bottlenecks_all_reduce_and_memory():
    """``plan`` at domain 2: the bottleneck is a collective layer whose comm/call is the ring
    all-reduce of its (B, C, K) sums, counted forward and backward, and its act/rank its rows
    plus the sums; the model plans without a refusal."""
    from credit_parallel.planner.make import make_plan
    from credit_parallel.planner.report import format_plan

    conf = {
        "model": {"type": "nextgen_wxformer"},
        "trainer": {"parallelism": {"data": "none", "tensor": 1, "domain": 2}},
    }
    model = _nextgen(stride=2, decoder=True)
    plan = make_plan(conf, 2, model=model, input_shapes=[(IN_CHANNELS, FRAMES, H, W)])
    assert plan.ok and not plan.violations
    (layer,) = [layer for layer in plan.layers if layer.kind == "spectral_bottleneck"]
    channels, k = 32, 3
    itemsize = plan.memory.activation_dtype_bytes
    assert layer.form == "collective" and layer.in_height == 2
    assert layer.communication_bytes == 2 * (2 - 1) * 1 * channels * k * itemsize  # batch 1
    assert layer.activation_bytes == (channels * 2 * 1 + channels * k) * itemsize
    assert plan.collectives["domain_all_reduce_bottleneck"] == 2
    text = format_plan(plan)
    assert "spectral_bottleneck" in text and "domain_all_reduce_bottleneck 2" in text
