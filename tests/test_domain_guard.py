"""The functional-call guard: calls that mix latitude rows on a domain-sharded activation are
found with the module path and call site — by ``credit-parallel verify`` (a FAIL row) and by the
opt-in training debug mode — while row-local calls and the library's own layers are not."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from credit_parallel import convert_to_domain_parallel, shard_tensor
from credit_parallel.domain.guard import FunctionalCallGuard, debug_guard, guard_requested
from credit_parallel.domain.manager import DomainParallelManager
from credit_parallel.layout.run_config import TrainerConfig
from credit_parallel.models import MODEL_TYPES
from credit_parallel.testing import run_on_ranks
from credit_parallel.tools.verify import judge, verify_layout


class FunctionalUpsample(nn.Module):
    def forward(self, x):
        return F.interpolate(x, scale_factor=2, mode="bilinear")


class InterpolatingNet(nn.Module):
    """A model whose forward resamples with F.interpolate: wrong on a shard."""

    def __init__(self, in_channels=2, out_channels=2, image_height=8, image_width=8):
        super().__init__()
        self.image_height, self.image_width = image_height, image_width
        self.conv = nn.Conv2d(in_channels, out_channels, 3, padding=1)
        self.decoder = nn.Sequential(FunctionalUpsample(), nn.Conv2d(out_channels, out_channels, 1))

    def forward(self, x):
        y = self.decoder(self.conv(x))
        return y[..., ::2, ::2]


def _findings(module, *inputs):
    with FunctionalCallGuard(module) as guard:
        guard.mark(*inputs)
        module(*inputs)
    return guard.findings


def _call(fn):
    class Call(nn.Module):
        def forward(self, x):
            return fn(x)

    return Call()


def test_guard_flags_interpolate_with_module_path_and_call_site():
    found = _findings(InterpolatingNet(), torch.randn(1, 2, 8, 8))
    # and its every-other-row subscript: a row's position on a shard is not its global one
    assert [(f.path, f.op) for f in found] == [
        ("decoder.0", "interpolate"),
        ("<root>", "__getitem__"),
    ]
    assert "test_domain_guard.py" in found[0].site


def test_guard_flags_pad_roll_flip_reduction_over_h_and_merging_reshape():
    x = torch.randn(1, 2, 6, 4)
    offending = {
        "pad": lambda t: F.pad(t, (0, 0, 1, 1)),
        "roll": lambda t: torch.roll(t, 1, dims=-2),
        "flip": lambda t: t.flip(2),
        "mean": lambda t: t.mean(dim=(-2, -1)),
        "sum": lambda t: t.sum(),
        "flatten": lambda t: t.flatten(1),  # C, H, W: H inside the merged dim
        "reshape": lambda t: t.reshape(1, 12, 4),  # C and H merged: H inner
        "adaptive_avg_pool2d": lambda t: F.adaptive_avg_pool2d(t, 1),
    }
    for op, fn in offending.items():
        found = _findings(_call(fn), x)
        assert [f.op for f in found] == [op], (op, found)


def test_guard_flags_rows_chosen_by_position_on_a_shard():
    x = torch.randn(1, 2, 6, 4)
    rows = torch.tensor([0, 2])
    offending = {
        "__getitem__": [
            lambda t: t[:, :, 1:-1],
            lambda t: t[..., 1:, :],
            lambda t: t[:, :, 0],
            lambda t: t[:, :, rows],
            lambda t: t[:, :, ::2],
            lambda t: torch.cat([t, t], dim=1)[:, :, 2:],  # still marked after a cat over C
        ],
        "narrow": [lambda t: t.narrow(-2, 0, 2)],
        "index_select": [lambda t: t.index_select(2, rows)],
        "cat": [lambda t: torch.cat([t, t], dim=-2)],
        "chunk": [lambda t: t.chunk(2, dim=2)[0]],
        "split": [lambda t: torch.split(t, 3, dim=-2)[0]],
        "unbind": [lambda t: t.unbind(2)[0]],
    }
    for op, fns in offending.items():
        for fn in fns:
            found = _findings(_call(fn), x)
            assert [f.op for f in found] == [op], (op, found)
            assert "latitude" in found[0].reason


def test_guard_accepts_row_local_calls():
    x = torch.randn(1, 2, 6, 4)
    row_local = [
        lambda t: F.pad(t, (1, 1, 0, 0), mode="circular"),  # longitude only
        lambda t: torch.roll(t, 1, dims=-1),
        lambda t: t.mean(dim=1, keepdim=True),  # channels
        lambda t: t.softmax(dim=-1),
        lambda t: t.reshape(1, 2, 3, 2, 4),  # H split into factors: rows stay apart
        lambda t: t.flatten(0, 1),
        # H merged OUTERMOST with W: each shard is one block of tokens (token attention's
        # layout); folded back to (H, W) after a transpose round trip
        lambda t: t.flatten(2).transpose(1, 2).transpose(1, 2).reshape(1, 2, 6, 4),
        lambda t: t.reshape(1, 2, 24),
        lambda t: t * 2 + 1,
        # every row kept: channels, longitude, whole slices, a new axis, cat / chunk over C
        lambda t: t[:, :1],
        lambda t: t[:, :, :],
        lambda t: t[..., 1:],
        lambda t: t[:, None, :, :],
        lambda t: t.narrow(2, 0, 6),
        lambda t: torch.cat([t, t], dim=1),
        lambda t: t.chunk(2, dim=1)[0],
    ]
    for fn in row_local:
        assert _findings(_call(fn), x) == []


def _tile_findings(module, x, **kw):
    with FunctionalCallGuard(module, **kw) as guard:
        guard.mark(x)
        module(x)
    return guard.findings


class _Named(nn.Module):
    """``fn`` inside a submodule ``body``: a finding names it."""

    def __init__(self, fn):
        super().__init__()
        self.conv = nn.Conv2d(2, 2, 1)
        self.body = _call(fn)

    def forward(self, x):
        return self.body(self.conv(x))


def test_guard_on_tiles_checks_the_width_too_naming_the_module():
    """On lat x lon tiles the width (the last dim) is split too: the calls that are column-local
    on a latitude shard reach other tiles' columns and are findings, named by module; what
    stays inside a tile's columns is not; without tiles nothing changes."""
    x = torch.randn(1, 2, 6, 4)
    cols = torch.tensor([0, 2])
    reaching = {
        "pad": lambda t: F.pad(t, (1, 1, 0, 0), mode="circular"),  # longitude only
        "roll": lambda t: torch.roll(t, 1, dims=-1),
        "flip": lambda t: t.flip(3),
        "softmax": lambda t: t.softmax(dim=-1),
        "mean": lambda t: t.mean(dim=-1),
        "__getitem__": lambda t: t[..., 1:],
        "narrow": lambda t: t.narrow(3, 0, 2),
        "index_select": lambda t: t.index_select(-1, cols),
        "cat": lambda t: torch.cat([t, t], dim=-1),
        "chunk": lambda t: t.chunk(2, dim=-1)[0],
        "linear": lambda t: F.linear(t, torch.randn(3, 4)),  # contracts the columns
        "flatten": lambda t: t.flatten(2),  # W merged under H: a tile is no block of tokens
    }
    for op, fn in reaching.items():
        found = _tile_findings(_Named(fn), x.clone(), tiles=True)
        assert [(f.path, f.op) for f in found] == [("body", op)], (op, found)
        assert "longitude" in found[0].reason or " W " in found[0].reason, found[0].reason
        assert "lat x lon tiles" in found[0].reason
        assert _tile_findings(_Named(fn), x.clone()) == [], op  # a latitude shard: column-local
    # over H: still the latitude finding (once), not a width one
    found = _tile_findings(_call(lambda t: F.pad(t, (0, 0, 1, 1))), x.clone(), tiles=True)
    assert [f.op for f in found] == ["pad"] and "tiles" not in found[0].reason
    # the marks follow a permute: B,H,W,C puts W at -2, a reduction there is found
    found = _tile_findings(_call(lambda t: t.permute(0, 2, 3, 1).sum(-2)), x.clone(), tiles=True)
    assert [f.op for f in found] == ["sum"] and "W" in found[0].reason
    tile_local = [
        lambda t: t * 2 + 1,
        lambda t: t.mean(dim=1, keepdim=True),
        lambda t: t[:, :1],
        lambda t: t[..., :],
        lambda t: torch.cat([t, t], dim=1),
        lambda t: t.permute(0, 2, 3, 1).softmax(-1),  # over channels
        lambda t: F.pad(t, (0, 0, 0, 0, 1, 1)),  # channels
    ]
    for fn in tile_local:
        assert _tile_findings(_call(fn), x.clone(), tiles=True) == []


def test_guard_watches_the_width_of_a_model_converted_for_tiles():
    class Tiled:
        is_tiled = True

    model = _Named(lambda t: torch.roll(t, 1, dims=-1))
    vars(model)["_domain_manager"] = Tiled()  # what convert_to_domain_parallel keeps
    found = _tile_findings(model, torch.randn(1, 2, 6, 4))
    assert [(f.path, f.op) for f in found] == [("body", "roll")]
    with pytest.raises(RuntimeError, match="body: roll .*lat x lon tiles"):
        _tile_findings(model, torch.randn(1, 2, 6, 4), raise_on_finding=True)


def _guard_converted(rank, world_size):
    manager = DomainParallelManager(world_size, world_size)
    model = convert_to_domain_parallel(nn.Sequential(nn.Upsample(scale_factor=2)), manager)
    x = shard_tensor(torch.randn(1, 1, 6, 4), -2, manager)
    with FunctionalCallGuard(model) as guard:
        guard.mark(x)
        model(x)
    return [str(f) for f in guard.findings]


def test_guard_ignores_the_library_layers_that_exchange_rows():
    assert run_on_ranks(_guard_converted, 2) == [[], []]


def _verify_interpolating(rank, world_size):
    MODEL_TYPES["interpolating"] = InterpolatingNet  # in the forked worker only
    conf = {
        "model": {
            "type": "interpolating",
            "in_channels": 2,
            "out_channels": 2,
            "image_height": 8,
            "image_width": 8,
        },
        "trainer": {"parallelism": {"domain": world_size}, "seed": 1},
    }
    return judge(verify_layout(conf, batch_size=1), torch.float64)


def test_verify_flags_interpolate_on_sharded_activation_with_module_path():
    for rows in run_on_ranks(_verify_interpolating, 2):
        flagged = [r for r in rows if r[0].startswith("functional call")]
        assert len(flagged) == 2 and all(r[-1] == "FAIL" for r in flagged)
        assert "decoder.0: interpolate" in flagged[0][0]
        assert "<root>: __getitem__" in flagged[1][0]


def test_debug_mode_off_by_default_on_by_config_or_env(monkeypatch):
    monkeypatch.delenv("CREDIT_PARALLEL_DOMAIN_GUARD", raising=False)
    assert not guard_requested(TrainerConfig.from_conf({"trainer": {}}).domain_guard)
    assert guard_requested(
        TrainerConfig.from_conf({"trainer": {"domain_guard": True}}).domain_guard
    )
    with pytest.raises(TypeError, match="trainer.domain_guard"):
        guard_requested({"trainer": {"domain_guard": True}})  # the raw config stops above
    monkeypatch.setenv("CREDIT_PARALLEL_DOMAIN_GUARD", "1")
    assert guard_requested()


def test_debug_mode_raises_at_the_first_finding(monkeypatch):
    monkeypatch.setenv("CREDIT_PARALLEL_DOMAIN_GUARD", "1")
    model = InterpolatingNet()
    x = torch.randn(1, 2, 8, 8)
    try:
        with debug_guard(model) as guard:
            guard.mark(x)
            model(x)
    except RuntimeError as err:
        assert "decoder.0" in str(err) and "interpolate" in str(err)
    else:
        raise AssertionError("the debug guard did not raise")
