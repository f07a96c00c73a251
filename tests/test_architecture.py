"""The architecture as the tree states it, checked from the source (every import, including the
ones inside functions): no import circle, and the pure policy core imports no I/O."""

from __future__ import annotations

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
PACKAGES = {"sidecar": "jetbatch.sidecar", "sdk": "jetbatch.sdk"}


def _modules() -> dict[str, tuple[Path, bool]]:
    out: dict[str, tuple[Path, bool]] = {}
    for folder, package in PACKAGES.items():
        for path in (ROOT / folder).rglob("*.py"):
            parts = list(path.relative_to(ROOT / folder).with_suffix("").parts)
            is_package = parts[-1] == "__init__"
            if is_package:
                parts = parts[:-1]
            out[".".join([package, *parts])] = (path, is_package)
    return out


def _imports(name: str, path: Path, is_package: bool, modules: dict[str, tuple[Path, bool]]) -> set[str]:
    """The modules of ours that ``name`` imports: ``from . import view`` is the module
    ``view``, not its package."""
    here = name if is_package else name.rsplit(".", 1)[0]
    deps: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.ImportFrom):
            if node.level:
                base = here.split(".")[: len(here.split(".")) - (node.level - 1)]
                target = ".".join(base + ([node.module] if node.module else []))
            else:
                target = node.module or ""
            for alias in node.names:
                sub = f"{target}.{alias.name}"
                deps.add(sub if sub in modules else target)
        elif isinstance(node, ast.Import):
            deps.update(alias.name for alias in node.names)
    return {d for d in deps if d in modules and d != name}


def _graph() -> dict[str, set[str]]:
    modules = _modules()
    return {name: _imports(name, path, is_package, modules) for name, (path, is_package) in modules.items()}


def _cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """Strongly connected components of more than one module (Tarjan)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found: list[list[str]] = []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in sorted(graph[v]):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            component = []
            while True:
                w = stack.pop()
                on_stack.discard(w)
                component.append(w)
                if w == v:
                    break
            if len(component) > 1:
                found.append(sorted(component))

    for v in sorted(graph):
        if v not in index:
            visit(v)
    return found


def test_no_module_imports_itself_through_others() -> None:
    graph = _graph()
    assert len(graph) > 60  # the walk found the tree
    assert _cycles(graph) == []


def test_the_cycle_finder_finds_a_lazy_circle() -> None:
    # What the handlers package had: the package imports a module that imports the package back
    # inside a function.
    assert _cycles({"p": {"p.a"}, "p.a": {"p"}, "q": set()}) == [["p", "p.a"]]


def test_the_policy_core_imports_no_io_and_nothing_outside_itself() -> None:
    graph = _graph()
    policy = {n for n in graph if n.startswith("jetbatch.sidecar.policy")}
    assert policy
    for name in policy:
        assert graph[name] <= policy, f"{name} imports {graph[name] - policy}"
        source = _modules()[name][0].read_text()
        for io in ("import nats", "import anyio", "import asyncio", "import time", "import socket"):
            assert io not in source, f"{name}: {io}"


def test_the_sdk_imports_nothing_of_the_sidecars() -> None:
    graph = _graph()
    for name, deps in graph.items():
        if name.startswith("jetbatch.sdk"):
            assert not {d for d in deps if d.startswith("jetbatch.sidecar")}, name


def test_only_the_driver_decides_and_feeds_the_estimator() -> None:
    """The live worker and the simulator hand events to ``policy.Driver``; no module outside the
    policy core calls a policy's decide or event hooks, or feeds the cost estimator itself."""
    calls = ("decide", "on_batch_done", "on_loaded", "on_evicted", "observe_batch", "observe_load", "observe_memory", "observe_host_memory")
    offenders = []
    for name, (path, _) in _modules().items():
        if not name.startswith("jetbatch.sidecar") or name.startswith("jetbatch.sidecar.policy"):
            continue
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute) and node.func.attr in calls:
                receiver = ast.unparse(node.func.value)
                if not receiver.endswith("driver"):
                    offenders.append(f"{name}: {receiver}.{node.func.attr}()")
    assert offenders == []
