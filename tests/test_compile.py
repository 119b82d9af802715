"""torch.compile through the library (``credit_parallel.parallel.compile``, ``domain/exchange/ops.py``): a compiled
converted block computes the single-process function (float64, 1e-10: forward, input gradient,
every parameter gradient) with the backend ``aot_eager`` at domain 2 and 3 and ``inductor`` at
domain 2, on uneven rows — conv / GroupNorm, CREDIT's head-split attention, nn.MultiheadAttention and SDPA
token attention, a module under nonlocal_policy="gather", timm's shifted Swin block — and Dynamo
sees no graph break in it; a bundled model compiled through
``parallelize`` at domain 1 matches the plain one."""

from __future__ import annotations

import copy

import pytest
import torch
from torch import nn
from torch._dynamo.utils import counters

from credit_parallel import compile_blocks, parallelize
from credit_parallel.domain.convert import convert_to_domain_parallel
from credit_parallel.domain.exchange.ops import decode_plans, encode_plan
from credit_parallel.domain.manager import DomainParallelManager
from credit_parallel.domain.rows import plan_exchange, shard_range
from credit_parallel.layout.run_config import TrainerConfig
from credit_parallel.models.crossformer import CrossFormer
from credit_parallel.models.unet import UNet, UNetResBlock
from credit_parallel.parallel.compile import compile_targets, is_compiled
from credit_parallel.testing import assert_parity, domain_parity_errors, run_on_ranks
from miles_credit import import_credit, import_timm


def _conv_norm_block():
    return nn.Sequential(
        nn.Conv2d(3, 8, 3, padding=1), nn.GroupNorm(2, 8), nn.SiLU(), nn.Conv2d(8, 4, 3, padding=1)
    )


def _attention_block():
    m = import_credit("credit.models.unet_diffusion")
    return nn.Sequential(nn.Conv2d(3, 8, 3, padding=1), m.Attention(8, heads=2, dim_head=4))


class _TokenAttention(nn.Module):
    """nn.MultiheadAttention over the flattened H*W tokens (converted to the sequence-parallel
    token form: token counts, two all-to-alls, under a TorchFunctionMode)."""

    def __init__(self, channels=8, heads=2):
        super().__init__()
        self.attn = nn.MultiheadAttention(channels, heads, batch_first=True)

    def forward(self, x):
        b, c, h, w = x.shape
        t = x.flatten(2).transpose(1, 2)
        y, _ = self.attn(t, t, t, need_weights=False)
        return y.transpose(1, 2).reshape(b, c, h, w)


class _SdpaTokens(nn.Module):
    """F.scaled_dot_product_attention over the H*W tokens, declared as token attention; its 3x3
    qkv convolution is converted inside the wrapper (a halo exchange in the same graph)."""

    _domain_attention = {"form": "tokens"}

    def __init__(self, channels=8, heads=2):
        super().__init__()
        self.heads = heads
        self.qkv = nn.Conv2d(channels, 3 * channels, 3, padding=1)

    def forward(self, x):
        b, c, h, w = x.shape
        q, k, v = self.qkv(x).reshape(b, 3, self.heads, -1, h * w).transpose(-1, -2).unbind(1)
        y = torch.nn.functional.scaled_dot_product_attention(q, k, v)
        return y.transpose(-1, -2).reshape(b, c, h, w)


class _HandAttention(nn.Module):
    """Attention over all H*W positions written by hand: nothing the converter recognises, so
    ``nonlocal_policy="gather"`` runs it on the all-gathered globe."""

    def __init__(self, channels=8):
        super().__init__()
        self.qkv = nn.Conv2d(channels, 3 * channels, 1)

    def forward(self, x):
        q, k, v = self.qkv(x).flatten(2).chunk(3, dim=1)
        attn = (q.transpose(1, 2) @ k / q.shape[1] ** 0.5).softmax(-1)
        return (v @ attn.transpose(1, 2)).reshape(x.shape)


class _SwinBetweenConvs(nn.Module):
    """timm's shifted SwinTransformerV2Block between convolutions, permuted B,H,W,C for it (as
    FuXi does): the H-roll becomes a row re-layout there and back (``DomainSwinBlock``)."""

    def __init__(self, height=14):
        super().__init__()
        timm = import_timm("timm.models.swin_transformer_v2")
        self.inp = nn.Conv2d(3, 8, 3, padding=1)
        self.block = timm.SwinTransformerV2Block(
            dim=8, input_resolution=(height, 6), num_heads=2, window_size=(2, 3),
            shift_size=(1, 1), mlp_ratio=2.0,
        )  # fmt: skip
        self.out = nn.Conv2d(8, 4, 3, padding=1)
        with torch.no_grad():  # every parameter off its init (zero biases, unit norms)
            for p in self.parameters():
                p.add_(0.2 * torch.randn_like(p))

    def forward(self, x):
        y = self.block(self.inp(x).permute(0, 2, 3, 1))
        return self.out(y.permute(0, 3, 1, 2))


def _between_convs(body):
    return lambda: nn.Sequential(
        nn.Conv2d(3, 8, 3, padding=1), body(), nn.Conv2d(8, 4, 3, padding=1)
    )


BLOCKS = {
    "conv_norm": _conv_norm_block,
    "attention": _attention_block,
    "tokens": _between_convs(_TokenAttention),
    "gather": _between_convs(_HandAttention),
    "tokens_sdpa": _between_convs(_SdpaTokens),
    "swin": _SwinBetweenConvs,
}
# the parameter every block must report a gradient error for (its communication is on the path)
_KEY_PARAM = {
    "attention": "to_qkv",
    "tokens": "in_proj_weight",
    "tokens_sdpa": "qkv",
    "gather": "qkv",
    "swin": "block.attn.qkv",
}
_POLICY = {"gather": "gather"}


def _compiled_parity_worker(rank, world, block, h, backend):
    torch.set_default_dtype(torch.float64)
    mgr = DomainParallelManager(world, world)
    x = torch.randn(2, 3, h, 6, generator=torch.Generator().manual_seed(3))
    a, b = shard_range(h, world, rank)
    token = ("parity", (tuple(x.shape),))
    policy = _POLICY.get(block, "raise")

    def convert(model, manager):
        model = convert_to_domain_parallel(model, manager, nonlocal_policy=policy)
        assert compile_blocks(model, backend=backend) == [""]
        manager.begin_forward(token)
        model(x[:, :, a:b])  # the first call per input shape runs eagerly (notes the heights)
        return model

    errors = domain_parity_errors(BLOCKS[block], x, mgr, convert=convert)
    assert_parity(errors)
    assert counters["stats"]["unique_graphs"] >= 1, dict(counters["stats"])  # it compiled
    # the converted block, traced by Dynamo: one graph, no break
    model = convert_to_domain_parallel(BLOCKS[block](), mgr, nonlocal_policy=policy)
    forms = sorted({getattr(m, "domain_form", "") for m in model.modules()} - {""})
    mgr.begin_forward(token)
    model(x[:, :, a:b])
    explained = torch._dynamo.explain(model)(x[:, :, a:b])
    return errors, explained.graph_break_count, explained.graph_count, forms


def _check(results, block):
    errors, breaks, graphs, forms = results[0]
    assert breaks == 0 and graphs == 1, (breaks, graphs)
    assert "output" in errors and "input_grad" in errors
    assert any(k.startswith("param:") for k in errors)
    if block in _KEY_PARAM:
        assert any(_KEY_PARAM[block] in k for k in errors), sorted(errors)
    expected = {"tokens": "sequence", "tokens_sdpa": "sequence", "gather": "gather"}
    expected["swin"] = "relayout"
    if block in expected:  # the converted form under test is really there
        assert expected[block] in forms, forms


# uneven rows at domain 2 (7/7 cuts windows of 2 rows for the Swin block) or 3 (4/4/3, 5/5/4)
_AOT_CASES = [
    (block, world, h) for block in sorted(set(BLOCKS) - {"swin"}) for world, h in [(2, 7), (3, 11)]
] + [("swin", 2, 14), ("swin", 3, 14)]


@pytest.mark.slow
@pytest.mark.parametrize("block, world, h", _AOT_CASES)
def test_compiled_block_aot_eager_matches_single_process(block, world, h):
    _check(run_on_ranks(_compiled_parity_worker, world, block, h, "aot_eager", timeout=600), block)


# inductor at domain 2 on uneven rows (4/3): what inductor adds to aot_eager is the lowering of
# the traced graph (the library's operators as fallback kernels, the rest generated); the graph at
# 3 ranks (4/4/3) is the aot_eager cases' above, so 3 ranks under inductor would re-prove them
# at the price of another C++ build per rank
_INDUCTOR_CASES = [("attention", 2, 7), ("conv_norm", 2, 7), ("tokens", 2, 7)]


@pytest.mark.slow
@pytest.mark.timeout(900)  # inductor's C++ builds: minutes on a loaded 2-core machine
@pytest.mark.parametrize("block, world, h", _INDUCTOR_CASES)
def test_compiled_block_inductor_matches_single_process(block, world, h):
    _check(run_on_ranks(_compiled_parity_worker, world, block, h, "inductor", timeout=900), block)


def _bundled(name):
    torch.manual_seed(0)
    if name == "crossformer":
        return CrossFormer(3, 2, 16, 16, dims=(16, 32), depths=(2, 2), window_sizes=(4, 2))
    return UNet(3, 2, 16, 16, base_channels=8, channel_mults=(1, 2))


def _grads(model):
    out = {}
    for name, p in model.named_parameters():
        g = p.grad
        out[name] = g.full_tensor() if hasattr(g, "full_tensor") else g
    return out


def _domain1_worker(rank, world, name, backend, monkeypatch_backend):
    torch.set_default_dtype(torch.float64)
    import credit_parallel.parallel.composition as composition

    # trainer.compile through parallelize, with the test's backend
    composition.compile_blocks = lambda m: compile_blocks(m, backend=monkeypatch_backend)
    ref = _bundled(name)
    par = copy.deepcopy(ref)
    conf = {
        "trainer": {
            "parallelism": {"data": "fsdp2", "tensor": 1, "domain": 1},
            "compile": True,
        }
    }
    par = parallelize(par, conf)
    compiled = [n for n, m in compile_targets(par) if is_compiled(m)]
    x = torch.randn(2, 3, 16, 16, generator=torch.Generator().manual_seed(1))
    results = []
    for model in (ref, par):
        xi = x.clone().requires_grad_()
        y = model(xi)
        (y * torch.arange(y.numel()).reshape(y.shape).sin()).sum().backward()
        results.append((y.detach(), xi.grad, _grads(model)))
    (y0, gx0, gp0), (y1, gx1, gp1) = results
    errs = {"output": float((y0 - y1).abs().max()), "input_grad": float((gx0 - gx1).abs().max())}
    errs.update({k: float((gp0[k] - gp1[k]).abs().max()) for k in gp0})
    assert set(gp0) == set(gp1)
    return errs, compiled


@pytest.mark.slow
@pytest.mark.timeout(900)
@pytest.mark.parametrize("backend", ["aot_eager", "inductor"])
@pytest.mark.parametrize("name", ["crossformer", "unet"])
def test_bundled_model_compiled_through_parallelize_matches_plain(name, backend):
    errs, compiled = run_on_ranks(_domain1_worker, 1, name, backend, backend, timeout=900)[0]
    assert len(compiled) >= 2, compiled  # per block, not the whole model
    bad = {k: v for k, v in errs.items() if v > 1e-10}
    assert not bad, bad


def test_compile_targets_are_the_innermost_fsdp_blocks():
    model = _bundled("unet")
    names = [n for n, _ in compile_targets(model)]
    marked = [n for n, m in model.named_modules() if getattr(m, "_fsdp2_shard", False)]
    assert names and set(names) <= set(marked)
    assert compile_targets(nn.Linear(2, 2))[0][0] == ""


def test_compile_blocks_twice_is_refused():
    model = nn.Sequential(nn.Linear(2, 2))
    compile_blocks(model, backend="eager")
    with pytest.raises(RuntimeError, match="already compiled"):
        compile_blocks(model, backend="eager")


def test_trainer_compile_key_defaults_off_and_parses():
    assert TrainerConfig.from_conf({"trainer": {}}).compile is False
    assert TrainerConfig.from_conf({"trainer": {"compile": True}}).compile is True
    with pytest.raises(ValueError, match="compile"):
        TrainerConfig.from_conf({"trainer": {"compile": "yes"}})


def test_plan_encoding_round_trips():
    windows = ((-1, 0, 1, 2, 3), (2, 3, 4, 5, 6, 7), (5, 6, 7, 8, 9, -1))
    for plan in plan_exchange(10, 3, windows):
        assert decode_plans(tuple(encode_plan(plan))) == (plan,)
    plans = plan_exchange(10, 3, windows)
    code = tuple(v for p in plans for v in encode_plan(p))
    assert decode_plans(code) == plans


class _Breaking(nn.Module):
    _fsdp2_shard = True

    def __init__(self):
        super().__init__()
        self.conv = nn.Conv2d(2, 2, 1)

    def forward(self, x):
        x = self.conv(x)
        torch._dynamo.graph_break()
        return x * 2


class _TwoBlocks(nn.Module):
    input_shapes = ((2, 4, 4),)

    def __init__(self):
        super().__init__()
        self.a = UNetResBlock(2, 4, 2)
        self.b = _Breaking()

    def forward(self, x):
        return self.b(self.a(x)[:, :2])


def test_plan_compile_lists_graph_breaks_per_block():
    from credit_parallel.planner.compile_report import compile_breaks, format_compile_breaks

    blocks = compile_breaks({}, model=_TwoBlocks().to("meta"))
    by_name = {b.name: b for b in blocks}
    assert by_name["a"].breaks == 0 and by_name["a"].graphs == 1
    assert by_name["b"].breaks == 1 and by_name["b"].graphs == 2
    text = format_compile_breaks(blocks)
    assert "1 graph breaks" in text and "b (_Breaking): 2 graph(s), 1 break(s)" in text
    assert "nonlocal gather" in text and "tokens" in text  # the traced forms are stated


def _bundled_domain_worker(rank, world, name, backend):
    torch.set_default_dtype(torch.float64)
    mgr = DomainParallelManager(world, world)
    x = torch.randn(1, 3, 16, 16, generator=torch.Generator().manual_seed(3))
    a, b = shard_range(16, world, rank)

    def convert(model, manager):
        model = convert_to_domain_parallel(model, manager)
        names = compile_blocks(model, backend=backend)
        manager.begin_forward(("parity", (tuple(x.shape),)))
        model(x[:, :, a:b])  # the first call per input shape runs eagerly
        return model, names

    compiled = []

    def convert_and_note(model, manager):
        model, names = convert(model, manager)
        compiled.extend(names)
        return model

    errors = domain_parity_errors(lambda: _bundled(name), x, mgr, convert=convert_and_note)
    assert_parity(errors)
    # the compiled graphs ran (not an eager fallback): Dynamo compiled one frame per block type
    assert counters["stats"]["unique_graphs"] >= 2, dict(counters["stats"])
    return errors, compiled


@pytest.mark.slow
@pytest.mark.parametrize("name", ["crossformer", "unet"])
def test_bundled_model_compiled_per_block_at_domain_3_matches_single_process(name):
    # 16 rows over 3 ranks: 6/5/5, halos, GroupNorm statistics, window re-layouts all compiled
    errors, compiled = run_on_ranks(_bundled_domain_worker, 3, name, "aot_eager", timeout=900)[0]
    assert len(compiled) >= 4 and "" not in compiled
    assert sum(k.startswith("param:") for k in errors) == len(list(_bundled(name).parameters()))


def _trainer_worker(rank, world, store):
    import credit_parallel.train.model_init as model_init
    from credit_parallel.train.trainer import Trainer
    from sample_conf import tiny_unet_conf

    model_init.compile_blocks = lambda m: compile_blocks(m, backend="aot_eager")
    out = {}
    for compiled in (False, True):
        trainer_conf = {
            "parallelism": {"data": "fsdp2", "tensor": 1, "domain": 2},
            "steps": 3,
            "batch_size": 2,
            "dtype": "float64",
            "seed": 3,
            "compile": compiled,
        }
        conf = tiny_unet_conf(store, 17, 32, time_slice=[0, 20], trainer=trainer_conf)
        trainer = Trainer(conf)
        losses = [trainer.train_step()["loss"] for _ in range(3)]
        params = {n: p.detach().full_tensor().clone() for n, p in trainer.model.named_parameters()}
        names = [n for n, m in compile_targets(trainer.model) if is_compiled(m)]
        out[compiled] = (losses, params, names)
    return out


@pytest.mark.slow
def test_trainer_compile_fsdp2_over_domain2_trains_like_eager(tmp_path):
    from credit_parallel.data import write_sample_dataset

    store = str(write_sample_dataset(tmp_path / "s.zarr", n_times=24, nlat=17, nlon=32))
    out = run_on_ranks(_trainer_worker, 2, store, timeout=900)[0]
    (eager_losses, eager_params, eager_names), (losses, params, names) = out[False], out[True]
    assert not eager_names and names  # trainer.compile compiled the blocks
    assert max(abs(a - b) for a, b in zip(losses, eager_losses)) <= 1e-10
    assert max(float((params[k] - eager_params[k]).abs().max()) for k in params) <= 1e-10


def _geometry_worker(rank, world):
    """A domain conv traced on its first call (no eager call before) records the geometry the
    eager layer computes: the same plan and the same split, the strips that read only fill rows
    beyond the globe dropped (one path, compiled or not)."""
    from credit_parallel import get_domain_manager, shard_tensor
    from credit_parallel.domain.layers.conv import DomainParallelConv2d

    torch.manual_seed(0)
    conv = nn.Sequential(nn.Conv2d(2, 3, 3, padding=1))
    conf = {"trainer": {"parallelism": {"domain": world}}}
    traced, eager = parallelize(copy.deepcopy(conv), conf), parallelize(copy.deepcopy(conv), conf)
    x = torch.randn(1, 2, 9, 6)
    y = torch.compile(traced, backend="eager", fullgraph=True)(
        shard_tensor(x, -2, get_domain_manager(traced))
    )
    ref = eager(shard_tensor(x, -2, get_domain_manager(eager)))
    layers = [
        [m for m in model.modules() if isinstance(m, DomainParallelConv2d)][0]
        for model in (traced, eager)
    ]
    (call,) = layers[0]._calls.values()
    return layers[0]._calls == layers[1]._calls, call.split, float((y - ref).abs().max())


def test_a_compiled_conv_computes_the_eager_geometry_with_the_fill_strips_dropped():
    results = run_on_ranks(_geometry_worker, 3)
    for rank, (same, split, err) in enumerate(results):
        assert same and err <= 1e-6
        assert (split.top_rows == 0) == (rank == 0)  # the first rank's top strip: fill only
        assert (split.bottom_rows == 0) == (rank == 2)
