"""`free_port` picks ports that outgoing connections cannot take before a service binds them."""

from __future__ import annotations

import socket

import pytest

from tandem import launcher
from tandem.launcher import LOWEST_PORT, ephemeral_ports, free_port


def test_ports_are_below_the_ephemeral_range_distinct_and_bindable() -> None:
    low, high = ephemeral_ports()
    assert LOWEST_PORT < low <= high
    ports = [free_port("127.0.0.1") for _ in range(50)]
    assert len(set(ports)) == len(ports)
    assert all(LOWEST_PORT <= p < low for p in ports)
    for port in ports[:5]:
        with socket.socket() as s:
            s.bind(("127.0.0.1", port))


def test_a_port_in_use_is_never_picked(monkeypatch: pytest.MonkeyPatch) -> None:
    # A window of 1,000 ports below the range, every other one taken by a listener.
    low, _ = ephemeral_ports()
    first = low - 1000
    monkeypatch.setattr(launcher, "LOWEST_PORT", first)
    held, taken = [], set()
    try:
        for port in range(first, low, 2):
            s = socket.socket()
            try:
                s.bind(("127.0.0.1", port))
            except OSError:
                s.close()
                continue
            s.listen()
            held.append(s)
            taken.add(port)
        picks = {free_port("127.0.0.1") for _ in range(50)}
        assert all(first <= p < low for p in picks)
        assert not picks & taken
    finally:
        for s in held:
            s.close()
