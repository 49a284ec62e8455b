#!/usr/bin/env bash
# Run HERE (not on the GPU host) before a GPU call: fills .whl/ (git-ignored; carry it) with the tandem wheel,
# the cp312 wheels the GPU image lacks (same versions as this venv, so CI and the GPU run the same code), and
# SmolLM2's tokenizer files (no weights: speed runs use dummy weights) under .whl/tandem-home.
set -euo pipefail
cd "$(dirname "$0")/../.."
PY=.venv/bin/python
rm -rf .whl && mkdir -p .whl
$PY -m pip wheel -q --no-deps -w .whl . 2>&1 | grep -v -i warn || true
# What the wheel was built from: run.sh refuses to run a wheel older than the tree it was carried with.
# (The files a device call carries: tracked or untracked, not ignored; generated protobuf modules are ignored.)
git ls-files -z -co --exclude-standard -- shared kernels prefill_svc decode_svc gateway protos benchmarks \
    | grep -z '\.py$' | xargs -0 sha1sum > .whl/SOURCES.sha1
version() { $PY -m pip show "$1" 2>/dev/null | awk '/^Version:/ {print $2}' || true; }
# The image has grpcio 1.84: the health/reflection packages of that release.
PINNED="grpcio-health-checking==1.84.0 grpcio-reflection==1.84.0"
for name in redis opentelemetry-api opentelemetry-sdk opentelemetry-exporter-otlp-proto-grpc \
            opentelemetry-exporter-otlp-proto-http opentelemetry-exporter-otlp-proto-common opentelemetry-proto \
            opentelemetry-semantic-conventions opentelemetry-exporter-http-transport opentelemetry-exporter-otlp-common \
            googleapis-common-protos importlib-metadata fastapi starlette uvicorn pydantic pydantic-core \
            annotated-types typing-inspection sniffio pytest-asyncio isal; do
    v=$(version "$name")
    if [ -n "$v" ]; then PINNED="$PINNED $name==$v"; fi  # not installed here: not needed by this Python either
done
$PY -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
    --platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 \
    --platform manylinux_2_27_x86_64 --platform any -d .whl $PINNED
# py-spy for the suites that profile the services (`run.sh`'s profile_services); a native binary, any Python.
$PY -m pip download -q --no-deps --only-binary=:all: -d .whl py-spy==0.4.3
HOME_DIR=.whl/tandem-home/models/smollm2-135m
mkdir -p "$HOME_DIR"
SRC=$($PY -c "from tandem.models.fetch import model_dir; print(model_dir('smollm2-135m'))")
for f in config.json generation_config.json tokenizer.json tokenizer_config.json chat_template.jinja special_tokens_map.json; do
    [ -f "$SRC/$f" ] && cp "$SRC/$f" "$HOME_DIR/"
done
# The cache's marker that the preset is fetched (weights are never loaded for dummy: models).
cp "$SRC/.complete" "$HOME_DIR/"
du -sh .whl; ls .whl | head -40
