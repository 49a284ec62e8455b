"""Where tandem keeps its files on a machine: read from the environment once, at the edges."""

from __future__ import annotations

import os
from pathlib import Path


def tandem_home() -> Path:
    """`$TANDEM_HOME` if set, else `~/.cache/tandem`: converted models under `models/`, run logs under `logs/`."""
    home = os.environ.get("TANDEM_HOME")
    return Path(home).expanduser() if home else Path.home() / ".cache" / "tandem"
