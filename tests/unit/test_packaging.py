"""The distribution installs every package and data file of the source tree (the packages list is
explicit, because the top-level folders install under other names)."""

from __future__ import annotations

import fnmatch
import os
import shutil
import subprocess
import sys
import sysconfig
import tomllib
import zipfile
from pathlib import Path, PurePosixPath
from typing import Any

ROOT = Path(__file__).resolve().parents[2]


def _setuptools() -> dict[str, Any]:
    return tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["setuptools"]


def _owner(module: PurePosixPath, dirs: dict[str, str], packages: set[str]) -> tuple[str, PurePosixPath]:
    """The deepest listed package whose folder holds ``module`` (a repository path), and the rest."""
    best: tuple[str, PurePosixPath] | None = None
    for name, folder in dirs.items():
        base = PurePosixPath(folder)
        if not module.is_relative_to(base):
            continue
        parts = module.relative_to(base).parts[:-1]
        for depth in range(len(parts), -1, -1):
            pkg = ".".join([name, *parts[:depth]])
            if pkg in packages:
                if best is None or len(pkg) > len(best[0]):
                    best = (pkg, PurePosixPath(*module.relative_to(base).parts[depth:]))
                break
    assert best is not None, f"{module} is in no listed package"
    return best


def test_every_source_package_is_listed() -> None:
    st = _setuptools()
    listed = set(st["packages"])
    found = set()
    for name, folder in st["package-dir"].items():
        base = ROOT / folder
        for init in base.rglob("__init__.py"):
            rel = init.parent.relative_to(base)
            found.add(".".join([name, *rel.parts]) if rel.parts else name)
    assert found - listed == set(), "packages missing from pyproject.toml [tool.setuptools] packages"


def test_every_data_file_is_package_data() -> None:
    st = _setuptools()
    listed = set(st["packages"])
    data = st["package-data"]
    files = [
        PurePosixPath(p.relative_to(ROOT).as_posix())
        for folder in st["package-dir"].values()
        for p in (ROOT / folder).rglob("*")
        if p.is_file() and "__pycache__" not in p.parts
    ]
    missing = []
    for path in files:
        if path.suffix in (".py", ".pyi", ".md"):
            continue
        pkg, rest = _owner(path, st["package-dir"], listed)
        if not any(fnmatch.fnmatch(str(rest), pattern) for pattern in data.get(pkg, [])):
            missing.append(str(path))
    assert missing == [], "files a wheel would leave out (add them to package-data)"


def test_the_built_wheel_runs_without_the_source_tree(tmp_path: Path) -> None:
    """What a deploy image installs: the wheel alone must carry schemas, migrations, dashboard."""
    # Built from a copy of what deploy/docker/Dockerfile copies: a stale build/ folder in the
    # checkout would otherwise hide files the packages list leaves out.
    src = tmp_path / "src"
    src.mkdir()
    for name in ("pyproject.toml", "README.md"):
        shutil.copy(ROOT / name, src / name)
    for folder in set(_setuptools()["package-dir"].values()):
        shutil.copytree(ROOT / folder, src / folder, ignore=shutil.ignore_patterns("__pycache__"))
    subprocess.run(
        [
            sys.executable,
            "-m",
            "pip",
            "wheel",
            "--no-deps",
            "--no-build-isolation",
            "-q",
            "-w",
            str(tmp_path),
            str(src),
        ],
        check=True,
        capture_output=True,
    )
    (wheel,) = tmp_path.glob("sparseety-*.whl")
    site = tmp_path / "site"
    zipfile.ZipFile(wheel).extractall(site)
    probe = (
        "import sparseety, pathlib, importlib.resources as r;"
        f"assert pathlib.Path(sparseety.__file__).is_relative_to({str(site)!r}), sparseety.__file__;"
        "from sparseety.schema_store import SchemaStore; assert SchemaStore.load().current;"
        "from sparseety.sinks.clickhouse.migrate import load_migrations; assert load_migrations();"
        "import sparseety.api.app, sparseety.streams.app, sparseety.producers.vllm.plugin;"
        "assert r.files('sparseety.api').joinpath('static', 'dashboard.html').is_file()"
    )
    # -S: no site module, so the editable install's import hook never loads and nothing can come
    # from the checkout; the dependencies still import from site-packages through PYTHONPATH.
    deps = sysconfig.get_paths()["purelib"]
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(site), deps])}
    done = subprocess.run(
        [sys.executable, "-S", "-c", probe], env=env, cwd=tmp_path, capture_output=True, text=True
    )
    assert done.returncode == 0, done.stderr[-2000:]
