"""Gradient collectives versus single-process references: bucketed all-reduce, domain gradient
sync and global-norm clipping over plain, TP, FSDP2 and 2-D (dp x tp) gradients."""

from __future__ import annotations

import copy
import math
import warnings

import pytest
import torch
import torch._dynamo  # noqa: F401  (see below)
import torch.distributed as dist
import torch.nn as nn
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import DTensor, Replicate, Shard, distribute_tensor

from credit_parallel import (
    allreduce_grads_avg,
    apply_fsdp2,
    build_device_mesh,
    clip_grad_norm_,
    sync_domain_gradients,
)
from credit_parallel.testing import run_on_ranks

__all__: list[str] = []

# DTensor imports torch._dynamo lazily on first use (several seconds); importing it above, in the
# parent, means the forked workers inherit it instead of each importing it again.

F64_TOL = 1e-10


class _AllReduceCounter:
    """Counts the reductions made in a with-block: ``all_reduce`` calls, and the batches of
    point-to-point sends that stand in for one on small gloo groups (small_collectives)."""

    def __enter__(self):
        self.calls = 0
        self._originals = dist.all_reduce, dist.batch_isend_irecv

        def counting(original):
            def call(*args, **kwargs):
                self.calls += 1
                return original(*args, **kwargs)

            return call

        dist.all_reduce, dist.batch_isend_irecv = map(counting, self._originals)
        return self

    def __exit__(self, *exc):
        dist.all_reduce, dist.batch_isend_irecv = self._originals


def _rel_err(a: torch.Tensor, b: torch.Tensor) -> float:
    return ((a.double() - b.double()).abs().max() / b.double().abs().max()).item()


# --------------------------------------------------------------------------------------------
# allreduce_grads_avg


def _mixed_grads(rank: int) -> list[torch.Tensor | None]:
    """f32/f64 gradients in awkward layouts, different on every rank."""
    g = torch.Generator().manual_seed(100 + rank)
    return [
        torch.randn(3, 4, generator=g),  # f32, contiguous, 48 B
        None,
        torch.randn(5, 3, dtype=torch.float64, generator=g).t(),  # f64 transposed, 120 B
        torch.randn(2, 3, 4, 5, generator=g).to(memory_format=torch.channels_last),  # f32 480 B
        torch.randn(7, dtype=torch.float64, generator=g),  # f64 56 B
        None,
        torch.randn(6, 8, generator=g)[:, ::2],  # f32 strided slice, 96 B
        torch.randn((), generator=g),  # f32 0-dim, 4 B
    ]


def _allreduce_worker(rank, world, bucket_cap_mb):
    grads = _mixed_grads(rank)
    ids = [id(t) for t in grads]
    strides = [None if t is None else t.stride() for t in grads]
    with _AllReduceCounter() as counter:
        allreduce_grads_avg(grads, None, bucket_cap_mb=bucket_cap_mb)
    same_objects = [id(t) for t in grads] == ids
    same_strides = [None if t is None else t.stride() for t in grads] == strides
    return grads, counter.calls, same_objects, same_strides


@pytest.mark.parametrize(
    "bucket_cap_mb, expected_calls",
    [
        (25.0, 2),  # one bucket per dtype
        (200 / 2**20, 4),  # 200 B: f32 -> [a] [c] [slice, scalar], f64 -> [b, d]
        (1e-9, 6),  # every tensor alone
    ],
)
def test_allreduce_grads_avg_mixed_layouts_3_ranks_matches_mean(bucket_cap_mb, expected_calls):
    results = run_on_ranks(_allreduce_worker, 3, bucket_cap_mb)
    per_rank = [_mixed_grads(r) for r in range(3)]
    for grads, calls, same_objects, same_strides in results:
        assert calls == expected_calls
        assert same_objects and same_strides
        assert grads[3].is_contiguous(memory_format=torch.channels_last)
        for i, got in enumerate(grads):
            if per_rank[0][i] is None:
                assert got is None
                continue
            expected = sum(pr[i] for pr in per_rank) / 3
            assert got.dtype == expected.dtype
            if got.dtype == torch.float64:
                assert (got - expected).abs().max().item() <= F64_TOL
            else:
                assert _rel_err(got, expected) <= 1e-6


def _dtensor_allreduce_worker(rank, world):
    # (tp, domain) = (2, 2): domain innermost, so domain groups are {0,1} and {2,3}.
    mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("tp", "domain"))
    domain_coord = mesh.get_local_rank("domain")
    full = torch.randn(
        5, 3, dtype=torch.float64, generator=torch.Generator().manual_seed(7 + domain_coord)
    )
    grad = distribute_tensor(full, mesh["tp"], [Shard(0)])  # uneven: 3 + 2 rows
    storage_before = grad.to_local().data_ptr()
    allreduce_grads_avg([grad, None], mesh["domain"].get_group())
    assert grad.to_local().data_ptr() == storage_before  # written back in place
    return type(grad).__name__, tuple(grad.placements), grad.full_tensor()


def test_allreduce_grads_avg_dtensor_reduces_local_shards_over_domain_group():
    results = run_on_ranks(_dtensor_allreduce_worker, 4)
    fulls = [
        torch.randn(5, 3, dtype=torch.float64, generator=torch.Generator().manual_seed(7 + d))
        for d in (0, 1)
    ]
    expected = (fulls[0] + fulls[1]) / 2
    for kind, placements, full in results:
        assert kind == "DTensor" and placements == (Shard(0),)
        assert (full - expected).abs().max().item() <= F64_TOL


def test_allreduce_grads_avg_single_process_group_of_one_is_identity():
    def worker(rank, world):
        grads = _mixed_grads(0)
        with _AllReduceCounter() as counter:
            allreduce_grads_avg(grads, None)
        return grads, counter.calls

    grads, calls = run_on_ranks(worker, 1)[0]
    assert calls == 0
    for got, ref in zip(grads, _mixed_grads(0)):
        assert (got is None and ref is None) or torch.equal(got, ref)


# --------------------------------------------------------------------------------------------
# sync_domain_gradients


class _FakeManager:
    def __init__(self, domain_group, domain_world_size):
        self.domain_group = domain_group
        self.domain_world_size = domain_world_size


class _RowModel(nn.Module):
    """Acts on each row independently, so sharding rows over domain ranks is exact."""

    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(3, 4)
        self.head = nn.Linear(4, 2)
        self.unused = nn.Parameter(torch.ones(3))

    def forward(self, x):
        return self.head(torch.tanh(self.lin(x)))


def _row_loss_terms(model, x):
    return model(x).pow(2).sum(dim=1)


def _sync_worker(rank, world):
    groups = [dist.new_group([0, 1]), dist.new_group([2, 3])]
    group_index, domain_rank = divmod(rank, 2)
    manager = _FakeManager(groups[group_index], 2)
    torch.manual_seed(0)
    model = _RowModel().double()
    reference = copy.deepcopy(model)
    # Each domain group has its own global batch, so a reduction leaking across groups shows.
    x = torch.randn(9, 3, dtype=torch.float64, generator=torch.Generator().manual_seed(group_index))
    out = {}

    # avg: equal shards (8 rows -> 4 + 4), loss = mean over the rank's own shard.
    model.zero_grad(set_to_none=True)
    _row_loss_terms(model, x[:8].chunk(2)[domain_rank]).mean().backward()
    sync_domain_gradients(model, manager, op="avg")
    reference.zero_grad(set_to_none=True)
    _row_loss_terms(reference, x[:8]).mean().backward()
    out["avg"] = max(
        (p.grad - q.grad).abs().max().item()
        for p, q in zip(model.parameters(), reference.parameters())
        if q.grad is not None
    )
    out["unused_grad_is_none"] = model.unused.grad is None

    # sum: uneven shards (9 rows -> 5 + 4), loss = local sum / global count.
    model.zero_grad(set_to_none=True)
    local = torch.tensor_split(x, 2)[domain_rank]
    (_row_loss_terms(model, local).sum() / x.shape[0]).backward()
    sync_domain_gradients(model, manager, op="sum")
    reference.zero_grad(set_to_none=True)
    _row_loss_terms(reference, x).mean().backward()
    out["sum"] = max(
        (p.grad - q.grad).abs().max().item()
        for p, q in zip(model.parameters(), reference.parameters())
        if q.grad is not None
    )

    # domain size 1: nothing is communicated, nothing changes.
    before = [p.grad.clone() for p in model.parameters() if p.grad is not None]
    with _AllReduceCounter() as counter:
        sync_domain_gradients(model, _FakeManager(None, 1), op="sum")
        sync_domain_gradients(model, None)
    out["size1_calls"] = counter.calls
    out["size1_unchanged"] = all(
        torch.equal(a, p.grad)
        for a, p in zip(before, [p for p in model.parameters() if p.grad is not None])
    )
    return out


def test_sync_domain_gradients_avg_equal_shards_and_sum_uneven_shards_match_single_process():
    for out in run_on_ranks(_sync_worker, 4):
        assert out["avg"] <= F64_TOL
        assert out["sum"] <= F64_TOL
        assert out["unused_grad_is_none"]
        assert out["size1_calls"] == 0 and out["size1_unchanged"]


def test_sync_domain_gradients_rejects_unknown_op():
    with pytest.raises(ValueError, match="op"):
        sync_domain_gradients(_RowModel(), _FakeManager(None, 2), op="max")


# --------------------------------------------------------------------------------------------
# clip_grad_norm_

# (max_norm, norm_type): each norm type once with clipping and once without.
_CLIP_CASES = [(0.05, 2.0), (1e3, 2.0), (0.01, math.inf), (1e3, math.inf), (0.05, 3.0)]


def _run_clip_cases(populate_grads, parallel_params, full_grads, reference):
    """For every case: fresh gradients, clip both, compare norm and clipped gradients."""
    results = []
    for max_norm, norm_type in _CLIP_CASES:
        populate_grads()
        ref_params = [q for q in reference.parameters() if q.grad is not None]
        ref_norm = torch.nn.utils.clip_grad_norm_(ref_params, max_norm, norm_type)
        norm = clip_grad_norm_(parallel_params(), max_norm, norm_type)
        grad_err = max(
            (got - q.grad).abs().max().item() for got, q in zip(full_grads(), ref_params)
        )
        results.append(
            {
                "norm": norm,
                "ref_norm": ref_norm.item(),
                "grad_err": grad_err,
                "clipped": ref_norm.item() > max_norm,
                "is_plain": type(norm) is torch.Tensor,
            }
        )
    return results


def _check_clip_results(all_ranks):
    for case_index, (max_norm, _) in enumerate(_CLIP_CASES):
        per_rank = [r[case_index] for r in all_ranks]
        first = per_rank[0]["norm"]
        for res in per_rank:
            assert res["is_plain"]
            assert torch.equal(res["norm"], first)  # identical on every rank
            assert abs(res["norm"].item() - res["ref_norm"]) <= F64_TOL
            assert res["grad_err"] <= F64_TOL
        # the cases really exercise both branches
        assert per_rank[0]["clipped"] == (max_norm < 1.0)


def _plain_worker(rank, world):
    torch.manual_seed(0)
    model = _RowModel().double()
    reference = copy.deepcopy(model)
    x = torch.randn(6, 3, dtype=torch.float64, generator=torch.Generator().manual_seed(1))

    def populate():
        for m in (model, reference):
            m.zero_grad(set_to_none=True)
            m(x).pow(2).mean().backward()

    return _run_clip_cases(
        populate,
        model.parameters,
        lambda: [p.grad for p in model.parameters() if p.grad is not None],
        reference,
    )


def test_clip_grad_norm_plain_replicated_2_ranks_matches_torch():
    _check_clip_results(run_on_ranks(_plain_worker, 2))


_TP_SPECS = [  # (shape, placement on the 1-D tp mesh) -- uneven and empty shards on 3 ranks
    ((5, 4), Shard(0)),
    ((3, 7), Shard(1)),
    ((2, 3), Shard(0)),  # rank 2 holds an empty shard
    ((4,), Replicate()),
    ((6,), None),  # a plain tensor
]


def _tp_full_grads():
    g = torch.Generator().manual_seed(3)
    return [torch.randn(*shape, dtype=torch.float64, generator=g) for shape, _ in _TP_SPECS]


def _tp_worker(rank, world):
    tp_mesh = init_device_mesh("cpu", (world,), mesh_dim_names=("tp",))
    params, ref_params = [], []
    for shape, placement in _TP_SPECS:
        value = torch.zeros(shape, dtype=torch.float64)
        ref_params.append(nn.Parameter(value.clone()))
        if placement is None:
            params.append(nn.Parameter(value))
        else:
            params.append(nn.Parameter(distribute_tensor(value, tp_mesh, [placement])))
    reference = nn.ParameterList(ref_params)

    def populate():
        for p, q, grad, (_, placement) in zip(params, ref_params, _tp_full_grads(), _TP_SPECS):
            q.grad = grad.clone()
            if placement is None:
                p.grad = grad.clone()
            else:
                p.grad = distribute_tensor(grad.clone(), tp_mesh, [placement])

    def full_grads():
        return [p.grad.full_tensor() if isinstance(p.grad, DTensor) else p.grad for p in params]

    return _run_clip_cases(populate, lambda: params, full_grads, reference)


def test_clip_grad_norm_tp_dtensors_3_ranks_counts_shards_once():
    _check_clip_results(run_on_ranks(_tp_worker, 3))


class _Block(nn.Module):
    _fsdp2_shard = True

    def __init__(self, dim):
        super().__init__()
        self.lin = nn.Linear(dim, dim)

    def forward(self, x):
        return torch.tanh(self.lin(x))


class _FsdpNet(nn.Module):
    def __init__(self):
        super().__init__()
        self.inp = nn.Linear(3, 5)  # odd sizes: uneven FSDP shards
        self.b1 = _Block(5)
        self.b2 = _Block(5)
        self.out = nn.Linear(5, 3)

    def forward(self, x):
        return self.out(self.b2(self.b1(self.inp(x))))


def _fsdp_worker(rank, world):
    torch.manual_seed(0)
    reference = _FsdpNet().double()
    model = apply_fsdp2(
        copy.deepcopy(reference), None, {"trainer": {"amp": False, "fsdp2_min_unit_params": 0}}
    )
    x = torch.randn(8, 3, dtype=torch.float64, generator=torch.Generator().manual_seed(2))

    def populate():
        model.zero_grad(set_to_none=True)
        model(x.chunk(world)[rank]).pow(2).mean().backward()
        reference.zero_grad(set_to_none=True)
        reference(x).pow(2).mean().backward()

    def full_grads():
        assert all(isinstance(p.grad, DTensor) for p in model.parameters())
        return [p.grad.full_tensor() for p in model.parameters()]

    return _run_clip_cases(populate, model.parameters, full_grads, reference)


def test_clip_grad_norm_fsdp2_2_dp_ranks_matches_single_process():
    _check_clip_results(run_on_ranks(_fsdp_worker, 2))


class _TPBlock(nn.Module):
    """Column-parallel `up` then row-parallel `down` when the weights are tp DTensors."""

    _fsdp2_shard = True

    def __init__(self):
        super().__init__()
        self.up = nn.Linear(4, 6)
        self.down = nn.Linear(6, 3)

    def forward(self, x):
        if not isinstance(self.up.weight, DTensor):
            return self.down(torch.tanh(self.up(x)))
        mesh = self.up.weight.device_mesh
        hidden = torch.tanh(self.up(DTensor.from_local(x, mesh, [Replicate()])))
        return self.down(hidden).redistribute(mesh, [Replicate()]).to_local().clone()


class _TPNet(nn.Module):
    def __init__(self):
        super().__init__()
        self.inp = nn.Linear(3, 4)
        self.block = _TPBlock()
        self.out = nn.Linear(3, 2)

    def forward(self, x):
        return self.out(self.block(self.inp(x)))


def _distribute_tp_block(block, tp_mesh):
    specs = {
        "up.weight": Shard(0),
        "up.bias": Shard(0),
        "down.weight": Shard(1),
        "down.bias": Replicate(),
    }
    for name, placement in specs.items():
        owner_name, attr = name.split(".")
        owner = getattr(block, owner_name)
        value = getattr(owner, attr).detach()
        setattr(owner, attr, nn.Parameter(distribute_tensor(value, tp_mesh, [placement])))


def _dp_tp_worker(rank, world):
    mesh, submeshes = build_device_mesh({"data": "fsdp2", "tensor": 2}, device="cpu")
    torch.manual_seed(0)
    reference = _TPNet().double()
    model = copy.deepcopy(reference)
    _distribute_tp_block(model.block, submeshes["tp"])
    apply_fsdp2(model, submeshes["dp"], {"trainer": {"fsdp2_min_unit_params": 0}})
    x = torch.randn(8, 3, dtype=torch.float64, generator=torch.Generator().manual_seed(4))
    dp_rank = mesh.get_local_rank("dp")

    def populate():
        model.zero_grad(set_to_none=True)
        model(x.chunk(2)[dp_rank]).pow(2).mean().backward()
        reference.zero_grad(set_to_none=True)
        reference(x).pow(2).mean().backward()

    def full_grads():
        return [p.grad.full_tensor() for p in model.parameters()]

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        results = _run_clip_cases(populate, model.parameters, full_grads, reference)
    # the mix this test is about: 1-D dp DTensors and 2-D (dp, tp) DTensors with a Replicate axis
    ndims = {p.grad.device_mesh.ndim for p in model.parameters()}
    assert ndims == {1, 2}, ndims
    return results


def test_clip_grad_norm_2x2_dp_tp_mesh_4_ranks_matches_single_process():
    _check_clip_results(run_on_ranks(_dp_tp_worker, 4))


def _hand_sharded_worker(rank, world):
    full = torch.randn(6, 3, dtype=torch.float64, generator=torch.Generator().manual_seed(5))
    piece = nn.Parameter(torch.zeros(3, 3, dtype=torch.float64))
    piece.grad = full.chunk(world)[rank].clone()
    norm = clip_grad_norm_([piece], 0.1, groups=[dist.group.WORLD])
    return norm, piece.grad


def test_clip_grad_norm_groups_sums_hand_sharded_plain_gradients():
    full = torch.randn(6, 3, dtype=torch.float64, generator=torch.Generator().manual_seed(5))
    ref = nn.Parameter(torch.zeros(6, 3, dtype=torch.float64))
    ref.grad = full.clone()
    ref_norm = torch.nn.utils.clip_grad_norm_([ref], 0.1)
    results = run_on_ranks(_hand_sharded_worker, 2)
    for norm, _ in results:
        assert abs(norm.item() - ref_norm.item()) <= F64_TOL
    clipped = torch.cat([grad for _, grad in results])
    assert (clipped - ref.grad).abs().max().item() <= F64_TOL


@pytest.mark.parametrize("bad", [math.inf, math.nan])
def test_clip_grad_norm_nonfinite_norm_is_returned_and_grads_left_alone(bad):
    # Plain gradients need no process group.
    param = nn.Parameter(torch.zeros(4))
    param.grad = torch.tensor([1.0, bad, 2.0, 3.0])
    before = param.grad.clone()
    norm = clip_grad_norm_([param], 1.0)
    assert not torch.isfinite(norm)
    assert torch.equal(param.grad.nan_to_num(), before.nan_to_num())
    with pytest.raises(RuntimeError, match="non-finite"):
        clip_grad_norm_([param], 1.0, error_if_nonfinite=True)


def test_clip_grad_norm_rejects_bad_norm_type_and_handles_no_grads():
    param = nn.Parameter(torch.ones(3))
    param.grad = torch.ones(3)
    for bad in (0, -1.0, -math.inf):
        with pytest.raises(ValueError, match="norm_type"):
            clip_grad_norm_([param], 1.0, norm_type=bad)
    assert clip_grad_norm_([nn.Parameter(torch.ones(2))], 1.0).item() == 0.0


def test_clip_grad_norm_bf16_grads_returns_float32_close_to_torch():
    param = nn.Parameter(torch.zeros(50, dtype=torch.bfloat16))
    grad = torch.linspace(-3, 3, 50).to(torch.bfloat16)
    param.grad = grad.clone()
    norm = clip_grad_norm_([param], 0.5)
    ref = torch.linalg.vector_norm(grad.float())
    assert norm.dtype == torch.float32
    assert abs(norm.item() - ref.item()) <= 1e-6 * ref.item()
    expected = (grad.float() * (0.5 / (ref + 1e-6))).to(torch.bfloat16)
    assert _rel_err(param.grad, expected) <= 1e-2
