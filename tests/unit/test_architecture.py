"""The package import rules of docs/architecture.md, checked on the source (imports inside functions
included, since a lazy import is still a dependency)."""

from __future__ import annotations

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
# Installed package name -> source folder (pyproject's package-dir).
FOLDERS = {
    "sparseety.producers": ROOT / "producers",
    "sparseety.streams": ROOT / "streams",
    "sparseety.sinks": ROOT / "sinks",
    "sparseety.schemas": ROOT / "schemas",
    "sparseety": ROOT / "sparseety",
}
COMPONENTS = (
    "sparseety.producers",
    "sparseety.streams",
    "sparseety.sinks",
    "sparseety.queries",
    "sparseety.offline",
    "sparseety.api",
    "sparseety.stack",
)
# The command line is the one place that wires every component together.
ENTRY_POINTS = {"sparseety.cli", "sparseety.cli_context", "sparseety.__main__"}


def _all_but(*allowed: str) -> tuple[str, ...]:
    """Every component but ``allowed``: what a room that may import only those must not."""
    return tuple(c for c in COMPONENTS if c not in allowed)


# (importer prefix, forbidden import prefixes, why)
RULES = [
    (
        "sparseety.producers",
        _all_but("sparseety.producers"),
        "the engine side ships alone into the engine process",
    ),
    ("sparseety.streams", _all_but("sparseety.streams"), "streams feed sinks"),
    (
        "sparseety.sinks",
        _all_but("sparseety.sinks", "sparseety.streams"),
        "the sinks store what the fold sends; the read side and offline wiring are built on them",
    ),
    (
        "sparseety.queries",
        _all_but("sparseety.queries", "sparseety.sinks"),
        "the read side reads the store the sinks fill; the API, the CLI and offline are built on it",
    ),
    (
        "sparseety.offline",
        ("sparseety.api", "sparseety.stack"),
        "offline analysis wires producers, streams and sinks; the CLI and the API run it",
    ),
    ("sparseety.api", ("sparseety.stack",), "the stack runs the API, not the other way"),
]


def _module_name(path: Path, folders: dict[str, Path] = FOLDERS) -> str:
    for package, folder in folders.items():
        if package != "sparseety" and path.is_relative_to(folder):
            parts = path.relative_to(folder).with_suffix("").parts
            break
    else:
        package, parts = "sparseety", path.relative_to(folders["sparseety"]).with_suffix("").parts
    if parts[-1] == "__init__":
        parts = parts[:-1]
    return ".".join((package, *parts))


def _imports(path: Path, module: str) -> set[str]:
    tree = ast.parse(path.read_text(), str(path))
    is_package = path.name == "__init__.py"
    found: set[str] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            found.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = module.split(".")
                base = base[: len(base) - node.level + (1 if is_package else 0)]
                name = ".".join([*base, node.module] if node.module else base)
            else:
                name = node.module or ""
            found.add(name)
            found.update(f"{name}.{alias.name}" for alias in node.names)
    return found


def _graph(folders: dict[str, Path] = FOLDERS) -> dict[str, set[str]]:
    graph = {}
    for folder in folders.values():
        for path in folder.rglob("*.py"):
            module = _module_name(path, folders)
            graph[module] = _imports(path, module)
    return graph


def _under(name: str, prefix: str) -> bool:
    return name == prefix or name.startswith(prefix + ".")


def _violations(graph: dict[str, set[str]] | None = None) -> list[str]:
    out = []
    for module, imports in sorted((_graph() if graph is None else graph).items()):
        for importer, forbidden, why in RULES:
            if _under(module, importer):
                out += [
                    f"{module} imports {name} ({why})"
                    for name in sorted(imports)
                    if any(_under(name, f) for f in forbidden)
                ]
        core = module.startswith("sparseety.") and module.count(".") == 1 and module not in ENTRY_POINTS
        if core and not any(_under(module, c) for c in COMPONENTS):
            out += [
                f"{module} (core contract) imports {name}"
                for name in sorted(imports)
                if any(_under(name, c) for c in COMPONENTS)
            ]
    return out


def test_no_forbidden_imports() -> None:
    assert _violations() == []


def test_rule_checker_catches_a_violation(tmp_path: Path) -> None:
    # The checker itself must be able to fail: a tree laid out as the repository is, with a
    # producer that imports streams relatively, a core module that imports a sink lazily, and a
    # stream module that obeys the rules.
    folders = {
        "sparseety.producers": tmp_path / "producers",
        "sparseety.streams": tmp_path / "streams",
        "sparseety": tmp_path / "sparseety",
    }
    files = {
        "producers/vllm/x.py": "from ...streams import assembler\n",
        "sparseety/config2.py": "def f():\n    from sparseety.sinks.clickhouse import writer\n",
        "streams/ok.py": "from sparseety import events\nfrom . import state\n",
    }
    for name, text in files.items():
        (tmp_path / name).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / name).write_text(text)
    found = _violations(_graph(folders))
    assert found == [
        "sparseety.config2 (core contract) imports sparseety.sinks.clickhouse",
        "sparseety.config2 (core contract) imports sparseety.sinks.clickhouse.writer",
        "sparseety.producers.vllm.x imports sparseety.streams "
        "(the engine side ships alone into the engine process)",
        "sparseety.producers.vllm.x imports sparseety.streams.assembler "
        "(the engine side ships alone into the engine process)",
    ]


# Replay loading no Faust is checked at run time:
# tests/topology/test_sink_replay.py::test_a_replay_run_loads_no_faust.


def _absolute_self_imports(room: str, folder: Path) -> list[str]:
    """``from sparseety.<room>... import`` lines inside ``folder`` (its own package)."""
    found = []
    for path in sorted(folder.rglob("*.py")):
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            if isinstance(node, ast.ImportFrom) and not node.level and node.module:
                if node.module == room or node.module.startswith(room + "."):
                    found.append(f"{path.relative_to(folder.parent)}:{node.lineno}: from {node.module}")
            elif isinstance(node, ast.Import):
                found += [
                    f"{path.relative_to(folder.parent)}:{node.lineno}: import {a.name}"
                    for a in node.names
                    if a.name == room or a.name.startswith(room + ".")
                ]
    return found


def test_rooms_import_their_own_modules_relatively() -> None:
    # producers/, streams/ and sinks/ install under other names (package-dir): relative imports
    # inside a folder keep its structure visible to readers and to tools that follow paths. The
    # read side (sparseety/queries/) follows the same rule.
    rooms = {room: FOLDERS[room] for room in ("sparseety.producers", "sparseety.streams", "sparseety.sinks")}
    rooms["sparseety.queries"] = FOLDERS["sparseety"] / "queries"
    for room, folder in rooms.items():
        assert _absolute_self_imports(room, folder) == []


def test_self_import_check_flags_an_absolute_import(tmp_path: Path) -> None:
    folder = tmp_path / "streams"
    folder.mkdir()
    (folder / "a.py").write_text("from . import b\nfrom sparseety.sinks import x\n")
    (folder / "b.py").write_text("def f():\n    from sparseety.streams.a import y\n")
    assert _absolute_self_imports("sparseety.streams", folder) == ["streams/b.py:2: from sparseety.streams.a"]


def _loops(graph: dict[str, set[str]]) -> list[list[str]]:
    """The import loops of ``graph``: its strongly connected components of more than one module
    (an import of ``pkg.mod.Name`` is an edge to the longest module it names; TYPE_CHECKING and
    function-level imports count, as everywhere in this file)."""
    modules = set(graph)

    def target(name: str) -> str | None:
        parts = name.split(".")
        return next(
            (".".join(parts[:i]) for i in range(len(parts), 0, -1) if ".".join(parts[:i]) in modules), None
        )

    edges = {m: {t for n in names if (t := target(n)) is not None and t != m} for m, names in graph.items()}
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found: list[list[str]] = []
    for root in sorted(edges):  # Tarjan's algorithm, iteratively (no recursion limit)
        if root in index:
            continue
        work = [(root, iter(sorted(edges[root])))]
        index[root] = low[root] = len(index)
        stack.append(root)
        on_stack.add(root)
        while work:
            node, children = work[-1]
            child = next(children, None)
            if child is not None:
                if child not in index:
                    index[child] = low[child] = len(index)
                    stack.append(child)
                    on_stack.add(child)
                    work.append((child, iter(sorted(edges[child]))))
                elif child in on_stack:
                    low[node] = min(low[node], index[child])
                continue
            work.pop()
            if work:
                low[work[-1][0]] = min(low[work[-1][0]], low[node])
            if low[node] == index[node]:
                component = []
                while True:
                    member = stack.pop()
                    on_stack.discard(member)
                    component.append(member)
                    if member == node:
                        break
                if len(component) > 1:
                    found.append(sorted(component))
    return sorted(found)


def test_no_import_loop() -> None:
    # Three loops were closed by moving the shared names down, never by a local import:
    # routing <-> session (producers/vllm/stamp.py), client <-> embedded
    # (sinks/clickhouse/engine.py), and the query library with its sub-queries
    # (sparseety/queries/base.py: Scope, QuerySpec, the grouping and hiding helpers).
    assert _loops(_graph()) == []


def test_the_loop_finder_finds_a_loop(tmp_path: Path) -> None:
    folders = {"sparseety.streams": tmp_path / "streams", "sparseety": tmp_path / "sparseety"}
    files = {
        "streams/a.py": "from . import b\n",
        "streams/b.py": "from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    from .c import X\n",
        "streams/c.py": "def f():\n    from .a import y\n",
        "streams/d.py": "from . import a\n",  # into the loop, not part of it
        "sparseety/e.py": "import sparseety.f\n",
        "sparseety/f.py": "",
    }
    for name, text in files.items():
        (tmp_path / name).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / name).write_text(text)
    assert _loops(_graph(folders)) == [["sparseety.streams.a", "sparseety.streams.b", "sparseety.streams.c"]]


def test_the_replay_runs_without_faust() -> None:
    """Issue 34: ``sparseety replay`` rebuilds results from topics without the worker's runtime:
    importing it loads no Faust and none of the worker's Faust workarounds (the broker's own
    workaround it needs lives in ``sparseety/broker_compat.py``)."""
    import subprocess
    import sys

    probe = (
        "import sys, sparseety.sinks.replay, sparseety.sinks.cli; "
        "print(sorted(m for m in sys.modules if m.split('.')[0] in ('faust', 'mode') "
        "or m == 'sparseety.streams.compat'))"
    )
    out = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "[]", out.stdout
