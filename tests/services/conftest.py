"""Fixtures shared by the service tests: a random model, and a prefill + decode worker pair on loopback."""

from __future__ import annotations

from collections.abc import AsyncIterator
from pathlib import Path

import pytest

from tests.factories import save_random_hf_model
from tests.services.test_disaggregated import Worker, engine_config, start_worker


@pytest.fixture
def model_folder(tmp_path: Path) -> Path:
    save_random_hf_model(tmp_path)
    return tmp_path


@pytest.fixture
async def workers(model_folder: Path) -> AsyncIterator[tuple[Worker, Worker]]:
    prefill = await start_worker("prefill", engine_config(model_folder))
    decode = await start_worker("decode", engine_config(model_folder))
    yield prefill, decode
    for worker in (prefill, decode):
        await worker.server.stop(0)
        worker.engine.close()
