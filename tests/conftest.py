"""Fixtures shared by every test folder."""

from __future__ import annotations

from pathlib import Path

import pytest

from tandem.models import default_cache_dir, fetch_model


@pytest.fixture(scope="session")
def smollm2_path() -> Path:
    """The converted SmolLM2-135M folder, fetched once into the persistent cache ($TANDEM_HOME or
    ~/.cache/tandem) so that repeated runs reuse it; the first run downloads and converts (~1 min)."""
    return fetch_model("smollm2-135m", cache_dir=default_cache_dir(), progress=False)

# A real redis-server per test that asks for `redis_server` (started and stopped by the fixture).
pytest_plugins = ["tests.redis_server"]
