#!/usr/bin/env bash
# GPU call 3: correctness with the per-position noise criterion, the stack on one GPU (cuda-ipc vs grpc),
# and disaggregated vs colocated serving at one load.
set -uo pipefail
source benchmarks/gpu/setup.sh
step correctness 55 python3 -m tandem.benchmarks.gpu_engine correctness --model dummy:llama-3.2-1b --steps 200 --out "$OUT"
step gpu-stack 110 python3 -m pytest -q -x tests/e2e/test_gpu_stack.py -p no:cacheprovider
step serve 120 bash benchmarks/gpu/serve_compare.sh dummy:llama-3.2-1b 16 32 fixed:1024 fixed:128
