#!/usr/bin/env bash
# GPU call 2: engine correctness, offline throughput (tandem; HF continuous batching), the stack on one GPU
# (cuda-ipc vs grpc give the same tokens), and disaggregated vs colocated serving.
set -uo pipefail
source benchmarks/gpu/setup.sh
E="python3 -m tandem.benchmarks.gpu_engine"
step correctness 80 $E correctness --model dummy:llama-3.2-1b --steps 300 --out "$OUT"
step offline 80 $E offline --out "$OUT"
step hf-batch 90 $E hf --mode batch --num-requests 64 --out "$OUT"
step gpu-stack 150 python3 -m pytest -q -x tests/e2e/test_gpu_stack.py -p no:cacheprovider
step serve 170 bash benchmarks/gpu/serve_compare.sh dummy:llama-3.2-1b 4,16,64 48 fixed:1024 fixed:128
