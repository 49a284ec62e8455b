"""`tandem up`'s launcher when a service fails to come up: the workers it already started are stopped before the
error goes on (a benchmark or a script that never reaches `stop()` left them serving, holding ports and memory)."""

from __future__ import annotations

from pathlib import Path

import pytest

from tandem.launcher import Stack, StackOptions


def test_a_gateway_that_fails_at_start_up_takes_the_started_workers_down(tmp_path: Path,
                                                                        monkeypatch: pytest.MonkeyPatch) -> None:
    # A home without SmolLM2's tokenizer: the dummy model's workers need none and come up, the gateway does not.
    monkeypatch.setenv("TANDEM_HOME", str(tmp_path / "home"))
    stack = Stack(StackOptions(model="dummy:tiny", log_dir=tmp_path / "logs", gateway_workers=1))
    try:
        with pytest.raises(RuntimeError, match="gateway exited"):
            stack.start()
        workers = [s for s in stack.services if s.role != "gateway"]
        assert workers and all(s.process is not None for s in workers)  # they had been started
        assert all(s.process.poll() is not None for s in stack.services if s.process is not None)
    finally:
        stack.stop()  # whatever this test's failure left running
