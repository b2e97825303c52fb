"""Process lifecycle helpers: is a pid still there; end a process that owns native resources;
announce that a process is ready."""

from __future__ import annotations

import contextlib
import gc
import logging
import os
import signal
import sys
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import NoReturn


def pid_alive(pid: int) -> bool:
    """Whether a process with ``pid`` exists and runs (a zombie child of ours is reaped, and any
    other zombie reads as gone: a killed part whose parent exited waits for init to reap it, and
    until then ``kill(pid, 0)`` still succeeds)."""
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
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except (OSError, IndexError):
        return True  # no procfs here: kill(pid, 0) is all there is
    return state not in ("Z", "X")


def terminate(pid: int, timeout_s: float, *, group: bool = False) -> bool:
    """SIGTERM ``pid`` (its process group with ``group``), wait up to ``timeout_s``, then SIGKILL.

    Returns:
        True when it stopped on SIGTERM, False when it had to be killed.
    """
    send = os.killpg if group else os.kill
    with contextlib.suppress(ProcessLookupError):
        send(pid, signal.SIGTERM)
    deadline = time.monotonic() + timeout_s
    while pid_alive(pid) and time.monotonic() < deadline:
        time.sleep(0.05)
    if not pid_alive(pid):
        return True
    with contextlib.suppress(ProcessLookupError):
        send(pid, signal.SIGKILL)
    return False


def exit_after(cleanup: Callable[[], object], code: int = 0, timeout_s: float = 15.0) -> NoReturn:
    """Run ``cleanup`` for at most ``timeout_s``, then end the process with ``code`` at once.

    For processes that own an embedded ClickHouse (chDB): its native shutdown can stall at
    interpreter exit when the machine is busy (seen under load: the event loop closed, the process
    lingered past 30 s). Every write was already acknowledged before its offsets were committed,
    so ending without waiting loses nothing; a stall must not keep a stopped service alive.
    """
    done = threading.Event()

    def run() -> None:
        try:
            cleanup()
        finally:
            done.set()

    threading.Thread(target=run, name="sparseety-cleanup", daemon=True).start()
    if not done.wait(timeout_s):
        logging.getLogger("sparseety").warning(
            "shutdown: cleanup did not finish in %.0f s; exiting", timeout_s
        )
    logging.shutdown()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)


#: Allocations of container objects between two young-generation collections in a component
#: process (CPython's default is 700). The worker and the sink allocate millions of short-lived
#: lists and dicts a second while holding large long-lived state, and at the default each
#: collection that reaches the older generations walks all of that state: it cost the worker
#: about a third of its CPU time (``benchmarks/bench_worker.py``, docs/benchmarks.md). Cycles
#: are still collected, only less often; the young generation stays a few MB.
GC_YOUNG_THRESHOLD = 50_000


def tune_gc() -> None:
    """Collect less often in a long-running component (see :data:`GC_YOUNG_THRESHOLD`), and never
    again walk what exists at start-up (modules, the app objects): ``gc.freeze``."""
    gc.freeze()
    _, older, oldest = gc.get_threshold()
    gc.set_threshold(GC_YOUNG_THRESHOLD, older, oldest)


def name_os_thread(name: str) -> None:
    """Give the calling thread ``name`` (15 characters kept) as its Linux thread name, so that
    ``top -H``, ``/proc/<pid>/task/*/comm`` and benchmarks can tell it apart from the threads of
    the process it runs in (CPython 3.11 names only its own ``threading`` object). No-op where
    ``prctl`` is missing."""
    try:
        import ctypes

        libc = ctypes.CDLL(None, use_errno=True)
        pr_set_name = 15
        libc.prctl(pr_set_name, name.encode()[:15], 0, 0, 0)
    except (OSError, AttributeError):
        pass


def run_then_exit(
    data_path: Path,
    role: str,
    body: Callable[[Path], object],
    *,
    cleanup: Callable[[], object] | None = None,
    log: logging.Logger,
) -> NoReturn:
    """Run a component process's ``body(ready_path)`` until it returns, then end the process.

    The process's garbage collector is tuned for throughput first (:func:`tune_gc`).
    ``<data_dir>/run/<role>-<pid>.ready`` (:func:`ready_file`) is cleared first and on the way
    out; ``body`` marks it when the component is ready. ``cleanup`` runs bounded in time
    (:func:`exit_after`: a stalled chDB shutdown must not keep a stopped process alive). The exit
    status is 0 when ``body`` returned, a ``SystemExit``'s code, or 1 on any other error (logged
    to ``log``).
    """
    ready = ready_file(data_path, role)
    clear_ready(ready)
    tune_gc()

    def finish() -> None:
        clear_ready(ready)
        if cleanup is not None:
            cleanup()

    code = 1
    try:
        body(ready)
        code = 0
    except SystemExit as exc:
        code = exc.code if isinstance(exc.code, int) else (0 if exc.code is None else 1)
    except BaseException:
        log.exception("the %s failed", role)
    finally:
        exit_after(finish, code)


def ready_file(data_path: Path, role: str, pid: int | None = None) -> Path:
    """``<data_dir>/run/<role>-<pid>.ready``: present while process ``pid`` (default: this one)
    in role ``worker``, ``sink``, ``store`` or ``api`` is ready; what supervisors wait for."""
    return data_path / "run" / f"{role}-{pid or os.getpid()}.ready"


def mark_ready(path: Path) -> None:
    """Announce readiness (the file holds the pid)."""
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(f"{os.getpid()}\n")


def clear_ready(path: Path) -> None:
    """Withdraw readiness (on exit; also before starting, against a stale file of a reused pid)."""
    path.unlink(missing_ok=True)
