"""The distribution installs every package of the source tree (the packages list is explicit,
because the top-level folders install under other names)."""

from __future__ import annotations

import tomllib
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def _setuptools() -> dict:
    return tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["setuptools"]


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


def test_package_data_belongs_to_listed_packages_and_matches_files() -> None:
    st = _setuptools()
    listed = set(st["packages"])
    dirs = st["package-dir"]
    for pkg, patterns in st["package-data"].items():
        assert pkg in listed, f"package-data for unlisted package {pkg}"
        top = max((n for n in dirs if pkg == n or pkg.startswith(n + ".")), key=len)
        folder = ROOT / dirs[top] / Path(*pkg[len(top) :].strip(".").split(".") if pkg != top else ())
        # Some patterns name optional folders (schemas/history/); at least one must match.
        assert any(list(folder.glob(p)) for p in patterns), f"{pkg}: {patterns} match nothing in {folder}"
