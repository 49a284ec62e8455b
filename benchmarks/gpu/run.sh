#!/usr/bin/env bash
# Since 2026-12-08 `tandem up` on a GPU with one decode worker has its prefill workers map the decode worker's weights
# (`--share-weights`): suites written before then measured each worker with its own copy; pass
# `--stack-args=--no-share-weights` (serve_modes) or `--no-share-weights` to reproduce them.
#
# The GPU checks and benchmarks, by suite: `benchmarks/gpu/run.sh SUITE [SUITE ...]` on the GPU host, after
# `benchmarks/gpu/prepare.sh` here (carry `.whl`). Every step writes under $OUT, its log to $OUT/run.log; a
# table of the steps (exit code, seconds) comes last. On the GPU host everything lands in $OUT/results.tgz (below).
#
#   kernels  kernel tests (Triton vs references, fp32 and bf16) and the kernel benchmark
#   engine   engine correctness vs the reference path, decode latency vs the HBM floor, offline throughput vs HF
#   stack    the same burst through the offline engine and through `tandem up` (stack / engine)
#   disagg   disaggregated vs colocated: the GPU stack test (cuda-ipc and grpc give the same tokens), the
#            prefill-worker forward vs a local prefill (`prefill_forward`), and `serve_modes` (the serve benchmark
#            on a colocated, a time-shared and an MPS-partitioned stack; SPLIT_MODE=split:P picks P)
#   chunked  chunked prefill vs whole-prompt steps: the paged prefill kernel over chunk x context, the serve benchmark
#            colocated at 2..48 req/s, one 32k-token prompt among 64 decoding streams
#   quant    quantized kernels' tests, decode step vs floor and offline throughput for bf16 / int8 / fp8 / fp8 + fp8
#            KV, a 1,000/1,000 max-throughput run, offline chunked vs whole prompts, HF transformers
#   spec     speculative decoding speed-up at batch 1 and 16: draft = target (the ceiling), n-gram
#   prefix   prefix caching through the stack (1 prefill + 2 decode): multi-turn chat, shared system prompt, random
#   stepcost, piecewise, serve_colocated, serve_final, long_offline, last
#            step cost by shape (eager vs piecewise CUDA graphs), serving at 2-48 req/s, the 32k prompt, offline
#            throughput with and without the graphs (2026-12-02; see each suite's comment)
#   first_request, recheck, recheck_more, decode_cost
#            cold-cache first requests with the compile watch, #15's stack rows, decode step cost at large batches
#            (2026-12-02, third session)
#   policy   #16's candidate scheduling policy (from benchmarks/sched_sim.py) against the defaults, ~6 min
#   next     decode step cost, disaggregated phases, decode's GIL switch interval A/B, ~5 min
#   buckets  step cost by token count around the piecewise graphs' buckets; the switch interval A/B again, ~5 min
#   policy2  after routing sizes to the fastest bucket: step costs, serve defaults vs prompt caps 512 / 384, ~8 min
#   policy3  the prompt cap lifted after a 50 ms wait (to 896 tokens or the whole budget) vs the defaults, ~7 min
#   prefix2  the prefix workloads twice, 64 random prompts (#17's no-loss target), ~5 min
#   async    async scheduling on vs off (TANDEM_ASYNC_SCHEDULING): its GPU test, #15's stack rows, ~6 min
#   async2   the 8B row with async scheduling: GPU test, offline engine on/off, the stack row with stacks, ~5 min
#   mps      one GPU under MPS without partitioning (and each role at the lower priority) vs colocated and
#            time-shared, 2 and 32 req/s, ~6 min
#   mps_full the 8B async row after its fix; colocated vs MPS (100:100) at 2-48 req/s; MPS spans, ~9 min
#   defaults colocated vs disaggregated with the 12-03 defaults (async, MPS, mid-step admission), ~5 min
#   grpc     #14's cross-host export after its pages went serialized by torch without the GIL: the exporter's tests,
#            the prefill forward (grpc vs local), the transport's GB/s, the spans and the serve benchmark with
#            --kv-transport grpc at 2-48 req/s, ~8 min
#   grpc2    the grpc export again: prefill forward (prefix cache off: the earlier run measured one token), the
#            transport's GB/s and the serve benchmark at 2 and 8 req/s, each with glibc's malloc as it is and with
#            its mmap and trim thresholds raised (no page faults on each message's fresh buffers), then split2, ~9 min
#   grpc3    with the exporter making messages on four threads (since taken out): its tests, the forward, the GB/s,
#            the serve benchmark with --kv-transport grpc at 2 req/s, ~3 min
#   split2   #14's ITL target at 8-32 req/s: prefill capped at 70% and 50% of the SMs (decode uncapped) under MPS,
#            against the 12-03 defaults' numbers (100:100), ~5 min
#   split3   #14 on one GPU: two prefill workers capped at 70% (then 60%) of the SMs under MPS, decode uncapped,
#            against colocated at 2-48 req/s (same seeds); the prefill forward profiled at batch 4, ~9 min
#   split4   split3 after the GPU's memory went by role (prefill workers their weights and a pool of 8 steps, decode
#            the rest): prefill forward with rotated order, two prefill workers at 60%, the default disagg, ~8 min
#   split5   split4's serve runs only (after the pools' fix), prefill workers at 60% and 70%, ~8 min
#   gc       the collector settled after start-up vs Python's default (gateway alone, #15's 1B rows), and the
#            random-prompt workload alone with the cache on/off in both orders (#17), ~7 min
#   client   #15: the stack's rows and the gateway alone with the burst dealt to 4 vs 1 load-generator processes, ~7 min
#   colo     #15: the 1B and 8B rows through a colocated stack vs the default disaggregated one, then the 128-token
#            row's burst timeline from its spans both ways, ~8 min
#   final15  #15: the warm-up step and the session's ack window (A/B) on the 1B rows, the gateway alone, 8B; the
#            model's build (#14's start-up), ~7.5 min
#   warm     #15: after the full-budget warm-up step: the three rows (medians of interleaved runs), the 128-token
#            row's timeline, ~6 min
#   local    #15/#14: the 1B rows with short prompts kept on decode (--local-prefill-max-tokens 256) vs 0, ~4 min
#   last15   #15: the 1B rows twice and the gateway alone on the session's last code, ~4 min
#   info     #15: after the cache summary's memo: decode step host parts, the 1B rows with decode's switch interval at
#            5 and 0.5 ms, ~6 min
#   rows     #15: after block tables from rows kept on the requests: GPU tests, decode step host parts, the 1B rows,
#            py-spy with native frames on decode, ~6 min
#   profile1024  #15: py-spy on the services during the 1B 1,024-token row; the 128-token row's spans, ~3 min
#   int8bits #18: int8 weights converted by integer ops vs I2F: the GEMV, the decode step on both int8 paths, offline
#            int8, ~6 min
#   pacer    #15: the stream pacer (--max-stream-interval 16 vs off) on one gateway process alone and the 1B rows;
#            #18: the 8B decode step against the card's own copy bandwidth, ~5 min
#   pacer_min  the pacer's A/B alone (gateway alone, the 128-token row), ~2.5 min
#   quant2   #18: the decode step table after the timing fix: every variant at batch 1/64/256, int8's conversion and
#            small-M A/B, bf16 with async scheduling off, the fusions' ablation, ~5 min
#   gil      #15/#14: a prefill step beside a busy Python thread by switch interval; the 1B rows at 50 us, ~6 min
#   prof15   #15: the 1B 128-token row with both workers' engine steps under torch.profiler (TANDEM_PROFILE_STEPS)
#            and every span printed: per-step GPU share (profile_steps), the burst's timeline, ~3 min
#   fresh15  #15: the three stack rows and the gateway alone, every burst with prompts of its own, ~4 min
#   quick15  #15: the 1B rows of fresh15 only, ~2 min
#   ack15    #15: the session's ack window 1 against 0 on the fresh 1B rows, ~5 min
#   columns  #15: a step's steady tokens in columns on the session (engine thread → session message, no per-request
#            event) vs per-request updates (TANDEM_SESSION_COLUMNS=0), interleaved: the gateway alone and the stack's
#            1B and 8B rows, ~8 min
#   pipe     #15/#14: prefill pipelining (TANDEM_PREFILL_PIPELINE) on vs off: its GPU tests and the GPU stack test,
#            the 1B rows interleaved, the 128-token row's timeline with it on, ~7 min
#   pipe_min the 128-token row of pipe and the gateway alone with the pacer off / 16, ~5 min
#   pdl      #18: PDL on / off and the norm_linear fusion (decode step table, tests, profiles), ~9 min
#   serve14  #14: the serve benchmark, colocated and disaggregated, 2-48 req/s, ~5 min
#   serve14b #14: serve14's disaggregated run with every worker's step budget at 2,048 tokens, ~3 min
#   serve14e #14: the prefill worker's forward vs local, two prefill workers capped at 70% (2-48 req/s) and at 85%
#            (2-16 req/s) at the 2,048 budget, ~7 min
#   kv18b    #18: after kv18: the kernel tests again (per-row q scaling), the sweep, the 8B fp8 + fp8 KV step and
#            offline with the new default tile, the old one and 128,4,3,f16, ~6 min
#   h18      #18 on an H200 (its targets' card): fp16 dots' and silu_quant's GPU tests, the decode step table (bf16 /
#            int8 / fp8 / fp8 + fp8 KV at batch 1/64/256), offline for every variant, ~4.5 min (with h18k: ~8)
#   h18k     #18 on an H200: the 1,000/1,000 max-throughput run, bf16 and fp8 + fp8 KV (H18K_TILE picks the tile), ~4 min
#   share14  #14: prefill workers mapping the decode worker's weights (one copy per GPU): the GPU stack test of it, then
#            two prefill workers at 85% of the SMs at 2-48 req/s (their pools recorded), ~8 min
#   share14c #14 in one call: share14's stack test, then colocated and two prefill workers with shared weights at 85% of
#            the SMs (SHARE14C_SPLITS="85 70" adds 70%) at 16, 32 and 48 req/s (SHARE14C_RATES), on the same card, ~4-6 min
#   first14  #14 item 4: the first request against steady, colocated and shared 85%, workers' logs and spans kept, ~3 min
#   n18      #18: the norm_quant and silu_quant fusions (activation quantization inside its producers): GPU tests, the
#            fp8 prompt step's kernels with them, fp8 + fp8 KV offline with none / one / both, twice, ~6 min
#   prof18   #18: where fp8's prefill falls short of 2x bf16 (offline 1.41x, target 1.5x): the GPU kernels of one
#            4,096-token prompt step and of a 256-sequence decode step, bf16 / fp8 / fp8 + fp8 KV; the silu_quant
#            fusion's GPU tests and its offline A/B (fp8 + fp8 KV), ~7 min
#   kv18     #18: the fp8 KV cache's decode attention tiles swept (fp16 dots), the best against the default through
#            the 8B step and offline, the 1,000/1,000 run with it, ~9 min
#   gemv18   #18: the M = 1 GEMV swept (split-K targets, CUDA-core tiles and warps), int8 and fp8, ~3 min
#   next18   #18: what came after the 12-07 H100 call: PDL's graph-edge test and determinism check, the greedy
#            sampler's kernel against torch, the silu_linear and x_tile A/Bs, the int8 batch-1 profile, ~8 min
#   serve14c #14: disaggregated serving on one GPU with tandem up's new prefill budget (2,048 on a shared GPU), at
#            1,024, and partitioned by MPS (70% of the SMs to prefill), ~8 min
#   serve14d #14/#15: two prefill workers each capped at 70% (MPS) at the 2,048 budget, the serve benchmark; the 1B
#            128-token stack row at 2,048 and 8,192 interleaved twice (4-serve14c's pair was order-confounded), ~9 min
#   v18      #18: the M = 1 GEMV's new defaults (16-row tiles, x_tile) against the old (32 rows, rows loaded plainly):
#            GPU kernel tests, the 8B batch-1 step A/B twice, PDL on with the new defaults, fp8's PDL logprobs with
#            piecewise graphs (small-M on / off at M = 4), ~5 min
#
# DRY_RUN=1 runs every step here, on the CPU with tiny shapes and the project's venv (no wheels installed),
# to check the script before spending device time.
set -uo pipefail
cd "$(dirname "$0")/../.."
export PYTHONUNBUFFERED=1 NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
# The tandem wheel must be built from this tree (prepare.sh records its sources): a stale one would measure old code.
if ! sha1sum --quiet -c .whl/SOURCES.sha1 > /dev/null 2>&1; then
    echo "the tandem wheel in .whl is not built from this tree: run benchmarks/gpu/prepare.sh"
    [ "${DRY_RUN:-0}" = 1 ] || exit 3  # the dry run uses the venv: a warning there
fi
if [ "${DRY_RUN:-0}" = 1 ]; then
    PY=${PY:-.venv/bin/python}
    OUT=${OUT:-/tmp/gpu-dry-run}
    DEVICE=cpu BIG=dummy:tiny SMALL=dummy:tiny SCALE=0 DRY=--dry-run
    TI="env TRITON_INTERPRET=1"  # steps that call Triton kernels directly take the interpreter
else
    python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl \
        || { echo "wheel install failed"; exit 1; }
    export PYTHONPATH=/tmp/site:$PWD PATH=/tmp/site/bin:$PATH
    # SmolLM2's tokenizer (no weights) for text with dummy models; the machine reaches no registry.
    export TANDEM_HOME=$PWD/.whl/tandem-home
    PY=python3
    DEVICE=cuda BIG=dummy:llama-3.1-8b SMALL=dummy:llama-3.2-1b SCALE=1 DRY= TI=
fi
# A call brings back at most 8 files from $OUT: the steps write into a scratch folder, packed into $OUT/results.tgz
# after every step (so a call cut short still returns what ran); the dry run keeps its files in $OUT.
if [ "${DRY_RUN:-0}" != 1 ]; then
    ARCHIVE="$OUT/results.tgz"
    mkdir -p "$OUT"
    OUT=$(mktemp -d /tmp/gpu-out.XXXXXX)
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
    # Ten seconds before the limit every tandem process prints its threads' stacks (SIGUSR1, tandem.common.debug):
    # a step that hangs says where; the services' logs (with their stacks) are kept beside the step's.
    local since
    since=$(date +%s)
    # (Python processes only: `timeout`'s own command line names the module too, and USR1 would kill it.)
    ( sleep $((limit > 20 ? limit - 10 : limit)); pkill -USR1 -f "^[^ ]*python[^ ]* -m tandem[.](cli|benchmarks)" ) &
    local watchdog=$!
    timeout "$limit" "$@" > "$OUT/$name.log" 2>&1
    local rc=$?
    kill "$watchdog" 2> /dev/null
    if [ "$rc" != 0 ] || [ "${KEEP_LOGS:-0}" = 1 ]; then  # KEEP_LOGS=1: the services' logs of every step
        mkdir -p "$OUT/$name-service-logs"
        find "${TANDEM_HOME:-$HOME/.cache/tandem}/logs" -type f -newermt "@$since" \
            -exec cp --backup=numbered -t "$OUT/$name-service-logs" {} + 2> /dev/null
    fi
    if [ "$rc" != 0 ]; then
        pkill -KILL -f "tandem[.]cli (up|prefill|decode|gateway)"  # what the killed step left running
    fi
    cat "$OUT/$name.log" >> "$LOG"
    printf "%s\t%s\t%s\n" "$name" "$rc" "$((SECONDS - start))" >> "$SUMMARY"
    echo "rc=$rc ($((SECONDS - start)) s)" | tee -a "$LOG"
    tail -3 "$OUT/$name.log"
    if [ -n "${ARCHIVE:-}" ]; then tar czf "$ARCHIVE" -C "$OUT" .; fi
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
    # The gateway alone over a decode worker with no engine (one process, 256 streams): its CPU per output token.
    step gateway-alone 90 $PY -m tandem.benchmarks.stack_overhead --fake-decode-step-ms 1 --gateway-workers 1 \
        --num-requests "$(n 256 8)" --output-len "fixed:$(n 128 8)" --out "$OUT/gateway-alone-w1.json"
    # The issue's rows with tandem up's default gateway processes (4 on a 16-CPU host), then the worst row with one.
    stack_row 1b-128-w4 "$SMALL" 256 128 4
    stack_row 1b-1024-w4 "$SMALL" 256 1024 4
    stack_row 8b-256-w4 "$BIG" 1024 256 4
    stack_row 1b-128-w1 "$SMALL" 256 128 1
    # 2026-12-02 (second session): the gateway alone and the worst row with --stream-interval 4.
    step gateway-alone-si4 90 $PY -m tandem.benchmarks.stack_overhead --fake-decode-step-ms 1 --gateway-workers 1 \
        --num-requests "$(n 256 8)" --output-len "fixed:$(n 128 8)" --stream-interval 4 \
        --out "$OUT/gateway-alone-w1-si4.json"
    stack_row 1b-128-w4-si4 "$SMALL" 256 128 4 --stream-interval 4
}

stack_row() {  # NAME MODEL PROMPT OUTPUT GATEWAY_WORKERS [MORE ARGS]
    step "stack-$1" 170 $PY -m tandem.benchmarks.stack_overhead --model "$2" --device "$DEVICE" \
        --num-requests "$(n 256 8)" --prompt-len "fixed:$(n "$3" 16)" --output-len "fixed:$(n "$4" 8)" \
        --gateway-workers "$5" --label "$1" --out "$OUT/stack-overhead-$1.json" "${@:6}"
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

suite_chunked() {
    step chunk-kernel 150 $TI $PY -m tandem.benchmarks.chunk_attention $DRY --out "$OUT/chunk-attention.json"
    serve_chunks chunked "" 200
    # Before chunked prefill: every prompt whole, in a step of its own (the budget holds the longest).
    serve_chunks whole "--no-chunked-prefill --max-num-batched-tokens 8192" 200
    long_prompt chunked ""
    long_prompt whole "--no-chunked-prefill --max-num-batched-tokens $(n 33000 600)"
}

# The serve rows alone, at the rates in CHUNK_RATES (default: all five).
suite_chunked_serve() {
    serve_chunks chunked "" 280
    serve_chunks whole "--no-chunked-prefill --max-num-batched-tokens 8192" 280
}

serve_chunks() {  # NAME STACK_ARGS TIMEOUT_S
    step "serve-$1" "$3" $PY -m tandem.benchmarks.serve_modes --mode colocated --model "$BIG" --device "$DEVICE" \
        --max-num-seqs "$(n 128 8)" --rates "$(n "${CHUNK_RATES:-2,8,16,32,48}" 4)" --num-requests "$(n 128 4)" \
        --prompt-len "fixed:$(n 1024 32)" --output-len "fixed:$(n 256 8)" --stack-args "$2" --out "$OUT/serve-$1.json"
}

long_prompt() {  # NAME STACK_ARGS
    step "long-prompt-$1" 150 $PY -m tandem.benchmarks.long_prompt --model "$BIG" --device "$DEVICE" \
        --long-prompt "$(n 32768 512)" --streams "$(n 64 4)" --stream-tokens "$(n 4096 200)" --stack-args "$2" \
        --out "$OUT/long-prompt-$1.json"
}

suite_quant() {
    local Q="$TI $PY -m tandem.benchmarks.quant"
    step quant-decode-latency 200 $Q decode-latency $DRY --model "$BIG" --steps "$(n 50 3)" --out "$OUT"
    step quant-offline 200 $Q offline $DRY --model "$BIG" --variants bf16,int8,fp8,fp8+fp8kv --out "$OUT/offline"
    step quant-1000 200 $Q offline $DRY --model "$BIG" --variants bf16,fp8+fp8kv --num-requests "$(n 512 8)" \
        --prompt-len 1000 --max-tokens 1000 --out "$OUT/offline-1000"
    step offline-whole 100 $Q offline $DRY --model "$BIG" --variants bf16 --no-chunked-prefill --out "$OUT/offline-whole"
    step offline-chunked-512 100 $Q offline $DRY --model "$BIG" --variants bf16 --max-num-batched-tokens 512 \
        --out "$OUT/offline-chunked-512"
    step quant-kernel-tests 200 $PY -m pytest -q -x --confcutdir=tests/kernels -p no:cacheprovider \
        tests/kernels/test_quant_linear.py tests/kernels/test_fp8_kv.py tests/kernels/test_quantized_model.py \
        tests/kernels/test_rope_store_kv.py tests/kernels/test_paged_prefill_attention.py
    local E="$PY -m tandem.benchmarks.gpu_engine"
    [ "$SCALE" = 1 ] || E="env TRITON_INTERPRET=1 $E"
    step hf 150 $E hf $DRY --model "$BIG" --out "$OUT"
}

# Where a decode step's time goes: bf16 against the quantized weights at batch 1 (torch.profiler, kernels by time).
suite_quant_profile() {
    local E="$PY -m tandem.benchmarks.gpu_engine"
    [ "$SCALE" = 1 ] || E="env TRITON_INTERPRET=1 $E"
    step profile-bf16 100 $E profile $DRY --model "$BIG" --batches 1 --out "$OUT"
    step profile-int8 100 $E profile $DRY --model "$BIG" --batches 1 --quantization int8 --out "$OUT"
    step profile-fp8 100 $E profile $DRY --model "$BIG" --batches 1 --quantization fp8 --out "$OUT"
}

# Each fusion of the decode layer on and off (TANDEM_FUSIONS), decode step vs the floor; the in-kernel combine of
# the split attention checked against the reference path.
suite_fusions() {
    local E="$PY -m tandem.benchmarks.gpu_engine"
    [ "$SCALE" = 1 ] || E="env TRITON_INTERPRET=1 $E"
    step fusion-ablation 240 $E decode-latency $DRY --models "$BIG" --fusions none,all,all+attn_combine \
        --batches 1,64 --steps "$(n 50 4)" --out "$OUT"
    step correctness-attn-combine 120 env TANDEM_FUSIONS=all+attn_combine $E correctness $DRY --model "$SMALL" \
        --steps "$(n 200 8)" --out "$OUT/attn-combine"
}

suite_spec() {
    local S="$PY -m tandem.benchmarks.spec_speed"
    step spec-draft 240 $S $DRY --device "$DEVICE" --model "$BIG" --draft-model "$BIG" --batch-sizes 1,16 \
        --prompts all --max-tokens "$(n 128 8)" --out "$OUT/spec-speed-draft.json"
    step spec-ngram 180 $S $DRY --device "$DEVICE" --model "$BIG" --batch-sizes 1,16 --prompts all \
        --max-tokens "$(n 128 8)" --out "$OUT/spec-speed-ngram.json"
}

# The small-M path of the quantized linears (weight-only GEMV with in-launch split-K): kernel tests, the
# micro-benchmark, and the decode step with the path on and off (TANDEM_QUANT_SMALL_M=0).
suite_quant_small_m() {
    local Q="$TI $PY -m tandem.benchmarks.quant"
    step small-m-tests 150 $PY -m pytest -q -x --confcutdir=tests/kernels -p no:cacheprovider \
        tests/kernels/test_quant_linear.py
    step quant-gemv 120 $TI $PY -m tandem.benchmarks.quant_gemv $DRY --out "$OUT/quant-gemv.json"
    step small-m-on 120 $Q decode-latency $DRY --model "$BIG" --variants bf16,int8,fp8 --batches 1,16,64 \
        --steps "$(n 50 3)" --out "$OUT/small-m-on"
    step small-m-off 120 env TANDEM_QUANT_SMALL_M=0 $Q decode-latency $DRY --model "$BIG" --variants int8,fp8 \
        --batches 1,16,64 --steps "$(n 50 3)" --out "$OUT/small-m-off"
}

# #18: int8 weights converted to float by integer ops (TANDEM_QUANT_INT8_BITS=1) instead of I2F, whose rate (16 per
# clock per SM) is below HBM's int8 rate: bitwise-equal check, the GEMV per projection, then the decode step on both
# int8 paths (old GEMM: TANDEM_QUANT_SMALL_M=0; small-M kernel up to 16 rows) and offline int8, each bits 0 / 1, ~6 min
suite_int8bits() {
    local Q="$TI $PY -m tandem.benchmarks.quant"
    step int8bits-tests 150 $PY -m pytest -q -x --confcutdir=tests/kernels -p no:cacheprovider \
        tests/kernels/test_quant_small_m.py
    step int8bits-gemv 150 $TI $PY -m tandem.benchmarks.quant_gemv $DRY --out "$OUT/quant-gemv.json"
    local small bits
    for small in 0 16; do
        for bits in 0 1; do
            step "int8bits-step-sm$small-b$bits" 120 env TANDEM_QUANT_SMALL_M=$small TANDEM_QUANT_INT8_BITS=$bits \
                $Q decode-latency $DRY --model "$BIG" --variants "$([ "$small$bits" = 00 ] && echo bf16,int8 || echo int8)" \
                --batches 1,16,64 --steps "$(n 50 3)" --out "$OUT/step-sm$small-b$bits"
        done
    done
    for bits in 0 1; do
        step "int8bits-offline-b$bits" 150 env TANDEM_QUANT_INT8_BITS=$bits $Q offline $DRY --model "$BIG" \
            --variants int8 --out "$OUT/offline-b$bits"
    done
}

# 2026-12-07 (#15/#14): prefill pipelining, a prefill worker's next step launched before the one in flight is read
# (its host part, ~6.4 ms per 8,192-token step in the burst, off the GPU's critical path). Its GPU tests and the
# stack test (cuda-ipc and grpc), then the 1B rows with it on and off, interleaved. ~6 min.
suite_pipe() {
    step pipe-tests 150 $PY -m pytest -q -x -p no:cacheprovider tests/kernels/test_prefill_pipeline_gpu.py \
        tests/kernels/test_async_scheduling_gpu.py tests/e2e/test_gpu_stack.py
    local i p
    for i in 1 2; do
        for p in 1 0; do
            TANDEM_PREFILL_PIPELINE=$p stack_row "1b-128-pipe$p-$i" "$SMALL" 256 128 4
        done
    done
    for p in 1 0; do
        TANDEM_PREFILL_PIPELINE=$p stack_row "1b-1024-pipe$p" "$SMALL" 256 1024 4
    done
    # Where a pipelined burst goes (an H100 run of the 128-token row had TTFT p50 608 ms against 217 in the run before).
    KEEP_LOGS=1 OTEL_TRACES_EXPORTER=console stack_row "1b-128-pipe1-spans" "$SMALL" 256 128 4
    local logs
    logs=$(ls -td "${TANDEM_HOME:-$HOME/.cache/tandem}"/logs/*/ | head -1)
    step "timeline-1b-128-pipe1" 60 $PY -m tandem.benchmarks.span_phases "$logs" --burst "$(n 256 8)" \
        --out "$OUT/timeline-1b-128-pipe1.json"
}

# The least of pipe and pacer_min for a short lease: the GPU tests, the 128-token row with pipelining on / off twice,
# the gateway alone with the pacer off / 16 once. ~5 min.
suite_pipe_min() {
    step pipe-tests 150 $PY -m pytest -q -x -p no:cacheprovider tests/kernels/test_prefill_pipeline_gpu.py \
        tests/e2e/test_gpu_stack.py
    local i p m
    for i in 1 2; do
        for p in 1 0; do
            TANDEM_PREFILL_PIPELINE=$p stack_row "1b-128-pipe$p-$i" "$SMALL" 256 128 4
        done
    done
    for m in 1 16; do
        step "gateway-alone-max$m" 90 $PY -m tandem.benchmarks.stack_overhead --fake-decode-step-ms 1 \
            --gateway-workers 1 --num-requests "$(n 256 8)" --output-len "fixed:$(n 256 8)" --repeat "$(n 3 1)" \
            --max-stream-interval $m --out "$OUT/gateway-alone-max$m.json"
    done
}

# 2026-12-06, third session (#15): the stream pacer (`--max-stream-interval`) A/B on one gateway process alone, off
# and 16 interleaved twice, and on the 1B rows through the stack (4 gateway processes, where it should stay at 1);
# then the 8B decode step (bf16 / int8, batch 1 / 64) against this card's own copy bandwidth. ~5 min.
suite_pacer() {
    suite_pacer_min 3
    stack_row "1b-1024-max1" "$SMALL" 256 1024 4 --repeat "$(n 2 1)"
    step pacer-step 120 $TI $PY -m tandem.benchmarks.quant decode-latency $DRY --model "$BIG" --variants bf16,int8 \
        --batches "$(n 1,64 1,4)" --steps "$(n 50 3)" --out "$OUT/pacer-step"
}

# The pacer's A/B alone, for a short lease: the gateway alone off / 16 twice, the 128-token row each way (that row
# REPEATS times, default 2). ~2.5 min.
suite_pacer_min() {
    local repeats=${1:-2} i m
    for i in 1 2; do
        for m in 1 16; do
            step "gateway-alone-max$m-$i" 90 $PY -m tandem.benchmarks.stack_overhead --fake-decode-step-ms 1 \
                --gateway-workers 1 --num-requests "$(n 256 8)" --output-len "fixed:$(n 256 8)" --repeat "$(n 3 1)" \
                --max-stream-interval $m --out "$OUT/gateway-alone-max$m-$i.json"
        done
    done
    for m in 1 16; do
        stack_row "1b-128-max$m" "$SMALL" 256 128 4 --repeat "$(n "$repeats" 1)" --max-stream-interval $m
    done
}

# 2026-12-06, third session (#18): the decode step table again after the timing fix (`steady_step_times`: with async
# scheduling a synchronisation before each step timed the host's part only, 0.4 ms for an 8B step). Every variant at
# batch 1 / 64 / 256; int8 with integer-op conversion (INT8_BITS) and the small-M kernel, A/B; bf16 with async
# scheduling off (the earlier tables' conditions); the fusions' ablation. ~5 min.
suite_quant2() {
    local Q="$TI $PY -m tandem.benchmarks.quant"
    step quant2-step 200 $Q decode-latency $DRY --model "$BIG" --variants bf16,int8,fp8,fp8+fp8kv \
        --batches "$(n 1,64,256 1,4)" --steps "$(n 50 3)" --out "$OUT/quant2-step"
    step quant2-step-sync 90 env TANDEM_ASYNC_SCHEDULING=0 $Q decode-latency $DRY --model "$BIG" --variants bf16 \
        --batches "$(n 1,64 1,4)" --steps "$(n 50 3)" --out "$OUT/quant2-step-sync"
    local small bits
    for small in 0 16; do
        for bits in 0 1; do
            [ "$small$bits" = 00 ] && continue  # the default: in quant2-step
            step "quant2-int8-sm$small-b$bits" 90 env TANDEM_QUANT_SMALL_M=$small TANDEM_QUANT_INT8_BITS=$bits \
                $Q decode-latency $DRY --model "$BIG" --variants int8 --batches "$(n 1,16,64 1,4)" \
                --steps "$(n 50 3)" --out "$OUT/quant2-int8-sm$small-b$bits"
        done
    done
    step quant2-fusions 150 $TI $PY -m tandem.benchmarks.gpu_engine $DRY decode-latency --models "$BIG" \
        --fusions none,all --batches "$(n 1,64 1,4)" --steps "$(n 50 3)" --out "$OUT/quant2-fusions"
}

# 2026-12-06 (#15/#14): the GIL convoy. Every torch op and Triton launch releases the GIL; a thread waiting for it
# takes it, and the engine thread waits up to a switch interval to get it back. A prefill step alone and beside a
# busy Python thread at 5 / 0.5 / 0.1 / 0.05 / 0.02 ms (1B at the 128-token burst's 32 x 256, 8B at 8 x 1,024), then
# the 1B rows with both workers' intervals at the defaults (prefill 0.5, decode 5 ms) vs 50 us, interleaved, and the
# 128-token row's timeline at 50 us. ~6 min.
suite_gil() {
    step gil-1b 120 $PY -m tandem.benchmarks.gil_contention --model "$SMALL" --device "$DEVICE" --batch "$(n 32 4)" \
        --prompt-len "$(n 256 16)" --repeat "$(n 5 2)" --out "$OUT/gil-contention-1b.json"
    step gil-8b 150 $PY -m tandem.benchmarks.gil_contention --model "$BIG" --device "$DEVICE" --batch "$(n 8 2)" \
        --prompt-len "$(n 1024 16)" --repeat "$(n 3 1)" --out "$OUT/gil-contention-8b.json"
    local i
    for i in 1 2; do
        stack_row "1b-128-w4-default-$i" "$SMALL" 256 128 4
        TANDEM_PREFILL_SWITCH_INTERVAL_S=0.00005 TANDEM_DECODE_SWITCH_INTERVAL_S=0.00005 \
            stack_row "1b-128-w4-50us-$i" "$SMALL" 256 128 4
    done
    stack_row "1b-1024-w4-default" "$SMALL" 256 1024 4
    TANDEM_PREFILL_SWITCH_INTERVAL_S=0.00005 TANDEM_DECODE_SWITCH_INTERVAL_S=0.00005 \
        stack_row "1b-1024-w4-50us" "$SMALL" 256 1024 4
    OTEL_TRACES_EXPORTER=console TANDEM_PREFILL_SWITCH_INTERVAL_S=0.00005 TANDEM_DECODE_SWITCH_INTERVAL_S=0.00005 \
        stack_row "1b-128-w4-50us-spans" "$SMALL" 256 128 4
    local logs
    logs=$(ls -td "${TANDEM_HOME:-$HOME/.cache/tandem}"/logs/*/ | head -1)
    step "timeline-1b-128-50us" 60 $PY -m tandem.benchmarks.span_phases "$logs" --burst "$(n 256 8)" \
        --out "$OUT/timeline-1b-128-50us.json"
}

suite_prof15() {
    # Busy period 2: the stack's 8-request warm-up burst is period 1; the offline engine's run and the load
    # generator's start-up (> 1 s) separate it from the measured burst, whose every step is in the ranges.
    local dir=$OUT/profiles
    KEEP_LOGS=1 OTEL_TRACES_EXPORTER=console TANDEM_PROFILE_DIR="$dir" \
        TANDEM_PROFILE_STEPS="prefill:1-$(n 40 6)@2,decode:1-$(n 450 40)@2" stack_row "1b-128-profiled" "$SMALL" 256 128 4
    local logs
    logs=$(ls -td "${TANDEM_HOME:-$HOME/.cache/tandem}"/logs/*/ | head -1)
    step "timeline-1b-128-profiled" 60 $PY -m tandem.benchmarks.span_phases "$logs" --burst "$(n 256 8)" \
        --out "$OUT/timeline-1b-128-profiled.json"
    step "profile-steps" 120 $PY -m tandem.benchmarks.profile_steps "$dir" --slowest 15 --out "$OUT/profile-steps.json"
    stack_row "1b-128-unprofiled" "$SMALL" 256 128 4
}

# 2026-12-06, second session (#15): the issue's three rows after stack_overhead stopped repeating prompts (the
# warm-up's 8 came back as prefix hits computed on decode; repeats ran cached prompts): each burst fresh, medians of
# repeats; the gateway alone. ~4 min.
suite_fresh15() {
    stack_row "1b-128-w4-fresh" "$SMALL" 256 128 4 --repeat "$(n 3 1)"
    stack_row "1b-1024-w4-fresh" "$SMALL" 256 1024 4 --repeat "$(n 2 1)"
    stack_row "8b-256-w4-fresh" "$BIG" 1024 256 4
    step "gateway-alone-fresh" 90 $PY -m tandem.benchmarks.stack_overhead --fake-decode-step-ms 1 \
        --gateway-workers 1 --num-requests "$(n 256 8)" --output-len "fixed:$(n 256 8)" --repeat "$(n 3 1)" \
        --out "$OUT/gateway-alone-w1-fresh.json"
}

# The least of fresh15, for a call with little device time: the 1B rows once each. ~2 min.
suite_quick15() {
    stack_row "1b-128-w4-fresh" "$SMALL" 256 128 4 --repeat "$(n 2 1)"
    stack_row "1b-1024-w4-fresh" "$SMALL" 256 1024 4
}

# The session's ack window (TANDEM_SESSION_ACK_WINDOW) 1 against 0 on the fresh 1B rows, interleaved. ~5 min.
suite_ack15() {
    local w
    for w in 1 0; do
        TANDEM_SESSION_ACK_WINDOW=$w stack_row "1b-128-w4-fresh-ack$w" "$SMALL" 256 128 4 --repeat "$(n 3 1)"
        TANDEM_SESSION_ACK_WINDOW=$w stack_row "1b-1024-w4-fresh-ack$w" "$SMALL" 256 1024 4 --repeat "$(n 2 1)"
    done
}

suite_prefix() {
    step prefix-chat 300 $PY -m tandem.benchmarks.prefix_chat --model "$BIG" --device "$DEVICE" \
        --conversations "$(n 32 2)" --turns "$(n 5 2)" --shared-requests "$(n 32 2)" --random-requests "$(n 16 2)" \
        --concurrency "$(n 16 2)" --max-tokens "$(n 64 4)" --out "$OUT/prefix-chat.json"
}

# Diagnosis of time to first token at a low rate: the engine alone step by step (chunked vs whole prompts: step
# kinds, step times, Triton compiles while serving), and the stack's spans per phase (colocated vs disaggregated).
suite_diag() {
    for mode in chunked whole; do
        local flag=""; [ "$mode" = whole ] && flag=--no-chunked-prefill
        step "step-trace-$mode" 150 $PY -m tandem.benchmarks.step_trace --model "$BIG" --device "$DEVICE" --rate 2 \
            --num-requests "$(n 48 6)" --prompt-len "$(n 1024 64)" --output-len "$(n 256 8)" $flag \
            --out "$OUT/step-trace-$mode.json"
    done
    span_phases colocated
    span_phases disagg
}

span_phases() {  # MODE: the serve benchmark at 2 req/s with every span printed into the logs, then per phase
    local tag=${1//:/-}
    step "spans-$tag" 150 env OTEL_TRACES_EXPORTER=console $PY -m tandem.benchmarks.serve_modes --mode "$1" \
        --model "$BIG" --device "$DEVICE" --max-num-seqs "$(n "${SPAN_SEQS:-64}" 8)" --rates 2 --num-requests "$(n 32 4)" \
        --prompt-len "fixed:$(n 1024 32)" --output-len "fixed:$(n 256 8)" --out "$OUT/spans-serve-$tag.json"
    local logs
    logs=$(ls -td "${TANDEM_HOME:-$HOME/.cache/tandem}"/logs/*/ | head -1)
    step "phases-$tag" 60 $PY -m tandem.benchmarks.span_phases "$logs" --out "$OUT/phases-$tag.json"
    # Triton compiles each worker counted while starting, and any a request waited for (the compile watch).
    grep -h 'Triton compiled' "$logs"/*.log > "$OUT/compiles-$tag.log" 2>/dev/null
    cat "$OUT/compiles-$tag.log" | tee -a "$LOG" | cut -c1-400
}

# After the budget and warm-up changes: the engine alone at 2 req/s (no compile while serving?), the colocated serve
# benchmark at the default budget over every rate, the 32k prompt among streams, and the disaggregated stack: its
# phases at 2 req/s and the serve benchmark over every rate (colocated vs disaggregated, issue #14's table).
suite_final() {
    step step-trace-default 150 $PY -m tandem.benchmarks.step_trace --model "$BIG" --device "$DEVICE" --rate 2 \
        --num-requests "$(n 48 6)" --prompt-len "$(n 1024 64)" --output-len "$(n 256 8)" \
        --out "$OUT/step-trace-default.json"
    serve_chunks chunked-default "" 200
    long_prompt chunked-default ""
    span_phases disagg
    step serve-disagg-all 200 $PY -m tandem.benchmarks.serve_modes --mode disagg --model "$BIG" --device "$DEVICE" \
        --max-num-seqs "$(n 128 8)" --rates "$(n 2,8,16,32,48 4)" --num-requests "$(n 128 4)" \
        --prompt-len "fixed:$(n 1024 32)" --output-len "fixed:$(n 256 8)" --out "$OUT/serve-disagg-all.json"
}

# The 32k prompt among 64 streams at the default budget (chunks shrink past LONG_CONTEXT_TOKENS of context).
suite_long() {
    long_prompt chunk-limit ""
}

# One row of the stack suite again (after a change of the decode worker's per-token work).
suite_stack_check() {
    stack_row 1b-1024-w4-after "$SMALL" 256 1024 4
}

# What one step costs by shape (prompt tokens x decoding sequences): host enqueue vs GPU time, kernels by time.
suite_stepcost() {
    step step-cost-8b 240 $PY -m tandem.benchmarks.step_cost --model "$BIG" --device "$DEVICE" --profile \
        --prompt-tokens "$(n 0,128,256,512,1024,2048 0,16,32)" --decodes "$(n 0,16,64 0,2)" \
        --context "$(n 1024 32)" --repeat "$(n 5 1)" --out "$OUT/step-cost-8b.json"
    step step-cost-1b 150 $PY -m tandem.benchmarks.step_cost --model "$SMALL" --device "$DEVICE" \
        --prompt-tokens "$(n 0,256,1024 0,16)" --decodes "$(n 0,64 0,2)" \
        --context "$(n 1024 32)" --repeat "$(n 5 1)" --out "$OUT/step-cost-1b.json"
}

# Piecewise CUDA graphs for steps with prompt tokens: the GPU tests (captured pieces give the eager tokens; the
# attention kernels writing into a given output), step cost with and without them, the step trace at 2 req/s.
suite_piecewise() {
    step piecewise-tests 300 $PY -m pytest -q -x --confcutdir=tests/kernels -p no:cacheprovider \
        tests/kernels/test_cuda_graphs.py tests/kernels/test_paged_decode_attention.py \
        tests/kernels/test_paged_prefill_attention.py tests/kernels/test_prefill_attention.py \
        tests/kernels/test_engine_kernel_path.py
    step step-cost-8b-piecewise 240 $PY -m tandem.benchmarks.step_cost --model "$BIG" --device "$DEVICE" --profile \
        --prompt-tokens "$(n 0,128,256,512,1024,2048 0,16,32)" --decodes "$(n 0,16,64 0,2)" \
        --context "$(n 1024 32)" --repeat "$(n 5 1)" --out "$OUT/step-cost-8b-piecewise.json"
    step step-cost-8b-eager 240 env TANDEM_PIECEWISE_GRAPHS=0 $PY -m tandem.benchmarks.step_cost --model "$BIG" \
        --device "$DEVICE" --prompt-tokens "$(n 0,128,256,512,1024,2048 0,16,32)" --decodes "$(n 0,16,64 0,2)" \
        --context "$(n 1024 32)" --repeat "$(n 5 1)" --out "$OUT/step-cost-8b-eager.json"
    step step-cost-1b-piecewise 150 $PY -m tandem.benchmarks.step_cost --model "$SMALL" --device "$DEVICE" \
        --prompt-tokens "$(n 0,256,1024 0,16)" --decodes "$(n 0,64 0,2)" \
        --context "$(n 1024 32)" --repeat "$(n 5 1)" --out "$OUT/step-cost-1b-piecewise.json"
    step step-trace-piecewise 150 $PY -m tandem.benchmarks.step_trace --model "$BIG" --device "$DEVICE" --rate 2 \
        --num-requests "$(n 48 6)" --prompt-len "$(n 1024 64)" --output-len "$(n 256 8)" \
        --out "$OUT/step-trace-piecewise.json"
}

# The serving results that piecewise graphs and the prompt-token cap change. Colocated at 2-48 req/s with the
# defaults (#16: ITL p99 vs TPOT p50), then without the cap at the low rates (what the graphs alone do), the step
# trace at 2 req/s.
suite_serve_colocated() {
    serve_chunks colocated-defaults "" 200
    CHUNK_RATES=2,8,16 serve_chunks colocated-no-cap "--prompt-tokens-while-decoding 0" 150
    step step-trace-defaults 120 $PY -m tandem.benchmarks.step_trace --model "$BIG" --device "$DEVICE" --rate 2 \
        --num-requests "$(n 48 6)" --prompt-len "$(n 1024 64)" --output-len "$(n 256 8)" \
        --out "$OUT/step-trace-defaults.json"
}

# Colocated and disaggregated at 2-48 req/s with the defaults (#16, #14).
suite_serve_final() {
    serve_chunks colocated-final "" 200
    step serve-disagg-final 200 $PY -m tandem.benchmarks.serve_modes --mode disagg --model "$BIG" \
        --device "$DEVICE" --max-num-seqs "$(n 128 8)" --rates "$(n 2,8,16,32,48 4)" --num-requests "$(n 128 4)" \
        --prompt-len "fixed:$(n 1024 32)" --output-len "fixed:$(n 256 8)" --out "$OUT/serve-disagg-final.json"
    span_phases disagg  # where the first disaggregated request's time goes (373 ms against 34 steady on 12-02)
}

# The first request after start-up with cold Triton caches, as on a fresh host (#14 item 4: within 2x of steady; on
# 12-02 the disaggregated stack's first took 508 ms against 37 steady in the first run, 50 against 39 in a second one
# with the disk cache warm): each worker logs what it compiled while serving. Then MPS-partitioned against time-shared.
suite_first_request() {
    TRITON_CACHE_DIR=$(mktemp -d /tmp/triton-cold.XXXXXX) SPAN_SEQS=128 span_phases disagg
    TRITON_CACHE_DIR=$(mktemp -d /tmp/triton-cold.XXXXXX) SPAN_SEQS=128 span_phases colocated
    step serve-split60 200 $PY -m tandem.benchmarks.serve_modes --mode split:60 --model "$BIG" \
        --device "$DEVICE" --max-num-seqs "$(n 128 8)" --rates "$(n 2,32 4)" --num-requests "$(n 128 4)" \
        --prompt-len "fixed:$(n 1024 32)" --output-len "fixed:$(n 256 8)" --out "$OUT/serve-split60.json"
}

# 2026-12-02 (third session): the two calls before ran a wheel built before the warm-up fix, the token sink and the
# stream interval (run.sh now refuses a stale wheel). The disaggregated first request with cold caches and the compile
# watch, then #15's stack rows that those changes concern, the colocated first request last.
suite_recheck() {
    TRITON_CACHE_DIR=$(mktemp -d /tmp/triton-cold.XXXXXX) SPAN_SEQS=128 span_phases disagg
    step gateway-alone 90 $PY -m tandem.benchmarks.stack_overhead --fake-decode-step-ms 1 --gateway-workers 1 \
        --num-requests "$(n 256 8)" --output-len "fixed:$(n 128 8)" --out "$OUT/gateway-alone-w1.json"
    step gateway-alone-si4 90 $PY -m tandem.benchmarks.stack_overhead --fake-decode-step-ms 1 --gateway-workers 1 \
        --num-requests "$(n 256 8)" --output-len "fixed:$(n 128 8)" --stream-interval 4 \
        --out "$OUT/gateway-alone-w1-si4.json"
    stack_row 1b-128-w4 "$SMALL" 256 128 4
    stack_row 1b-128-w4-si4 "$SMALL" 256 128 4 --stream-interval 4
    stack_row 1b-1024-w4 "$SMALL" 256 1024 4
    TRITON_CACHE_DIR=$(mktemp -d /tmp/triton-cold.XXXXXX) SPAN_SEQS=128 span_phases colocated
}

# The rest of #15's rows after `recheck` (its first 1B row ran with cold caches).
suite_recheck_more() {
    stack_row 1b-128-w4-warm "$SMALL" 256 128 4
    stack_row 8b-256-w4 "$BIG" 1024 256 4
}

# Decode steps at large batches (#15: is the 1B engine at ~25,000 tok/s bound by the host or by the GPU?): wall,
# host enqueue and GPU time per step, kernels by time.
suite_decode_cost() {
    step decode-cost-1b 150 $PY -m tandem.benchmarks.step_cost --model "$SMALL" --device "$DEVICE" --profile \
        --prompt-tokens 0 --decodes "$(n 64,128,256 2,4)" --context "$(n 768 32)" --repeat "$(n 10 1)" \
        --out "$OUT/decode-cost-1b.json"
    step decode-cost-8b 150 $PY -m tandem.benchmarks.step_cost --model "$BIG" --device "$DEVICE" --profile \
        --prompt-tokens 0 --decodes "$(n 64,256 2,4)" --context "$(n 1024 32)" --repeat "$(n 10 1)" \
        --out "$OUT/decode-cost-8b.json"
}

# #16's candidate policy from `benchmarks/sched_sim.py` (cap 384 beside decodes, 1,280-token steps: ITL p99 within
# 2.5x TPOT p50 at every rate in the model, goodput -19% at 32 req/s) against the defaults, same lease; then the
# step costs at the context the serve run reaches (the model's table was measured at 1,024).
suite_policy() {
    serve_chunks policy-defaults "" 200
    serve_chunks policy-cap384-1280 "--prompt-tokens-while-decoding 384 --max-num-batched-tokens 1280" 200
    step step-cost-8b-1152 120 $PY -m tandem.benchmarks.step_cost --model "$BIG" --device "$DEVICE" \
        --prompt-tokens "$(n 0,128,256,384,512,1024,1280,2048 0,16)" --decodes "$(n 0,1,16,64,128 0,2)" \
        --context "$(n 1152 32)" --repeat "$(n 5 1)" --out "$OUT/step-cost-8b-1152.json"
}

# For the next session (after `policy`, a call of its own): what the host-bookkeeping cut and admission between steps
# did (#15, #14), then decode's GIL switch interval (5 ms, Python's, against 0.5 ms). ~5 min.
suite_next() {
    suite_decode_cost
    span_phases disagg
    stack_row 1b-1024-w4-si5ms "$SMALL" 256 1024 4
    TANDEM_DECODE_SWITCH_INTERVAL_S=0.0005 stack_row 1b-1024-w4-si05ms "$SMALL" 256 1024 4
}

# 2026-12-02 (fourth session): the `policy` run's step costs put a 384-token chunk beside 1-16 decodes (a step of
# 385-400 tokens, the 448-token graph) at 16.7-17.7 ms, as much as 512 beside them and 6 ms over 384 alone: the
# step's cost by token count around the graphs' buckets, with graphs and eager, kernels of two shapes; then decode's
# GIL switch interval twice more each way, interleaved (one run each on 12-02: 79% at 5 ms, 85% at 0.5 ms).
suite_buckets() {
    local sizes
    sizes=$(n 256,320,384,400,416,432,448,464,480,512,576,640,768,896,1024 16,32)
    step step-cost-8b-buckets 150 $PY -m tandem.benchmarks.step_cost --model "$BIG" --device "$DEVICE" \
        --prompt-tokens "$sizes" --decodes "$(n 0,16 0,2)" --context "$(n 1152 32)" --repeat "$(n 5 1)" \
        --out "$OUT/step-cost-8b-buckets.json"
    step step-cost-8b-buckets-eager 150 env TANDEM_PIECEWISE_GRAPHS=0 $PY -m tandem.benchmarks.step_cost \
        --model "$BIG" --device "$DEVICE" --prompt-tokens "$sizes" --decodes "$(n 0,16 0,2)" \
        --context "$(n 1152 32)" --repeat "$(n 5 1)" --out "$OUT/step-cost-8b-buckets-eager.json"
    step step-cost-8b-kernels 120 $PY -m tandem.benchmarks.step_cost --model "$BIG" --device "$DEVICE" --profile \
        --prompt-tokens "$(n 384,432,448 16)" --decodes "$(n 0,16 0,2)" --context "$(n 1152 32)" --repeat "$(n 3 1)" \
        --out "$OUT/step-cost-8b-kernels.json"
    for i in 1 2; do
        TANDEM_DECODE_SWITCH_INTERVAL_S=0.0005 stack_row "1b-1024-w4-si05ms-$i" "$SMALL" 256 1024 4
        stack_row "1b-1024-w4-si5ms-$i" "$SMALL" 256 1024 4
    done
}

# After `buckets`: each size replays the bucket measured fastest, and a continuing chunk is trimmed to end its step on
# a size without padding. The step costs again (448 -> 512?), then the serve benchmark with the defaults and with
# prompt tokens beside decodes capped at 512 and 384 (budget 2,048: the backlog lifts the cap under load). ~8 min.
suite_policy2() {
    step step-cost-8b-routed 150 $PY -m tandem.benchmarks.step_cost --model "$BIG" --device "$DEVICE" \
        --prompt-tokens "$(n 256,320,384,400,432,448,464,512,576,640,768,1024 16,32)" --decodes "$(n 0,16 0,2)" \
        --context "$(n 1152 32)" --repeat "$(n 5 1)" --out "$OUT/step-cost-8b-routed.json"
    serve_chunks routed-defaults "" 200
    serve_chunks routed-cap512 "--prompt-tokens-while-decoding 512" 200
    serve_chunks routed-cap384 "--prompt-tokens-while-decoding 384" 200
}

# For the next session: the prompt-cap experiments picked in `benchmarks/sched_sim.py` with the step costs of 12-02
# (cap 512; once a prompt has waited 50 ms the cap is lifted, to 896 prompt tokens or to the whole budget) against the
# defaults, same lease. ~7 min.
suite_policy3() {
    serve_chunks policy3-defaults "" 200
    TANDEM_PROMPT_CAP_MAX_WAIT_MS=50 TANDEM_PROMPT_CAP_LIFT=896 \
        serve_chunks policy3-cap512-wait50-lift896 "--prompt-tokens-while-decoding 512" 200
    TANDEM_PROMPT_CAP_MAX_WAIT_MS=50 serve_chunks policy3-cap512-wait50 "--prompt-tokens-while-decoding 512" 200
}

# For the next session (#17): the prefix workloads twice, with 64 random prompts instead of 16 (the 12-02 run's random
# row, 16 requests in 1.6-1.9 s, is too short to tell a throughput loss from noise). ~5 min.
suite_prefix2() {
    for i in 1 2; do
        step "prefix-chat-$i" 300 $PY -m tandem.benchmarks.prefix_chat --model "$BIG" --device "$DEVICE" \
            --conversations "$(n 32 2)" --turns "$(n 5 2)" --shared-requests "$(n 32 2)" \
            --random-requests "$(n 64 2)" --concurrency "$(n 16 2)" --max-tokens "$(n 64 4)" \
            --out "$OUT/prefix-chat-$i.json"
    done
}

# 2026-12-02 (fifth session): services settle the garbage collector after start-up (`settle_heap`); A/B by
# TANDEM_GC_YOUNG_THRESHOLD=0, interleaved. Then #17's random workload alone, 128 prompts, the cache off first and
# on first (prefix2 gave 0.93x and 1.00x with "on" always first).
suite_gc() {
    for v in 0 50000; do
        TANDEM_GC_YOUNG_THRESHOLD=$v step "gateway-alone-gc$v" 90 $PY -m tandem.benchmarks.stack_overhead \
            --fake-decode-step-ms 1 --gateway-workers 1 --num-requests "$(n 256 8)" --output-len "fixed:$(n 256 8)" \
            --repeat "$(n 3 1)" --out "$OUT/gateway-alone-w1-gc$v.json"
    done
    for i in 1 2; do
        for v in 0 50000; do
            TANDEM_GC_YOUNG_THRESHOLD=$v stack_row "1b-1024-w4-gc$v-$i" "$SMALL" 256 1024 4
        done
    done
    stack_row 1b-128-w4-gc50000 "$SMALL" 256 128 4
    for modes in off,on on,off; do
        step "prefix-random-${modes/,/-}" 200 $PY -m tandem.benchmarks.prefix_chat --model "$BIG" --device "$DEVICE" \
            --conversations 0 --shared-requests 0 --random-requests "$(n 128 4)" --concurrency "$(n 16 2)" \
            --max-tokens "$(n 64 4)" --modes "$modes" --out "$OUT/prefix-random-${modes/,/-}.json"
    done
}

# 2026-12-03 (fourth session, #15): session token columns on (1) / off (0), read by the gateway processes (off: no
# slots, every token in updates, and the 64 KiB session window of before), interleaved.
suite_columns() {
    for v in 1 0; do
        TANDEM_SESSION_COLUMNS=$v step "gateway-alone-col$v" 90 $PY -m tandem.benchmarks.stack_overhead \
            --fake-decode-step-ms 1 --gateway-workers 1 --num-requests "$(n 256 8)" --output-len "fixed:$(n 256 8)" \
            --repeat "$(n 3 1)" --out "$OUT/gateway-alone-w1-col$v.json"
    done
    for i in 1 2; do
        for v in 1 0; do
            TANDEM_SESSION_COLUMNS=$v stack_row "1b-1024-w4-col$v-$i" "$SMALL" 256 1024 4
        done
    done
    for v in 1 0; do
        TANDEM_SESSION_COLUMNS=$v stack_row "1b-128-w4-col$v" "$SMALL" 256 128 4
    done
    TANDEM_SESSION_COLUMNS=1 stack_row "8b-256-w4-col1" "$BIG" 1024 256 4
}

# py-spy (carried by prepare.sh) on each service of the running stack for SECONDS (only busy samples: --idle off),
# once they are up; raw stacks to $OUT/pyspy-ROLE-TAG.txt. A profiler that cannot attach says so in its log.
profile_services() {  # TAG SECONDS
    local tag=$1 secs=$2 role pid i
    for i in $(seq 120); do pgrep -f "tandem[.]cli decode" > /dev/null && break; sleep 1; done
    sleep 15  # the workers' start-up and the first runs
    for role in prefill decode gateway; do
        pid=$(pgrep -f "tandem[.]cli $role" | tail -1)  # the gateway: its last worker process
        [ -n "$pid" ] && py-spy record -p "$pid" -d "$secs" -r 200 -f raw ${PYSPY_NATIVE:+--native} \
            -o "$OUT/pyspy-$role-$tag.txt" \
            > "$OUT/pyspy-$role-$tag.log" 2>&1 &
    done
    wait
}

# 2026-12-04 (#15): where the 1B rows' remaining time goes: the burst of 256 prompts of the 128-token row (services
# profiled, then the same row with its spans into the logs and their phases), and the 1,024-token row three times.
suite_burst() {
    if [ "${DRY_RUN:-0}" != 1 ]; then profile_services 128 40 & fi
    stack_row "1b-128-w4-prof" "$SMALL" 256 128 4 --repeat "$(n 6 1)"
    wait
    OTEL_TRACES_EXPORTER=console stack_row "1b-128-w4-spans" "$SMALL" 256 128 4
    local logs
    logs=$(ls -td "${TANDEM_HOME:-$HOME/.cache/tandem}"/logs/*/ | head -1)
    step "phases-1b-128" 60 $PY -m tandem.benchmarks.span_phases "$logs" --out "$OUT/phases-1b-128.json"
    stack_row "1b-1024-w4-r3" "$SMALL" 256 1024 4 --repeat "$(n 3 1)"
}

# 2026-12-04 (#15): a step's inputs through reused pinned arenas (HostStaging) against a pin_memory() per input, A/B by
# TANDEM_HOST_STAGING (the offline engine and the stack's workers read it), interleaved; the equality tests first.
suite_staging() {
    step staging-gpu-tests 200 $PY -m pytest -q -x --confcutdir=tests/kernels -p no:cacheprovider \
        tests/kernels/test_host_staging_gpu.py tests/kernels/test_async_scheduling_gpu.py
    for i in 1 2; do
        for v in 1 0; do
            TANDEM_HOST_STAGING=$v stack_row "1b-1024-w4-stage$v-$i" "$SMALL" 256 1024 4
        done
    done
    for v in 1 0; do
        TANDEM_HOST_STAGING=$v stack_row "1b-128-w4-stage$v" "$SMALL" 256 128 4
    done
}

# 2026-12-04, second session (#15): is one load-generator process what caps the stack? (At ~60k tok/s and ~0.5
# messages per token it receives ~30k messages a second, ~1 core of grpc.aio.) The 1B rows with the burst dealt to 4
# or 1 client processes, interleaved; the gateway alone with 4 and 1; the 8B row with 4.
suite_client() {
    for i in 1 2; do
        for c in 4 1; do
            stack_row "1b-1024-w4-c$c-$i" "$SMALL" 256 1024 4 --client-processes $c
        done
    done
    for c in 4 1; do
        stack_row "1b-128-w4-c$c" "$SMALL" 256 128 4 --client-processes $c
    done
    for c in 4 1; do
        step "gateway-alone-c$c" 90 $PY -m tandem.benchmarks.stack_overhead --fake-decode-step-ms 1 \
            --gateway-workers 1 --num-requests "$(n 256 8)" --output-len "fixed:$(n 256 8)" --repeat "$(n 3 1)" \
            --client-processes $c --out "$OUT/gateway-alone-w1-c$c.json"
    done
    stack_row "8b-256-w4-c4" "$BIG" 1024 256 4 --client-processes 4
}

# 2026-12-04, second session (#15): with the load spread over 4 client processes, where the decode worker's steady state
# goes (py-spy on each service during the 1B 1,024-token row), and the 128-token row's burst in spans.
suite_profile1024() {
    if [ "${DRY_RUN:-0}" != 1 ]; then profile_services 1024 40 & fi
    stack_row "1b-1024-w4-prof" "$SMALL" 256 1024 4 --repeat "$(n 3 1)"
    wait
    OTEL_TRACES_EXPORTER=console stack_row "1b-128-w4-spans" "$SMALL" 256 128 4
    local logs
    logs=$(ls -td "${TANDEM_HOME:-$HOME/.cache/tandem}"/logs/*/ | head -1)
    step "phases-1b-128" 60 $PY -m tandem.benchmarks.span_phases "$logs" --out "$OUT/phases-1b-128.json"
}

# 2026-12-04, second session (#15): after block tables joined from rows kept on the requests (and the arenas written
# through a memoryview): the GPU tests of the step inputs, the decode step's host parts (step_cost, as 12-02d's
# decode-cost-1b), the 1B rows as in `client` (4 client processes), then py-spy with native frames on the decode
# worker during one more 1,024-token row.
suite_rows() {
    step rows-gpu-tests 200 $PY -m pytest -q -x --confcutdir=tests/kernels -p no:cacheprovider \
        tests/kernels/test_host_staging_gpu.py tests/kernels/test_async_scheduling_gpu.py
    step decode-cost-1b 150 $PY -m tandem.benchmarks.step_cost --model "$SMALL" --device "$DEVICE" \
        --prompt-tokens 0 --decodes "$(n 64,128,256 2,4)" --context "$(n 768 32)" --repeat "$(n 10 1)" \
        --out "$OUT/decode-cost-1b.json"
    for i in 1 2; do
        stack_row "1b-1024-w4-rows-$i" "$SMALL" 256 1024 4
    done
    stack_row "1b-128-w4-rows" "$SMALL" 256 128 4
    if [ "${DRY_RUN:-0}" != 1 ]; then PYSPY_NATIVE=1 profile_services native 30 & fi
    stack_row "1b-1024-w4-native" "$SMALL" 256 1024 4 --repeat "$(n 3 1)"
    wait
}

# 2026-12-04, second session (#15): after the workers' cache summary is taken at most every 0.25 s (four gateways'
# probes took 14% of decode's event loop) and gpu_uuid is remembered: the decode step's host parts (step_cost, now with
# async scheduling off), the 1B rows, and decode's GIL switch interval at 0.5 ms (the native profile of `rows` found
# the engine thread waiting to take the GIL back in 29% of its samples).
suite_info() {
    step decode-cost-1b 150 $PY -m tandem.benchmarks.step_cost --model "$SMALL" --device "$DEVICE" \
        --prompt-tokens 0 --decodes "$(n 64,128,256 2,4)" --context "$(n 768 32)" --repeat "$(n 10 1)" \
        --out "$OUT/decode-cost-1b.json"
    for i in 1 2; do
        stack_row "1b-1024-w4-info-$i" "$SMALL" 256 1024 4
        TANDEM_DECODE_SWITCH_INTERVAL_S=0.0005 stack_row "1b-1024-w4-info-si05-$i" "$SMALL" 256 1024 4
    done
    stack_row "1b-128-w4-info" "$SMALL" 256 128 4
    TANDEM_DECODE_SWITCH_INTERVAL_S=0.0005 stack_row "1b-128-w4-info-si05" "$SMALL" 256 128 4
}

# 2026-12-04, second session (#15): the 1B rows and the gateway alone once more on the session's last code (the
# leases of `rows` and `info` ran the host ~1.5-3x slower than `client`'s).
suite_last15() {
    for i in 1 2; do
        stack_row "1b-1024-w4-last-$i" "$SMALL" 256 1024 4
        stack_row "1b-128-w4-last-$i" "$SMALL" 256 128 4
    done
    step "gateway-alone-last" 90 $PY -m tandem.benchmarks.stack_overhead --fake-decode-step-ms 1 \
        --gateway-workers 1 --num-requests "$(n 256 8)" --output-len "fixed:$(n 256 8)" --repeat "$(n 3 1)" \
        --out "$OUT/gateway-alone-w1-last.json"
}

# 2026-12-04, second session (#15, #14): conditional disaggregation: the gateway keeps prompts of at most N uncached
# tokens on their decode worker (--local-prefill-max-tokens); the 1B rows with N = 256 (every prompt of these rows)
# against 0 (all to the prefill worker), interleaved.
suite_local() {
    for i in 1 2; do
        for t in 256 0; do
            stack_row "1b-128-w4-local$t-$i" "$SMALL" 256 128 4 --local-prefill-max-tokens $t
        done
    done
    for t in 256 0; do
        stack_row "1b-1024-w4-local$t" "$SMALL" 256 1024 4 --local-prefill-max-tokens $t
    done
}

# Prepared 2026-12-04 for the next session (#15): is the 128-token row's loss disaggregation's own cost on one GPU?
# The 1B rows through a colocated stack (`--prefill-workers 0`) against the default (1 prefill worker, MPS),
# interleaved, with the 8B row once each.
suite_colo() {
    for i in 1 2; do
        for p in 0 1; do
            stack_row "1b-128-w4-p$p-$i" "$SMALL" 256 128 4 --prefill-workers $p
        done
    done
    for p in 0 1; do
        stack_row "1b-1024-w4-p$p" "$SMALL" 256 1024 4 --prefill-workers $p
        stack_row "8b-256-w4-p$p" "$BIG" 1024 256 4 --prefill-workers $p
    done
    # The 128-token row's burst on one clock, both ways: when each phase of the 256 requests started and ended.
    for p in 1 0; do
        OTEL_TRACES_EXPORTER=console stack_row "1b-128-w4-p$p-spans" "$SMALL" 256 128 4 --prefill-workers $p
        local logs
        logs=$(ls -td "${TANDEM_HOME:-$HOME/.cache/tandem}"/logs/*/ | head -1)
        step "timeline-1b-128-p$p" 60 $PY -m tandem.benchmarks.span_phases "$logs" --burst "$(n 256 8)" \
            --out "$OUT/timeline-1b-128-p$p.json"
    done
}

# 2026-12-04 (third session, #15): every worker's warm-up ends with one step at its whole token budget (the first
# 8,192-token batch of a fresh prefill worker took 121 ms against ~42), and the offline engine is warmed the same
# way. The three rows with medians of interleaved runs, then the 128-token row's burst timeline again.
suite_warm() {
    for i in 1 2; do
        stack_row "1b-128-w4-warm-$i" "$SMALL" 256 128 4 --repeat "$(n 3 1)"
    done
    stack_row "1b-1024-w4-warm" "$SMALL" 256 1024 4 --repeat "$(n 2 1)"
    stack_row "8b-256-w4-warm" "$BIG" 1024 256 4
    OTEL_TRACES_EXPORTER=console stack_row "1b-128-w4-warm-spans" "$SMALL" 256 128 4
    local logs
    logs=$(ls -td "${TANDEM_HOME:-$HOME/.cache/tandem}"/logs/*/ | head -1)
    step "timeline-1b-128-warm" 60 $PY -m tandem.benchmarks.span_phases "$logs" --burst "$(n 256 8)" \
        --out "$OUT/timeline-1b-128-warm.json"
}

# 2026-12-04 (third session, #15), one call for what is left of the budget: the full-budget warm-up step and the
# session's flow control in messages (TANDEM_SESSION_ACK_WINDOW=1 against 0, the default: the byte window alone),
# A/B on the 1B rows (medians of interleaved runs), the gateway alone both ways, the 8B row, then the 128-token row's
# timeline. Most important first. ~7 min.
suite_final15() {
    # The model built in its dtype (no float32 copy first): build time and the allocator's peak per model.
    step startup 150 $PY -m tandem.benchmarks.startup --models "$BIG,$SMALL" --dtypes bfloat16 --device "$DEVICE" \
        --repeat 1 --out "$OUT/startup.json"
    for w in 1 0; do
        TANDEM_SESSION_ACK_WINDOW=$w stack_row "1b-128-w4-ack$w" "$SMALL" 256 128 4 --repeat "$(n 3 1)"
    done
    for w in 1 0; do
        TANDEM_SESSION_ACK_WINDOW=$w stack_row "1b-1024-w4-ack$w" "$SMALL" 256 1024 4 --repeat "$(n 2 1)"
    done
    for w in 1 2 0; do
        TANDEM_SESSION_ACK_WINDOW=$w step "gateway-alone-ack$w" 60 $PY -m tandem.benchmarks.stack_overhead \
            --fake-decode-step-ms 1 --num-requests "$(n 256 8)" --output-len "fixed:$(n 256 8)" --gateway-workers 1 \
            --repeat "$(n 3 1)" --label "gateway-alone-ack$w" --out "$OUT/gateway-alone-ack$w.json"
    done
    stack_row "8b-256-w4-ack1" "$BIG" 1024 256 4
    OTEL_TRACES_EXPORTER=console stack_row "1b-128-w4-ack1-spans" "$SMALL" 256 128 4
    local logs
    logs=$(ls -td "${TANDEM_HOME:-$HOME/.cache/tandem}"/logs/*/ | head -1)
    step "timeline-1b-128-ack1" 60 $PY -m tandem.benchmarks.span_phases "$logs" --burst "$(n 256 8)" \
        --out "$OUT/timeline-1b-128-ack1.json"
}

# 2026-12-02 (fifth session): pure decode steps launched one ahead of the host (async scheduling), A/B by
# TANDEM_ASYNC_SCHEDULING (both the offline engine and the stack's decode worker read it), interleaved.
suite_async() {
    step async-gpu-test 200 $PY -m pytest -q -x --confcutdir=tests/kernels -p no:cacheprovider \
        tests/kernels/test_async_scheduling_gpu.py
    for i in 1 2; do
        for v in 0 1; do
            TANDEM_ASYNC_SCHEDULING=$v stack_row "1b-1024-w4-async$v-$i" "$SMALL" 256 1024 4
        done
    done
    for v in 0 1; do
        TANDEM_ASYNC_SCHEDULING=$v stack_row "1b-128-w4-async$v" "$SMALL" 256 128 4
    done
    for v in 0 1; do
        TANDEM_ASYNC_SCHEDULING=$v stack_row "8b-256-w4-async$v" "$BIG" 1024 256 4
    done
}

# 2026-12-03: where the 8B row stops with async scheduling on (it did not finish in 170 s on 12-02): the GPU equality
# test (its pool now sized), the offline engine alone on the 8B row's workload (progress bar in the log), on and off,
# then the stack row with async on (stacks of every tandem process ten seconds before its limit). ~5 min.
suite_async2() {
    step async-gpu-test 150 $PY -m pytest -q -x --confcutdir=tests/kernels -p no:cacheprovider \
        tests/kernels/test_async_scheduling_gpu.py
    local E="$PY -m tandem.benchmarks.gpu_engine"
    [ "$SCALE" = 1 ] || E="env TRITON_INTERPRET=1 $E"
    for v in 1 0; do
        mkdir -p "$OUT/offline-8b-async$v"
        TANDEM_ASYNC_SCHEDULING=$v step "offline-8b-async$v" 100 $E offline $DRY --model "$BIG" \
            --num-requests "$(n 256 8)" --prompt-len "$(n 1024 32)" --max-tokens "$(n 256 8)" \
            --out "$OUT/offline-8b-async$v"
    done
    TANDEM_ASYNC_SCHEDULING=1 stack_row "8b-256-w4-async1" "$BIG" 1024 256 4
}

# 2026-12-03 (#14): one GPU shared through MPS without partitioning (both roles capped at 100% of the SMs, kernels of
# both side by side), also with either role at MPS's lower client priority, against colocated and time-shared, same
# lease, 2 and 32 req/s. ~6 min.
suite_mps() {
    for mode in colocated disagg split:100:100; do
        serve_mps "$mode" ""
    done
    serve_mps split:100:100 "--gpu-split-low-priority decode" decode-low
    serve_mps split:100:100 "--gpu-split-low-priority prefill" prefill-low
}

serve_mps() {  # MODE STACK_ARGS [SUFFIX]
    local name="mps-${1//:/-}${3:+-$3}"
    step "$name" 130 $PY -m tandem.benchmarks.serve_modes --mode "$1" --model "$BIG" --device "$DEVICE" \
        --max-num-seqs "$(n 128 8)" --rates "$(n 2,32 4)" --num-requests "$(n 48 4)" \
        --prompt-len "fixed:$(n 1024 32)" --output-len "fixed:$(n 256 8)" --stack-args "$2" --out "$OUT/$name.json"
}

# 2026-12-03, after `async2` and `mps`: the 8B stack row with async scheduling after the fix of lost reservations
# (on, then off, same lease); #14's benchmark, colocated against MPS without partitioning at 2-48 req/s (128 requests
# per rate); where the MPS stack's TTFT goes at 2 req/s (spans per phase). ~9 min.
suite_mps_full() {
    TANDEM_ASYNC_SCHEDULING=1 stack_row "8b-256-w4-async1-fixed" "$BIG" 1024 256 4
    TANDEM_ASYNC_SCHEDULING=0 stack_row "8b-256-w4-async0" "$BIG" 1024 256 4
    for mode in colocated split:100:100; do
        step "serve-full-${mode//:/-}" 200 $PY -m tandem.benchmarks.serve_modes --mode "$mode" --model "$BIG" \
            --device "$DEVICE" --max-num-seqs "$(n 128 8)" --rates "$(n 2,8,16,32,48 4)" --num-requests "$(n 128 4)" \
            --prompt-len "fixed:$(n 1024 32)" --output-len "fixed:$(n 256 8)" --out "$OUT/serve-full-${mode//:/-}.json"
    done
    span_phases split:100:100
}

# 2026-12-03, the new defaults (async scheduling on for CUDA, one-GPU disaggregation through MPS without caps, a
# request's admission and activation run while a launched decode step computes): #14's benchmark, colocated against
# disaggregated, each with `tandem up`'s defaults, 2-48 req/s, 128 requests per rate. ~5 min.
suite_defaults() {
    for mode in colocated disagg; do
        step "serve-defaults-$mode" 200 $PY -m tandem.benchmarks.serve_modes --mode "$mode" --model "$BIG" \
            --device "$DEVICE" --max-num-seqs "$(n 128 8)" --rates "$(n 2,8,16,32,48 4)" --num-requests "$(n 128 4)" \
            --prompt-len "fixed:$(n 1024 32)" --output-len "fixed:$(n 256 8)" --out "$OUT/serve-defaults-$mode.json"
    done
}

grpc_export_checks() {  # the exporter's tests, the prefill forward (grpc vs local), the transport's GB/s
    step exporter-tests 120 $PY -m pytest -q -x -p no:cacheprovider tests/unit/test_page_exporter.py
    step prefill-forward 120 $PY -m tandem.benchmarks.prefill_forward --model "$BIG" --device "$DEVICE" \
        --prompt-len "$(n 1024 48)" --batches 1,4 --repeat "$(n 8 2)" --out "$OUT/prefill-forward.json"
    step kv-grpc 90 $PY -m tandem.benchmarks.kv_grpc_throughput --device "$DEVICE" --tokens "$(n 1024,4096 64)" \
        --model "$(n dummy:llama-3.1-8b dummy:tiny)" --out "$OUT/kv-grpc.json"
}

serve_grpc() {  # RATES NUM_REQUESTS TIMEOUT_S: the serve benchmark with --kv-transport grpc
    step serve-grpc "$3" $PY -m tandem.benchmarks.serve_modes --mode grpc --model "$BIG" \
        --device "$DEVICE" --max-num-seqs "$(n 128 8)" --rates "$(n "$1" 4)" --num-requests "$(n "$2" 4)" \
        --prompt-len "fixed:$(n 1024 32)" --output-len "fixed:$(n 256 8)" --out "$OUT/serve-grpc.json"
}

suite_grpc() {
    grpc_export_checks
    span_phases grpc
    serve_grpc 2,8,16,32,48 128 220
}

suite_grpc2() {
    local tun="GLIBC_TUNABLES=glibc.malloc.mmap_threshold=67108864:glibc.malloc.trim_threshold=1073741824"
    for variant in plain tuned; do
        local env="env"
        [ "$variant" = tuned ] && env="env $tun"
        step "prefill-forward-$variant" 100 $env $PY -m tandem.benchmarks.prefill_forward --model "$BIG" \
            --device "$DEVICE" --prompt-len "$(n 1024 48)" --batches 1,4 --repeat "$(n 8 2)" \
            --out "$OUT/prefill-forward-$variant.json"
        step "kv-grpc-$variant" 90 $env $PY -m tandem.benchmarks.kv_grpc_throughput --device "$DEVICE" \
            --tokens "$(n 1024,4096 64)" --model "$(n dummy:llama-3.1-8b dummy:tiny)" --out "$OUT/kv-grpc-$variant.json"
    done
    step serve-grpc-tuned 120 env "$tun" $PY -m tandem.benchmarks.serve_modes --mode grpc --model "$BIG" \
        --device "$DEVICE" --max-num-seqs "$(n 128 8)" --rates "$(n 2,8 4)" --num-requests "$(n 64 4)" \
        --prompt-len "fixed:$(n 1024 32)" --output-len "fixed:$(n 256 8)" --out "$OUT/serve-grpc-tuned.json"
    suite_split2
}

suite_grpc3() {
    grpc_export_checks
    serve_grpc 2 32 100
}

suite_split2() {
    for split in 70:100 50:100; do
        step "serve-split-${split/:/-}" 170 $PY -m tandem.benchmarks.serve_modes --mode "split:$split" --model "$BIG" \
            --device "$DEVICE" --max-num-seqs "$(n 128 8)" --rates "$(n 8,16,32 4)" --num-requests "$(n 128 4)" \
            --prompt-len "fixed:$(n 1024 32)" --output-len "fixed:$(n 256 8)" --out "$OUT/serve-split-${split/:/-}.json"
    done
}

# #14 on one GPU: two prefill workers each capped (so one prompt alone leaves decode SMs; two at once use the GPU),
# against colocated, same seeds; the prefill forward profiled at batch 4 (mirror / grpc vs local).
suite_split3() {
    clocks_start
    forward_rotated --profile
    serve_one_gpu serve-colocated --mode colocated
    serve_two_prefill ${SPLITS:-70:100 60:100}
}

# split3 again after the memory shares by role: the forward with rotated order and pauses, then the serve runs
# (split5: the serve runs only, after the pools' fix).
suite_split4() {
    clocks_start
    local KEEP_LOGS=1  # every step keeps its services' logs (step reads it)
    forward_rotated
    serve_two_prefill ${SPLITS:-60:100}
    serve_one_gpu serve-disagg --mode disagg
}
suite_split5() {
    clocks_start
    local KEEP_LOGS=1  # every step keeps its services' logs (step reads it)
    serve_two_prefill ${SPLITS:-60:100 70:100}
    serve_one_gpu serve-disagg --mode disagg
}

# The prefill forward against local (`prefill_forward`: modes rotated, a pause before each step), batches 1 and 4.
forward_rotated() {
    step prefill-forward 100 $PY -m tandem.benchmarks.prefill_forward --model "$BIG" --device "$DEVICE" \
        --prompt-len "$(n 1024 48)" --batches 1,4 --repeat "$(n 8 2)" "$@" --out "$OUT/prefill-forward.json"
}

# serve_one_gpu NAME ARGS...: #14's serve benchmark (1,024 / 256 tokens, 2-48 req/s, 128 requests per rate).
serve_one_gpu() {
    local name=$1; shift
    step "$name" 170 $PY -m tandem.benchmarks.serve_modes "$@" --model "$BIG" --device "$DEVICE" \
        --max-num-seqs "$(n 128 8)" --rates "$(n 2,8,16,32,48 4)" --num-requests "$(n 128 4)" \
        --prompt-len "fixed:$(n 1024 32)" --output-len "fixed:$(n 256 8)" --out "$OUT/$name.json"
}

# 2026-12-07 (#14): the serve benchmark colocated and disaggregated on this code (prefill pipelining on the prefill
# worker by default). ~5.5 min.
suite_serve14() {
    local mode
    for mode in colocated disagg; do
        step "serve-$mode" 170 $PY -m tandem.benchmarks.serve_modes --mode $mode --model "$BIG" --device "$DEVICE" \
            --max-num-seqs "$(n 128 8)" --rates "$(n "${SERVE14_RATES:-2,8,16,32,48}" 4)" --num-requests "$(n 128 4)" \
            --prompt-len "fixed:$(n 1024 32)" --output-len "fixed:$(n 256 8)" --out "$OUT/serve-$mode.json"
    done
}

# Next (#18): the int8 GEMV at one token, the gap to int8's 400 tok/s (its GEMV is 3.08 of a 4.14 ms step on the H100,
# 75% of bandwidth; 60% on the H200 of 12-01): every projection at M = 1 with split-K targets and CUDA-core tiles and
# warps swept (`quant_gemv --sweep`). ~3 min.
suite_gemv18() {
    step gemv18 170 $TI $PY -m tandem.benchmarks.quant_gemv $DRY --sweep --kinds int8,fp8 --m 1 \
        --out "$OUT/quant-gemv-sweep.json"
}

# Next (#14), after the 12-07 H100 serve14: disaggregated ITL p99 rose above colocated's at 32-48 req/s (76 / 116 ms
# against 68 / 66) while the prefill worker ran 8,192-token steps beside decode's; the same with every worker's step
# budget at 2,048 tokens (decode's default already), so a prefill step holds the GPU a quarter as long. ~3 min.
suite_serve14b() {
    step serve-disagg-mbt2048 170 $PY -m tandem.benchmarks.serve_modes --mode disagg --model "$BIG" --device "$DEVICE" \
        --max-num-seqs "$(n 128 8)" --rates "$(n "${SERVE14_RATES:-2,8,16,32,48}" 4)" --num-requests "$(n 128 4)" \
        --prompt-len "fixed:$(n 1024 32)" --output-len "fixed:$(n 256 8)" \
        --stack-args "--max-num-batched-tokens $(n 2048 64)" --out "$OUT/serve-disagg-mbt2048.json"
}

# After serve14b (2026-12-07, fourth session): #14's serve benchmark, disaggregated on one GPU, three ways: the default
# sharing (MPS, neither role capped) with `tandem up`'s default prefill budget on a shared GPU (now 2,048: serve14b's
# setting, again), the same at 1,024 (one prompt per prefill step), and MPS-partitioned (prefill 70% of the SMs,
# decode all) at the default budget. ~8 min.
suite_serve14c() {
    local name mode budget
    if [ -n "${STACK14C:-}" ]; then  # the stack's 1B 128-token row (#15) at the new prefill budget and the old
        stack_row 1b-128-mbt2048 "$SMALL" 256 128 4
        stack_row 1b-128-mbt8192 "$SMALL" 256 128 4 --max-num-batched-tokens "$(n 8192 256)"
    fi
    for name in ${SERVE14C:-disagg:disagg: disagg-mbt1024:disagg:1024 split70:split:70:100:}; do
        mode=${name#*:}; budget=${mode##*:}; mode=${mode%:*}; name=${name%%:*}
        step "serve-$name" 190 $PY -m tandem.benchmarks.serve_modes --mode "$mode" --model "$BIG" --device "$DEVICE" \
            --max-num-seqs "$(n 128 8)" --rates "$(n "${SERVE14_RATES:-2,8,16,32,48}" 4)" \
            --num-requests "$(n 128 4)" --prompt-len "fixed:$(n 1024 32)" --output-len "fixed:$(n 256 8)" \
            ${budget:+--stack-args "--max-num-batched-tokens $(n "$budget" 64)"} --out "$OUT/serve-$name.json"
    done
}

# Next (#14, #15), after serve14c: one capped prefill worker cannot keep up (goodput 0.09x colocated's at 32 req/s)
# and the uncapped default misses the ITL target; two capped workers met it at 8-16 req/s on an H200 with 8,192-token
# steps (12-03), so the serve benchmark with two at 2,048. Then the 1B 128-token stack row at the two prefill budgets,
# interleaved twice. ~9 min.
suite_serve14d() {
    step serve-split70x2 190 $PY -m tandem.benchmarks.serve_modes --mode split:70:100 --prefill-workers 2 \
        --model "$BIG" --device "$DEVICE" --max-num-seqs "$(n 128 8)" --rates "$(n "${SERVE14_RATES:-2,8,16,32,48}" 4)" \
        --num-requests "$(n 128 4)" --prompt-len "fixed:$(n 1024 32)" --output-len "fixed:$(n 256 8)" \
        --out "$OUT/serve-split70x2.json"
    local i
    for i in 1 2; do
        stack_row "1b-128-mbt2048-$i" "$SMALL" 256 128 4
        stack_row "1b-128-mbt8192-$i" "$SMALL" 256 128 4 --max-num-batched-tokens "$(n 8192 256)"
    done
}

# 2026-12-07, sixth session (#14): the prefill worker's forward against local (not measured since the 2,048 budget
# and prefill pipelining), two prefill workers capped at 70% at the 2,048 budget (serve14d's serve run), and two at 85%
# at 2-16 req/s (a single prompt at 70% missed the TTFT bound at 2 req/s). ~7 min.
suite_serve14e() {
    step prefill-forward 100 $PY -m tandem.benchmarks.prefill_forward --model "$BIG" --device "$DEVICE" \
        --prompt-len "$(n 1024 48)" --batches 1,4 --repeat "$(n 6 2)" --out "$OUT/prefill-forward.json"
    local p rates
    for p in 70 85; do
        rates=${SERVE14_RATES:-2,8,16,32,48}
        [ "$p" = 85 ] && rates=2,8,16
        step "serve-split${p}x2" 200 $PY -m tandem.benchmarks.serve_modes --mode "split:$p:100" --prefill-workers 2 \
            --model "$BIG" --device "$DEVICE" --max-num-seqs "$(n 128 8)" --rates "$(n "$rates" 4)" \
            --num-requests "$(n 128 4)" --prompt-len "fixed:$(n 1024 32)" --output-len "fixed:$(n 256 8)" \
            --out "$OUT/serve-split${p}x2.json"
    done
}

# 2026-12-07, third session (#14, #15): the serve benchmark both ways on this code, then where a pipelined burst of the
# 128-token stack row goes (spans of every service, span_phases). ~7.5 min.
suite_serve14_tl() {
    suite_serve14
    KEEP_LOGS=1 OTEL_TRACES_EXPORTER=console stack_row "1b-128-spans" "$SMALL" 256 128 4
    local logs
    logs=$(ls -td "${TANDEM_HOME:-$HOME/.cache/tandem}"/logs/*/ | head -1)
    step "timeline-1b-128" 60 $PY -m tandem.benchmarks.span_phases "$logs" --burst "$(n 256 8)" \
        --out "$OUT/timeline-1b-128.json"
}

# 2026-12-07, third session (#18): the decode step table (every variant, batch 1 / 64 / 256), then where a batch-1 step's
# time goes (torch.profiler: device time per kernel, device busy against wall) for bf16 and int8. ~4 min.
suite_q18() {
    step quant2-step 200 $TI $PY -m tandem.benchmarks.quant decode-latency $DRY --model "$BIG" \
        --variants bf16,int8,fp8,fp8+fp8kv --batches "$(n 1,64,256 1,4)" --steps "$(n 50 3)" --out "$OUT/quant2-step"
    suite_quant_profile
}

# 2026-12-07 (#18): programmatic dependent launch ($TANDEM_PDL) and the norm_linear fusion. Their GPU tests (PDL: the
# same tokens and logprobs on and off, bf16 / int8 / fp8, CUDA graphs; norm_linear: kernel and model logits against
# the unfused path), norm_linear off / on / off / on (int8, fp8 at batch 1), the decode step with PDL off / on / off /
# on (bf16, int8, fp8 at batch 1 / 64), int8 at batch 1 by the GEMM (the old default), both switches on, then where a
# batch-1 step's time goes (torch.profiler) for bf16, int8 and fp8. ~9 min (ran on an H100: results h100-2026-12-07c).
suite_pdl() {
    step pdl-tests 200 $PY -m pytest -q -p no:cacheprovider tests/kernels/test_pdl_gpu.py \
        tests/kernels/test_norm_linear.py tests/kernels/test_norm_linear_model.py
    local Q="$TI $PY -m tandem.benchmarks.quant" i p f
    # The norm_linear fusion (RMSNorm inside the qkv / gate_up GEMV at batch 1), PDL off, interleaved.
    for i in 1 2; do
        for f in all all+norm_linear; do
            step "nl-${f#all+}-$i" 90 env TANDEM_PDL=0 TANDEM_FUSIONS=$f $Q decode-latency $DRY --model "$BIG" \
                --variants int8,fp8 --batches 1 --steps "$(n 50 3)" --out "$OUT/nl-${f#all+}-$i"
        done
    done
    for i in 1 2; do
        for p in 0 1; do
            step "pdl$p-step-$i" 150 env TANDEM_PDL=$p $Q decode-latency $DRY --model "$BIG" --variants bf16,int8,fp8 \
                --batches "$(n 1,64 1,4)" --steps "$(n 50 3)" --out "$OUT/pdl$p-step-$i"
        done
    done
    # int8 at batch 1 by the GEMM (the default before the small-M GEMV took M = 1), against pdl0-step's int8 rows.
    step int8-gemm-b1 90 env TANDEM_PDL=0 TANDEM_QUANT_SMALL_M=0 $Q decode-latency $DRY --model "$BIG" \
        --variants int8 --batches 1 --steps "$(n 50 3)" --out "$OUT/int8-gemm-b1"
    step pdl1-nl 90 env TANDEM_PDL=1 TANDEM_FUSIONS=all+norm_linear $Q decode-latency $DRY --model "$BIG" \
        --variants int8,fp8 --batches 1 --steps "$(n 50 3)" --out "$OUT/pdl1-nl"
    suite_quant_profile
}

# Next (#18), after the 12-07 H100 call: the tests of what came since (PDL's graph-edge test, the greedy sampler's
# kernel, the silu_linear fusion's kernel and model tests, PDL's on/off test), where fp8's logprobs move with PDL on
# (prompt steps eager: `pdl_determinism --no-piecewise`), the greedy sampler against torch's reductions, the
# silu_linear fusion off / on / off / on (int8, fp8 at batch 1, PDL off), the same for $TANDEM_QUANT_X_TILE, and the
# int8 batch-1 profile again (the sampler's ~55 us should be gone). ~8 min.
suite_next18() {
    step next18-tests 200 $PY -m pytest -q -p no:cacheprovider tests/kernels/test_pdl_graph_edges_gpu.py \
        tests/kernels/test_greedy_sample.py tests/kernels/test_norm_linear.py tests/kernels/test_norm_linear_model.py \
        tests/kernels/test_pdl_gpu.py
    if [ "$SCALE" = 1 ]; then  # CUDA only
        step pdl-determinism 150 $PY -m tandem.benchmarks.pdl_determinism --quantization fp8 --prompt-lens 4,40 \
            --no-piecewise
    fi
    step sample-cost 60 $TI $PY -m tandem.benchmarks.sample_cost $DRY --out "$OUT/sample-cost.json"
    local Q="$TI $PY -m tandem.benchmarks.quant" i f
    for i in 1 2; do
        for f in all all+silu_linear; do
            step "sl-${f#all+}-$i" 90 env TANDEM_PDL=0 TANDEM_FUSIONS=$f $Q decode-latency $DRY --model "$BIG" \
                --variants int8,fp8 --batches 1 --steps "$(n 50 3)" --out "$OUT/sl-${f#all+}-$i"
        done
    done
    # M = 1's activations in the weight tile's layout (no CTA barriers per K step), off / on / off / on.
    for i in 1 2; do
        for f in 0 1; do
            step "xt$f-$i" 90 env TANDEM_PDL=0 TANDEM_QUANT_X_TILE=$f $Q decode-latency $DRY --model "$BIG" \
                --variants int8,fp8 --batches 1 --steps "$(n 50 3)" --out "$OUT/xt$f-$i"
        done
    done
    local E="$PY -m tandem.benchmarks.gpu_engine"
    [ "$SCALE" = 1 ] || E="env TRITON_INTERPRET=1 $E"
    step profile-int8 100 $E profile $DRY --model "$BIG" --batches 1 --quantization int8 --out "$OUT"
}

# After next18 and gemv18 (2026-12-07, fourth session): the new M = 1 defaults on hardware (kernel tests), the step
# with them against the old tile, interleaved twice (int8, fp8, batch 1, PDL off), PDL on with them (bf16, int8, fp8),
# and where fp8's PDL logprobs move: the piecewise-graph run of a 4-token prompt (the xfail), again with the small-M
# path off (TANDEM_QUANT_SMALL_M=0: M = 4 takes the W8A8 GEMM). ~5 min.
suite_v18() {
    step v18-tests 150 $PY -m pytest -q -p no:cacheprovider tests/kernels/test_quant_small_m.py
    local Q="$TI $PY -m tandem.benchmarks.quant" i f
    for i in 1 2; do
        for f in new old; do
            local env="TANDEM_QUANT_M1_BLOCK_N=16 TANDEM_QUANT_X_TILE=1"
            [ "$f" = old ] && env="TANDEM_QUANT_M1_BLOCK_N=32 TANDEM_QUANT_X_TILE=0"
            step "m1-$f-$i" 90 env TANDEM_PDL=0 $env $Q decode-latency $DRY --model "$BIG" \
                --variants int8,fp8 --batches 1 --steps "$(n 50 3)" --out "$OUT/m1-$f-$i"
        done
    done
    step m1-pdl1 120 env TANDEM_PDL=1 $Q decode-latency $DRY --model "$BIG" --variants bf16,int8,fp8 --batches 1 \
        --steps "$(n 50 3)" --out "$OUT/m1-pdl1"
    if [ "$SCALE" = 1 ]; then  # CUDA only
        step pdl-det-piecewise 100 $PY -m tandem.benchmarks.pdl_determinism --quantization fp8 --prompt-lens 4
        step pdl-det-gemm 100 env TANDEM_QUANT_SMALL_M=0 $PY -m tandem.benchmarks.pdl_determinism \
            --quantization fp8 --prompt-lens 4
    fi
}

# Next (#18), after kv18: the fp16 dots' GPU test failed with a fixed q scale (now per row) and the doubled fp8 tile is
# the default without fp16 dots, its step effect unmeasured. The kernel tests (fp16 dots and the default tiles with a
# large q), the sweep, then the 8B step and offline: the new default, the old tile (64,4,2) and 128,4,3,f16. ~6 min.
suite_kv18b() {
    step kv18b-tests 150 $PY -m pytest -q -p no:cacheprovider tests/kernels/test_paged_decode_attention.py
    step attn-sweep 240 $PY -m tandem.benchmarks.decode_attention_sweep $DRY --out "$OUT/attn-sweep.json"
    local Q="$TI $PY -m tandem.benchmarks.quant" tile name
    for tile in default 64,4,2 128,4,3,f16; do
        name=${tile//,/-}
        step "kv18b-step-$name" 150 env TANDEM_FP8_KV_DECODE_TILE="${tile#default}" $Q decode-latency $DRY \
            --model "$BIG" --variants fp8+fp8kv --batches 1,64,256 --steps "$(n 50 3)" --out "$OUT/step-$name"
    done
    for tile in default 128,4,3,f16; do
        name=${tile//,/-}
        step "kv18b-offline-$name" 150 env TANDEM_FP8_KV_DECODE_TILE="${tile#default}" $Q offline $DRY \
            --model "$BIG" --variants fp8+fp8kv --out "$OUT/offline-$name"
    done
}

# 2026-12-07, eighth session (#18): the issue's table on its own card in one call (nothing of it ran on an H200 since
# 12-03: fp8 KV tiles, fp16 dots, silu_quant, the small-M paths are H100 numbers).
suite_h18() {
    step h18-tests 150 $PY -m pytest -q -p no:cacheprovider tests/kernels/test_paged_decode_attention.py \
        tests/kernels/test_quant_linear.py tests/kernels/test_norm_linear_model.py -k "paged or silu_quant or silu_quantize"
    local Q="$TI $PY -m tandem.benchmarks.quant"
    step h18-step 200 $Q decode-latency $DRY --model "$BIG" --variants bf16,int8,fp8,fp8+fp8kv \
        --batches "$(n 1,64,256 1,4)" --steps "$(n 50 3)" --out "$OUT/step"
    step h18-offline 200 $Q offline $DRY --model "$BIG" --variants bf16,int8,fp8,fp8+fp8kv --out "$OUT/offline"
    # int8's prompt steps through its own GEMM (the path before dequantize + cuBLAS at M >= 512)
    step h18-offline-int8-gemm 100 env TANDEM_INT8_DEQUANT_MIN_M=0 $Q offline $DRY --model "$BIG" --variants int8 \
        --out "$OUT/offline-int8-gemm"
}

suite_h18k() {
    step h18k-1000 300 env TANDEM_FP8_KV_DECODE_TILE="${H18K_TILE:-}" $TI $PY -m tandem.benchmarks.quant offline $DRY \
        --model "$BIG" --variants bf16,fp8+fp8kv --num-requests "$(n 512 8)" --prompt-len 1000 --max-tokens 1000 \
        --out "$OUT/offline-1000"
}

# 2026-12-07, seventh session (#14): on an 80 GB card two 8B prefill workers' own weights left decode ~8 GB of pages; now
# they may map the decode worker's (`tandem up --share-weights`, opt-in until this ran; the default since 12-08). The stack test of it, then serve14e's
# two workers at 85% at every rate.
suite_share14() {
    step share14-stack 150 $PY -m pytest -q -x -p no:cacheprovider tests/e2e/test_gpu_stack.py \
        -k mapped_weights
    step serve-split85x2-shared 420 $PY -m tandem.benchmarks.serve_modes --mode split:85:100 --prefill-workers 2 \
        --model "$BIG" --device "$DEVICE" --max-num-seqs "$(n 128 8)" --rates "$(n "${SERVE14_RATES:-2,8,16,32,48}" 4)" \
        --num-requests "$(n 128 4)" --prompt-len "fixed:$(n 1024 32)" --output-len "fixed:$(n 256 8)" \
        --stack-args=--share-weights --out "$OUT/serve-split85x2-shared.json"
}

# The same in one call with its baseline: colocated and shared at the rates where #14's targets are missed (16-48).
suite_share14c() {
    step share14-stack 150 $PY -m pytest -q -x -p no:cacheprovider tests/e2e/test_gpu_stack.py -k mapped_weights
    local rates mode
    rates=$(n "${SHARE14C_RATES:-16,32,48}" 4)
    for mode in colocated $(for p in ${SHARE14C_SPLITS:-85}; do echo "shared$p"; done); do
        local args=(--mode colocated)
        [ $mode != colocated ] && args=(--mode "split:${mode#shared}:100" --prefill-workers 2 --stack-args=--share-weights)
        step "serve-$mode" 220 $PY -m tandem.benchmarks.serve_modes "${args[@]}" --model "$BIG" --device "$DEVICE" \
            --max-num-seqs "$(n 128 8)" --rates "$rates" --num-requests "$(n 128 4)" --prompt-len "fixed:$(n 1024 32)" \
            --output-len "fixed:$(n 256 8)" --out "$OUT/serve-$mode.json"
    done
}

# 2026-12-07, seventh session (#18): fp8 + fp8 KV offline was 1.41x bf16 on the H100 (target 1.5x), prefill most of
# that job's time. The kernels of one step by shape and variant (`step_cost --profile`: torch.profiler, top 15).
suite_prof18() {
    local variant args
    for variant in bf16 fp8 fp8+fp8kv; do
        case $variant in
            bf16) args=() ;;
            fp8) args=(--quantization fp8) ;;
            *) args=(--quantization fp8 --kv-cache-dtype fp8) ;;
        esac
        step "prof18-$variant" 170 $PY -m tandem.benchmarks.step_cost --model "$BIG" --device "$DEVICE" "${args[@]}" \
            --prompt-tokens "0,$(n 4096 64)" --decodes "0,$(n 256 4)" --context "$(n 1024 32)" --repeat "$(n 5 1)" \
            --profile --out "$OUT/step-cost-$variant.json"
    done
    step silu-quant-tests 150 $PY -m pytest -q -p no:cacheprovider tests/kernels/test_quant_linear.py \
        tests/kernels/test_norm_linear_model.py -k "silu_quant or silu_quantize"
    local fusions
    for fusions in all all+silu_quant; do
        step "offline-$fusions" 150 env TANDEM_FUSIONS=$fusions $TI $PY -m tandem.benchmarks.quant offline $DRY \
            --model "$BIG" --variants fp8+fp8kv --out "$OUT/offline-$fusions"
    done
}

# prof18's fp8 + fp8 KV prompt step alone (one 4,096-token step, kernels by time), for a short lease, ~2.5 min.
suite_prof18q() {
    local variant args
    for variant in ${PROF18Q_VARIANTS:-fp8+fp8kv}; do
        case $variant in
            bf16) args=() ;;
            fp8) args=(--quantization fp8) ;;
            *) args=(--quantization fp8 --kv-cache-dtype fp8) ;;
        esac
        step "prof18q-$variant" 200 $PY -m tandem.benchmarks.step_cost --model "$BIG" --device "$DEVICE" "${args[@]}" \
            --prompt-tokens "0,$(n 4096 64)" --decodes 0 --context "$(n 1024 32)" --repeat "$(n 3 1)" \
            --profile --out "$OUT/step-cost-$variant.json"
    done
}

# 2026-12-08, ninth session (#14 item 4): the first request took 3.95x steady colocated and 3.55x with shared weights
# (share14c), against 1.12-1.34x on 12-02. A short run of each mode with the workers' logs kept (the compile watch names
# any kernel compiled while serving) and every span exported for the first request's phases, ~3 min.
suite_first14() {
    local mode args
    for mode in colocated shared85; do
        args=(--mode colocated)
        [ $mode = shared85 ] && args=(--mode split:85:100 --prefill-workers 2)
        KEEP_LOGS=1 step "first14-$mode" 150 env OTEL_TRACES_EXPORTER=console OTEL_BSP_SCHEDULE_DELAY=200 \
            $PY -m tandem.benchmarks.serve_modes "${args[@]}" --model "$BIG" --device "$DEVICE" \
            --max-num-seqs "$(n 128 8)" --rates 2 --num-requests "$(n 16 2)" --prompt-len "fixed:$(n 1024 32)" \
            --output-len "fixed:$(n 64 4)" --out "$OUT/first14-$mode.json"
    done
}

# 2026-12-08, ninth session (#18): the fp8 prompt step's quantization passes (prof18q: 6 of 74 ms) taken into the
# producers: norm_quant (RMSNorm -> qkv / gate_up) and silu_quant (SwiGLU -> down). Their GPU tests, the prompt step's
# kernels with both, then fp8 + fp8 KV offline with all / +norm_quant / +norm_quant+silu_quant, twice in rotated
# order, ~6 min.
suite_n18() {
    step n18-tests 150 $PY -m pytest -q -p no:cacheprovider tests/kernels/test_quant_linear.py \
        tests/kernels/test_norm_linear_model.py -k "norm_quant or norm_quantize or silu_quant or silu_quantize"
    step n18-prof 120 env TANDEM_FUSIONS=all+norm_quant+silu_quant $PY -m tandem.benchmarks.step_cost --model "$BIG" \
        --device "$DEVICE" --quantization fp8 --kv-cache-dtype fp8 --prompt-tokens "0,$(n 4096 64)" --decodes 0 \
        --context "$(n 1024 32)" --repeat "$(n 3 1)" --profile --out "$OUT/step-cost-fused.json"
    local fusions round
    for round in 1 2; do
        for fusions in all all+norm_quant all+norm_quant+silu_quant; do
            step "n18-offline-$fusions-$round" 100 env TANDEM_FUSIONS=$fusions $TI $PY -m tandem.benchmarks.quant \
                offline $DRY --model "$BIG" --variants fp8+fp8kv --out "$OUT/offline-$fusions-$round"
        done
    done
}

# 2026-12-07, sixth session (#18): an fp8 KV cache's decode attention streamed at ~half a bf16 cache's bandwidth (batch
# 64-256). Its kernel tests (fp16 dots), the tile sweep, then the best fp8 tile at batch 256 (from the sweep) against
# the default through the 8B decode step and offline (~6.5 min), and with KV18_1000=1 the 1,000/1,000 run with it (~4).
suite_kv18() {
    step kv18-tests 150 $PY -m pytest -q -p no:cacheprovider tests/kernels/test_paged_decode_attention.py
    step attn-sweep 240 $PY -m tandem.benchmarks.decode_attention_sweep $DRY --out "$OUT/attn-sweep.json"
    local best
    best=$($PY -c "import json, sys
rows = [r for r in json.load(open(sys.argv[1]))['results'] if r['kv_dtype'] == 'fp8']
row = max(rows, key=lambda r: (r['batch'], -r['context']))
t = min(row['tiles'], key=lambda t: t['us'])['tile']
print(f\"{t['block_n']},{t['num_warps']},{t['num_stages']}\" + (',f16' if t['f16_dot'] else ''))" "$OUT/attn-sweep.json")
    echo "best fp8 tile at the largest batch: ${best:-none}" | tee -a "$LOG"
    [ -n "$best" ] || return
    local Q="$TI $PY -m tandem.benchmarks.quant"
    step kv18-step-default 150 $Q decode-latency $DRY --model "$BIG" --variants fp8,fp8+fp8kv \
        --steps "$(n 50 3)" --out "$OUT/step-default"
    step kv18-step-best 150 env TANDEM_FP8_KV_DECODE_TILE="$best" $Q decode-latency $DRY --model "$BIG" \
        --variants fp8,fp8+fp8kv --steps "$(n 50 3)" --out "$OUT/step-best"
    step kv18-offline-best 200 env TANDEM_FP8_KV_DECODE_TILE="$best" $Q offline $DRY --model "$BIG" \
        --variants bf16,fp8,fp8+fp8kv --out "$OUT/offline-best"
    step kv18-offline-default 100 $Q offline $DRY --model "$BIG" --variants fp8+fp8kv --out "$OUT/offline-default"
    [ "${KV18_1000:-0}" = 1 ] || return 0  # the 1,000/1,000 run (~4 min) only when asked for
    step kv18-1000-best 240 env TANDEM_FP8_KV_DECODE_TILE="$best" $Q offline $DRY --model "$BIG" \
        --variants bf16,fp8+fp8kv --num-requests "$(n 512 8)" --prompt-len 1000 --max-tokens 1000 \
        --out "$OUT/offline-1000-best"
}

# 2026-12-07, the least of pace14 for ~4 min of device time: the GPU tests, the 128-token row with the pacer at its new
# default (16) and off.
suite_pace_min() {
    step pipe-tests 150 $PY -m pytest -q -p no:cacheprovider tests/kernels/test_prefill_pipeline_gpu.py \
        tests/e2e/test_gpu_stack.py
    local m
    for m in 16 1; do
        stack_row "1b-128-max$m" "$SMALL" 256 128 4 --max-stream-interval $m
    done
}

# 2026-12-07, second call: the GPU tests of prefill pipelining (their test fixed), the pacer's A/B with the stack's
# 128-token row, #14's serve benchmark at its three highest-load rates. ~9 min.
suite_pace14() {
    step pipe-tests 150 $PY -m pytest -q -p no:cacheprovider tests/kernels/test_prefill_pipeline_gpu.py \
        tests/e2e/test_gpu_stack.py
    suite_pacer_min
    SERVE14_RATES=8,32,48 suite_serve14
}

# serve_two_prefill P:D...: the same with two prefill workers under each MPS cap (no MPS on the CPU: uncapped).
serve_two_prefill() {
    local split
    for split in "$@"; do
        local mode="split:$split"
        [ "$SCALE" = 1 ] || mode=disagg
        serve_one_gpu "serve-2p-${split/:/-}" --mode "$mode" --prefill-workers 2
    done
}

# The GPU's SM clock, power and temperature every 100 ms into $OUT/clocks.csv, until the suite ends.
clocks_start() {
    command -v nvidia-smi > /dev/null || return 0
    nvidia-smi --query-gpu=timestamp,clocks.sm,power.draw,temperature.gpu --format=csv -lms 100 > "$OUT/clocks.csv" &
    CLOCKS_PID=$!
    trap 'kill $CLOCKS_PID 2> /dev/null' EXIT
}

# One 32k prompt among 64 streams (#16), offline throughput with and without piecewise graphs (#16: not lower).
suite_long_offline() {
    long_prompt final ""
    suite_long_offline_throughput
}
suite_long_offline_throughput() {
    local E="$PY -m tandem.benchmarks.gpu_engine"
    [ "$SCALE" = 1 ] || E="env TRITON_INTERPRET=1 $E"
    step offline 150 $E offline $DRY --out "$OUT"
    mkdir -p "$OUT/eager"
    step offline-eager 150 env TANDEM_PIECEWISE_GRAPHS=0 $E offline $DRY --out "$OUT/eager"
}

# After the decode tokens' attention joined the piecewise graphs: the GPU capture tests, the colocated serve benchmark
# at 2-48 req/s (#16), step cost of mixed steps, the 32k prompt among 64 streams, offline throughput with/without.
suite_last() {
    step graph-tests 120 $PY -m pytest -q -x --confcutdir=tests/kernels -p no:cacheprovider \
        tests/kernels/test_cuda_graphs.py
    serve_chunks colocated-last "" 200
    step step-cost-8b-last 90 $PY -m tandem.benchmarks.step_cost --model "$BIG" --device "$DEVICE" \
        --prompt-tokens "$(n 0,128,384,512,1024 0,16)" --decodes "$(n 0,16,64 0,2)" \
        --context "$(n 1024 32)" --repeat "$(n 5 1)" --out "$OUT/step-cost-8b-last.json"
    long_prompt last ""
    suite_long_offline_throughput
}

for suite in "$@"; do
    if ! declare -F "suite_$suite" > /dev/null; then
        echo "unknown suite $suite (kernels, engine, stack, disagg, disagg_recheck, chunked, quant, spec, prefix)"; exit 2
    fi
    "suite_$suite"
done
echo
printf "%-36s%-5s%s\n" step rc seconds
awk -F'\t' '{printf "%-36s%-5s%s\n", $1, $2, $3}' "$SUMMARY"
