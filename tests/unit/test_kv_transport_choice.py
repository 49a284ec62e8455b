"""Which KV transport a decode worker uses with a prefill peer."""

from __future__ import annotations

import pytest

from tandem.serving.kv_ipc import CUDA_IPC, GRPC, choose_transport

BOTH = [GRPC, CUDA_IPC]


@pytest.mark.parametrize(("preference", "mine", "theirs", "transports", "failed", "expected"), [
    ("auto", "GPU-a", "GPU-a", BOTH, False, CUDA_IPC),  # same GPU: write straight into our pool
    ("auto", "GPU-a", "GPU-b", BOTH, False, GRPC),  # another GPU (or host): bytes over gRPC
    ("auto", "", "", [GRPC], False, GRPC),  # CPU workers
    ("auto", "GPU-a", "GPU-a", BOTH, True, GRPC),  # its test open failed once: not again
    ("auto", "GPU-a", "GPU-a", [GRPC], False, GRPC),  # a peer that does not offer it
    ("grpc", "GPU-a", "GPU-a", BOTH, False, GRPC),  # forced
    ("cuda-ipc", "GPU-a", "GPU-a", BOTH, False, CUDA_IPC),
])
def test_choice(preference: str, mine: str, theirs: str, transports: list[str], failed: bool, expected: str) -> None:
    assert choose_transport(preference, mine, theirs, transports, failed) == expected


def test_forced_cuda_ipc_that_cannot_work_is_an_error_naming_why() -> None:
    with pytest.raises(ValueError, match="cuda-ipc impossible"):
        choose_transport("cuda-ipc", "GPU-a", "GPU-b", BOTH, False)
