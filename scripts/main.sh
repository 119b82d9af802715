#!/usr/bin/env bash
# Set up (idempotent) and run the main job: train the U-Net demo on 4 CPU ranks with
# {data: fsdp2, tensor: 2, domain: 2} on the 33 x 64 sample grid (uneven latitude shards), then
# verify that the layout computes exactly what one process computes.
set -euo pipefail
root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
bash "$root/scripts/setup.sh"
cd "$root"
cli=.venv/bin/credit-parallel
config=src/credit_parallel/configs/demo_unet.yaml
if [ ! -d data/sample.zarr ]; then
    "$cli" sample-data --output data/sample.zarr
fi
"$cli" train --config "$config" --nproc 4 --output outputs/demo
"$cli" verify --config "$config" --nproc 4
