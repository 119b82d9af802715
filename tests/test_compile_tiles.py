"""``torch.compile`` on lat x lon tiles (issue 26, SPEC §3b / §5a): the 2-D tile exchange traced
as the ``credit_parallel::`` operators, the global heights AND widths derived at trace time
(``domain/traced_heights.py``: each axis view of the tiled manager keeps its own table).

* the whole model, ``torch.compile(parallelize(m, conf))`` and ``parallelize(torch.compile(m),
  conf)``, with no eager call first: the conv + GroupNorm net and the bundled U-Net at
  ``{lat 2, lon 2}`` and on uneven tiles (``{lat 1, lon 3}``: 16 columns as 6/5/5; ``{lat 3,
  lon 2}``: 13 rows as 5/4/4, 11 columns as 6/5) compute the single-process eager function
  (float64 1e-10: output, input gradient, every parameter gradient after the domain gradient
  sum, and a second call), and ``torch._dynamo.explain`` finds one graph and no break;
  ``aot_eager`` and (slow) ``inductor``; also a circular conv, reflection / replication pads,
  a strided conv, a transposed conv and pixel (un)shuffle in one graph;
* per block (``trainer.compile: true``: ``compile_blocks``) through ``parallelize``: the same;
* the trainer with ``compile: true`` at ``{lat 2, lon 2}`` trains like the eager trainer.
"""

from __future__ import annotations

import copy

import pytest
import torch
from torch import nn

from credit_parallel import (
    compile_blocks,
    gather_tensor,
    get_domain_manager,
    get_raw_model,
    parallelize,
    shard_batch,
    shard_tensor,
    sync_domain_gradients,
)
from credit_parallel.parallel.compile import compile_targets, is_compiled
from credit_parallel.testing import run_on_ranks
from test_compile_whole import _build as _build_1d
from test_compile_whole import _full

TOL = 1e-10


class _LayerMix(nn.Module):
    """The other tile layer families in one graph: a circular (longitude-wrapping) conv, a
    reflection pad, a strided conv, a transposed conv, pixel (un)shuffle, a replication pad."""

    def __init__(self):
        super().__init__()
        self.wrap = nn.Conv2d(3, 8, 3, padding=1, padding_mode="circular")
        self.pad = nn.ReflectionPad2d(1)
        self.down = nn.Conv2d(8, 8, 3, stride=2)
        self.up = nn.ConvTranspose2d(8, 4, 3, stride=2, padding=1, output_padding=1)
        self.unshuffle = nn.PixelUnshuffle(2)
        self.shuffle = nn.PixelShuffle(2)
        self.out = nn.Sequential(nn.ReplicationPad2d((1, 1, 2, 0)), nn.Conv2d(4, 4, 3))

    def forward(self, x):
        y = self.up(self.down(self.pad(torch.relu(self.wrap(x)))))
        return self.out(self.shuffle(self.unshuffle(y)))


def _build(name):
    if name == "mix":
        torch.manual_seed(0)
        return _LayerMix()
    if name == "crossformer":  # its attention runs on latitude strips (tiles_relayout.py)
        from credit_parallel.models.crossformer import CrossFormer

        torch.manual_seed(0)
        return CrossFormer(
            3, 2, 24, 16, dims=(8, 8), depths=(2, 2), dim_head=4, window_sizes=(2, 2)
        )
    return _build_1d(name)


def _parallel(model, how, backend, shape, tensor=1):
    import credit_parallel.parallel.composition as composition

    conf = {"trainer": {"parallelism": {"data": "none", "tensor": tensor}}}
    conf["trainer"]["parallelism"]["domain"] = {"lat": shape[0], "lon": shape[1]}
    if how == "compile_then_parallelize":  # CREDIT's trainer order
        return parallelize(torch.compile(model, backend=backend), conf)
    if how == "parallelize_then_compile":
        return torch.compile(parallelize(model, conf), backend=backend)
    # trainer.compile: true (compile_blocks per block), with the test's backend
    composition.compile_blocks = lambda m: compile_blocks(m, backend=backend)
    conf["trainer"]["compile"] = True
    model = parallelize(model, conf)
    assert [n for n, m in compile_targets(model) if is_compiled(m)]
    return model


def _tile_worker(rank, world, name, how, backend, h, w, shape, tensor=1):
    torch.set_default_dtype(torch.float64)
    ref = _build(name)
    model = _parallel(copy.deepcopy(ref), how, backend, shape, tensor)
    mgr = get_domain_manager(model)
    assert mgr.domain_shape == shape
    x = torch.randn(2, 3, h, w, generator=torch.Generator().manual_seed(1))
    xr = x.clone().requires_grad_()
    yr = ref(xr)
    weights = torch.randn(yr.shape, generator=torch.Generator().manual_seed(2))
    (yr * weights).sum().backward()
    if how == "compile_then_parallelize":  # shard_batch registers the global shape
        xl = shard_batch({"x": x}, manager=mgr)["x"].detach().requires_grad_()
    else:
        xl = shard_tensor(x, -2, mgr).detach().requires_grad_()
    assert xl.shape[-1] < w  # a tile: columns split too
    y = model(xl)  # whole-model compile: traced and compiled at once, no eager call first
    (y * shard_tensor(weights, -2, mgr, register=False)).sum().backward()
    errors = {
        "output": float((gather_tensor(y.detach(), -2, mgr) - yr.detach()).abs().max()),
        "input_grad": float((gather_tensor(xl.grad, -2, mgr) - xr.grad).abs().max()),
    }
    inner = getattr(model, "_orig_mod", model)
    sync_domain_gradients(inner, mgr, op="sum")
    reference = dict(ref.named_parameters())
    for pname, p in inner.named_parameters():
        errors[f"param:{pname}"] = float((_full(p.grad) - reference[pname].grad).abs().max())
    assert len(errors) == 2 + len(reference)
    if name == "tp":  # found by the guard's trace on the meta twin at the global H x W
        assert get_raw_model(model)._tp_partial_gradient_report.modules == ["block.pos"]
    again = model(shard_tensor(x, -2, mgr))  # the compiled graph (a new token: retraced)
    errors["second_call"] = float(
        (gather_tensor(again.detach(), -2, mgr) - yr.detach()).abs().max()
    )
    if how == "blocks":
        return errors, None, None, []
    explained = torch._dynamo.explain(model)(shard_tensor(x, -2, mgr))
    reasons = [str(b.reason)[:300] for b in explained.break_reasons]
    return errors, explained.graph_break_count, explained.graph_count, reasons


def _check(results, whole=True):
    for errors, breaks, graphs, reasons in results:
        bad = {k: v for k, v in errors.items() if v > TOL}
        assert not bad, bad
        if whole:
            assert breaks == 0 and graphs == 1, (breaks, graphs, reasons)


@pytest.mark.parametrize(
    "order",
    ["compile_then_parallelize", pytest.param("parallelize_then_compile", marks=pytest.mark.slow)],
)
def test_whole_model_compile_on_2x2_tiles_matches_single_process(order):
    # 13 x 10: rows 7/6, columns 5/5 (the conv + GroupNorm + dilated conv net)
    _check(run_on_ranks(_tile_worker, 4, "net", order, "aot_eager", 13, 10, (2, 2), timeout=600))


@pytest.mark.parametrize(
    "order",
    ["parallelize_then_compile", "compile_then_parallelize"],
)
@pytest.mark.slow  # 40-50 s each on 2 loaded cores
def test_crossformer_compiled_whole_on_tiles_with_its_attention_on_strips(order):
    # 24 x 16 at {lat 2, lon 2}: the convolutions on tiles, each attention module moved to
    # latitude strips and back (the all-to-all traced as credit_parallel::all_to_all); the
    # heights over the strips noted by the shape twin at trace time: one graph, no break
    _check(run_on_ranks(_tile_worker, 4, "crossformer", order, "aot_eager", 24, 16, (2, 2),
                        timeout=900))  # fmt: skip


@pytest.mark.slow  # ~30 s on 2 loaded cores
def test_whole_model_compile_of_the_other_tile_layers_matches_single_process():
    # 12 x 10 at {lat 2, lon 2}: rows 6/6, columns 5/5 (after the pad 7/7 x 6/6, the strided
    # conv 3/3 x 3/2: uneven); the circular conv wraps longitude across the two lon ranks
    args = ("mix", "parallelize_then_compile", "aot_eager", 12, 10, (2, 2))
    _check(run_on_ranks(_tile_worker, 4, *args, timeout=600))


@pytest.mark.slow
def test_whole_model_compile_on_uneven_3x2_tiles_matches_single_process():
    # 6 ranks: rows 5/4/4, columns 6/5
    args = ("net", "parallelize_then_compile", "aot_eager", 13, 11, (3, 2))
    _check(run_on_ranks(_tile_worker, 6, *args, timeout=900))


@pytest.mark.slow  # 60-70 s each on 2 loaded cores
@pytest.mark.parametrize(
    "order, shape", [("compile_then_parallelize", (1, 3)), ("parallelize_then_compile", (2, 2))]
)
def test_bundled_unet_compiled_whole_on_tiles_matches_single_process(order, shape):
    # 16 x 16; (1, 3): columns 6/5/5 down to 2/1/1 at the bottom level (interpolation, pads)
    _check(run_on_ranks(_tile_worker, 3 if shape == (1, 3) else 4, "unet", order, "aot_eager",
                        16, 16, shape, timeout=900))  # fmt: skip


@pytest.mark.slow
@pytest.mark.timeout(900)  # inductor's C++ builds: minutes on a loaded 2-core machine
def test_whole_model_compile_on_tiles_inductor_matches_single_process():
    args = ("net", "parallelize_then_compile", "inductor", 13, 11, (1, 2))
    _check(run_on_ranks(_tile_worker, 2, *args, timeout=900))


@pytest.mark.slow
@pytest.mark.timeout(1200)  # inductor's C++ builds on 4 ranks: minutes on a loaded 2-core machine
def test_bundled_unet_compiled_whole_with_inductor_on_2x2_tiles_matches_single_process():
    # 16 x 16 at {lat 2, lon 2}: the U-Net's convs, GroupNorms, interpolation and pads on
    # 8 x 8 tiles (2 x 2 at the bottom level), inductor's generated kernels against eager
    args = ("unet", "parallelize_then_compile", "inductor", 16, 16, (2, 2))
    _check(run_on_ranks(_tile_worker, 4, *args, timeout=1200))


@pytest.mark.parametrize(
    "name, shape", [pytest.param("unet", (2, 2), marks=pytest.mark.slow), ("net", (1, 3))]
)
def test_trainer_compile_blocks_on_tiles_matches_single_process(name, shape):
    # compile_blocks: the first call per input shape eager (notes the heights and widths)
    h, w = (16, 16) if name == "unet" else (13, 11)
    world = shape[0] * shape[1]
    results = run_on_ranks(_tile_worker, world, name, "blocks", "aot_eager", h, w, shape,
                           timeout=900)  # fmt: skip
    _check(results, whole=False)


def _trainer_worker(rank, world, store, data):
    import credit_parallel.train.model_init as model_init
    from credit_parallel.train.trainer import Trainer
    from sample_conf import tiny_unet_conf

    model_init.compile_blocks = lambda m: compile_blocks(m, backend="aot_eager")
    out = {}
    for compiled in (False, True):
        trainer_conf = {
            "parallelism": {"data": data, "tensor": 1, "domain": {"lat": 2, "lon": 2}},
            "steps": 2,
            "batch_size": 2,
            "dtype": "float64",
            "seed": 3,
            "compile": compiled,
        }
        conf = tiny_unet_conf(store, 17, 30, time_slice=[0, 20], trainer=trainer_conf)
        trainer = Trainer(conf)
        losses = [trainer.train_step()["loss"] for _ in range(2)]
        params = {n: _full(p.detach()).clone() for n, p in trainer.model.named_parameters()}
        names = [n for n, m in compile_targets(trainer.model) if is_compiled(m)]
        out[compiled] = (losses, params, names)
    return out


@pytest.mark.slow
def test_trainer_compile_on_2x2_tiles_trains_like_eager(tmp_path):
    from credit_parallel.data import write_sample_dataset

    store = str(write_sample_dataset(tmp_path / "s.zarr", n_times=24, nlat=17, nlon=30))
    out = run_on_ranks(_trainer_worker, 4, store, "fsdp2", timeout=900)[0]
    (eager_losses, eager_params, eager_names), (losses, params, names) = out[False], out[True]
    assert not eager_names and names  # trainer.compile compiled the blocks
    assert max(abs(a - b) for a, b in zip(losses, eager_losses)) <= TOL
    assert max(float((params[k] - eager_params[k]).abs().max()) for k in params) <= TOL


@pytest.mark.slow  # 4 ranks, ~20-30 s
def test_whole_model_compile_under_tensor2_x_tiles_matches_single_process():
    # tensor 2 x {lat 1, lon 2}: the partial-gradient guard's meta twin runs at the global
    # H x W of the tiles (traced_heights.global_inputs), its all-reduce inside the graph
    args = ("tp", "compile_then_parallelize", "aot_eager", 13, 10, (1, 2), 2)
    _check(run_on_ranks(_tile_worker, 4, *args, timeout=600))


def test_token_widths_and_the_global_inputs_of_a_tile():
    from credit_parallel.domain.traced_heights import global_inputs, token_widths

    assert token_widths(("shard_tensor", (2, 3, 13, 10), 2)) == {10}
    batch = ("shard_batch", (("x", (1, 4, 2, 13, 10), 3), ("static", (1, 2, 13, 10), 2)))
    assert token_widths(batch) == {10}
    assert token_widths(("parity", ((2, 3, 11, 6),))) == {6}
    assert token_widths(None) == set()

    class Tile:  # tile (2, 1) of {lat 3, lon 2}: rows 4 of 13 (5/4/4), columns 5 of 11 (6/5)
        is_tiled, shard_dim = True, -2
        domain_shape, domain_coords = (3, 2), (2, 1)

    token = ("shard_tensor", (2, 3, 13, 11), 2)
    (meta,), _ = global_inputs(Tile(), token, (("tensor", (2, 3, 4, 5), torch.float64),), ())
    assert meta.shape == (2, 3, 13, 11) and meta.device.type == "meta"
