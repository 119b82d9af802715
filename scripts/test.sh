#!/usr/bin/env bash
# Set up (idempotent) and run the quality gates and the whole test suite.
set -euo pipefail
root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
bash "$root/scripts/setup.sh"
cd "$root"
.venv/bin/ruff check src tests benchmarks
.venv/bin/ruff format --check src tests benchmarks
# pytest exits 5 when it collected no test; set -e turns that (and any failure) into a red run.
# pyproject's addopts has -q once: pytest still ends with its "N passed, M skipped in Ts" line
# (a second -q would drop it); -r fEs lists every failure, error and skip above that line.  Tests
# marked slow (> 20 s on the loaded 2-core machine) run too: nothing is deselected here.
exec .venv/bin/python -m pytest tests -r fEs "$@"
