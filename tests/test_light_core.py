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


def test_the_core_imports_without_the_credit_extra_and_gen2_configs_name_it(tmp_path):
    """Every module imports with the whole extra missing; a CREDIT gen-2 data block and
    ``use_ema`` (miles-credit's ``credit.trainers.utils`` imports cftime) name the extra."""
    import json

    blocked = [*STACK, "cftime"]
    body = """
    import importlib, json, pkgutil
    import credit_parallel
    names = [m.name for m in pkgutil.walk_packages(credit_parallel.__path__, "credit_parallel.")]
    names = [n for n in names if not n.endswith("__main__")]
    for name in names:
        importlib.import_module(name)
    leaked = sorted(n for n in sys.modules if n.split(".")[0] in BLOCKED and sys.modules[n])
    print("IMPORTED:", len(names), "leaked", leaked)
    from credit_parallel.layout.credit_gen2 import credit_gen2_conf
    from credit_parallel.train.ema import ema_tracker_class
    for key, call in (
        ("data.source", lambda: credit_gen2_conf(json.loads(sys.argv[1]))),
        ("trainer.use_ema", ema_tracker_class),
    ):
        try:
            call()
        except ValueError as err:
            print("REFUSED:", err)
    """.replace("BLOCKED", repr(blocked))
    done = _run(blocked, body, json.dumps(_gen2_conf(tmp_path)))
    assert done.returncode == 0, done.stderr[-3000:]
    lines = done.stdout.splitlines()
    imported = lines[0].split()
    assert int(imported[1]) > 150  # every module of the package, not an empty walk
    assert lines[0].endswith("leaked []")
    refused = lines[1:]
    assert [r.split()[1] for r in refused] == ["data.source", "trainer.use_ema"], done.stdout
    for line in refused:
        assert "needs `cftime`" in line and EXTRA in line


def test_a_bridgescaler_config_without_the_extra_is_refused_before_any_rank_starts(tmp_path):
    import yaml

    scaler = tmp_path / "scaler.json"
    scaler.write_text("{}")
    block = {"type": "bridgescaler_transform", "args": {"scaler_path": str(scaler)}}
    conf = _gen2_conf(tmp_path, {"norm": {"scaler": block}})
    path = tmp_path / "run.yaml"
    path.write_text(yaml.safe_dump(conf))
    netcdf = tmp_path / "mean.nc"
    netcdf.write_bytes(b"\x89HDF\r\n\x1a\n")  # any file: the engine is asked for first
    body = """
    import yaml
    from credit_parallel.data.store import open_fields
    from credit_parallel.layout.credit_gen2 import credit_gen2_conf

    conf = yaml.safe_load(open(sys.argv[1]))
    try:
        credit_gen2_conf(conf)
    except ValueError as err:
        print("MAPPING:", str(err).replace("\\n", " "))
    try:
        open_fields(sys.argv[2], "data.static_path")
    except ValueError as err:
        print("NETCDF:", err)
    from credit_parallel.cli import main
    code = main(["train", "--config", sys.argv[1], "--output", sys.argv[3]])
    print("EXIT:", code)
    """
    done = _run(STACK, body, str(path), str(netcdf), str(tmp_path / "out"))
    lines = {line.split(":", 1)[0]: line for line in done.stdout.splitlines() if ":" in line}
    mapping, nc = lines.get("MAPPING", ""), lines.get("NETCDF", "")
    assert "preblocks.norm.scaler.args.scaler_path needs `bridgescaler`" in mapping, done.stdout
    assert EXTRA in mapping
    assert "needs `h5netcdf`" in nc and EXTRA in nc, done.stdout
    # the command line stops in this process with a one-line reason: no rank ever started
    assert lines.get("EXIT") != "EXIT: 0", done.stdout + done.stderr[-2000:]
    assert EXTRA in done.stderr and "bridgescaler" in done.stderr, done.stderr[-2000:]
    assert not (tmp_path / "out").exists()
