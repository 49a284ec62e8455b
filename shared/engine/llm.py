"""The in-process API, shaped like vLLM's: `LLM(model=...).generate(prompts, sampling_params)`."""

from __future__ import annotations

import itertools
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

from tqdm import tqdm

from tandem.common.config import OFFLINE_BATCHED_TOKENS_CUDA, EngineConfig
from tandem.common.errors import InvalidRequestError
from tandem.common.sampling_params import SamplingParams
from tandem.engine.engine import Engine
from tandem.engine.request import Request, RequestStatus
from tandem.engine.spec_decode import SpeculativeConfig
from tandem.models import apply_chat_template, load_model_config, load_tokenizer

if TYPE_CHECKING:
    from tandem.models.detokenizer import IncrementalDetokenizer

Prompt = str | Sequence[int]
Message = dict[str, str]


@dataclass
class RequestOutput:
    request_id: str
    prompt_token_ids: list[int]
    token_ids: list[int] = field(default_factory=list)
    logprobs: list[float] = field(default_factory=list)
    text: str = ""
    finish_reason: str | None = None  # "stop" | "length"

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None


class LLM:
    """Loads a model into one colocated engine and generates for batches of prompts.

    `max_num_batched_tokens` defaults to OFFLINE_BATCHED_TOKENS_CUDA (16,384) on a GPU, the throughput choice of an
    offline job, and to the served workers' default elsewhere."""

    def __init__(self, model: str, *, device: str = "cpu", dtype: str = "auto",
                 max_model_len: int | None = None, max_num_seqs: int = 256,
                 max_num_batched_tokens: int | None = None, enable_chunked_prefill: bool = True,
                 prompt_tokens_while_decoding: int | None = None, enable_prefix_caching: bool = True,
                 speculative_config: dict[str, Any] | None = None,
                 block_size: int = 16, num_kv_blocks: int | None = None,
                 gpu_memory_fraction: float = 0.85, use_triton: bool = True, use_cuda_graphs: bool = True,
                 piecewise_cuda_graphs: bool = True, seed: int = 0, quantization: str | None = None,
                 kv_cache_dtype: str = "auto", async_scheduling: bool | None = None,
                 cache_dir: Path | None = None) -> None:
        model_config = load_model_config(model, cache_dir=cache_dir)
        if max_num_batched_tokens is None and enable_chunked_prefill and device.startswith("cuda"):
            max_num_batched_tokens = OFFLINE_BATCHED_TOKENS_CUDA
        self.config = EngineConfig.create(
            model_config, device=device, dtype=dtype, block_size=block_size, num_kv_blocks=num_kv_blocks,
            gpu_memory_fraction=gpu_memory_fraction, max_model_len=max_model_len, max_num_seqs=max_num_seqs,
            max_num_batched_tokens=max_num_batched_tokens, enable_chunked_prefill=enable_chunked_prefill,
            prompt_tokens_while_decoding=prompt_tokens_while_decoding, enable_prefix_caching=enable_prefix_caching,
            use_triton=use_triton, use_cuda_graphs=use_cuda_graphs, piecewise_cuda_graphs=piecewise_cuda_graphs,
            seed=seed, quantization=quantization, kv_cache_dtype=kv_cache_dtype, async_scheduling=async_scheduling)
        speculative = SpeculativeConfig.from_dict(speculative_config) if speculative_config is not None else None
        self.engine = Engine(self.config, speculative=speculative)
        self.tokenizer: Any = load_tokenizer(model_config) if model_config.tokenizer_path else None
        self._ids = itertools.count()

    # -- public -------------------------------------------------------------------------------------
    def generate(self, prompts: Prompt | Sequence[Prompt],
                 sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
                 use_tqdm: bool = False) -> list[RequestOutput]:
        """Generate for every prompt (strings or token-id lists); outputs come back in prompt order."""
        prompt_list = self._as_prompt_list(prompts)
        token_lists = [self._encode(p) for p in prompt_list]
        return list(self._run(token_lists, sampling_params, use_tqdm))

    def chat(self, messages: Sequence[Message] | Sequence[Sequence[Message]],
             sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
             use_tqdm: bool = False) -> list[RequestOutput]:
        """Like `generate`, for one conversation or a list of them, through the model's chat template."""
        conversations = [messages] if messages and isinstance(messages[0], dict) else messages
        tokenizer = self._require_tokenizer()
        token_lists = [apply_chat_template(tokenizer, list(c)) for c in conversations]  # type: ignore[arg-type]
        return list(self._run(token_lists, sampling_params, use_tqdm))

    def stream(self, prompt: Prompt, sampling_params: SamplingParams | None = None) -> Iterator[str]:
        """Yield the text of one request piece by piece as it is generated."""
        emitted = 0
        for output in self._run_streaming([self._encode(prompt)], sampling_params):
            if len(output.text) > emitted:
                yield output.text[emitted:]
                emitted = len(output.text)

    # -- internals ----------------------------------------------------------------------------------
    def _run(self, token_lists: list[list[int]],
             sampling_params: SamplingParams | Sequence[SamplingParams] | None,
             use_tqdm: bool) -> list[RequestOutput]:
        final: dict[str, RequestOutput] = {}
        order: list[str] = []
        bar = tqdm(total=len(token_lists), desc="generate", disable=not use_tqdm)
        for output in self._run_streaming(token_lists, sampling_params, order):
            if output.finished and output.request_id not in final:
                final[output.request_id] = output
                bar.update()
        bar.close()
        return [final[req_id] for req_id in order]

    def _run_streaming(self, token_lists: list[list[int]],
                       sampling_params: SamplingParams | Sequence[SamplingParams] | None,
                       order: list[str] | None = None) -> Iterator[RequestOutput]:
        params_list = self._as_params_list(sampling_params, len(token_lists))
        # Validate everything before admitting anything: a bad prompt leaves the engine untouched.
        for tokens, params in zip(token_lists, params_list, strict=True):
            self.engine.validate(tokens, params)
        outputs: dict[str, RequestOutput] = {}
        detokenizers: dict[str, IncrementalDetokenizer | None] = {}
        for tokens, params in zip(token_lists, params_list, strict=True):
            req_id = f"llm-{next(self._ids)}"
            self.engine.add_request(req_id, tokens, params)
            outputs[req_id] = RequestOutput(req_id, list(tokens))
            detokenizers[req_id] = self._detokenizer(tokens, params)
            if order is not None:
                order.append(req_id)
        try:
            while self.engine.has_unfinished():
                step = self.engine.step()
                for request in step.requests:
                    output = outputs[request.req_id]
                    self._update(output, request, detokenizers[request.req_id])
                    yield output
        finally:
            for req_id, output in outputs.items():
                if not output.finished:
                    self.engine.abort(req_id)

    def _update(self, output: RequestOutput, request: Request,
                detok: IncrementalDetokenizer | None) -> None:
        new_ids = request.output_token_ids[len(output.token_ids):]
        new_logprobs = request.output_logprobs[len(output.logprobs):]
        if detok is None:
            output.token_ids += new_ids
            output.logprobs += new_logprobs
        else:
            output.text += detok.push(new_ids)
            if detok.stopped:
                # A stop string ends the request: keep the tokens that produced the text before it.
                used = detok.num_tokens_used - len(output.token_ids)
                output.token_ids += new_ids[:used]
                output.logprobs += new_logprobs[:used]
                output.finish_reason = RequestStatus.FINISHED_STOPPED.value
                self.engine.abort(request.req_id)
                return
            output.token_ids += new_ids
            output.logprobs += new_logprobs
        if request.status.is_finished:
            if detok is not None:
                output.text += detok.finish()
            output.finish_reason = request.finish_reason

    def _detokenizer(self, prompt_ids: list[int], params: SamplingParams) -> IncrementalDetokenizer | None:
        if self.tokenizer is None:
            if params.stop:
                raise InvalidRequestError("stop", "stop strings need a tokenizer; this model has none")
            return None
        from tandem.models.detokenizer import IncrementalDetokenizer

        return IncrementalDetokenizer(self.tokenizer, prompt_ids, stop=params.stop,
                                      skip_special_tokens=params.skip_special_tokens)

    def _encode(self, prompt: Prompt) -> list[int]:
        if isinstance(prompt, str):
            return list(self._require_tokenizer().encode(prompt, add_special_tokens=False))
        return [int(t) for t in prompt]

    def _require_tokenizer(self) -> Any:
        if self.tokenizer is None:
            raise InvalidRequestError("prompt", "this model has no tokenizer; pass token id lists")
        return self.tokenizer

    @staticmethod
    def _as_prompt_list(prompts: Prompt | Sequence[Prompt]) -> list[Prompt]:
        if isinstance(prompts, str):
            return [prompts]
        if prompts and all(isinstance(t, int) for t in prompts):
            return [list(prompts)]  # type: ignore[arg-type]
        return list(prompts)  # type: ignore[arg-type]

    @staticmethod
    def _as_params_list(sampling_params: SamplingParams | Sequence[SamplingParams] | None,
                        count: int) -> list[SamplingParams]:
        if sampling_params is None:
            return [SamplingParams()] * count
        if isinstance(sampling_params, SamplingParams):
            return [sampling_params] * count
        params = list(sampling_params)
        if len(params) != count:
            raise InvalidRequestError("sampling_params", f"got {len(params)} for {count} prompts")
        return params
