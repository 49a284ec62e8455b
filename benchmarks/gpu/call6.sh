#!/usr/bin/env bash
# A short GPU check of this session's changes (the session had ~100 s of device time left): the grpc page
# exporter's side-stream path, and the engine's CUDA-graph decode fed from pinned host inputs against the
# reference path (teacher-forced). Carry .whl (the tandem wheel only is used).
set -uo pipefail
python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/site .whl/tandem-*.whl
export PYTHONPATH=/tmp/site:$PWD PYTHONUNBUFFERED=1
timeout 25 python3 -c "from tests.unit.test_page_exporter import test_pages_arrive_in_order_and_equal_a_direct_read as t; t('cuda'); print('exporter on cuda: ok')" 2>&1 | tail -3 | tee "$OUT/exporter.txt"
timeout 60 python3 -m tandem.benchmarks.gpu_engine correctness --model dummy:tiny --steps 20 --out "$OUT/correctness" 2>&1 | tail -8 | tee "$OUT/correctness.txt"
