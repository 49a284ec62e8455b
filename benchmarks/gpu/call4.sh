#!/usr/bin/env bash
# GPU call 4: the stack on one GPU, prefill and decode processes sharing it (cuda-ipc vs grpc).
set -uo pipefail
source benchmarks/gpu/setup.sh
step gpu-stack 62 python3 -m pytest -q -x tests/e2e/test_gpu_stack.py -p no:cacheprovider
