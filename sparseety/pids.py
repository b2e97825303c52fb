"""Process ids in pid files: is the process still there?"""

from __future__ import annotations

import contextlib
import os


def pid_alive(pid: int) -> bool:
    """Whether a process with ``pid`` exists (a zombie child of ours is reaped and reads as gone)."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True  # exists, owned by someone else
    with contextlib.suppress(ChildProcessError):
        done, _ = os.waitpid(pid, os.WNOHANG)
        if done == pid:
            return False
    return True
