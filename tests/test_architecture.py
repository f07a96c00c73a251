"""The architecture as the tree states it, checked from the source (every import, including the
ones inside functions): no import circle, and the pure policy core imports no I/O."""

from __future__ import annotations

import ast
import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
# Each top-level folder holds one portion of the `jetbatch` namespace (PEP 420).
PACKAGES = {"sidecar/jetbatch/sidecar": "jetbatch.sidecar", "sdk/jetbatch/sdk": "jetbatch.sdk"}


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


def test_the_worker_core_imports_no_io_and_only_the_policy_core() -> None:
    graph = _graph()
    core = {n for n in graph if n.startswith("jetbatch.sidecar.core")}
    assert core
    allowed = core | {n for n in graph if n.startswith("jetbatch.sidecar.policy")}
    for name in core:
        assert graph[name] <= allowed, f"{name} imports {graph[name] - allowed}"
        source = _modules()[name][0].read_text()
        for io in ("import nats", "import anyio", "import asyncio", "import time", "import socket", "import random", "open("):
            assert io not in source, f"{name}: {io}"


def test_only_the_worker_core_decides_and_feeds_the_estimator() -> None:
    """The live worker and the simulator hand events to ``core.WorkerCore``; only the core calls
    its driver's events and decisions, and no module outside the policy core calls a policy's
    decide or event hooks or feeds the cost estimator itself."""
    calls = ("decide", "on_batch_done", "on_loaded", "on_evicted", "observe_batch", "observe_load", "observe_memory", "observe_host_memory")
    driver_events = ("batch_done", "loaded", "evicted", "warmed", "decide", "callers_gone", "idle_unloads")
    offenders = []
    for name, (path, _) in _modules().items():
        if not name.startswith("jetbatch.sidecar") or name.startswith("jetbatch.sidecar.policy"):
            continue
        in_core = name.startswith("jetbatch.sidecar.core")
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute):
                receiver = ast.unparse(node.func.value)
                if node.func.attr in calls and not (in_core and receiver.endswith("driver")):
                    offenders.append(f"{name}: {receiver}.{node.func.attr}()")
                elif node.func.attr in driver_events and receiver.endswith("driver") and not in_core:
                    offenders.append(f"{name}: {receiver}.{node.func.attr}()")
    assert offenders == []


# Who writes each field of a worker's per-model record (``worker/slots.py: Slot``) and of the
# core: one module each. A write is an assignment to ``<obj>.<field>`` from outside the owner;
# methods of the owner are how others change it.
SLOT_OWNERS = {
    # what the queues hold, from events and counts
    **dict.fromkeys(
        ("arrivals", "bulk", "doubted", "head_deadline", "hold_until", "oldest_enqueued_at", "stranded", "stranded_since", "unfetchable", "unknown_head_at", "unknown_head_deadline"),
        "worker/queues.py",
    ),
    "interactive_run": "worker/batching.py",
}
# The records a slot holds (``worker/slots.py``), each written by one module: a write is an
# assignment to ``<obj>.<record>.<field>``.
RECORD_OWNERS = {
    "place": ("Placement", "worker/residency.py"),  # where the model is, what its load left for the first batch
    "lines": ("PullLines", "worker/pullers.py"),  # its consumers and pull subscriptions
    "fetches": ("FetchHealth", "worker/lines.py"),  # what its empty fetches said
}
CORE_FIELDS = {"serving", "hold_missed", "current", "last_used", "resident_since", "idle_wake", "driver", "budget", "rules"}


def _foreign_writes() -> set[tuple[str, str, str]]:
    """(module, receiver, field) of every assignment to another object's attribute."""
    out = set()
    for path in (ROOT / "sidecar/jetbatch/sidecar").rglob("*.py"):
        module = str(path.relative_to(ROOT / "sidecar/jetbatch/sidecar"))
        for node in ast.walk(ast.parse(path.read_text())):
            targets = node.targets if isinstance(node, ast.Assign) else [node.target] if isinstance(node, (ast.AugAssign, ast.AnnAssign)) else []
            for target in targets:
                for t in target.elts if isinstance(target, ast.Tuple) else [target]:
                    if isinstance(t, ast.Attribute) and ast.unparse(t.value) not in ("self", "cls"):
                        out.add((module, ast.unparse(t.value), t.attr))
    return out


def test_each_field_of_a_slot_and_of_the_core_has_one_writer() -> None:
    from jetbatch.sidecar.worker.slots import Slot

    from jetbatch.sidecar.worker import slots as slots_module

    fields = set(Slot.__dataclass_fields__)
    record_fields = {name: set(getattr(slots_module, record).__dataclass_fields__) for name, (record, _) in RECORD_OWNERS.items()}
    offenders = []
    for module, receiver, attr in _foreign_writes():
        last = receiver.rsplit(".", 1)[-1]
        if last in RECORD_OWNERS and attr in record_fields[last] and module != RECORD_OWNERS[last][1]:
            offenders.append(f"{module} writes {receiver}.{attr} (owner: {RECORD_OWNERS[last][1]})")
        if attr in RECORD_OWNERS and module != "worker/slots.py":
            offenders.append(f"{module} replaces {receiver}.{attr} (made with its slot)")
        if last in ("slot", "victim", "held", "s") and attr in fields:
            owner = SLOT_OWNERS.get(attr, "worker/queues.py" if attr == "backlog" else None)
            if module != owner:
                offenders.append(f"{module} writes {receiver}.{attr} (owner: {owner})")
        if last == "core" and attr in CORE_FIELDS:
            offenders.append(f"{module} writes {receiver}.{attr} (owner: core/turns.py)")
        if last.endswith("residency") and attr == "loading":
            offenders.append(f"{module} writes {receiver}.loading (owner: worker/residency.py)")
    assert offenders == []


def test_the_ownership_check_sees_a_foreign_write(tmp_path: Path) -> None:
    tree = ast.parse("def f(slot, core):\n    slot.tier = 'warm'\n    core.serving = None\n    self.x = 1\n")
    writes = {ast.unparse(t.value) + "." + t.attr for n in ast.walk(tree) if isinstance(n, ast.Assign) for t in n.targets if isinstance(t, ast.Attribute)}
    assert writes == {"slot.tier", "core.serving", "self.x"}
    assert {(m, a) for m, r, a in _foreign_writes() if a == "tier"} == {("worker/residency.py", "tier")}


def test_every_file_has_one_import_name() -> None:
    """From the repository root (on sys.path, as under pytest or ``python -m bench...``), the
    folders are not packages of their own: ``sidecar.handlers`` or ``jetbatch.bench`` cannot be a
    second module object for a file, and ``jetbatch`` is found only in the two portions."""
    code = (
        "import importlib, jetbatch, jetbatch.sidecar.handlers as h\n"
        "print(sorted(jetbatch.__path__))\n"
        "for name in ('sidecar.handlers', 'sdk.client', 'jetbatch.bench', 'jetbatch.tests', 'jetbatch.examples'):\n"
        "    try:\n"
        "        importlib.import_module(name)\n"
        "    except ImportError:\n"
        "        continue\n"
        "    print('importable', name)\n"
    )
    out = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=60, env={**os.environ, "PYTHONPATH": str(ROOT)})
    assert out.returncode == 0, out.stderr
    first, *rest = out.stdout.splitlines()
    assert first == repr(sorted([str(ROOT / "sdk" / "jetbatch"), str(ROOT / "sidecar" / "jetbatch")]))
    assert rest == []
    # No stray __init__.py makes a folder above a portion a package again.
    assert not (ROOT / "sdk" / "__init__.py").exists() and not (ROOT / "sidecar" / "__init__.py").exists()
    assert not (ROOT / "sdk" / "jetbatch" / "__init__.py").exists() and not (ROOT / "sidecar" / "jetbatch" / "__init__.py").exists()


# Public functions of the standard library whose documented name starts with an underscore.
_DOCUMENTED_UNDERSCORE_NAMES = frozenset({"os._exit"})
# nats-py's internals that jetbatch replaces on purpose, each where it does so (its header parser
# and message dispatch: jetbatch.sdk.connection; the control connection's bounded dispatch), and
# the marker those wrappers leave on a callback.
_NATS_PY_HOOKS = {
    ("jetbatch.sdk.connection", "_parse_header_lines"), ("jetbatch.sdk.connection", "_process_msg"),
    ("jetbatch.sdk.connection", "_HEADER_VALUE_NEWLINES"), ("jetbatch.sdk.connection", "_jetbatch_guard"),
    ("jetbatch.sidecar.worker.control", "_process_msg"), ("jetbatch.sidecar.worker.control", "_jetbatch_guard"),
}  # fmt: skip


def _private_names_by_module() -> dict[str, set[str]]:
    """Each private name (``_x``) and the modules whose classes define it (a method, a class
    attribute, or ``self._x = ...``)."""
    defined: dict[str, set[str]] = {}
    for name, (path, _) in _modules().items():
        for node in ast.walk(ast.parse(path.read_text())):
            found: list[str] = []
            if isinstance(node, ast.ClassDef):
                for item in node.body:
                    if isinstance(item, (ast.FunctionDef, ast.AsyncFunctionDef)):
                        found.append(item.name)
                    elif isinstance(item, (ast.Assign, ast.AnnAssign)):
                        found += [t.id for t in (item.targets if isinstance(item, ast.Assign) else [item.target]) if isinstance(t, ast.Name)]
            elif isinstance(node, (ast.Assign, ast.AnnAssign)):
                targets = node.targets if isinstance(node, ast.Assign) else [node.target]
                found += [t.attr for t in targets if isinstance(t, ast.Attribute) and ast.unparse(t.value) == "self"]
            for attr in found:
                if attr.startswith("_") and not attr.startswith("__"):
                    defined.setdefault(attr, set()).add(name)
    return defined


def _private_reads(name: str, tree: ast.AST, defined: dict[str, set[str]]) -> list[str]:
    """The reads of another object's private fields in module ``name`` (see the test below)."""
    classes = {n.name for n in ast.walk(tree) if isinstance(n, ast.ClassDef)}
    offenders = []
    for fn in [n for n in ast.walk(tree) if isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef))]:
        known: dict[str, str] = {}
        for arg in (*fn.args.posonlyargs, *fn.args.args, *fn.args.kwonlyargs):
            if arg.annotation is not None:
                known[arg.arg] = ast.unparse(arg.annotation).strip("'\"")
        for node in ast.walk(fn):
            if isinstance(node, ast.Assign) and isinstance(node.value, ast.Call) and isinstance(node.value.func, ast.Name):
                known.update((t.id, node.value.func.id) for t in node.targets if isinstance(t, ast.Name))
        for node in ast.walk(fn):
            if not isinstance(node, ast.Attribute):
                continue
            attr = node.attr
            if not attr.startswith("_") or attr.startswith("__") or attr.endswith("_"):
                continue  # public, dunder, or an enum's sunder names
            receiver = ast.unparse(node.value)
            if receiver in ("self", "cls") or receiver.startswith("super()") or f"{receiver}.{attr}" in _DOCUMENTED_UNDERSCORE_NAMES:
                continue
            if isinstance(node.value, ast.Name) and known.get(receiver) in classes | {"cls"}:
                continue
            if defined.get(attr) == {name} or (name, attr) in _NATS_PY_HOOKS:
                continue
            offenders.append(f"{name}:{node.lineno}: {receiver}.{attr} (defined in {sorted(defined.get(attr, ()))})")
    return offenders


def test_no_module_reads_another_objects_private_fields() -> None:
    """``x._field`` (a leading underscore is private to its module) only on ``self``, ``cls``,
    ``super()``, an object the function knows to be of a class of its module (a parameter so
    annotated, a variable made by such a class or by ``cls``), or a private name no other module
    defines: a part that needs another's state gets it through a public name or as an argument.
    (The rule used to accept any ``x._field`` whose name the module defined anywhere, so a module
    with a ``_slots`` of its own could read another's.)"""
    defined = _private_names_by_module()
    offenders = [o for name, (path, _) in _modules().items() for o in _private_reads(name, ast.parse(path.read_text()), defined)]
    assert offenders == []


def test_the_private_field_rule_sees_a_read_of_another_modules_private_name() -> None:
    """What the old rule let through: a module with a ``_slots`` of its own reading another
    object's ``_slots``; its own object's, typed, is fine."""
    source = (
        "class A:\n    def __init__(self):\n        self._slots = {}\n"
        "    def peek(self, other: B, mine: A):\n        return other._slots, mine._slots\n"
    )
    defined = {"_slots": {"jetbatch.sidecar.a", "jetbatch.sidecar.b"}}
    found = _private_reads("jetbatch.sidecar.a", ast.parse(source), defined)
    assert [f.split(": ")[1].split(" ")[0] for f in found] == ["other._slots"]
    # A private name only this module defines may be read on any receiver of it.
    assert _private_reads("jetbatch.sidecar.a", ast.parse(source), {"_slots": {"jetbatch.sidecar.a"}}) == []


def test_nats_exceptions_are_named_in_one_module() -> None:
    """Only ``jetbatch.sdk.failures`` names nats-py's exception classes; everyone else catches
    its groups (TRANSPORT_ERRORS, TIMEOUTS, NOT_FOUND, ...), so they cannot drift apart."""
    offenders = []
    for name, (path, _) in _modules().items():
        if name == "jetbatch.sdk.failures":
            continue
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Import) and any(a.name in ("nats.errors", "nats.js.errors") for a in node.names):
                offenders.append(f"{name}: import {', '.join(a.name for a in node.names)}")
            elif isinstance(node, ast.ImportFrom) and node.module in ("nats.errors", "nats.js.errors"):
                offenders.append(f"{name}: from {node.module} import ...")
            elif isinstance(node, ast.Attribute) and ast.unparse(node).startswith(("nats.errors.", "nats.js.errors.")):
                offenders.append(f"{name}: {ast.unparse(node)}")
    assert offenders == []
