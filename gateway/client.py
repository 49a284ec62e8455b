"""A small streaming client of the public API (`tandem client`, and the README's demo)."""

from __future__ import annotations

import sys
from pathlib import Path
from typing import TextIO

import grpc

from tandem.v1 import generation_pb2, generation_pb2_grpc


def stream_reply(address: str, prompt: str, *, max_tokens: int = 64, temperature: float = 0.0,
                 seed: int | None = None, chat: bool = True, out: TextIO = sys.stdout, api_key: str | None = None,
                 tls_ca: str | None = None) -> generation_pb2.GenerateResponse:
    """Send one request, write the text as it streams, return the last message (usage, timing)."""
    sampling = generation_pb2.SamplingParams(max_tokens=max_tokens, temperature=temperature)
    if seed is not None:
        sampling.seed = seed
    request = generation_pb2.GenerateRequest(sampling=sampling)
    if chat:
        request.messages.messages.add(role="user", content=prompt)
    else:
        request.prompt = prompt
    last = generation_pb2.GenerateResponse()
    metadata = [("authorization", f"Bearer {api_key}")] if api_key else None
    channel = (grpc.secure_channel(address, grpc.ssl_channel_credentials(Path(tls_ca).read_bytes()))
               if tls_ca else grpc.insecure_channel(address))
    with channel:
        for response in generation_pb2_grpc.GenerationStub(channel).Generate(request, metadata=metadata):
            out.write(response.text)
            out.flush()
            last = response
    reason = generation_pb2.FinishReason.Name(last.finish_reason)
    out.write(f"\n[{reason.removeprefix('FINISH_REASON_').lower()}: {last.usage.prompt_tokens} prompt + "
              f"{last.usage.completion_tokens} completion tokens, first token after "
              f"{last.timing.time_to_first_token_s * 1000:.0f} ms, total {last.timing.e2e_s:.2f} s]\n")
    return last
