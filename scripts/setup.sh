#!/usr/bin/env bash
# Creates .venv if missing and installs everything the project needs into it.
# torch is pinned to 2.13.0 here on purpose: on these machines a CPU wheel of exactly that
# version lies on local disk, while an unpinned torch would pull a multi-GB CUDA build.
# (The package itself declares torch>=2.11 so cluster users keep their own CUDA build.)
set -euo pipefail
root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cd "$root"
py="${PYTHON:-python3}"
if [ ! -x .venv/bin/python ]; then
    "$py" -m venv .venv
fi
stamp=.venv/.credit-parallel-installed
want="$(cat pyproject.toml scripts/setup.sh | sha1sum | cut -d' ' -f1)"
if [ ! -f "$stamp" ] || [ "$(cat "$stamp")" != "$want" ]; then
    .venv/bin/python -m pip install --quiet --upgrade pip
    .venv/bin/python -m pip install --quiet torch==2.13.0 numpy
    # -e .[dev,credit]: the package's dependencies, the test tools, and the optional extra
    # `credit` (bridgescaler, h5netcdf / h5py, cftime: what only CREDIT's configs need; a core
    # install is `pip install credit-parallel`, CREDIT users add `[credit]`)
    .venv/bin/python -m pip install --quiet -e ".[dev,credit]"
    # test dependencies: miles-credit's and timm's own model classes
    # (tests/test_domain_attention.py, tests/test_timm_swin.py).
    # --no-deps: their model files import torchvision & co. only at import time;
    # tests/miles_credit.py puts inert placeholders in their place for the import.
    .venv/bin/python -m pip install --quiet --no-deps miles-credit==2026.2.0 timm==1.0.31
    echo "$want" > "$stamp"
fi
