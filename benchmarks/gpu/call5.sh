#!/usr/bin/env bash
# Next GPU call (not yet run): the stack on one GPU (cuda-ipc vs grpc), where an 8B decode step's time goes,
# and disaggregated vs colocated serving. Build the wheel first (`pip wheel --no-deps -w .whl .`) and carry .whl.
set -uo pipefail
source benchmarks/gpu/setup.sh
step gpu-stack 120 python3 -m pytest -q -x tests/e2e/test_gpu_stack.py -p no:cacheprovider
step profile-b1 90 python3 -m tandem.benchmarks.gpu_engine profile --model dummy:llama-3.1-8b --batches 1 --out "$OUT/b1"
step profile-b64 90 python3 -m tandem.benchmarks.gpu_engine profile --model dummy:llama-3.1-8b --batches 64 --out "$OUT/b64"
step serve 240 bash benchmarks/gpu/serve_compare.sh dummy:llama-3.2-1b 4,16,64 48 fixed:1024 fixed:128
