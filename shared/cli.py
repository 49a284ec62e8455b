"""`tandem` command line: the edge where flags become config objects.

Imports are local to each command so `tandem --help` and thin commands start fast.
"""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Annotated

import typer

app = typer.Typer(help="tandem: disaggregated LLM serving (gateway → prefill → decode over gRPC).",
                  no_args_is_help=True, pretty_exceptions_enable=False)

ModelOpt = Annotated[str, typer.Option("--model", "-m", help="Preset name, local HF folder, or dummy:<shape>.")]
DeviceOpt = Annotated[str, typer.Option(help="cpu or cuda[:N].")]


@app.command("fetch-model")
def fetch_model_cmd(
    name: Annotated[str, typer.Argument(help="Preset name, e.g. smollm2-135m.")] = "smollm2-135m",
    cache_dir: Annotated[Path | None, typer.Option(help="Default: $TANDEM_HOME or ~/.cache/tandem.")] = None,
) -> None:
    """Download and convert a preset model once (idempotent); print its local folder last."""
    from tandem.models import fetch_model

    path = fetch_model(name, cache_dir=cache_dir, progress=True)
    print(path)


@app.command()
def generate(
    prompt: Annotated[str, typer.Argument(help="Prompt text.")],
    model: ModelOpt = "smollm2-135m",
    max_tokens: Annotated[int, typer.Option(help="Tokens to generate at most.")] = 64,
    temperature: Annotated[float, typer.Option(help="0 = greedy.")] = 0.0,
    top_p: float = 1.0,
    top_k: int = 0,
    seed: int | None = None,
    chat: Annotated[bool, typer.Option(help="Apply the model's chat template.")] = True,
    device: DeviceOpt = "cpu",
    threads: Annotated[int | None, typer.Option(help="torch CPU threads (default: torch's).")] = None,
) -> None:
    """Generate in-process (no servers) and stream the text to the terminal."""
    import torch

    from tandem import LLM, SamplingParams
    from tandem.models import apply_chat_template

    if threads:
        torch.set_num_threads(threads)
    llm = LLM(model, device=device, max_model_len=2048, max_num_batched_tokens=2048)
    params = SamplingParams(max_tokens=max_tokens, temperature=temperature, top_p=top_p, top_k=top_k, seed=seed)
    prompt_input: str | list[int] = prompt
    if chat and llm.tokenizer is not None:
        prompt_input = apply_chat_template(llm.tokenizer, [{"role": "user", "content": prompt}])
    for piece in llm.stream(prompt_input, params):
        sys.stdout.write(piece)
        sys.stdout.flush()
    sys.stdout.write("\n")


# -- services (what compose runs) -----------------------------------------------------------------------
HostOpt = Annotated[str, typer.Option(help="Address to bind.")]
PortOpt = Annotated[int, typer.Option(help="gRPC port (0 picks a free one).")]
HttpPortOpt = Annotated[int, typer.Option(help="HTTP port of /metrics (0 picks a free one).")]
AdvertiseOpt = Annotated[str | None, typer.Option(help="host:port others reach this worker at.")]
RedisOpt = Annotated[str | None, typer.Option(
    envvar="TANDEM_REDIS_URL", help="Redis URL of the registry (default: static addresses); credentials go in the URL "
    "(redis://:PASSWORD@HOST:6379/0, rediss:// for TLS): set it in $TANDEM_REDIS_URL to keep them off `ps`.")]
ThreadsOpt = Annotated[int, typer.Option(help="torch CPU threads (0: torch's default).")]
TlsCertOpt = Annotated[str | None, typer.Option(help="TLS certificate (PEM) of this service; off by default.")]
TlsKeyOpt = Annotated[str | None, typer.Option(help="TLS private key (PEM) of this service.")]
TlsCaOpt = Annotated[str | None, typer.Option(
    help="CA (PEM) that signs the other services' certificates: with it, TLS is mutual between services.")]


InternalTokenFileOpt = Annotated[str | None, typer.Option(
    envvar="TANDEM_INTERNAL_TOKEN_FILE", show_default=False,
    help="File holding the stack's internal token, which every call to a worker must carry (or set the token itself "
         "in $TANDEM_INTERNAL_TOKEN; `tandem up` makes one by itself). Default: none.")]
InsecureOpt = Annotated[bool, typer.Option(
    "--insecure", help="Listen beyond loopback (--host) with neither an internal token nor mutual TLS: any caller "
                       "that reaches the port may use this worker. Refused without this flag.")]


def _tls(cert: str | None, key: str | None, ca: str | None, client_auth: bool = True):  # noqa: ANN202
    from tandem.serving.rpc import TlsConfig

    return TlsConfig.from_flags(cert, key, ca, client_auth)


def _internal_token(role: str, file: str | None) -> str | None:
    """The stack's internal token (`file`, else $TANDEM_INTERNAL_TOKEN_FILE or $TANDEM_INTERNAL_TOKEN), or None;
    exits with the reason when it is unusable."""
    from tandem.common.config import ConfigError
    from tandem.serving.auth import load_internal_token

    try:
        return load_internal_token(file)
    except ConfigError as error:
        typer.echo(f"tandem {role}: {error}", err=True)
        raise typer.Exit(2) from None


def _service_options(role: str, internal_token_file: str | None, **fields: object):  # noqa: ANN202
    """A worker's `ServiceOptions` with the stack's internal token; a configuration that would not be safe to
    serve (beyond loopback with no authentication: `tandem.serving.auth`) exits with the reason."""
    from tandem.common.config import ConfigError
    from tandem.serving.service import ServiceOptions

    token = _internal_token(role, internal_token_file)
    try:
        return ServiceOptions(role=role, internal_token=token, **fields)  # type: ignore[arg-type]
    except ConfigError as error:
        typer.echo(f"tandem {role}: {error}", err=True)
        raise typer.Exit(2) from None


EngineGroup = "Engine"


def _worker(role: str, service: dict[str, object], engine: dict[str, object], threads: int,
            kv_transport: str = "auto", max_queued: int = 1024, prefill_peers: list[str] | None = None,
            speculative_config: str | None = None, weights_from: str | None = None) -> None:
    """Flags → `ServiceOptions` and `EngineConfig` (each built once, here), then the worker's `serve`."""
    import asyncio
    import logging

    logging.basicConfig(level=logging.INFO, format=f"%(asctime)s {role} %(levelname)s %(name)s: %(message)s")
    # Before torch loads: a worker that may not serve (no auth beyond loopback, say) says so at once.
    tls = _tls(service.pop("tls_cert"), service.pop("tls_key"), service.pop("tls_ca"))  # type: ignore[arg-type]
    options = _service_options(role, tls=tls, **service)  # type: ignore[arg-type]

    import torch

    from tandem.common.config import EngineConfig, default_batched_tokens
    from tandem.models import load_model_config

    if threads:
        torch.set_num_threads(threads)
    model = str(engine.pop("model"))
    if engine.get("max_num_batched_tokens") is None:
        engine["max_num_batched_tokens"] = default_batched_tokens(str(engine.get("device", "cpu")),
                                                                  bool(engine.get("enable_chunked_prefill")), role)
    config = EngineConfig.create(load_model_config(model), **engine)  # type: ignore[arg-type]
    if role == "prefill":
        from tandem.prefill_svc.server import serve as serve_prefill
        from tandem.serving.weight_ipc import WeightsShareError

        try:
            asyncio.run(serve_prefill(options, config, model, weights_from))
        except WeightsShareError as error:  # a clear line, not a traceback: the owner or its answer is the problem
            typer.echo(f"tandem prefill: --weights-from {weights_from}: {error}", err=True)
            raise typer.Exit(2) from None
    else:
        import json

        from tandem.decode_svc.server import serve as serve_decode
        from tandem.engine.spec_decode import SpeculativeConfig

        try:
            speculative = SpeculativeConfig.from_dict(json.loads(speculative_config)) if speculative_config else None
        except json.JSONDecodeError as error:
            raise typer.BadParameter(f"not JSON: {error}", param_hint="--speculative-config") from None
        asyncio.run(serve_decode(options, config, model, kv_transport, max_queued, prefill_peers or [], speculative))


NumKvBlocksOpt = Annotated[int | None, typer.Option(help="KV pool size in blocks (default: from memory).",
                                                     rich_help_panel=EngineGroup)]
MaxModelLenOpt = Annotated[int | None, typer.Option(help="Longest prompt + output (default: the model's, capped).",
                                                     rich_help_panel=EngineGroup)]
MaxNumSeqsOpt = Annotated[int, typer.Option(help="Requests per step at most.", rich_help_panel=EngineGroup)]
GpuFractionOpt = Annotated[float, typer.Option(help="Share of the GPU this worker may use.",
                                               rich_help_panel=EngineGroup)]
BatchedTokensOpt = Annotated[int | None, typer.Option(
    help="Token budget of one step (decode tokens + prompt chunks); default: the device's (GPU: 2048, 8192 on a "
         "prefill worker; CPU: 256).",
    rich_help_panel=EngineGroup)]
PromptCapOpt = Annotated[int | None, typer.Option(
    min=0, help="Prompt tokens a step may compute beside decode tokens while few prompts wait (0, the default: no "
                "cap; measured slower on an H200, see README).", rich_help_panel=EngineGroup, show_default=False)]
ChunkedOpt = Annotated[bool, typer.Option(
    "--chunked-prefill/--no-chunked-prefill",
    help="Compute long prompts in chunks, in steps shared with decode tokens.", rich_help_panel=EngineGroup)]
AsyncSchedulingOpt = Annotated[bool | None, typer.Option(
    "--async-scheduling/--no-async-scheduling",
    help="Launch each pure decode step before the previous one's tokens are read (vLLM's --async-scheduling). "
         "Default: on for CUDA, off on the CPU.", rich_help_panel=EngineGroup, show_default=False)]
SpeculativeOpt = Annotated[str | None, typer.Option(
    help='Speculative decoding, vLLM\'s config as JSON: \'{"method": "ngram", "num_speculative_tokens": 4, '
         '"prompt_lookup_max": 4, "prompt_lookup_min": 2}\'. Default: off.', rich_help_panel=EngineGroup)]
PrefixCachingOpt = Annotated[bool, typer.Option(
    "--prefix-caching/--no-prefix-caching",
    help="Keep full KV blocks for reuse by later prompts that start the same way.", rich_help_panel=EngineGroup)]
QuantizationOpt = Annotated[str | None, typer.Option(
    help="Quantize the weights at load: int8 (weight-only, per-channel) or fp8 (e4m3 weights, per-token "
         "activations). Default: the model's own (unquantized).", rich_help_panel=EngineGroup)]
KvCacheDtypeOpt = Annotated[str, typer.Option(
    help="KV cache element type: auto (the model's dtype) or fp8 (e4m3, half the bytes; per-head scales).",
    rich_help_panel=EngineGroup)]


@app.command()
def prefill(model: ModelOpt = "smollm2-135m", host: HostOpt = "127.0.0.1", port: PortOpt = 50061,
            http_port: HttpPortOpt = 8061, advertise: AdvertiseOpt = None, redis: RedisOpt = None,
            device: DeviceOpt = "cpu", threads: ThreadsOpt = 0, num_kv_blocks: NumKvBlocksOpt = None,
            max_model_len: MaxModelLenOpt = None, max_num_seqs: MaxNumSeqsOpt = 256, drain_s: float = 30.0,
            gpu_memory_fraction: GpuFractionOpt = 0.85, max_num_batched_tokens: BatchedTokensOpt = None,
            prompt_tokens_while_decoding: PromptCapOpt = None,
            chunked_prefill: ChunkedOpt = True, prefix_caching: PrefixCachingOpt = True,
            quantization: QuantizationOpt = None, kv_cache_dtype: KvCacheDtypeOpt = "auto",
            async_scheduling: AsyncSchedulingOpt = None,
            tls_cert: TlsCertOpt = None, tls_key: TlsKeyOpt = None, tls_ca: TlsCaOpt = None,
            internal_token_file: InternalTokenFileOpt = None, insecure: InsecureOpt = False,
            weights_from: Annotated[str | None, typer.Option(
                help="HOST:PORT of a decode worker on this GPU whose weights to map (CUDA IPC) instead of loading a "
                     "copy; this worker waits for it and exits if it goes away. `tandem up` sets it on one GPU.",
                rich_help_panel=EngineGroup)] = None,
            ) -> None:
    """Run one prefill worker."""
    _worker("prefill", dict(host=host, port=port, http_port=http_port, advertise=advertise, redis_url=redis,
                            drain_s=drain_s, tls_cert=tls_cert, tls_key=tls_key, tls_ca=tls_ca,
                            internal_token_file=internal_token_file, insecure=insecure),
            dict(model=model, device=device, num_kv_blocks=num_kv_blocks, max_model_len=max_model_len,
                 max_num_seqs=max_num_seqs, gpu_memory_fraction=gpu_memory_fraction,
                 max_num_batched_tokens=max_num_batched_tokens, enable_chunked_prefill=chunked_prefill,
                 prompt_tokens_while_decoding=prompt_tokens_while_decoding,
                 enable_prefix_caching=prefix_caching, quantization=quantization, kv_cache_dtype=kv_cache_dtype,
                 async_scheduling=async_scheduling),
            threads, weights_from=weights_from)


@app.command()
def decode(model: ModelOpt = "smollm2-135m", host: HostOpt = "127.0.0.1", port: PortOpt = 50071,
           http_port: HttpPortOpt = 8071, advertise: AdvertiseOpt = None, redis: RedisOpt = None,
           device: DeviceOpt = "cpu", threads: ThreadsOpt = 0, num_kv_blocks: NumKvBlocksOpt = None,
           max_model_len: MaxModelLenOpt = None, max_num_seqs: MaxNumSeqsOpt = 256, drain_s: float = 30.0,
           kv_transport: Annotated[str, typer.Option(help="auto | grpc | cuda-ipc (same GPU only).")] = "auto",
           gpu_memory_fraction: GpuFractionOpt = 0.85, max_num_batched_tokens: BatchedTokensOpt = None,
           prompt_tokens_while_decoding: PromptCapOpt = None,
           chunked_prefill: ChunkedOpt = True, prefix_caching: PrefixCachingOpt = True,
           quantization: QuantizationOpt = None, kv_cache_dtype: KvCacheDtypeOpt = "auto",
           async_scheduling: AsyncSchedulingOpt = None, speculative_config: SpeculativeOpt = None,
           max_queued: Annotated[int, typer.Option(
               help="Requests accepted but not yet running (incl. waiting for blocks); past it RESOURCE_EXHAUSTED."
           )] = 1024,
           prefill: Annotated[list[str] | None, typer.Option(
               "--prefill", help="A prefill worker this decode worker may pull pages from (repeat); with --redis, "
                                 "also every prefill worker the registry lists. No other address is ever dialled.")
           ] = None,
           tls_cert: TlsCertOpt = None, tls_key: TlsKeyOpt = None, tls_ca: TlsCaOpt = None,
           internal_token_file: InternalTokenFileOpt = None, insecure: InsecureOpt = False,
           ) -> None:
    """Run one decode worker."""
    if kv_transport not in ("auto", "grpc", "cuda-ipc"):
        raise typer.BadParameter("must be auto, grpc or cuda-ipc", param_hint="--kv-transport")
    _worker("decode", dict(host=host, port=port, http_port=http_port, advertise=advertise, redis_url=redis,
                           drain_s=drain_s, tls_cert=tls_cert, tls_key=tls_key, tls_ca=tls_ca,
                           internal_token_file=internal_token_file, insecure=insecure),
            dict(model=model, device=device, num_kv_blocks=num_kv_blocks, max_model_len=max_model_len,
                 max_num_seqs=max_num_seqs, gpu_memory_fraction=gpu_memory_fraction,
                 max_num_batched_tokens=max_num_batched_tokens, enable_chunked_prefill=chunked_prefill,
                 prompt_tokens_while_decoding=prompt_tokens_while_decoding,
                 enable_prefix_caching=prefix_caching, quantization=quantization, kv_cache_dtype=kv_cache_dtype,
                 async_scheduling=async_scheduling),
            threads, kv_transport, max_queued, prefill, speculative_config)


LimitsGroup = "Limits"
StreamIntervalOpt = Annotated[int, typer.Option(
    min=1, help="Tokens per streamed message after the first (vLLM's --stream-interval): 1 streams every step's "
                "tokens; larger values cut the gateway's CPU per token for a burstier stream.")]
MaxStreamIntervalOpt = Annotated[int, typer.Option(
    min=1, help="Tokens per streamed message a gateway process may go up to while its event loop is saturated: it "
                "sends fewer, larger messages instead of falling behind, and comes back to --stream-interval once it "
                "keeps up. 1: off. Default 16 (`tandem.gateway.limits.DEFAULT_MAX_STREAM_INTERVAL`).")]
LocalPrefillOpt = Annotated[int, typer.Option(
    min=0, help="Prompts with at most this many tokens outside the decode worker's prefix cache are prefilled by "
                "the decode worker itself, even with prefill workers up (conditional disaggregation); 0: never.")]
DecodeStallOpt = Annotated[float, typer.Option(
    "--decode-stall-timeout", help="Seconds a decode worker may send nothing (not even its heartbeat) with "
    "requests in flight before they resume on another worker.", rich_help_panel=LimitsGroup)]


@app.command()
def gateway(
    model: ModelOpt = "smollm2-135m", host: HostOpt = "127.0.0.1", port: PortOpt = 50051,
    http_port: HttpPortOpt = 8000, redis: RedisOpt = None,
    prefill: Annotated[list[str] | None, typer.Option("--prefill", help="Static prefill address (repeat).")] = None,
    decode: Annotated[list[str] | None, typer.Option("--decode", help="Static decode address (repeat).")] = None,
    max_model_len: int | None = None, drain_s: float = 30.0,
    max_concurrent_requests: Annotated[int, typer.Option(
        help="Requests in flight (gRPC and HTTP together), per gateway process (see --workers); past it "
             "RESOURCE_EXHAUSTED / 429.")] = 1024,
    api_key: Annotated[list[str] | None, typer.Option(
        "--api-key", help="Accepted API key (repeat, or comma-separated; also $TANDEM_API_KEYS). Default: no auth.",
        show_default=False)] = None,
    tls_cert: TlsCertOpt = None, tls_key: TlsKeyOpt = None, tls_ca: TlsCaOpt = None,
    tls_client_auth: Annotated[bool, typer.Option(
        help="Require client certificates on the public port too (with --tls-ca).")] = False,
    internal_token_file: InternalTokenFileOpt = None,
    max_request_bytes: Annotated[int, typer.Option(
        help="Largest HTTP body (413 past it) or gRPC message (RESOURCE_EXHAUSTED).",
        rich_help_panel=LimitsGroup)] = 16 * 1024 * 1024,
    max_prompt_chars: Annotated[int | None, typer.Option(
        help="Characters of a prompt (or of a chat's contents), checked before tokenizing. Default: 32 × the "
             "context length.", rich_help_panel=LimitsGroup, show_default=False)] = None,
    max_messages: Annotated[int, typer.Option(help="Messages of a chat.", rich_help_panel=LimitsGroup)] = 2048,
    max_stop_sequences: Annotated[int, typer.Option(
        help="Stop strings of a request.", rich_help_panel=LimitsGroup)] = 16,
    max_stop_chars: Annotated[int, typer.Option(
        help="Characters of each stop string.", rich_help_panel=LimitsGroup)] = 256,
    max_stop_token_ids: Annotated[int, typer.Option(
        help="Stop token ids of a request.", rich_help_panel=LimitsGroup)] = 1024,
    max_sequences_per_request: Annotated[int, typer.Option(
        help="Sequences one request generates (prompts × n); each holds a concurrency slot.",
        rich_help_panel=LimitsGroup)] = 128,
    decode_stall_timeout: DecodeStallOpt = 10.0,
    stream_interval: StreamIntervalOpt = 1,
    max_stream_interval: MaxStreamIntervalOpt = 16,
    local_prefill_max_tokens: LocalPrefillOpt = 0,
    workers: Annotated[int, typer.Option(
        min=0, help="Gateway processes on the same ports (SO_REUSEPORT: the kernel spreads connections among them), "
                    "each with its own sessions to the decode workers and its own --max-concurrent-requests; "
                    "0: one per 4 CPUs, between 1 and 4.")] = 1,
) -> None:
    """Run the gateway (the public gRPC API)."""
    import asyncio
    import logging

    from tandem.common.config import ConfigError
    from tandem.gateway.auth import parse_api_keys
    from tandem.gateway.limits import GatewayLimits
    from tandem.gateway.server import serve
    from tandem.serving.service import ServiceOptions

    logging.basicConfig(level=logging.INFO, format="%(asctime)s gateway %(levelname)s %(name)s: %(message)s")
    if not redis and not decode:
        raise typer.BadParameter("give --redis URL or at least one --decode address", param_hint="--decode")
    service = ServiceOptions(role="gateway", host=host, port=port, http_port=http_port, redis_url=redis,
                             drain_s=drain_s, tls=_tls(tls_cert, tls_key, tls_ca, tls_client_auth),
                             internal_token=_internal_token("gateway", internal_token_file))
    if max_concurrent_requests < 1:
        raise typer.BadParameter("must be at least 1", param_hint="--max-concurrent-requests")
    try:
        limits = GatewayLimits(max_request_bytes=max_request_bytes, max_prompt_chars=max_prompt_chars,
                               max_messages=max_messages, max_stop_sequences=max_stop_sequences,
                               max_stop_chars=max_stop_chars, max_stop_token_ids=max_stop_token_ids,
                               max_sequences_per_request=max_sequences_per_request,
                               decode_stall_timeout_s=decode_stall_timeout, stream_interval=stream_interval,
                               max_stream_interval=max_stream_interval,
                               local_prefill_max_tokens=local_prefill_max_tokens)
    except ConfigError as error:
        raise typer.BadParameter(str(error)) from None
    keys = parse_api_keys(api_key)
    logging.getLogger(__name__).info("API keys: %s", f"{len(keys)} accepted" if keys else "off")
    from tandem.gateway.workers import GatewayArgs, resolve_num_workers, run_workers

    num_workers = resolve_num_workers(workers)
    if num_workers > 1:
        args = GatewayArgs(service, model, tuple(prefill or ()), tuple(decode or ()), max_model_len,
                           max_concurrent_requests, keys, limits)
        raise typer.Exit(run_workers(args, num_workers))
    asyncio.run(serve(service, model, prefill or [], decode or [], max_model_len,
                      max_concurrent_requests=max_concurrent_requests, api_keys=keys, limits=limits))


@app.command()
def client(
    prompt: Annotated[str, typer.Argument(help="Prompt text (sent as a user chat message).")],
    address: Annotated[str, typer.Option(help="Gateway gRPC address.")] = "127.0.0.1:50051",
    max_tokens: int = 64, temperature: float = 0.0, seed: int | None = None,
    raw: Annotated[bool, typer.Option(help="Send the prompt as plain text, without the chat template.")] = False,
    api_key: Annotated[str | None, typer.Option(help="API key, sent as `authorization: Bearer`.")] = None,
    tls_ca: Annotated[str | None, typer.Option(help="CA (PEM) to verify a TLS gateway with.")] = None,
) -> None:
    """Stream a reply from a running gateway."""
    from tandem.gateway.client import stream_reply

    stream_reply(address, prompt, max_tokens=max_tokens, temperature=temperature, seed=seed, chat=not raw,
                 api_key=api_key, tls_ca=tls_ca)


@app.command()
def healthcheck(
    address: Annotated[str, typer.Argument(help="host:port of a tandem gRPC server.")] = "127.0.0.1:50051",
    timeout: Annotated[float, typer.Option(help="Seconds to wait for the answer.")] = 2.0,
    tls_cert: TlsCertOpt = None, tls_key: TlsKeyOpt = None, tls_ca: TlsCaOpt = None,
) -> None:
    """Exit 0 if the server reports SERVING over grpc.health.v1, else 1 (container health checks)."""
    from tandem.launcher import is_serving

    raise typer.Exit(0 if is_serving(address, timeout, _tls(tls_cert, tls_key, tls_ca)) else 1)


@app.command("internal-token")
def internal_token_cmd(
    file: Annotated[Path | None, typer.Option(
        "--file", help="Write the token here (mode 0600) instead of printing it: $TANDEM_INTERNAL_TOKEN's if set, "
                       "else the valid token already there, else a new one.", show_default=False)] = None,
) -> None:
    """Make the internal token that the services of one stack share (service-to-service authentication): print a
    new random one (`export TANDEM_INTERNAL_TOKEN=$(tandem internal-token)`), or write it to --file once."""
    import os

    from tandem.common.config import ConfigError
    from tandem.serving.auth import INTERNAL_TOKEN_ENV, generate_token, load_internal_token, write_token_file

    if file is None:
        print(generate_token())
        return
    try:
        given = os.environ.get(INTERNAL_TOKEN_ENV)
        if given:
            token, what = load_internal_token(env={INTERNAL_TOKEN_ENV: given}) or "", f"${INTERNAL_TOKEN_ENV}"
        else:
            try:
                token, what = load_internal_token(file, env={}) or "", "the token already there (kept)"
            except ConfigError:  # none there yet, or not a usable one: a new one
                token, what = generate_token(), "a new token"
        write_token_file(file, token)
    except (ConfigError, OSError) as error:
        typer.echo(f"tandem internal-token: {error}", err=True)
        raise typer.Exit(2) from None
    print(f"internal token: {what} in {file} (mode 0600)")


@app.command()
def up(
    model: ModelOpt = "smollm2-135m",
    prefill: Annotated[int, typer.Option("--prefill", help="Prefill workers.")] = 1,
    decode: Annotated[int, typer.Option("--decode", help="Decode workers.")] = 1,
    redis: RedisOpt = None, device: DeviceOpt = "cpu",
    threads: Annotated[int, typer.Option(help="torch threads per worker.")] = 1,
    host: HostOpt = "127.0.0.1", port: Annotated[int, typer.Option(help="Gateway gRPC port.")] = 50051,
    http_port: Annotated[int, typer.Option(help="Gateway HTTP port.")] = 8000,
    num_kv_blocks: int | None = None, max_model_len: int | None = None,
    status_file: Annotated[Path | None, typer.Option(help="Write the services as JSON here.")] = None,
    demo: Annotated[str | None, typer.Option(help="Once up, stream a reply to this prompt.")] = None,
    exit_after_demo: bool = False,
    kv_transport: Annotated[str, typer.Option(help="Decode workers' KV transport: auto | grpc | cuda-ipc.")] = "auto",
    gpu_memory_fraction: Annotated[float | None, typer.Option(
        help="GPU share per worker (default: 0.85 split evenly between the workers sharing the GPU).")] = None,
    max_num_seqs: Annotated[int, typer.Option(help="Decode batch cap per worker.")] = 256,
    gpu_split: Annotated[str, typer.Option(
        help="How prefill and decode workers share one GPU. auto: CUDA MPS with neither capped, when installed (tandem "
             "runs its own daemon), else time-sharing; off: time-sharing; P: MPS with P% of the SMs for prefill "
             "workers and the rest for decode workers; P:D caps each role separately (100:100 is auto's).")] = "auto",
    gpu_split_low_priority: Annotated[str | None, typer.Option(
        help="With --gpu-split: run this role (prefill or decode) at MPS's lower client priority.",
        show_default=False)] = None,
    max_num_batched_tokens: BatchedTokensOpt = None, chunked_prefill: ChunkedOpt = True,
    prompt_tokens_while_decoding: PromptCapOpt = None, prefix_caching: PrefixCachingOpt = True,
    quantization: QuantizationOpt = None, kv_cache_dtype: KvCacheDtypeOpt = "auto",
    async_scheduling: AsyncSchedulingOpt = None, speculative_config: SpeculativeOpt = None,
    max_request_bytes: Annotated[int | None, typer.Option(
        help="The gateway's largest HTTP body / gRPC message (default: the gateway's, 16 MiB).",
        rich_help_panel=LimitsGroup, show_default=False)] = None,
    decode_stall_timeout: Annotated[float | None, typer.Option(
        "--decode-stall-timeout", help="The gateway's --decode-stall-timeout (default: the gateway's, 10 s).",
        rich_help_panel=LimitsGroup, show_default=False)] = None,
    stream_interval: StreamIntervalOpt = 1,
    max_stream_interval: MaxStreamIntervalOpt = 16,
    local_prefill_max_tokens: LocalPrefillOpt = 0,
    gateway_workers: Annotated[int | None, typer.Option(
        min=1, help="Gateway processes on the gateway's ports (`tandem gateway --workers`). Default: one per 4 "
                    "CPUs, between 1 and 4.", show_default=False)] = None,
    share_weights: Annotated[bool | None, typer.Option(
        "--share-weights/--no-share-weights",
        help="On a GPU, prefill workers map the first decode worker's weights (CUDA IPC) instead of loading a copy "
             "each; they then stop when it does. Default: on with one decode worker, unless PYTORCH_CUDA_ALLOC_CONF "
             "asks for expandable segments; never with --gpu-memory-fraction (it sizes every worker alike).",
        show_default=False)] = None,
) -> None:
    """Start a gateway, N prefill and M decode workers (one process each), until Ctrl-C/SIGTERM."""
    from tandem.launcher import Stack, StackOptions
    from tandem.mps import GpuSplit

    split = None
    if gpu_split not in ("auto", "off"):
        try:
            split = GpuSplit.parse(gpu_split, gpu_split_low_priority)
        except ValueError as error:
            raise typer.BadParameter(str(error), param_hint="--gpu-split") from None
    elif gpu_split_low_priority is not None:
        raise typer.BadParameter("needs --gpu-split P or P:D", param_hint="--gpu-split-low-priority")
    options = StackOptions(model=model, num_prefill=prefill, num_decode=decode, redis_url=redis, device=device,
                           threads=threads, host=host, gateway_port=port, gateway_http_port=http_port,
                           num_kv_blocks=num_kv_blocks, max_model_len=max_model_len, status_file=status_file,
                           kv_transport=kv_transport, gpu_memory_fraction=gpu_memory_fraction,
                           max_num_seqs=max_num_seqs, gpu_split=split, auto_mps=gpu_split == "auto",
                           max_num_batched_tokens=max_num_batched_tokens, enable_chunked_prefill=chunked_prefill,
                           prompt_tokens_while_decoding=prompt_tokens_while_decoding,
                           enable_prefix_caching=prefix_caching, speculative_config=speculative_config,
                           quantization=quantization, kv_cache_dtype=kv_cache_dtype,
                           async_scheduling=async_scheduling, max_request_bytes=max_request_bytes,
                           decode_stall_timeout_s=decode_stall_timeout,
                           stream_interval=stream_interval, max_stream_interval=max_stream_interval,
                           local_prefill_max_tokens=local_prefill_max_tokens, gateway_workers=gateway_workers,
                           share_weights=share_weights)
    raise typer.Exit(Stack(options).run(demo=demo, exit_after_demo=exit_after_demo))


bench_app = typer.Typer(help="Benchmarks against a running stack.", no_args_is_help=True)
app.add_typer(bench_app, name="bench")


@bench_app.command("serve")
def bench_serve(
    address: Annotated[str, typer.Option(help="Gateway gRPC address.")] = "127.0.0.1:50051",
    rates: Annotated[str, typer.Option(help="Comma-separated request rates (req/s); inf = burst.")] = "1,2,4",
    num_requests: Annotated[int, typer.Option(help="Requests per rate.")] = 64,
    prompt_len: Annotated[str, typer.Option(help="fixed:N, uniform:LO:HI or sharegpt:MEDIAN:MAX.")] = "uniform:128:512",
    output_len: Annotated[str, typer.Option(help="Same forms as --prompt-len.")] = "uniform:32:128",
    ttft_slo: Annotated[float, typer.Option(help="TTFT target (s) for goodput.")] = 0.2,
    tpot_slo: Annotated[float, typer.Option(help="TPOT target (s) for goodput.")] = 0.05,
    seed: int = 0,
    timeout: Annotated[float, typer.Option(help="Per-request deadline (s).")] = 600.0,
    out: Annotated[Path | None, typer.Option(help="JSON results.")] = None,
    plot: Annotated[Path | None, typer.Option(help="PNG of latency against load.")] = None,
    label: str = "",
    client_processes: Annotated[int, typer.Option(
        min=1, help="Load-generator processes the requests are dealt to (one Python process receives a few tens "
                    "of thousands of streamed messages a second at most).")] = 1,
) -> None:
    """Poisson load at each rate; TTFT/TPOT/ITL/e2e percentiles, throughput and goodput."""
    from tandem.benchmarks.serve import run

    rate_list = [float(r) for r in rates.split(",")]
    run(address, rate_list, num_requests, prompt_len, output_len, ttft_slo, tpot_slo, seed, timeout, out, plot, label,
        client_processes=client_processes)


def main() -> None:
    from tandem.common.debug import dump_stacks_on_sigusr1

    dump_stacks_on_sigusr1()
    app()


if __name__ == "__main__":
    main()
