# syntax=docker/dockerfile:1
# One image for every role: the entrypoint is the `tandem` CLI, so `docker run IMAGE decode --redis ...`
# runs exactly the `tandem decode ...` command that `tandem up` runs as a process.
#
# TORCH_VARIANT picks the torch wheel index: cu128 (CUDA 12.8; the wheels carry the CUDA runtime, so the
# host needs only the NVIDIA driver and container toolkit) or cpu (a far smaller image for CPU hosts).
ARG PYTHON_VERSION=3.12
FROM python:${PYTHON_VERSION}-slim

ARG TORCH_VARIANT=cu128
ARG TORCH_SPEC="torch>=2.6"
ENV PYTHONUNBUFFERED=1 \
    PIP_NO_CACHE_DIR=1 \
    PIP_DISABLE_PIP_VERSION_CHECK=1 \
    TANDEM_HOME=/models

# Triton (the CUDA kernels) compiles a small C launcher per kernel signature at run time.
RUN if [ "${TORCH_VARIANT}" != "cpu" ]; then \
        apt-get update && apt-get install -y --no-install-recommends gcc libc6-dev && rm -rf /var/lib/apt/lists/*; \
    fi

# torch first, from the chosen index: `pip install .` alone would resolve PyPI's default build, which
# is not what a CPU host wants. A layer of its own, so code changes do not reinstall it.
RUN pip install --index-url "https://download.pytorch.org/whl/${TORCH_VARIANT}" "${TORCH_SPEC}"

WORKDIR /src
COPY . .
# convert: `tandem fetch-model`; http: the gateway's OpenAI-compatible API.
RUN pip install ".[convert]" && rm -rf /src

# Models live in a volume shared by the services (compose's `model` service fills it once).
RUN useradd --create-home --uid 1000 tandem && mkdir -p /models && chown tandem /models
USER tandem
WORKDIR /home/tandem
VOLUME ["/models"]

# gateway gRPC + HTTP, prefill gRPC + metrics, decode gRPC + metrics (the CLI's default ports)
EXPOSE 50051 8000 50061 8061 50071 8071
ENTRYPOINT ["tandem"]
CMD ["--help"]
