#!/usr/bin/env bash
# The GPU checks and benchmarks, by suite: `benchmarks/gpu/run.sh SUITE [SUITE ...]` on the GPU host, after
# `benchmarks/gpu/prepare.sh` here (carry `.whl`). Every step writes under $OUT, its log to $OUT/run.log; a
# table of the steps (exit code, seconds) comes last.
#
#   kernels  kernel tests (Triton vs references, fp32 and bf16) and the kernel benchmark
#   engine   engine correctness vs the reference path, decode latency vs the HBM floor, offline throughput vs HF
#   stack    the same burst through the offline engine and through `tandem up` (stack / engine)
#   disagg   disaggregated vs colocated: the GPU stack test (cuda-ipc and grpc give the same tokens), the
#            prefill-worker forward vs a local prefill (`prefill_forward`), and `serve_modes` (the serve benchmark
#            on a colocated, a time-shared and an MPS-partitioned stack; SPLIT_MODE=split:P picks P)
#
# DRY_RUN=1 runs every step here, on the CPU with tiny shapes and the project's venv (no wheels installed),
# to check the script before spending device time.
set -uo pipefail
cd "$(dirname "$0")/../.."
export PYTHONUNBUFFERED=1 NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
if [ "${DRY_RUN:-0}" = 1 ]; then
    PY=${PY:-.venv/bin/python}
    OUT=${OUT:-/tmp/gpu-dry-run}
    DEVICE=cpu BIG=dummy:tiny SMALL=dummy:tiny SCALE=0 DRY=--dry-run
else
    python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl \
        || { echo "wheel install failed"; exit 1; }
    export PYTHONPATH=/tmp/site:$PWD PATH=/tmp/site/bin:$PATH
    # SmolLM2's tokenizer (no weights) for text with dummy models; the machine reaches no registry.
    export TANDEM_HOME=$PWD/.whl/tandem-home
    PY=python3
    DEVICE=cuda BIG=dummy:llama-3.1-8b SMALL=dummy:llama-3.2-1b SCALE=1 DRY=
fi
mkdir -p "$OUT"
LOG="$OUT/run.log"
SUMMARY="$OUT/summary.tsv"
: > "$SUMMARY"
{ nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv 2>/dev/null || echo "no GPU (dry run)";
  $PY -c "import torch, triton, transformers, grpc; print('torch', torch.__version__, 'triton', triton.__version__, 'transformers', transformers.__version__, 'grpcio', grpc.__version__)"
  date -u +%FT%TZ; } | tee -a "$LOG"

# step NAME TIMEOUT_S CMD...: output to $OUT/NAME.log and run.log, exit code and seconds to the summary.
step() {
    local name=$1 limit=$2; shift 2
    echo "== $name: $*" | tee -a "$LOG"
    local start=$SECONDS
    timeout "$limit" "$@" > "$OUT/$name.log" 2>&1
    local rc=$?
    cat "$OUT/$name.log" >> "$LOG"
    printf "%s\t%s\t%s\n" "$name" "$rc" "$((SECONDS - start))" >> "$SUMMARY"
    echo "rc=$rc ($((SECONDS - start)) s)" | tee -a "$LOG"
    tail -3 "$OUT/$name.log"
}
# n FULL DRY: a count for the real run, a tiny one for the dry run.
n() { if [ "$SCALE" = 1 ]; then echo "$1"; else echo "$2"; fi; }

suite_kernels() {
    step kernel-tests 300 $PY -m pytest -q -x --confcutdir=tests/kernels -p no:cacheprovider tests/kernels
    step kernel-bench 200 $PY -m tandem.benchmarks.kernels $DRY --out "$OUT/kernels.json"
}

suite_engine() {
    local E="$PY -m tandem.benchmarks.gpu_engine"
    [ "$SCALE" = 1 ] || E="env TRITON_INTERPRET=1 $E"  # the dry run takes the kernel path through the interpreter
    step correctness 120 $E correctness $DRY --model "$SMALL" --steps "$(n 200 8)" --out "$OUT"
    step decode-latency 200 $E decode-latency $DRY --out "$OUT"
    step offline 150 $E offline $DRY --out "$OUT"
}

suite_stack() {
    step stack-overhead 300 $PY -m tandem.benchmarks.stack_overhead --model "$SMALL" --device "$DEVICE" \
        --num-requests "$(n 256 8)" --prompt-len "fixed:$(n 256 16)" --output-len "fixed:$(n 1024 8)" \
        --out "$OUT/stack-overhead.json"
}

# After a fix of the cuda-ipc handle: the stack test, the forward (also at Python's default switch interval) and
# the time-shared stack again.
suite_disagg_recheck() {
    step gpu-stack 120 $PY -m pytest -q -x -p no:cacheprovider tests/e2e/test_gpu_stack.py
    step prefill-forward 80 $PY -m tandem.benchmarks.prefill_forward --model "$BIG" --device "$DEVICE" \
        --prompt-len "$(n 1024 48)" --batches 1,4 --repeat "$(n 6 2)" --out "$OUT/prefill-forward.json"
    step prefill-forward-5ms 80 $PY -m tandem.benchmarks.prefill_forward --model "$BIG" --device "$DEVICE" \
        --prompt-len "$(n 1024 48)" --batches 1 --repeat "$(n 6 2)" --switch-interval 0.005 \
        --out "$OUT/prefill-forward-5ms.json"
    serve_mode disagg 170
}

suite_disagg() {
    # Most important first: a call cut short by its time limit still returns what finished.
    step prefill-forward 100 $PY -m tandem.benchmarks.prefill_forward --model "$BIG" --device "$DEVICE" \
        --prompt-len "$(n 1024 48)" --batches 1,4 --repeat "$(n 8 2)" --out "$OUT/prefill-forward.json"
    serve_mode colocated 150
    serve_mode disagg 170
    step gpu-stack 120 $PY -m pytest -q -x -p no:cacheprovider tests/e2e/test_gpu_stack.py
    serve_mode "${SPLIT_MODE:-split:60}" 150
}

serve_mode() {  # MODE TIMEOUT_S
    local mode=$1 name="serve-${1/:/-}"
    step "$name" "$2" $PY -m tandem.benchmarks.serve_modes --mode "$mode" --model "$BIG" --device "$DEVICE" \
        --max-num-seqs "$(n 64 8)" --rates "$(n 2,8,32 4)" --num-requests "$(n 48 4)" \
        --prompt-len "fixed:$(n 1024 32)" --output-len "fixed:$(n 256 8)" --out "$OUT/$name.json"
}

for suite in "$@"; do
    if ! declare -F "suite_$suite" > /dev/null; then
        echo "unknown suite $suite (kernels, engine, stack, disagg, disagg_recheck)"; exit 2
    fi
    "suite_$suite"
done
echo
echo "step                rc   seconds"
awk -F'\t' '{printf "%-20s%-5s%s\n", $1, $2, $3}' "$SUMMARY"
