#!/usr/bin/env bash
# Set up (idempotent) and run the quality gates and the whole test suite.
set -euo pipefail
root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
bash "$root/scripts/setup.sh"
cd "$root"
.venv/bin/ruff check src tests benchmarks
.venv/bin/ruff format --check src tests benchmarks
# pytest exits 5 when it collected no test; set -e turns that (and any failure) into a red run.
exec .venv/bin/python -m pytest tests "$@"
