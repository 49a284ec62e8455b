"""Values across the wire: sampling parameters (public proto → engine params → worker proto and back), finish
reasons and KV layouts. Defaults live in one place, `SamplingParams`; an unset optional proto field takes it."""

from __future__ import annotations

import random
from dataclasses import replace

from tandem.common.config import KVLayout
from tandem.common.sampling_params import SamplingParams
from tandem.v1 import generation_pb2, worker_pb2

_FINISH_REASONS = {
    None: generation_pb2.FINISH_REASON_UNSPECIFIED,
    "stop": generation_pb2.FINISH_REASON_STOP,
    "length": generation_pb2.FINISH_REASON_LENGTH,
}
_FINISH_NAMES = {v: k for k, v in _FINISH_REASONS.items()}


def finish_reason_to_proto(reason: str | None) -> int:
    # An aborted request never reaches a client as a normal end; report it as a stop.
    return _FINISH_REASONS.get(reason, generation_pb2.FINISH_REASON_STOP)


def finish_reason_from_proto(value: int) -> str | None:
    return _FINISH_NAMES[value]


def sampling_from_public(message: generation_pb2.SamplingParams) -> SamplingParams:
    """Public request params; unset fields take `SamplingParams`' defaults; bad values raise
    InvalidRequestError naming the field."""
    defaults = SamplingParams()
    has = message.HasField
    return SamplingParams(
        max_tokens=message.max_tokens if has("max_tokens") else defaults.max_tokens,
        temperature=message.temperature if has("temperature") else defaults.temperature,
        top_p=message.top_p if has("top_p") else defaults.top_p,
        top_k=message.top_k if has("top_k") else defaults.top_k,
        seed=message.seed if has("seed") else None,
        stop=tuple(message.stop),
        stop_token_ids=tuple(message.stop_token_ids),
        ignore_eos=message.ignore_eos if has("ignore_eos") else defaults.ignore_eos,
        skip_special_tokens=(message.skip_special_tokens if has("skip_special_tokens")
                             else defaults.skip_special_tokens),
    )


def with_resolved_seed(params: SamplingParams) -> SamplingParams:
    """Give an unseeded request its seed once, at the edge, so every worker samples it alike."""
    if params.seed is not None:
        return params
    return replace(params, seed=random.getrandbits(63))


def sampling_to_worker(params: SamplingParams) -> worker_pb2.WorkerSamplingParams:
    assert params.seed is not None, "resolve the seed before sending a request to a worker"
    return worker_pb2.WorkerSamplingParams(
        max_tokens=params.max_tokens, temperature=params.temperature, top_p=params.top_p, top_k=params.top_k,
        seed=params.seed, stop_token_ids=list(params.stop_token_ids), ignore_eos=params.ignore_eos)


def sampling_from_worker(message: worker_pb2.WorkerSamplingParams) -> SamplingParams:
    return SamplingParams(max_tokens=message.max_tokens, temperature=message.temperature, top_p=message.top_p,
                          top_k=message.top_k, seed=message.seed, stop_token_ids=tuple(message.stop_token_ids),
                          ignore_eos=message.ignore_eos)


def layout_to_proto(layout: KVLayout) -> worker_pb2.KVLayout:
    return worker_pb2.KVLayout(dtype=layout.dtype, block_size=layout.block_size, num_layers=layout.num_layers,
                               num_kv_heads=layout.num_kv_heads, head_dim=layout.head_dim,
                               model_fingerprint=layout.model_fingerprint)


def layout_from_proto(message: worker_pb2.KVLayout) -> KVLayout:
    return KVLayout(dtype=message.dtype, block_size=message.block_size, num_layers=message.num_layers,
                    num_kv_heads=message.num_kv_heads, head_dim=message.head_dim,
                    model_fingerprint=message.model_fingerprint)
