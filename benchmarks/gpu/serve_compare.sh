#!/usr/bin/env bash
# Disaggregated (1 prefill + 1 decode process sharing the GPU, cuda-ipc) vs colocated (1 decode worker
# prefilling itself), same model and load: `tandem bench serve` against each stack in turn.
# Usage: serve_compare.sh MODEL RATES NUM_REQUESTS PROMPT_LEN OUTPUT_LEN
set -uo pipefail
MODEL=$1 RATES=$2 NUM=$3 PROMPT=$4 OUTPUT=$5
run_stack() {  # NAME NUM_PREFILL
    local name=$1 prefill=$2 port=$((50100 + RANDOM % 800))
    rm -f "/tmp/status-$name.json"
    python3 -m tandem.cli up --model "$MODEL" --device cuda --prefill "$prefill" --decode 1 --port "$port" --max-num-seqs 64 \
        --http-port $((port + 1000)) --status-file "/tmp/status-$name.json" > "/tmp/up-$name.log" 2>&1 &
    local pid=$!
    for _ in $(seq 300); do [ -f "/tmp/status-$name.json" ] && break; sleep 0.5; done
    [ -f "/tmp/status-$name.json" ] || { echo "$name did not start"; tail -20 "/tmp/up-$name.log"; kill $pid; return; }
    python3 -m tandem.cli bench serve --address "127.0.0.1:$port" --rates "$RATES" --num-requests "$NUM" \
        --prompt-len "$PROMPT" --output-len "$OUTPUT" --out "$OUT/serve-$name.json" --plot "$OUT/serve-$name.png" \
        --label "$MODEL $name"
    kill -TERM $pid; wait $pid
}
run_stack disaggregated 1
run_stack colocated 0
