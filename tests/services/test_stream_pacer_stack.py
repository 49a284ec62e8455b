"""A paced gateway (`--max-stream-interval`) through a real decode worker: while its pacer asks for N tokens per
message, every stream still gets every token, in order, in fewer client messages; without the option the router
has no pacer."""

from __future__ import annotations

import pytest

from tandem.common.sampling_params import SamplingParams
from tandem.gateway.limits import GatewayLimits
from tandem.gateway.router import Router
from tandem.gateway.server import load_gateway_model
from tandem.gateway.sessions import StreamPacer
from tandem.serving.registry import StaticRegistry
from tests.services.test_reliability import MODEL, start_worker

PROMPTS = [[5, 6, 7, 8, 9], [11, 12, 13], [21, 22, 23, 24, 25, 26, 27]]


async def collect(router: Router, tag: str) -> list[tuple[list[int], int]]:
    """Each prompt's tokens and the number of messages they came in."""
    results = []
    for i, prompt in enumerate(PROMPTS):
        params = SamplingParams(max_tokens=20, temperature=0.0, ignore_eos=True, seed=0)
        token_ids: list[int] = []
        messages = 0
        async for new_ids, _text, _progress in router.stream(f"{tag}-{i}", prompt, params):
            token_ids += new_ids
            messages += 1
        results.append((token_ids, messages))
    return results


async def test_paced_streams_are_complete_and_merged(monkeypatch: pytest.MonkeyPatch) -> None:
    decode = await start_worker("decode")
    registry = StaticRegistry([], [decode.address])
    plain = Router(load_gateway_model(MODEL, 256), registry, limits=GatewayLimits(max_stream_interval=1))
    # No tick during the test: the interval stays where a saturated loop would have left it.
    monkeypatch.setattr(StreamPacer, "TICK_S", 3600.0)
    paced = Router(load_gateway_model(MODEL, 256), registry, limits=GatewayLimits(max_stream_interval=8))
    try:
        assert plain.pacer is None
        assert paced.pacer is not None and paced.pacer.maximum == 8
        paced.pacer.interval = 8
        expected = await collect(plain, "plain")
        got = await collect(paced, "paced")
        for (want_ids, _), (ids, messages) in zip(expected, got, strict=True):
            assert ids == want_ids and len(ids) == 20
            assert messages <= 1 + -(-19 // 8) + 1  # the first token, then at least 8 a message (the end may split)
    finally:
        await plain.close()
        await paced.close()
        await decode.server.stop(0)
        decode.engine.close()
