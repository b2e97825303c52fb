"""The data directory is private to its owner: directories 0700, files 0600.

It holds billing data, the admin token, spilled events with prompts' hashes and chDB's store.
chDB creates its directories and files with the process umask, so the entry points set
:data:`PRIVATE_UMASK` before anything is created (:func:`private_umask`), and tighten what an
earlier version or another process left readable (:func:`tighten`). Producers running inside an
engine's process (the vLLM plugin) must not change that process's umask: they create their
folders with :func:`private_mkdir` instead, and a 0700 folder keeps what is inside it private.
"""

from __future__ import annotations

import os
import stat
from pathlib import Path

#: No group or other bits on anything created.
PRIVATE_UMASK = 0o077


def private_umask() -> None:
    """Set the process umask so everything it creates from now on is private (entry points only)."""
    os.umask(PRIVATE_UMASK)


def private_mkdir(path: Path) -> None:
    """``mkdir -p`` whose new directories are 0700, whatever the umask."""
    missing = [p for p in (path, *path.parents) if not p.exists()]
    for p in reversed(missing):
        try:
            p.mkdir(mode=0o700)
        except FileExistsError:  # another process made it first
            continue
        p.chmod(0o700)  # mkdir's mode is masked by the umask, never widened; chmod is not


def tighten(data_dir: Path) -> int:
    """Remove group and other permissions from ``data_dir`` and everything under it; returns how
    many entries changed. Symlinks are left alone (their target may be outside the data dir), and
    entries that vanish or cannot be changed meanwhile (a running store's temporary parts) are
    skipped: the next start tightens them."""
    if not data_dir.is_dir():
        return 0
    changed = 0
    for root, dirs, files in os.walk(data_dir):
        for name in (".", *dirs, *files):
            p = os.path.join(root, name)
            try:
                st = os.lstat(p)
                if stat.S_ISLNK(st.st_mode) or not st.st_mode & 0o077:
                    continue
                os.chmod(p, stat.S_IMODE(st.st_mode) & ~0o077)
                changed += 1
            except OSError:
                continue
    return changed
