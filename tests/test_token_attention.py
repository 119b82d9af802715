"""Attention over flattened H*W tokens (``nn.MultiheadAttention``, ``F.scaled_dot_product_attention``)
converted by the DEFAULT ``convert_to_domain_parallel`` is sequence parallel and exact: output,
input gradient and every parameter gradient summed over the domain ranks equal one process's
(float64, max abs error <= 1e-10) on uneven shards, inside a model with convolutions before and
after; returned attention weights are the single-process rows of each rank's queries; masks and
``is_causal`` are refused naming the module; the attention layer's activation memory per rank is
about 1/d of one process; the guard follows tokens flattened with H outermost; the planner
reports the form "sequence"."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from credit_parallel import convert_to_domain_parallel, shard_tensor
from credit_parallel.domain.adapters.recognise import recognised_attention_form
from credit_parallel.domain.attention import DomainTokenAttention
from credit_parallel.domain.convert import find_unsafe_modules
from credit_parallel.domain.guard import FunctionalCallGuard
from credit_parallel.domain.manager import DomainParallelManager
from credit_parallel.domain.rows import shard_range
from credit_parallel.testing import run_on_ranks
from test_domain_attention import TOL, exactness_errors, saved_activation_bytes


class GlobalSelfAttention(nn.Module):
    """nn.MultiheadAttention over all H*W positions of a B,C,H,W tensor (the typical user
    module: flatten with H outermost, attend, fold back)."""

    def __init__(self, c, heads, *, batch_first=True, need_weights=None, masked=False, **mha):
        super().__init__()
        self.batch_first, self.need_weights, self.masked = batch_first, need_weights, masked
        self.mha = nn.MultiheadAttention(c, heads, batch_first=batch_first, **mha)

    def forward(self, x):
        b, c, h, w = x.shape
        t = x.flatten(2).transpose(1, 2)  # B, H*W, C: the local rows' tokens
        if not self.batch_first:
            t = t.transpose(0, 1)
        kwargs = {} if self.need_weights is None else {"need_weights": self.need_weights}
        if self.masked:  # ignore the keys whose first channel is negative (local per token)
            kwargs["key_padding_mask"] = x[:, 0].flatten(1) < -1.0
        y, _ = self.mha(t, t, t, **kwargs)
        if not self.batch_first:
            y = y.transpose(0, 1)
        return y.transpose(1, 2).reshape(b, c, h, w)


class CrossTokenAttention(nn.Module):
    """Queries from x, keys and values from another token-sharded projection with its own
    channel count (separate q/k/v projection weights in nn.MultiheadAttention)."""

    def __init__(self, c, heads):
        super().__init__()
        self.kv = nn.Conv2d(c, 4, 1)
        self.mha = nn.MultiheadAttention(c, heads, kdim=4, vdim=4, batch_first=True)

    def forward(self, x):
        b, c, h, w = x.shape
        q = x.flatten(2).transpose(1, 2)
        kv = self.kv(x).flatten(2).transpose(1, 2)
        y, _ = self.mha(q, kv, kv, need_weights=False)
        return y.transpose(1, 2).reshape(b, c, h, w)


class SdpaAttention(nn.Module):
    """1x1-conv qkv projection, F.scaled_dot_product_attention on (B, heads, H*W, D), 1x1-conv
    output projection; declares its structure."""

    _domain_attention = {"form": "tokens"}

    def __init__(self, c, heads, *, causal=False, kernel=1):
        super().__init__()
        self.heads, self.causal = heads, causal
        self.qkv = nn.Conv2d(c, 3 * heads * 2, kernel, padding=kernel // 2)
        self.out = nn.Conv2d(heads * 2, c, 1)

    def forward(self, x):
        b, c, h, w = x.shape
        q, k, v = self.qkv(x).reshape(b, 3, self.heads, 2, h * w).transpose(-1, -2).unbind(1)
        y = F.scaled_dot_product_attention(q, k, v, is_causal=self.causal)
        return self.out(y.transpose(-1, -2).reshape(b, self.heads * 2, h, w))


def _layer(kind: str) -> nn.Module:
    return {
        "mha": lambda: GlobalSelfAttention(6, 3),
        "mha_seq_first": lambda: GlobalSelfAttention(6, 3, batch_first=False),
        "mha_no_weights": lambda: GlobalSelfAttention(6, 3, need_weights=False),
        "mha_bias_kv_zero_attn": lambda: GlobalSelfAttention(
            6, 2, add_bias_kv=True, add_zero_attn=True
        ),
        "mha_key_padding_mask": lambda: GlobalSelfAttention(6, 2, masked=True),
        "mha_one_head": lambda: GlobalSelfAttention(6, 1),  # heads < d
        "mha_cross_separate_kv": lambda: CrossTokenAttention(6, 2),
        "sdpa": lambda: SdpaAttention(6, 3),
        # a 3x3 qkv conv inside the declared module still gets its halo exchange
        "sdpa_3x3_qkv": lambda: SdpaAttention(6, 2, kernel=3),
    }[kind]()


def _model(kind: str) -> nn.Module:
    torch.manual_seed(0)
    # convolutions before and after: halos and sequence-parallel attention compose
    return nn.Sequential(
        nn.Conv2d(3, 6, 3, padding=1), _layer(kind), nn.Conv2d(6, 2, 3, padding=1)
    ).double()


def _exact_on_ranks(rank, world_size, kind, height, mode):
    net = _model(kind)
    net.train(mode == "train")
    x = torch.randn(
        2, 3, height, 6, generator=torch.Generator().manual_seed(2), dtype=torch.float64
    )
    errors = exactness_errors(net, x, (), DomainParallelManager(world_size, world_size))
    errors["converted"] = sorted(
        getattr(m, "module_path", "") for m in net.modules() if isinstance(m, DomainTokenAttention)
    )
    errors["halo_convs"] = [type(m).__name__ for m in net[1].modules()]
    return errors


_KINDS = [
    "mha",
    "mha_seq_first",
    "mha_no_weights",
    "mha_bias_kv_zero_attn",
    "mha_key_padding_mask",
    "mha_one_head",
    "mha_cross_separate_kv",
    "sdpa",
    "sdpa_3x3_qkv",
]


@pytest.mark.parametrize("domain,height", [(2, 7), (3, 11)])
@pytest.mark.parametrize("kind", _KINDS)
def test_token_attention_default_converter_exact_uneven_h(kind, domain, height):
    for errors in run_on_ranks(_exact_on_ranks, domain, kind, height, "eval"):
        assert errors["keys_equal"]
        assert errors["out"] <= TOL, errors
        assert errors["input_grad"] <= TOL, errors
        assert errors["param_grad"] <= TOL, errors
        assert errors["out_ref"] > 1e-3 and errors["param_grad_ref"] > 1e-3  # not vacuous
        assert errors["converted"] == (["1"] if kind.startswith("sdpa") else ["1.mha"])
        halo = "DomainParallelConv2d" in errors["halo_convs"]
        assert halo == (kind == "sdpa_3x3_qkv"), errors["halo_convs"]


@pytest.mark.parametrize("mode", ["train", "eval"])
def test_multihead_attention_train_and_eval_mode_exact_dropout_zero(mode):
    for errors in run_on_ranks(_exact_on_ranks, 3, "mha", 7, mode):
        assert errors["out"] <= TOL and errors["input_grad"] <= TOL, errors
        assert errors["param_grad"] <= TOL, errors


# ------------------------------------------------------------------ returned attention weights
def _weights_on_ranks(rank, world_size, average):
    torch.manual_seed(0)
    mha = nn.MultiheadAttention(6, 3, batch_first=True).double()
    ref = nn.MultiheadAttention(6, 3, batch_first=True).double()
    ref.load_state_dict(mha.state_dict())
    height, width = 7, 4
    x = torch.randn(2, 6, height, width, dtype=torch.float64)
    tokens = x.flatten(2).transpose(1, 2)
    _, w_ref = ref(tokens, tokens, tokens, average_attn_weights=average)
    manager = DomainParallelManager(world_size, world_size)
    layer = convert_to_domain_parallel(mha, manager)
    xl = shard_tensor(x, -2, manager)
    tl = xl.flatten(2).transpose(1, 2)
    _, w = layer(tl, tl, tl, average_attn_weights=average)
    start, stop = shard_range(height, world_size, rank)
    mine = w_ref[..., start * width : stop * width, :]  # my queries' rows, every key
    return tuple(w.shape) == tuple(mine.shape), (w - mine).abs().max().item()


@pytest.mark.parametrize("average", [True, False])
def test_returned_attention_weights_are_the_rows_of_my_queries(average):
    for same_shape, err in run_on_ranks(_weights_on_ranks, 3, average):
        assert same_shape and err <= TOL


# ------------------------------------------------------------------ what stays refused
def _masked_on_ranks(rank, world_size, which):
    manager = DomainParallelManager(world_size, world_size)
    if which == "sdpa_causal":
        net = nn.Sequential(nn.Conv2d(3, 6, 1), SdpaAttention(6, 2, causal=True)).double()
    else:

        class MaskedAttention(GlobalSelfAttention):
            def forward(self, x):
                t = x.flatten(2).transpose(1, 2)
                mask = torch.ones(t.shape[1], t.shape[1], dtype=torch.bool).triu(1)
                return self.mha(t, t, t, attn_mask=mask)[0].transpose(1, 2).reshape(x.shape)

        net = nn.Sequential(nn.Conv2d(3, 6, 1), MaskedAttention(6, 2)).double()
    net = convert_to_domain_parallel(net, manager)
    x = shard_tensor(torch.randn(1, 3, 7, 4, dtype=torch.float64), -2, manager)
    try:
        net(x)
    except ValueError as err:
        return str(err)
    return None


@pytest.mark.parametrize("which", ["sdpa_causal", "mha_attn_mask"])
def test_masks_and_causal_raise_naming_the_module(which):
    for message in run_on_ranks(_masked_on_ranks, 2, which):
        assert message is not None
        path = "1" if which == "sdpa_causal" else "1.mha"
        assert message.startswith(f"{path}: ") and "nonlocal_policy='gather'" in message


class ClassTokenAttention(GlobalSelfAttention):
    """Prepends a token per rank (a class token): not the flattened rows of the shard."""

    def forward(self, x):
        t = x.flatten(2).transpose(1, 2)
        t = torch.cat([t[:, :1], t], 1)
        return self.mha(t, t, t)[0][:, 1:].transpose(1, 2).reshape(x.shape)


def _class_token_on_ranks(rank, world_size):
    manager = DomainParallelManager(world_size, world_size)
    net = convert_to_domain_parallel(nn.Sequential(ClassTokenAttention(6, 2)).double(), manager)
    x = shard_tensor(torch.randn(1, 6, 7, 4, dtype=torch.float64), -2, manager)
    try:
        net(x)
    except ValueError as err:
        return str(err)
    return None


def test_extra_tokens_per_rank_raise_naming_the_module_on_uneven_shards():
    for message in run_on_ranks(_class_token_on_ranks, 2):
        assert message is not None and message.startswith("0.mha: token counts [17, 13]")


class RowAttention(nn.Module):
    """nn.MultiheadAttention within each row (tokens = the W positions of one row)."""

    _domain_local = True

    def __init__(self, c, heads):
        super().__init__()
        self.mha = nn.MultiheadAttention(c, heads, batch_first=True)

    def forward(self, x):
        b, c, h, w = x.shape
        t = x.permute(0, 2, 3, 1).reshape(b * h, w, c)
        return self.mha(t, t, t)[0].reshape(b, h, w, c).permute(0, 3, 1, 2)


def _row_attention_on_ranks(rank, world_size):
    torch.manual_seed(0)
    net = nn.Sequential(nn.Conv2d(3, 6, 3, padding=1), RowAttention(6, 2)).double()
    x = torch.randn(2, 3, 7, 5, generator=torch.Generator().manual_seed(2), dtype=torch.float64)
    errors = exactness_errors(net, x, (), DomainParallelManager(world_size, world_size))
    errors["converted"] = [m for m in net.modules() if isinstance(m, DomainTokenAttention)]
    return errors


def test_multihead_attention_inside_a_declared_row_local_module_is_left_alone_and_exact():
    for errors in run_on_ranks(_row_attention_on_ranks, 3):
        assert errors["converted"] == []
        assert errors["out"] <= TOL and errors["input_grad"] <= TOL, errors
        assert errors["param_grad"] <= TOL, errors


class HandWrittenAttention(nn.Module):
    """Softmax attention over all tokens written by hand: nothing the converter recognises."""

    def __init__(self, c):
        super().__init__()
        self.qkv = nn.Conv2d(c, 3 * c, 1)

    def forward(self, x):
        q, k, v = self.qkv(x).flatten(2).chunk(3, dim=1)
        attn = (q.transpose(1, 2) @ k).softmax(-1)
        return (v @ attn.transpose(1, 2)).reshape(x.shape)


def test_module_named_attention_without_recognised_attention_still_refused():
    net = nn.Sequential(nn.Conv2d(3, 6, 1), HandWrittenAttention(6))
    assert [p for p, _ in find_unsafe_modules(net)] == ["1"]
    with pytest.raises(ValueError, match="1: HandWrittenAttention"):
        convert_to_domain_parallel(net, object())  # nothing communicates


def test_module_named_attention_holding_multihead_attention_is_not_refused():
    net = nn.Sequential(nn.Conv2d(3, 6, 1), GlobalSelfAttention(6, 2), SdpaAttention(6, 2))
    assert find_unsafe_modules(net) == []
    assert recognised_attention_form(net[1].mha) == "sequence"
    assert recognised_attention_form(net[2]) == "sequence"
    assert recognised_attention_form(net[1]) is None  # the parent stays the user's module


# ------------------------------------------------------------------ memory per rank
def _memory_on_ranks(rank, world_size, kind):
    torch.manual_seed(0)
    layer = _layer(kind).double()
    # batch 2 x 3 heads: 6 (batch, head) units, whole shares at d = 2 and 3
    x = torch.randn(2, 6, 24, 8, dtype=torch.float64, requires_grad=True)
    single = saved_activation_bytes(layer, x)
    manager = DomainParallelManager(world_size, world_size)
    layer = convert_to_domain_parallel(layer, manager)
    xl = shard_tensor(x.detach(), -2, manager).requires_grad_()
    return single, saved_activation_bytes(layer, xl)


@pytest.mark.parametrize("domain", [2, 3])
@pytest.mark.parametrize("kind", ["mha", "sdpa"])
def test_token_attention_memory_per_rank_at_most_1_2_over_d(kind, domain):
    for single, per_rank in run_on_ranks(_memory_on_ranks, domain, kind):
        assert per_rank <= 1.2 * single / domain, (kind, domain, single, per_rank)


# ------------------------------------------------------------------ planner
def test_planner_shows_form_sequence_for_the_converted_multihead_attention():
    from credit_parallel.planner import format_plan, make_plan

    model = nn.Sequential(nn.Conv2d(3, 6, 3, padding=1), GlobalSelfAttention(6, 3))
    conf = {"trainer": {"parallelism": {"data": "none", "tensor": 1, "domain": 2}}}
    plan = make_plan(conf, 2, model=model, input_shapes=[(3, 8, 4)])
    assert plan.violations == []
    (layer,) = [layer for layer in plan.layers if layer.path == "1.mha"]
    assert layer.form == "sequence"
    # fp32, batch 1: q, k, v and output (32 tokens x 6 channels) half of it moving, plus
    # the returned weights (3 heads x 32 x 32)
    assert layer.communication_bytes == (4 * 32 * 6 + 3 * 32 * 32) * 4 // 2
    assert layer.activation_bytes == 3 * 2 * 32 * 2 * 4  # 2 of 3 heads on the busiest rank
    text = format_plan(plan)
    assert "1.mha" in text and "sequence" in text


# ------------------------------------------------------------------ the functional-call guard
def _findings(module, x):
    with FunctionalCallGuard(module) as guard:
        guard.mark(x)
        module(x)
    return [(f.path, f.op) for f in guard.findings]


class UndeclaredSdpa(SdpaAttention):
    """F.scaled_dot_product_attention on the shard, not declared: its name says nothing, so
    the converter keeps it (1x1 convs only); the guard is what catches it."""

    _domain_attention = None


class InnerMerge(nn.Module):
    def forward(self, x):  # C and H merged, H inner: rows of the shard interleave
        return x.reshape(x.shape[0], -1, x.shape[-1]).softmax(-1).reshape(x.shape)


def test_guard_flags_undeclared_sdpa_unconverted_mha_and_h_inner_merge_with_paths():
    x = torch.randn(1, 6, 4, 3)
    net = nn.Sequential(nn.Conv2d(6, 6, 1), UndeclaredSdpa(6, 2), GlobalSelfAttention(6, 2))
    net.append(InnerMerge())
    assert _findings(net, x) == [
        ("1", "scaled_dot_product_attention"),
        ("2.mha", "multi_head_attention_forward"),
        ("3", "reshape"),
    ]


def test_guard_follows_tokens_flattened_h_outermost_and_folded_back():
    # flatten(2) / transpose / reshape back are not findings; a softmax or a reduction over
    # the token dim afterwards is (the mark followed the tokens)
    x = torch.randn(1, 6, 4, 3)
    assert _findings(_call(lambda t: t.flatten(2).transpose(1, 2).sigmoid()), x) == []
    tokens_softmax = _call(lambda t: t.flatten(2).transpose(1, 2).softmax(1))
    assert _findings(tokens_softmax, x) == [("<root>", "softmax")]
    assert _findings(_call(lambda t: t.flatten(2).mean(-1)), x) == [("<root>", "mean")]


def _call(fn):
    class Call(nn.Module):
        def forward(self, x):
            return fn(x)

    return Call()


class TokenNet(nn.Module):
    """conv -> global token attention -> conv, for ``credit-parallel verify``."""

    def __init__(self, in_channels=3, out_channels=2, image_height=7, image_width=6, sdpa="mha"):
        super().__init__()
        self.image_height, self.image_width = image_height, image_width
        attention = {"mha": lambda: GlobalSelfAttention(6, 3), "sdpa": lambda: UndeclaredSdpa(6, 3)}
        self.net = nn.Sequential(
            nn.Conv2d(in_channels, 6, 3, padding=1),
            attention[sdpa](),
            nn.Conv2d(6, out_channels, 3, padding=1),
        )

    def forward(self, x):
        return self.net(x)


def _verify_token_net(rank, world_size, attention):
    from credit_parallel.models import MODEL_TYPES
    from credit_parallel.tools.verify import judge, verify_layout

    MODEL_TYPES["token_net"] = TokenNet  # in the forked worker only
    conf = {
        "model": {
            "type": "token_net",
            "in_channels": 3,
            "out_channels": 2,
            "image_height": 7,
            "image_width": 6,
            "sdpa": attention,
        },
        "trainer": {"parallelism": {"domain": world_size}, "seed": 1},
    }
    rows = judge(verify_layout(conf, batch_size=1), torch.float64)
    return [r for r in rows if r[0].startswith("functional call")], [r[-1] for r in rows]


def test_verify_converted_global_attention_has_no_finding():
    for flagged, verdicts in run_on_ranks(_verify_token_net, 2, "mha"):
        assert flagged == []
        assert "FAIL" not in verdicts


def test_verify_flags_undeclared_sdpa_module_with_its_path():
    for flagged, _ in run_on_ranks(_verify_token_net, 2, "sdpa"):
        assert len(flagged) == 1 and flagged[0][-1] == "FAIL"
        assert "net.1: scaled_dot_product_attention" in flagged[0][0]


def test_form_cost_of_declared_sdpa_module_over_its_tokens():
    from credit_parallel.domain.attention import form_cost

    layer = DomainTokenAttention(SdpaAttention(6, 3))
    cost = form_cost(layer, (1, 6, 8, 4), 2, 8)
    assert cost["form"] == "sequence"
    # q, k, v and the output at the input's 6 channels x 32 tokens, half of each moving
    assert cost["communication_bytes"] == 4 * 32 * 6 * 8 // 2
    # 3 heads over 2 ranks: the busiest holds 2 heads of 6 // 3 channels on all 32 tokens
    assert cost["activation_bytes"] == 3 * 2 * 32 * 2 * 8


def _unbatched_on_ranks(rank, world_size):
    torch.manual_seed(0)
    mha = nn.MultiheadAttention(6, 3, add_bias_kv=True).double()
    ref = nn.MultiheadAttention(6, 3, add_bias_kv=True).double()
    ref.load_state_dict(mha.state_dict())
    x = torch.randn(7 * 4, 6, dtype=torch.float64)  # (L, E): 7 rows of 4 tokens, unbatched
    y_ref, w_ref = ref(x, x, x)
    layer = convert_to_domain_parallel(mha, DomainParallelManager(world_size, world_size))
    start, stop = shard_range(7, world_size, rank)
    mine = slice(start * 4, stop * 4)
    y, w = layer(x[mine], x[mine], x[mine])
    return (y - y_ref[mine]).abs().max().item(), (w - w_ref[mine]).abs().max().item()


def test_unbatched_input_with_bias_kv_output_and_weights_exact():
    for out_err, weights_err in run_on_ranks(_unbatched_on_ranks, 3):
        assert out_err <= TOL and weights_err <= TOL


def _no_grad_eval_on_ranks(rank, world_size):
    torch.manual_seed(0)
    # batch_first, self-attention, eval, no grad: the conditions of torch's fused fast path
    # (torch._native_multi_head_attention), which a TorchFunctionMode must turn off
    mha = nn.MultiheadAttention(6, 3, batch_first=True).double().eval()
    ref = nn.MultiheadAttention(6, 3, batch_first=True).double().eval()
    ref.load_state_dict(mha.state_dict())
    x = torch.randn(2, 7 * 4, 6, dtype=torch.float64)
    layer = convert_to_domain_parallel(mha, DomainParallelManager(world_size, world_size))
    start, stop = shard_range(7, world_size, rank)
    mine = x[:, start * 4 : stop * 4]
    with torch.no_grad():
        y_ref = ref(x, x, x, need_weights=False)[0][:, start * 4 : stop * 4]
        y = layer(mine, mine, mine, need_weights=False)[0]
    return (y - y_ref).abs().max().item()


def test_eval_no_grad_fast_path_conditions_still_sequence_parallel_and_exact():
    assert max(run_on_ranks(_no_grad_eval_on_ranks, 2)) <= TOL
