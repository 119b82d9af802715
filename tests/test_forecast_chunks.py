"""The forecast store's chunk plan (``forecast/chunks.py``): exhaustively over grids and rank
counts, every chunk is whole, has one writer and no chunk has one row; the exchange moves each
row to its chunk's owner (1-D rows and 2 x 2 tiles with a chunk straddling four tiles)."""

from __future__ import annotations

import pytest
import torch

from credit_parallel.domain.rows import shard_range
from credit_parallel.forecast.chunks import axis_plan, chunk_length, exchange, row_chunk_length
from credit_parallel.testing import run_on_ranks

__all__: list[str] = []

LENGTHS = [*range(1, 70), 181, 360, 721, 1440, 1801, 3600]


def _check(length, ranges, chunk, parts):
    """Every property the store relies on, for one plan."""
    owned = [p.owned for p in parts]
    written = sorted(o for o in owned if o[0] < o[1])
    # the owned ranges tile [0, length) in whole chunks
    assert [a for a, _ in written] == [0, *(b for _, b in written[:-1])], written
    assert written[-1][1] == length
    for a, b in written:
        assert a % chunk == 0 and (b % chunk == 0 or b == length), (a, b, chunk)
    for r, (part, (a, b)) in enumerate(zip(parts, ranges)):
        o0, o1 = part.owned
        if o0 < o1:
            assert a <= o0 < b  # a chunk is written by the rank holding its first row
        head = part.send[1] if part.send else (a, a)
        keep = (max(a, min(o0, b)), b) if o0 < o1 else (b, b)
        assert head[0] == a and head[1] == keep[0] and keep[1] == b  # held = head + kept
        if part.send:
            dst = part.send[0]
            d0, d1 = parts[dst].owned
            assert d0 <= head[0] and head[1] <= d1, (r, part, parts[dst])  # to its owner
            assert r in {src for src, _ in parts[dst].receive}
        # owned = kept rows, then the received ones in order
        pieces = [keep, *(rows for _, rows in part.receive)]
        if o0 < o1:
            assert pieces[0][0] == o0 and pieces[-1][1] == o1
            assert all(x[1] == y[0] for x, y in zip(pieces, pieces[1:])), pieces
        else:
            assert not part.receive


@pytest.mark.parametrize("parts", range(1, 17))
def test_balanced_rows_over_1_to_16_ranks_have_whole_chunks_with_one_writer(parts):
    for length in LENGTHS:
        chunk = chunk_length(length, parts)
        assert 1 <= chunk <= length
        if length >= 2:
            rest = length % chunk
            assert chunk >= 2 and rest != 1, (length, chunk)
        ranges = [shard_range(length, parts, r) for r in range(parts)]
        plan = axis_plan(length, ranges, chunk)
        _check(length, ranges, chunk, plan)
        shortest = length // parts  # the rows of the smallest rank
        if chunk > shortest + 1:  # only when no chunk <= shortest + 1 avoids a one-row tail
            assert all(length % c == 1 for c in range(2, shortest + 2)), (length, parts)
        elif shortest >= 1:  # a chunk straddles at most two ranks: neighbours only
            for r, part in enumerate(plan):
                assert part.send is None or part.send[0] == r - 1, (length, parts, r, part)
                assert all(src == r + 1 for src, _ in part.receive)


def test_the_0_25_degree_grid_and_the_issue_s_split():
    # 721 rows over 4 ranks (181/180/180/180): chunks of 181, the last one 178 rows
    assert chunk_length(721, 4) == 181
    plan = axis_plan(721, [shard_range(721, 4, r) for r in range(4)], 181)
    assert [p.owned for p in plan] == [(0, 181), (181, 362), (362, 543), (543, 721)]
    assert [p.send for p in plan] == [None, None, (1, (361, 362)), (2, (541, 543))]
    assert chunk_length(721, 1) == 721 and chunk_length(1440, 8) == 180
    assert chunk_length(7, 3) == 4  # 4 + 3, not 3 + 3 + 1
    # the store's row chunk: one per rank, at most a quarter globe
    assert [row_chunk_length(721, p) for p in (1, 2, 4, 8, 16)] == [181, 181, 181, 91, 46]
    assert chunk_length(721, 1, max_rows=100) == 91  # 721 rows in 8 chunks (the last 84)
    assert chunk_length(17, 4) == 5 and chunk_length(10, 3) == 4  # 5+5+5+2, 4+4+2


def test_a_store_chunked_for_another_layout_is_still_written_by_one_owner_per_chunk():
    """--resume under another layout keeps the store's chunks: any chunk over any split."""
    for length in (9, 17, 33, 50):
        for parts in range(1, 9):
            ranges = [shard_range(length, parts, r) for r in range(parts)]
            for chunk in range(1, length + 1):
                _check(length, ranges, chunk, axis_plan(length, ranges, chunk))


def test_bad_input_is_refused():
    with pytest.raises(ValueError, match="not contiguous"):
        axis_plan(10, [(0, 4), (5, 10)], 5)
    with pytest.raises(ValueError, match="do not cover"):
        axis_plan(10, [(0, 4), (4, 9)], 5)
    with pytest.raises(ValueError, match="length and parts"):
        chunk_length(0, 2)


def _exchange_tiles(rank, world, height, width, chunks):
    """2 x 2 tiles of a global field (rank = lat * 2 + lon): columns, then rows, moved to the
    owners of their chunks; the result is the field's owned block."""
    field = torch.arange(3 * height * width, dtype=torch.float64).view(3, height, width)
    lat, lon = divmod(rank, 2)
    rows = [shard_range(height, 2, i) for i in range(2)]
    columns = [shard_range(width, 2, j) for j in range(2)]
    row_part = axis_plan(height, rows, chunks[0])[lat]
    column_part = axis_plan(width, columns, chunks[1])[lon]
    (a, b), (c, d) = rows[lat], columns[lon]
    block = exchange(field[:, a:b, c:d], column_part, -1, lambda j: lat * 2 + j)
    block = exchange(block, row_part, -2, lambda i: i * 2 + lon)
    (o0, o1), (p0, p1) = row_part.owned, column_part.owned
    return block, field[:, o0:o1, p0:p1]


def test_exchange_on_2x2_tiles_brings_a_chunk_straddling_four_tiles_to_its_owner():
    # 9 x 9 in tiles of 5/4 rows and columns, chunks of 6 x 6: chunk (0, 0) takes row 5 from
    # the tile below, column 5 from the tile to the right, and (5, 5) from the corner tile
    results = run_on_ranks(_exchange_tiles, 4, 9, 9, (6, 6), timeout=120)
    shapes = [tuple(block.shape) for block, _ in results]
    assert shapes == [(3, 6, 6), (3, 6, 3), (3, 3, 6), (3, 3, 3)]
    for block, expected in results:
        assert torch.equal(block, expected)
