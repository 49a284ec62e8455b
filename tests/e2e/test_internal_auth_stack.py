"""`tandem up` turns service-to-service authentication on by itself: its workers refuse a caller without the
stack's token (which only its own processes hold), while the stack serves as before."""

from __future__ import annotations

import os
from pathlib import Path

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc

from tandem.serving.auth import INTERNAL_TOKEN_ENV, INTERNAL_TOKEN_FILE_ENV
from tandem.v1 import generation_pb2, generation_pb2_grpc, worker_pb2, worker_pb2_grpc
from tests.e2e.test_stack import start_stack

pytestmark = [pytest.mark.e2e]


def test_tandem_up_workers_refuse_callers_without_the_token(tmp_path: Path, smollm2_path: Path,
                                                            monkeypatch: pytest.MonkeyPatch) -> None:
    for name in (INTERNAL_TOKEN_ENV, INTERNAL_TOKEN_FILE_ENV):
        monkeypatch.delenv(name, raising=False)  # a newcomer's shell: nothing configured
    assert INTERNAL_TOKEN_ENV not in os.environ
    for stack in start_stack(tmp_path, model="dummy:tiny"):
        with grpc.insecure_channel(stack.address("gateway")) as channel:
            request = generation_pb2.GenerateRequest(prompt="Hello", sampling=generation_pb2.SamplingParams(
                max_tokens=4, temperature=0.0, ignore_eos=True))
            replies = list(generation_pb2_grpc.GenerationStub(channel).Generate(request, timeout=60))
            assert sum(len(r.token_ids) for r in replies) == 4
        assert stack.metric("decode", "tandem_decode_local_prefill_tokens_total") == 0  # decode → prefill too
        for role, stub in (("prefill", worker_pb2_grpc.PrefillStub), ("decode", worker_pb2_grpc.DecodeStub)):
            with grpc.insecure_channel(stack.address(role)) as channel:
                with pytest.raises(grpc.RpcError) as info:
                    stub(channel).Info(worker_pb2.InfoRequest(), timeout=10)
                assert info.value.code() == grpc.StatusCode.UNAUTHENTICATED  # type: ignore[attr-defined]
                health = health_pb2_grpc.HealthStub(channel).Check(health_pb2.HealthCheckRequest(), timeout=10)
                assert health.status == health_pb2.HealthCheckResponse.SERVING
