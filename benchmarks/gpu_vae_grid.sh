#!/usr/bin/env bash
# The paper's MNIST experiment, all 3 recognition models x {IWAE, TMC} x {none, STL, DReGs},
# on a lent GPU, in a call of its own. vae.csv is rewritten after every configuration,
# so a run stopped by its limit keeps what it finished. Usage: gpu_vae_grid.sh SECONDS TRAIN_SIZE
# Expects the wheels in .whl/ and the pickled MNIST at .data/mnist.pkl.gz.
set -o pipefail
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl || exit 1
export PYTHONPATH=/tmp/site:$PWD PYTHONUNBUFFERED=1
OUT=${OUT:-results/gpu}; mkdir -p "$OUT"
timeout "${1:-300}" python3 -m pyro_tmc vae --device cuda --mnist .data/mnist.pkl.gz --epochs 1 \
    --train-size "${2:-15000}" --test-size 5000 --out /tmp/vae --overwrite 2>&1 | tee "$OUT/vae_log.txt"
cp /tmp/vae/vae.csv /tmp/vae/run.json /tmp/vae/*.png "$OUT/"  # no checkpoints: at most 8 files come back
