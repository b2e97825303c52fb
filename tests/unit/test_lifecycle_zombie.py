"""``pid_alive`` on a process that is dead but not yet reaped by someone else."""

from __future__ import annotations

import subprocess
import sys
import time
from pathlib import Path

from sparseety.lifecycle import pid_alive


def test_a_zombie_that_is_not_our_child_reads_as_gone() -> None:
    # A child that starts a grandchild, lets it exit and never reaps it: the grandchild stays a
    # zombie of the child, which `kill(pid, 0)` alone reads as alive (`sparseety up` then left a
    # SIGKILLed worker unreplaced until init reaped it).
    parent = subprocess.Popen(
        [
            sys.executable,
            "-c",
            "import subprocess, sys, time; p = subprocess.Popen(['true']); print(p.pid, flush=True); "
            "time.sleep(30)",
        ],
        stdout=subprocess.PIPE,
        text=True,
    )
    try:
        assert parent.stdout is not None
        zombie = int(parent.stdout.readline())
        deadline = time.monotonic() + 10
        while Path(f"/proc/{zombie}/stat").read_text().rsplit(")", 1)[1].split()[0] != "Z":
            assert time.monotonic() < deadline, "the grandchild never exited"
            time.sleep(0.05)
        assert not pid_alive(zombie)
        assert pid_alive(parent.pid)
    finally:
        parent.kill()
        parent.wait()
    assert not pid_alive(parent.pid)
