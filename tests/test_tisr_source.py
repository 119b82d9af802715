"""CREDIT's computed ``tisr`` source on a rank's rows or tile (``data/tisr_source.py``): each
rank computes only its own rows, bitwise the same field at every layout (one process, rows,
tiles), and miles-credit's ``TISRDataset`` values to float32 rounding: its vectorised float32
sin / cos round a point by its position in the tensor (measured <= 1.9e-7 relative to the
point, 2 ulps)."""

from __future__ import annotations

import pandas as pd
import pytest
import torch

from credit_parallel.data.tisr_source import TISRSource
from miles_credit import import_credit

TIMES = ("2021-06-01T06", "2021-12-21T18")


def _source(**grid):
    grid = grid or {"lat_spec": [90, -90, 9], "lon_spec": [0, 315, 8]}
    return {
        "dataset_type": "tisr",
        "variables": {
            "prognostic": None,
            "diagnostic": None,
            "dynamic_forcing": {"vars_2D": ["tisr"]},
        },
        "num_integration_steps": 24,
        **grid,
    }


def _credit(source, time):
    """miles-credit's own dataset, whole grid, at ``time``."""
    tisr = import_credit("credit.datasets.gen_2.tisr")
    conf = {
        "source": {"TISR": source},
        "start_datetime": "2021-06-01",
        "end_datetime": "2021-12-31",
        "timestep": "6h",
        "forecast_len": 0,
    }
    sample = tisr.TISRDataset(conf)[(pd.Timestamp(time), 0)]
    return sample["input"]["TISR/dynamic_forcing/2d/tisr"]


@pytest.mark.parametrize(
    "shape", [(2, 1), (3, 1), (2, 2)], ids=["rows2", "rows3_uneven", "tiles2x2_uneven"]
)
def test_each_rank_computes_its_rows_bitwise_as_one_process_and_credits_tisr_to_rounding(shape):
    """9 x 8 points: rows 5 / 4 (2 ranks), 3 / 3 / 3, tiles (5, 4) x (4, 4)."""
    source = _source()
    for time in TIMES:
        whole = _credit(source, time)
        assert whole.shape == (1, 1, 9, 8) and whole.abs().max() > 0
        pieces = []
        for lat in range(shape[0]):
            row = []
            for lon in range(shape[1]):
                part = TISRSource.from_source(source, "6h", shape=shape, coords=(lat, lon))
                local = part.at(time)
                (r0, r1), (c0, c1) = part.rows, part.columns
                assert local.shape == (1, 1, r1 - r0, c1 - c0)
                ref = whole[..., r0:r1, c0:c1]
                relative = ((local - ref).abs() / ref.abs().clamp_min(1.0)).max().item()
                assert relative <= 5e-7, (shape, time, lat, lon, relative)
                row.append(local)
            pieces.append(torch.cat(row, dim=-1))
        one_process = TISRSource.from_source(source, "6h").at(time)
        assert torch.equal(torch.cat(pieces, dim=-2), one_process)  # layout-independent


def test_the_source_block_is_checked_naming_its_key():
    with pytest.raises(ValueError, match=r"data\.source\.TISR: give exactly one grid"):
        TISRSource.from_source(
            _source(lat_spec=[90, -90, 9], lon_spec=[0, 315, 8], latlon_grid_path="g.nc"), "6h"
        )
    bad = _source()
    bad["variables"]["dynamic_forcing"]["vars_2D"] = ["tsi"]
    with pytest.raises(ValueError, match=r"dynamic_forcing\.vars_2D must be \['tisr'\]"):
        TISRSource.from_source(bad, "6h")
