"""A bare ``nn.MultiheadAttention`` on the tokens of a lat x lon tile (SPEC §3b,
``domain/attention/token_core.py``): sequence parallel over the P x Q ranks, exact (float64,
1e-10: output, input gradient, every parameter gradient) on uneven tiles, its attention weights
in the global key order; refused, naming the module, where the weights' key order is unknown
or the tokens are not whole tiles."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from credit_parallel.domain.attention.token_core import tile_grids
from credit_parallel.domain.manager import TiledDomainManager
from credit_parallel.domain.rows import shard_sizes
from credit_parallel.testing import domain_parity_errors, run_on_ranks

TOL = 1e-10


class _Tokens(nn.Module):
    """A 3x3 conv, then attention over the tile's tokens (flattened H outermost); with
    ``need_weights`` the output also reads the weights against the GLOBAL key index, so a key
    order other than the single process's changes it."""

    def __init__(self, need_weights: bool, batch_first: bool, class_token: bool = False):
        super().__init__()
        self.conv = nn.Conv2d(3, 4, 3, padding=1)
        self.mha = nn.MultiheadAttention(4, 2, batch_first=batch_first)
        self.need, self.batch_first, self.class_token = need_weights, batch_first, class_token

    def forward(self, x):
        x = self.conv(x)
        b, c, h, w = x.shape
        t = x.flatten(2).transpose(1, 2)  # (B, L, C)
        if self.class_token:
            t = torch.cat([t.mean(1, keepdim=True), t], 1)
        if not self.batch_first:
            t = t.transpose(0, 1)
        y, weights = self.mha(t, t, t, need_weights=self.need)
        if not self.batch_first:
            y = y.transpose(0, 1)
        y = y[:, -h * w :].transpose(1, 2).reshape(b, c, h, w)
        if self.need:
            key_index = torch.arange(weights.shape[-1], dtype=weights.dtype)
            y = y + (weights * key_index).sum(-1).reshape(b, 1, h, w)
        return y


def _worker(rank, world, shape, hw, need_weights, batch_first):
    m = TiledDomainManager(world, shape)
    x = torch.randn(2, 3, *hw, dtype=torch.float64, generator=torch.Generator().manual_seed(3))
    build = lambda: _Tokens(need_weights, batch_first).double()  # noqa: E731
    return domain_parity_errors(build, x, m)


@pytest.mark.parametrize(
    "shape, hw, need_weights, batch_first",
    [
        ((2, 2), (9, 11), True, True),  # uneven rows and columns: the grid is determined
        ((3, 2), (10, 7), True, False),
        ((2, 2), (8, 12), False, True),  # equal tiles
        ((1, 3), (5, 8), False, True),
    ],
)
def test_multihead_attention_on_tile_tokens_is_exact(shape, hw, need_weights, batch_first):
    results = run_on_ranks(_worker, shape[0] * shape[1], shape, hw, need_weights, batch_first)
    for errors in results:
        for key, (err, ref) in errors.items():
            assert err <= TOL and ref > 0, (shape, key, err, ref)


def _refused_worker(rank, world, class_token):
    from credit_parallel.domain.attention import token_mha

    m = TiledDomainManager(world, (2, 2))
    # equal tiles (several grids give their counts), or uneven ones (a class token shows)
    x = torch.randn(1, 3, *((9, 11) if class_token else (8, 12)), dtype=torch.float64)
    build = lambda: _Tokens(not class_token, True, class_token).double()  # noqa: E731
    exchanges = []  # the all-to-alls of the attention: none runs before the refusal
    core = token_mha.core_over_all_tokens
    token_mha.core_over_all_tokens = lambda *a: exchanges.append(1) or core(*a)
    try:
        domain_parity_errors(build, x, m)
    except ValueError as err:
        return str(err), len(exchanges)
    finally:
        token_mha.core_over_all_tokens = core
    return "", len(exchanges)


@pytest.mark.parametrize(
    "class_token, words",
    [
        # equal tiles of an evenly divisible grid, need_weights=True: several grids give the
        # counts, so the weights' key order is unknown
        (False, "need_weights=True on lat x lon tiles"),
        (True, "not whole balanced tiles"),  # one extra token per rank (uneven tiles)
    ],
)
def test_unknown_key_order_and_tokens_that_are_not_tiles_are_refused(class_token, words):
    for text, exchanges in run_on_ranks(_refused_worker, 4, class_token):
        assert words in text and "mha" in text, text
        assert exchanges == 0, exchanges  # refused before the attention's all-to-all
        if not class_token:
            assert "need_weights=False" in text, text


def test_tile_grids_from_the_token_counts():
    def counts(h, w, p, q):
        rows, cols = shard_sizes(h, p), shard_sizes(w, q)
        return tuple(r * c for r in rows for c in cols)

    assert tile_grids(counts(9, 11, 2, 2), (2, 2)) == ((9, 11),)
    assert tile_grids(counts(10, 7, 3, 2), (3, 2)) == ((10, 7),)
    assert (8, 12) in tile_grids(counts(8, 12, 2, 2), (2, 2))
    assert len(tile_grids(counts(8, 12, 2, 2), (2, 2))) > 1  # equal tiles: ambiguous
    assert tile_grids((30, 25, 24, 21), (2, 2)) == ()
