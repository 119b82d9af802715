"""timm's Swin-V2 blocks (the blocks of CREDIT's FuXi) and miles-credit's SwinTransformerV2CrBlock
under latitude sharding, tested against the REAL classes (test dependencies installed by
scripts/setup.sh, imported through tests/miles_credit.py): converted by the default
``convert_to_domain_parallel``, each computes the single-process function on (B, H, W, C) shards
along H — output, input gradient and every parameter gradient summed over the domain ranks
(float64, max abs error <= 1e-10) — with its state_dict keys unchanged, without gathering the
globe."""

from __future__ import annotations

import copy

import pytest
import torch
from torch import nn

from credit_parallel import convert_to_domain_parallel, shard_tensor
from credit_parallel.domain.adapters.recognise import recognised_attention_form
from credit_parallel.domain.adapters.swin import DomainSwinBlock
from credit_parallel.domain.attention import form_cost
from credit_parallel.domain.convert import find_unsafe_modules
from credit_parallel.domain.manager import DomainParallelManager
from credit_parallel.testing import domain_parity_errors, run_on_ranks
from miles_credit import import_credit, import_timm
from test_domain_attention import saved_activation_bytes

TOL = 1e-10
TIMM = "timm.models.swin_transformer_v2"
# window rows -> a height whose shards at 2 and 3 ranks end inside windows, uneven at one of them
# (w=3, H=15: 8/7 and 5/5/5; w=2, H=14: 7/7 and 5/5/4)
HEIGHT = {2: 14, 3: 15}


def _randomise(module: nn.Module) -> nn.Module:
    """float64, and every parameter moved off its init (zero biases, unit norms) so that each
    gradient is a real test."""
    module = module.double()
    with torch.no_grad():
        for p in module.parameters():
            p.add_(0.2 * torch.randn_like(p))
    return module


def timm_block(rows: int, shifted: bool, width: int = 6, **extra):
    """A SwinTransformerV2Block on a (HEIGHT[rows], width) grid with windows of ``rows`` x 4
    (width 6 is padded to 8 by the block itself); shifted by (1, 2) or not."""
    torch.manual_seed(0)
    block = import_timm(TIMM).SwinTransformerV2Block(
        dim=8,
        input_resolution=(HEIGHT[rows], width),
        num_heads=2,
        window_size=(rows, 4),
        shift_size=(1, 2) if shifted else 0,
        mlp_ratio=2.0,
        **extra,
    )
    return _randomise(block)


def credit_block(rows: int, shifted: bool):
    torch.manual_seed(0)
    block = import_credit("credit.models.swin").SwinTransformerV2CrBlock(
        dim=8,
        num_heads=2,
        feat_size=(HEIGHT[rows], 8),
        window_size=(rows, 4),
        shift_size=(1, 2) if shifted else (0, 0),
        mlp_ratio=2.0,
    )
    # its position-bias MLP has a fixed dropout of 0.125: random in training, so no two runs
    # (one process or several) compute the same function
    for m in block.modules():
        if isinstance(m, nn.Dropout):
            m.p = 0.0
    return _randomise(block)


class PermutedStage(nn.Module):
    """What FuXi's UTransformer does around its SwinTransformerV2Stage: a B,C,H,W model that
    permutes to B,H,W,C for the stage and back; a 3x3 conv on either side."""

    def __init__(self, height: int, width: int, rows: int):
        super().__init__()
        self.inp = nn.Conv2d(2, 8, 3, padding=1)
        self.stage = import_timm(TIMM).SwinTransformerV2Stage(
            dim=8,
            out_dim=8,
            input_resolution=(height, width),
            depth=2,
            num_heads=2,
            window_size=(rows, 4),
            mlp_ratio=2.0,
        )
        self.out = nn.Conv2d(8, 2, 3, padding=1)

    def forward(self, x):
        y = self.stage(self.inp(x).permute(0, 2, 3, 1))
        return self.out(y.permute(0, 3, 1, 2))


def _build(kind: str, rows: int, shifted: bool):
    """(module, global input, the dim its input is sharded along)."""
    h = HEIGHT[rows]
    if kind == "timm":
        return timm_block(rows, shifted), torch.randn(2, h, 6, 8, dtype=torch.float64), -3
    if kind == "timm_dynamic_mask":
        block = timm_block(rows, shifted, dynamic_mask=True)
        return block, torch.randn(2, h, 6, 8, dtype=torch.float64), -3
    if kind == "timm_fewer_windows_than_ranks":
        torch.manual_seed(0)
        block = import_timm(TIMM).SwinTransformerV2Block(
            dim=8, input_resolution=(4, 8), num_heads=2, window_size=(2, 4), shift_size=(1, 2)
        )
        return _randomise(block), torch.randn(2, 4, 8, 8, dtype=torch.float64), -3
    if kind == "credit":
        return credit_block(rows, shifted), torch.randn(2, h, 8, 8, dtype=torch.float64), -3
    if kind == "timm_stage_downsample":
        # patch merging of an ODD height (timm pads the 15th row pair at the globe's end) to
        # 8 rows, then a plain and a shifted block of 2-row windows
        torch.manual_seed(0)
        stage = import_timm(TIMM).SwinTransformerV2Stage(
            dim=4, out_dim=8, input_resolution=(15, 8), depth=2, num_heads=2,
            window_size=(2, 4), downsample=True,
        )  # fmt: skip
        return _randomise(stage), torch.randn(1, 15, 8, 4, dtype=torch.float64), -3
    if kind == "credit_patch_merging":
        torch.manual_seed(0)
        merge = import_credit("credit.models.swin").PatchMerging(4)
        return _randomise(merge), torch.randn(2, h, 6, 4, dtype=torch.float64), -3
    if kind == "timm_patch_merging_three_rows":
        torch.manual_seed(0)
        merge = import_timm(TIMM).PatchMerging(4, 8)
        return _randomise(merge), torch.randn(2, 3, 5, 4, dtype=torch.float64), -3
    torch.manual_seed(0)
    if kind == "timm_stage":
        stage = import_timm(TIMM).SwinTransformerV2Stage(
            dim=8, out_dim=8, input_resolution=(h, 8), depth=2, num_heads=2, window_size=(rows, 4)
        )
        return _randomise(stage), torch.randn(1, h, 8, 8, dtype=torch.float64), -3
    assert kind == "permuted_stage"
    return _randomise(PermutedStage(h, 8, rows)), torch.randn(1, 2, h, 8).double(), -2


def _exact_on_ranks(rank, world_size, kind, rows, shifted):
    module, x, dim = _build(kind, rows, shifted)
    manager = DomainParallelManager(world_size, world_size)
    errors = domain_parity_errors(lambda: copy.deepcopy(module), x, manager, shard_dim=dim)
    converted = convert_to_domain_parallel(copy.deepcopy(module), manager)
    forms = sorted({type(m).__name__ for m in converted.modules() if hasattr(m, "domain_form")})
    keys_equal = list(converted.state_dict()) == list(module.state_dict())
    return errors, forms, keys_equal


def _assert_exact(results, blocks: int, forms_expected=("DomainSwinBlock",)):
    for errors, forms, keys_equal in results:
        assert keys_equal
        assert set(forms_expected) <= set(forms) and "DomainGatherModule" not in forms, forms
        least = max(blocks * 10, 2)  # every parameter of every block has its gradient checked
        assert len([k for k in errors if k.startswith("param:")]) >= least, errors.keys()
        bad = {k: v for k, v in errors.items() if v[0] > TOL}
        assert not bad, bad


@pytest.mark.parametrize("domain", [2, 3])
@pytest.mark.parametrize("rows", [2, 3])
@pytest.mark.parametrize("shifted", [False, True], ids=["plain", "shifted"])
def test_timm_swinv2_block_uneven_shards_cut_windows_exact(domain, rows, shifted):
    _assert_exact(run_on_ranks(_exact_on_ranks, domain, "timm", rows, shifted), 1)


def test_timm_swinv2_block_two_window_rows_over_3_ranks_idle_rank_exact():
    # H = 4 in windows of 2 rows: rank 2 owns a row but holds no window while attention runs
    _assert_exact(run_on_ranks(_exact_on_ranks, 3, "timm_fewer_windows_than_ranks", 2, True), 1)


@pytest.mark.parametrize("domain", [2, 3])
def test_timm_swinv2_block_dynamic_mask_shifted_exact(domain):
    _assert_exact(run_on_ranks(_exact_on_ranks, domain, "timm_dynamic_mask", 3, True), 1)


@pytest.mark.parametrize("domain", [2, 3])
@pytest.mark.parametrize("rows", [2, 3])
def test_timm_swinv2_stage_plain_and_shifted_blocks_default_converter_exact(domain, rows):
    _assert_exact(run_on_ranks(_exact_on_ranks, domain, "timm_stage", rows, True), 2)


@pytest.mark.parametrize("domain", [2, 3])
def test_timm_swinv2_stage_patch_merging_odd_h15_then_blocks_exact(domain):
    both = ("DomainSwinPatchMerging", "DomainSwinBlock")
    _assert_exact(run_on_ranks(_exact_on_ranks, domain, "timm_stage_downsample", 2, True), 2, both)


def test_credit_patch_merging_h14_domain3_uneven_shards_exact():
    # shards 5/5/4 of 14 rows; output 7 rows as 3/2/2: rank 0 borrows row 5 from rank 1
    results = run_on_ranks(_exact_on_ranks, 3, "credit_patch_merging", 2, False)
    _assert_exact(results, 0, ("DomainSwinPatchMerging",))


def test_timm_patch_merging_three_rows_over_3_ranks_empty_rank_exact():
    # 3 rows (odd: padded at the globe's end) -> 2 output rows: rank 2 holds none
    results = run_on_ranks(_exact_on_ranks, 3, "timm_patch_merging_three_rows", 2, False)
    _assert_exact(results, 0, ("DomainSwinPatchMerging",))


@pytest.mark.parametrize("domain", [2, 3])
def test_timm_swinv2_stage_between_permutes_in_bchw_model_exact(domain):
    _assert_exact(run_on_ranks(_exact_on_ranks, domain, "permuted_stage", 3, True), 2)


@pytest.mark.parametrize("domain", [2, 3])
@pytest.mark.parametrize("shifted", [False, True], ids=["plain", "shifted"])
def test_credit_swinv2_cr_block_uneven_shards_cut_windows_exact(domain, shifted):
    _assert_exact(run_on_ranks(_exact_on_ranks, domain, "credit", 3, shifted), 1)


# ------------------------------------------------------------------ what cannot be exact
class _Holder(nn.Module):
    def __init__(self, block):
        super().__init__()
        self.swin = block

    def forward(self, x):
        return self.swin(x)


def _padded_timm_block():
    """H = 7 is not a multiple of the 2-row windows: timm pads the rolled grid at its end."""
    torch.manual_seed(0)
    block = import_timm(TIMM).SwinTransformerV2Block(
        dim=8, input_resolution=(7, 8), num_heads=2, window_size=(2, 4), shift_size=(1, 2)
    )
    return _randomise(block)


def _refused_on_ranks(rank, world_size):
    manager = DomainParallelManager(world_size, world_size)
    with pytest.raises(ValueError) as refused:
        convert_to_domain_parallel(_Holder(_padded_timm_block()), manager)
    return str(refused.value)


def test_timm_block_height_not_multiple_of_window_refused_naming_module():
    for message in run_on_ranks(_refused_on_ranks, 2):
        assert "swin: SwinTransformerV2Block" in message
        assert "not a multiple of its 2-row windows" in message
        assert "nonlocal_policy='gather'" in message


def _gathered_on_ranks(rank, world_size):
    manager = DomainParallelManager(world_size, world_size)
    holder = _Holder(_padded_timm_block())
    x = torch.randn(2, 7, 8, 8, dtype=torch.float64)

    def convert(model, mgr):
        with pytest.warns(UserWarning, match="swin"):
            return convert_to_domain_parallel(model, mgr, nonlocal_policy="gather")

    errors = domain_parity_errors(
        lambda: copy.deepcopy(holder), x, manager, convert=convert, shard_dim=-3
    )
    converted = convert(copy.deepcopy(holder), manager)
    return errors, type(converted.swin).__name__, converted.swin.shard_dim


@pytest.mark.parametrize("domain", [2, 3])
def test_timm_block_height_not_multiple_of_window_exact_with_gather_policy_along_h(domain):
    for errors, wrapper, dim in run_on_ranks(_gathered_on_ranks, domain):
        assert (wrapper, dim) == ("DomainGatherModule", -3)
        bad = {k: v for k, v in errors.items() if v[0] > TOL}
        assert not bad, bad


def _refused_at_forward_on_ranks(rank, world_size, height, dynamic_mask):
    """A shifted block converted for 14 rows, then fed a globe of ``height`` rows: with a
    dynamic mask 13 rows are not whole windows; with its static mask (the windows of 14 rows)
    16 rows would make the block itself fail or mix windows on the globe."""
    manager = DomainParallelManager(world_size, world_size)
    block = convert_to_domain_parallel(timm_block(2, True, dynamic_mask=dynamic_mask), manager)
    x = shard_tensor(torch.randn(1, height, 6, 8, dtype=torch.float64), -3, manager)
    with pytest.raises(ValueError) as refused:
        block(x)
    return str(refused.value)


def test_timm_block_global_height_not_multiple_of_window_at_forward_raises():
    for message in run_on_ranks(_refused_at_forward_on_ranks, 2, 13, True):
        assert "SwinTransformerV2Block" in message and "13 rows" in message
        assert "nonlocal_policy='gather'" in message


def test_timm_block_global_height_other_than_its_static_mask_raises():
    for message in run_on_ranks(_refused_at_forward_on_ranks, 2, 16, False):
        assert "SwinTransformerV2Block" in message and "16 x 6" in message


# ------------------------------------------------------------------ recognition, cost, memory
def test_swin_blocks_recognised_by_qualified_name_not_reported_unsafe():
    assert recognised_attention_form(timm_block(3, True)) == "relayout"
    assert recognised_attention_form(credit_block(3, True)) == "relayout"
    stage, _, _ = _build("timm_stage", 3, True)
    assert find_unsafe_modules(stage) == []
    assert find_unsafe_modules(_Holder(_padded_timm_block()))[0][0] == "swin"


def test_swin_block_form_cost_h15_window3_shift1_over_2_ranks():
    # windows of the grid rolled by -1: rank 0 holds window rows 0-2 = global rows 1..9 (owns
    # 0..7: rows 8 and 9 travel), rank 1 window rows 3-4 = rows 10..14 and 0 (row 0 travels)
    wrapped = DomainSwinBlock(timm_block(3, True))
    row = 2 * 6 * 8 * 8  # B * W * C * itemsize of one row of a (2, 15, 6, 8) float64 input
    assert form_cost(wrapped, (2, 15, 6, 8), 2, 8) == {
        "form": "relayout",
        "communication_bytes": 2 * 3 * row,
        "activation_bytes": 9 * row,
    }


def _memory_on_ranks(rank, world_size):
    # a grid of 48 x 32: the block's continuous position-bias MLP runs on the window's
    # (2*2-1) x (2*4-1) offsets on every rank (about 88 kB of saved activations, whatever the
    # grid), small beside the attention's own activations only on a grid of realistic size
    torch.manual_seed(0)
    block = (
        import_timm(TIMM)
        .SwinTransformerV2Block(
            dim=8, input_resolution=(48, 32), num_heads=2, window_size=(2, 4), shift_size=(1, 2)
        )
        .double()
    )
    x = torch.randn(1, 48, 32, 8, dtype=torch.float64, requires_grad=True)
    single = saved_activation_bytes(block, x)
    manager = DomainParallelManager(world_size, world_size)
    wrapped = convert_to_domain_parallel(block, manager)
    xl = shard_tensor(x.detach(), -3, manager).requires_grad_()
    return single, saved_activation_bytes(wrapped, xl), type(wrapped).__name__


@pytest.mark.parametrize("domain", [2, 3])
def test_timm_swin_block_memory_per_rank_at_most_1_2_over_d(domain):
    for single, per_rank, wrapper in run_on_ranks(_memory_on_ranks, domain):
        assert wrapper == "DomainSwinBlock"
        assert per_rank <= 1.2 * single / domain, (domain, single, per_rank)


def test_plan_of_bchw_model_with_timm_stage_reads_h_of_the_blocks_at_dim_minus_3():
    from credit_parallel.planner import make_plan

    conf = {"trainer": {"parallelism": {"data": "none", "tensor": 1, "domain": 2}}}
    plan = make_plan(conf, 2, model=PermutedStage(15, 8, 3), input_shapes=[(2, 15, 8)])
    assert plan.violations == []
    blocks = {layer.path: layer for layer in plan.layers if layer.kind == "DomainSwinBlock"}
    assert sorted(blocks) == ["stage.blocks.0", "stage.blocks.1"]
    row = 8 * 8 * 4  # W * C * float32 bytes at batch 1
    plain, shifted = blocks["stage.blocks.0"], blocks["stage.blocks.1"]
    assert (plain.in_height, plain.out_rows, plain.form) == (15, (8, 7), "relayout")
    # plain windows of 3 rows over 8 + 7 rows: row 8 travels; shifted by 1: rows 8, 9 and 0
    assert (plain.communication_bytes, shifted.communication_bytes) == (2 * row, 2 * 3 * row)
    assert plain.rows_received == (1, 0) and shifted.rows_received == (2, 1)


class _PermutedDownsampleStage(nn.Module):
    def __init__(self):
        super().__init__()
        self.inp = nn.Conv2d(2, 4, 3, padding=1)
        self.stage = import_timm(TIMM).SwinTransformerV2Stage(
            dim=4, out_dim=8, input_resolution=(15, 8), depth=2, num_heads=2,
            window_size=(2, 4), downsample=True,
        )  # fmt: skip

    def forward(self, x):
        return self.stage(self.inp(x).permute(0, 2, 3, 1)).permute(0, 3, 1, 2)


def test_plan_of_timm_patch_merging_h15_over_3_ranks_row_pairs():
    from credit_parallel.planner import make_plan

    conf = {"trainer": {"parallelism": {"data": "none", "tensor": 1, "domain": 3}}}
    plan = make_plan(conf, 3, model=_PermutedDownsampleStage(), input_shapes=[(2, 15, 8)])
    assert plan.violations == []
    merge = next(layer for layer in plan.layers if layer.kind == "patch_merging")
    # 15 rows as 5/5/5 -> 8 rows as 3/3/2: ranks read rows 0-5, 6-11, 12-14
    assert (merge.in_height, merge.out_height, merge.out_rows) == (15, 8, (3, 3, 2))
    assert merge.rows_received == (1, 2, 0)
