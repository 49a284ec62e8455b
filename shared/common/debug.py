"""`kill -USR1 PID` prints every thread's Python stack of a tandem process to its stderr (the service's log), and
the process goes on: what a stuck worker, gateway or benchmark is waiting for, without a debugger on the host."""

from __future__ import annotations

import faulthandler
import signal
import sys


def dump_stacks_on_sigusr1() -> None:
    if hasattr(signal, "SIGUSR1"):  # not on Windows
        faulthandler.register(signal.SIGUSR1, file=sys.stderr, all_threads=True, chain=False)
