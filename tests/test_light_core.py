"""A light core: ``pip install credit-parallel`` without the optional extra ``[credit]``.

bridgescaler (and scikit-learn, scipy, numba, crick under it), h5netcdf / h5py and cftime are
what only CREDIT's own configs and files need (``layout/extras.py``).  In a subprocess each of
them is made unimportable (a ``None`` entry in ``sys.modules``, which makes ``import`` raise
``ImportError``): every module of the package still imports, and a config that needs one of
them is refused before any rank starts, naming the extra.
"""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

SRC = str(Path(__file__).resolve().parents[1] / "src")
EXTRA = "credit-parallel[credit]"
STACK = ["bridgescaler", "sklearn", "scipy", "numba", "crick", "h5netcdf", "h5py"]

_PRELUDE = """
import sys
for name in {blocked!r}:
    sys.modules[name] = None  # `import name` raises ImportError
"""


def _run(blocked: list[str], body: str, *args: str) -> subprocess.CompletedProcess:
    code = _PRELUDE.format(blocked=blocked) + textwrap.dedent(body)
    env = {**os.environ, "PYTHONPATH": SRC, "OMP_NUM_THREADS": "1"}
    return subprocess.run(
        [sys.executable, "-c", code, *args],
        capture_output=True,
        text=True,
        timeout=240,
        env=env,
    )


def _gen2_conf(tmp_path: Path, preblocks: dict | None = None) -> dict:
    """The smallest CREDIT gen-2 config (one local source), for the mapping only."""
    conf = {
        "save_loc": str(tmp_path / "run"),
        "data": {
            "source": {
                "ERA5": {
                    "level_coord": "level",
                    "levels": [500],
                    "variables": {
                        "prognostic": {
                            "vars_3D": ["T"],
                            "vars_2D": ["SP"],
                            "path": str(tmp_path / "era5.zarr"),
                        }
                    },
                }
            }
        },
        "trainer": {"parallelism": {"data": "none", "tensor": 1, "domain": 1}, "steps": 1},
        "model": {"type": "unet"},
    }
    if preblocks is not None:
        conf["preblocks"] = preblocks
    return conf


_BODY = """
import importlib, json, pkgutil
import credit_parallel
names = [m.name for m in pkgutil.walk_packages(credit_parallel.__path__, "credit_parallel.")]
names = [n for n in names if not n.endswith("__main__")]
for name in names:
    importlib.import_module(name)
leaked = sorted(n for n in sys.modules if n.split(".")[0] in BLOCKED and sys.modules[n])
print("IMPORTED:", len(names), "leaked", leaked)
from credit_parallel.data.store import open_fields
from credit_parallel.layout.credit_gen2 import credit_gen2_conf
from credit_parallel.layout.credit_scaler_blocks import load_scaler
from credit_parallel.train.ema import ema_tracker_class
conf, scaler, netcdf, path, out = json.loads(sys.argv[1]), *sys.argv[2:]
for key, call in (
    ("data.source", lambda: credit_gen2_conf(conf)),
    ("trainer.use_ema", ema_tracker_class),
    ("bridgescaler", lambda: load_scaler(scaler, "preblocks.norm.scaler.args.scaler_path")),
    ("h5netcdf", lambda: open_fields(netcdf, "data.static_path")),
):
    try:
        call()
        print(f"ACCEPTED {key}:")
    except ValueError as err:
        print(f"REFUSED {key}:", str(err).replace("\\n", " "))
from credit_parallel.cli import main
print("EXIT:", main(["train", "--config", path, "--output", out]))
"""


@pytest.fixture(scope="module")
def without_extra(tmp_path_factory):
    """One subprocess with the whole extra unimportable: every module imported, then each
    use of the extra asked for (one interpreter start: the imports are what costs)."""
    import json

    import yaml

    root = tmp_path_factory.mktemp("light_core")
    scaler = root / "scaler.json"
    scaler.write_text("{}")
    netcdf = root / "mean.nc"
    netcdf.write_bytes(b"\x89HDF\r\n\x1a\n")  # any file: the engine is asked for first
    conf = _gen2_conf(root)
    path = root / "run.yaml"
    path.write_text(yaml.safe_dump(conf))
    blocked = [*STACK, "cftime"]
    args = [json.dumps(conf), str(scaler), str(netcdf), str(path), str(root / "out")]
    done = _run(blocked, _BODY.replace("BLOCKED", repr(blocked)), *args)
    lines = {}
    for line in done.stdout.splitlines():
        head, _, rest = line.partition(":")
        lines[head] = rest.strip()
    return done, lines, root


def test_the_core_imports_without_the_credit_extra(without_extra):
    done, lines, _ = without_extra
    imported = lines.get("IMPORTED", "").split()
    assert imported, done.stdout + done.stderr[-3000:]
    assert int(imported[0]) > 150  # every module of the package, not an empty walk
    assert imported[1:] == ["leaked", "[]"]


@pytest.mark.parametrize(
    "key,module",
    [
        ("data.source", "cftime"),  # a gen-2 data block: miles-credit's inject_flat_var_keys
        ("trainer.use_ema", "cftime"),  # miles-credit's EMATracker
        ("bridgescaler", "bridgescaler"),  # a bridgescaler_transform block's scaler file
        ("h5netcdf", "h5netcdf"),  # CREDIT's netCDF files
    ],
)
def test_what_needs_the_extra_is_refused_naming_the_key_and_the_extra(without_extra, key, module):
    done, lines, _ = without_extra
    refusal = lines.get(f"REFUSED {key}")
    assert refusal is not None, done.stdout + done.stderr[-3000:]
    assert f"needs `{module}`" in refusal and EXTRA in refusal, refusal
    where = {
        "bridgescaler": "preblocks.norm.scaler.args.scaler_path",
        "h5netcdf": "data.static_path",
    }
    assert refusal.startswith(where.get(key, key)), refusal


def test_the_command_line_refuses_such_a_config_before_any_rank_starts(without_extra):
    done, lines, root = without_extra
    assert lines.get("EXIT") not in (None, "0"), done.stdout + done.stderr[-2000:]
    assert EXTRA in done.stderr and "cftime" in done.stderr, done.stderr[-2000:]
    assert not (root / "out").exists()  # no rank started, nothing written
