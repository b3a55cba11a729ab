#!/usr/bin/env bash
# The device check run on a lent GPU (see docs/performance.md): the CUDA tests and the frontier
# (chain first: the GPU targets), each under its own limit.
# Its files replace those of benchmarks/results/cuda_<card>/ (one folder per card, the latest run).
# Expects the pyro-ppl, pyro-api, funsor and makefun wheels in .whl/ (the GPU image has no Pyro).
# The MNIST 3 x 6 grid gets a call of its own: benchmarks/gpu_vae_grid.sh.
set -o pipefail
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl || exit 1
export PYTHONPATH=/tmp/site:$PWD PYTHONUNBUFFERED=1
OUT=${OUT:-results/gpu}; mkdir -p "$OUT"
nvidia-smi --query-gpu=name,driver_version --format=csv | tee "$OUT/gpu.txt"
python3 -c "import torch, pyro; print('torch', torch.__version__, 'pyro', pyro.__version__)" | tee -a "$OUT/gpu.txt"
timeout 200 python3 -m pytest -q -p no:cacheprovider -k cuda tests/infer/test_tmc_elbo.py tests/infer/test_tmc_ground_truth.py \
    tests/compile/test_compiled.py tests/compile/test_captured_step.py tests/compile/test_loop_rolling.py 2>&1 | tee "$OUT/cuda_tests.txt"
# 2026-11-27 on an H200 the CUDA tests needed more than 130 s; the frontier below took about 300 s.
# The GPU targets first, one case at a time (the table is rewritten after each): the toy N=128 K=8
# ("overhead"), the N=100 chain, the other toys, then the N=1000 chain, whose inductor compile
# takes minutes. --lean leaves out the chains' uncompiled compile='graph' rows. On CUDA the chain's
# and the toy's inductor whole steps replay as CUDA graphs (mode="reduce-overhead"); perf_hints
# logs why inductor skips one, if it does.
TORCH_LOGS=perf_hints timeout 380 python3 benchmarks/frontier.py --device cuda --repeats 5 --lean \
    --only overhead,chain100,toy,chain1000,hmm --out "$OUT/frontier_cuda.md" 2>&1 | tee "$OUT/frontier_log.txt"
