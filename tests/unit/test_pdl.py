"""$TANDEM_PDL: parsed once, strictly, and never turning PDL on where it cannot run (a CPU, the interpreter)."""

from __future__ import annotations

from collections.abc import Iterator

import pytest
import torch

from tandem.kernels import _triton


@pytest.fixture(autouse=True)
def _fresh() -> Iterator[None]:
    _triton.pdl_requested.cache_clear()
    yield
    _triton.pdl_requested.cache_clear()


def test_off_unless_asked(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv(_triton.PDL_ENV, raising=False)
    assert not _triton.pdl_requested()
    monkeypatch.setenv(_triton.PDL_ENV, "1")
    assert not _triton.pdl_requested()  # read once
    _triton.pdl_requested.cache_clear()
    assert _triton.pdl_requested()


def test_a_bad_value_names_the_variable(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(_triton.PDL_ENV, "yes")
    with pytest.raises(ValueError, match="TANDEM_PDL"):
        _triton.pdl_requested()


def test_never_on_a_cpu(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(_triton.PDL_ENV, "1")
    assert _triton.pdl_requested()
    assert not _triton.use_pdl(torch.device("cpu"))
