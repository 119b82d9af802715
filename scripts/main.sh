#!/usr/bin/env bash
# Set up (idempotent) and run the main job: train the U-Net demo on 4 CPU ranks with
# {data: fsdp2, tensor: 2, domain: 2} on the 33 x 64 sample grid (uneven latitude shards), verify
# that the layout computes exactly what one process computes, then forecast from the run's final
# checkpoint under the same layout for four initial times of the validation range (2 days, 8 steps)
# into outputs/demo/forecast/forecast.zarr and print the scores against the sample store's truth.
set -euo pipefail
root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
bash "$root/scripts/setup.sh"
cd "$root"
cli=.venv/bin/credit-parallel
config=src/credit_parallel/configs/demo_unet.yaml
# (re)write the sample store when missing or older than its dynamic forcing / static fields
if [ ! -d data/sample.zarr ] || [ ! -d data/sample.zarr/tsi ]; then
    "$cli" sample-data --output data/sample.zarr
fi
"$cli" train --config "$config" --nproc 4 --output outputs/demo
"$cli" verify --config "$config" --nproc 4
"$cli" forecast --config "$config" --nproc 4 --checkpoint outputs/demo/checkpoints \
    --init-range 2020-02-20T00 2020-02-21T12 12h --steps 8 \
    --output outputs/demo/forecast --overwrite
