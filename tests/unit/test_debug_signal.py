"""`kill -USR1` makes a tandem process print every thread's stack and go on (`tandem.common.debug`)."""

from __future__ import annotations

import signal
import subprocess
import sys
import time

import pytest


@pytest.mark.skipif(not hasattr(signal, "SIGUSR1"), reason="no SIGUSR1 on this platform")
def test_sigusr1_prints_every_threads_stack_and_the_process_goes_on() -> None:
    code = ("import threading, time\n"
            "from tandem.common.debug import dump_stacks_on_sigusr1\n"
            "dump_stacks_on_sigusr1()\n"
            "def waiting_in_a_thread(): time.sleep(30)\n"
            "threading.Thread(target=waiting_in_a_thread, daemon=True).start()\n"
            "print('ready', flush=True)\n"
            "time.sleep(3)\n"
            "print('went on', flush=True)\n")
    process = subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    assert process.stdout is not None
    assert process.stdout.readline().strip() == "ready"
    time.sleep(0.2)
    process.send_signal(signal.SIGUSR1)
    stdout, stderr = process.communicate(timeout=30)
    assert process.returncode == 0 and "went on" in stdout
    assert "waiting_in_a_thread" in stderr and "most recent call first" in stderr
