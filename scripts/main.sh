#!/usr/bin/env bash
# Set up (idempotent) and run the main job.
set -euo pipefail
root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
bash "$root/scripts/setup.sh"
cd "$root"
exec .venv/bin/credit-parallel mesh-demo --nproc 4 --data fsdp2 --tensor 2 --domain 1
