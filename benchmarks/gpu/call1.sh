#!/usr/bin/env bash
# GPU call 1 (issue 3): engine correctness (Triton path vs reference on the same weights), decode step
# latency against the HBM floor, offline throughput of tandem and of HF transformers (static and
# continuous batching), each in its own process. Results land in $OUT.
set -uo pipefail
source benchmarks/gpu/setup.sh

E="python3 -m tandem.benchmarks.gpu_engine"
step correctness 80 $E correctness --model dummy:llama-3.2-1b --steps 300 --out "$OUT"
step decode-latency 170 $E decode-latency --out "$OUT"
step offline 100 $E offline --out "$OUT"
step hf-static 100 $E hf --mode static --out "$OUT"
step hf-batch 80 $E hf --mode batch --num-requests 64 --out "$OUT"
