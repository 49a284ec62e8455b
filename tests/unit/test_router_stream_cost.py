"""`benchmarks/router_stream_cost`: the gateway's real router over a stepped session delivers every token, one
client message per token while its readers keep up, and reports a CPU cost per message."""

from __future__ import annotations

from tandem.benchmarks.router_stream_cost import _BenchRouter, run_once


async def test_every_token_in_one_message_per_step() -> None:
    router = _BenchRouter("dummy:tiny", max_model_len=64)
    result = await run_once(router, num_streams=4, num_tokens=8)
    assert result["messages_per_token"] == 1.0
    assert result["cpu_us_per_message"] > 0
    assert not router.session.running
