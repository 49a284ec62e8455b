"""The stack on one GPU: prefill and decode processes sharing it, KV pages over cuda-ipc and over grpc, the prefill
worker with the decode worker's weights mapped (the default) or a copy of its own (`--no-share-weights`)."""

from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest
import torch

from tandem.v1 import generation_pb2
from tests.e2e.test_stack import start_stack, stream

pytestmark = [pytest.mark.gpu, pytest.mark.e2e,
              pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")]

MODEL = "dummy:llama-3.2-1b"


def token_request(prompt: list[int]) -> generation_pb2.GenerateRequest:
    return generation_pb2.GenerateRequest(
        prompt_token_ids=generation_pb2.TokenIds(ids=prompt),
        sampling=generation_pb2.SamplingParams(max_tokens=16, temperature=0.0, ignore_eos=True))


PROMPTS = [[1000 + (7 * i + 13 * j) % 30000 for j in range(n)] for i, n in enumerate([5, 100, 400, 900])]


LOCAL = "tandem_decode_local_prefill_tokens_total"


def run_prompts(tmp_path: Path, transport: str, *args: str) -> tuple[list[list[int]], float, float]:
    """Outputs (one at a time, so every run batches alike), and decode's transfer bytes and the prompt tokens it
    computed itself for any reason but a cached prompt's last block."""
    tmp_path.mkdir(parents=True, exist_ok=True)
    for stack in start_stack(tmp_path, "--device", "cuda", "--kv-transport", transport, "--max-num-seqs", "64",
                             *args, model=MODEL):
        prefill_log = Path(str(next(s for s in stack.services if s["role"] == "prefill")["log"])).read_text()
        mapped = "weight tensors of the worker beside it" in prefill_log  # start_engine's line
        assert mapped == ("--no-share-weights" not in args), prefill_log[-2000:]  # shared by default
        gateway = stack.address("gateway")
        outputs = [stream(gateway, token_request(p))[0] for p in PROMPTS]
        assert stack.metric("decode", LOCAL) == 0  # every prompt was prefilled by the prefill worker
        with ThreadPoolExecutor(4) as pool:  # and concurrently: nothing lost, nothing hung
            concurrent = list(pool.map(lambda p, g=gateway: stream(g, token_request(p))[0], PROMPTS))
        assert all(len(o) == 16 for o in concurrent)
        sent = stack.metric("decode", "tandem_kv_transfer_bytes_total")
        # The second time, a prompt cached on decode but for its last block is finished there (`prefix_cached`).
        local = stack.metric("decode", LOCAL) - stack.metric("decode", LOCAL, {"reason": "prefix_cached"})
        assert stack.metric("decode", "tandem_kv_blocks_free") == stack.metric("decode", "tandem_kv_blocks_total")
    return outputs, sent, local


def test_cuda_ipc_and_grpc_give_the_same_tokens(tmp_path: Path) -> None:
    ipc, ipc_bytes, ipc_local = run_prompts(tmp_path / "ipc", "cuda-ipc")
    grpc_out, grpc_bytes, grpc_local = run_prompts(tmp_path / "grpc", "grpc")
    assert ipc_local == 0 and grpc_local == 0  # no fallback, preemption or failed transfer
    assert ipc_bytes > 0 and grpc_bytes > 0
    assert ipc == grpc_out


def test_prefill_with_mapped_weights_gives_what_its_own_copy_gives(tmp_path: Path) -> None:
    shared, _, shared_local = run_prompts(tmp_path / "shared", "cuda-ipc")
    own, _, own_local = run_prompts(tmp_path / "own", "cuda-ipc", "--no-share-weights")
    assert shared_local == 0 and own_local == 0
    assert shared == own
