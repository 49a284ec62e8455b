#!/usr/bin/env bash
# GPU call 1 (issue 3): kernel tests and benchmark, engine correctness (Triton path vs reference on the
# same weights), decode step latency against the HBM floor. Results land in $OUT.
set -uo pipefail
source benchmarks/gpu/setup.sh
step() { local name=$1; shift; echo "== $name"; timeout "$@" 2>&1 | tee "$OUT/$name.log" | tail -25; }
step kernel-tests 120 python3 -m pytest -q -x tests/kernels -p no:cacheprovider
step kernels 200 python3 -m tandem.benchmarks.kernels --out "$OUT/kernels.json"
step correctness 120 python3 -m tandem.benchmarks.gpu_engine correctness --model dummy:llama-3.2-1b --steps 300 --out "$OUT"
step decode-latency 240 python3 -m tandem.benchmarks.gpu_engine decode-latency --out "$OUT"
