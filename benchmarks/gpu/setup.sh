# Sourced at the start of every GPU call: install the carried wheels (tandem built here, plus the
# packages the GPU image lacks) into /tmp/site, and keep the machine's NCCL/NVLink settings.
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl \
    || { echo "wheel install failed"; exit 1; }
export PYTHONPATH=/tmp/site PYTHONUNBUFFERED=1 PATH=/tmp/site/bin:$PATH
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
# SmolLM2's tokenizer (no weights) for text with dummy models; the machine reaches no registry.
export TANDEM_HOME=$PWD/.whl/tandem-home
mkdir -p "$OUT"
LOG="$OUT/run.log"
{ nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv;
  python3 -c "import torch, triton, transformers, grpc; print('torch', torch.__version__, 'triton', triton.__version__, 'transformers', transformers.__version__, 'grpcio', grpc.__version__)"; } | tee -a "$LOG"
# step NAME TIMEOUT CMD...: output appended to run.log, the tail echoed.
step() { local name=$1; shift; echo "== $name" | tee -a "$LOG"; timeout "$@" > "/tmp/$name.log" 2>&1; local rc=$?;
         cat "/tmp/$name.log" >> "$LOG"; echo "rc=$rc" | tee -a "$LOG"; tail -4 "/tmp/$name.log"; }
