"""The data dir is private (issue 12): after a real command opened a real chDB store in it,
every directory is 0700 and every file 0600 (no group or other bits), including chDB's own and
what an earlier version left world-readable."""

from __future__ import annotations

import os
import stat
import subprocess
from pathlib import Path

from sparseety.private_dir import private_mkdir, tighten
from tests.helpers import VENV_BIN


def _open_to_others(root: Path) -> list[str]:
    out = []
    for dirpath, dirs, files in os.walk(root):
        for name in (".", *dirs, *files):
            p = os.path.join(dirpath, name)
            st = os.lstat(p)
            if not stat.S_ISLNK(st.st_mode) and st.st_mode & 0o077:
                out.append(f"{oct(stat.S_IMODE(st.st_mode))} {p}")
    return out


def test_a_real_store_leaves_nothing_readable_by_others(tmp_path: Path) -> None:
    data = tmp_path / "data"
    legacy = data / "old"
    legacy.mkdir(parents=True)
    os.chmod(data, 0o777)
    os.chmod(legacy, 0o777)
    (legacy / "bill.csv").write_text("acme,1\n")
    os.chmod(legacy / "bill.csv", 0o666)
    env = {k: v for k, v in os.environ.items() if not k.startswith("SPARSEETY_")}
    result = subprocess.run(
        [str(VENV_BIN / "sparseety"), "--data-dir", str(data), "db", "migrate"],
        env={**env, "HOME": str(tmp_path)},
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert result.returncode == 0, result.stderr[-2000:]
    assert (data / "chdb").is_dir() and any((data / "chdb").rglob("*"))
    assert _open_to_others(data) == []
    assert stat.S_IMODE((data / "chdb").stat().st_mode) == 0o700


def test_private_mkdir_and_tighten(tmp_path: Path) -> None:
    old = os.umask(0o022)
    try:
        private_mkdir(tmp_path / "a" / "b" / "c")
        assert _open_to_others(tmp_path / "a") == []
        (tmp_path / "a" / "f").write_text("x")
        os.symlink("/etc/hostname", tmp_path / "a" / "link")
        assert _open_to_others(tmp_path / "a") != []
        assert tighten(tmp_path / "a") == 1 and _open_to_others(tmp_path / "a") == []
        assert tighten(tmp_path / "missing") == 0
    finally:
        os.umask(old)
