"""The project's modules import one way, and none reaches into another's private members.

Read from the source with ``ast`` (nothing is imported), so the rules hold for code paths no other
test runs:

* no import cycle anywhere in the project: imports under ``if TYPE_CHECKING:`` and imports inside
  functions count, since a cycle hidden behind either is still a cycle in the design;
* ``store/`` is layered: model ← DuckDB and storage helpers ← the in-memory index ← the writer
  and the reads ← the facade; a module imports nothing from a layer above its own, model modules
  do not import DuckDB, and only the facade imports the service built on the store (the catalog's
  ``migrations/``, which opening a database runs, is the one package below it);
* no ``x._name`` where ``x`` is not ``self``/``cls`` and ``_name`` is a member that a class of
  another module defines (a module may use its own classes' private members: they are one unit).
  The check goes by name, not by type: ``x._lock`` in a module whose own classes define ``_lock``
  passes whatever ``x`` is. Tests are not checked (they may look inside what they test).
"""
from __future__ import annotations

import ast
import pathlib
from collections import defaultdict

ROOT = pathlib.Path(__file__).resolve().parents[2]
PACKAGES = ("store", "flight_server", "producers", "consumers", "expstore", "bench", "migrations")

#: Every module of store/ and its layer; a module may import only modules of its layer or below.
#: The writer and the reads share a layer: neither may import the facade.
MODEL, STORAGE, INDEX, WRITER_READS, FACADE = range(5)
STORE_LAYERS = {
    # the model: ids, types, schemas, tensors, settings, errors; checking and converting a put;
    # the blob store's file format; the queries' time limits (a thread); no DuckDB
    "store.errors": MODEL, "store.naming": MODEL, "store.types": MODEL, "store.tensors": MODEL,
    "store.schema": MODEL, "store.settings": MODEL, "store.cache": MODEL, "store.ipc": MODEL,
    "store.barrier": MODEL, "store.blob_rows": MODEL, "store.row_cut": MODEL, "store.blobs": MODEL,
    "store.blob_keys": MODEL, "store.blob_chunks": MODEL, "store.blob_files": MODEL,
    "store.blob_writes": MODEL,
    "store.prepare": MODEL, "store.deadlines": MODEL, "store.table_memo": MODEL,
    "store.halves": MODEL, "store.host_arrays": MODEL,
    "store.waits": MODEL,
    # DuckDB and storage helpers: opening a database, Arrow sources, the SQL guard and the query
    # views, the put log's format, storage faults; claim requests and the Store protocol sit
    # here because a request's predicate is checked by the SQL guard, which parses with DuckDB
    "store.opening": STORAGE, "store.sources": STORAGE, "store.sqlguard": STORAGE,
    "store.sqlvalues": STORAGE, "store.putlog": STORAGE, "store.storage_fault": STORAGE,
    "store.claims": STORAGE, "store.interface": STORAGE, "store.retention": STORAGE,
    # the in-memory index: live rows, leases, the state the writer and the reads share
    "store.live": INDEX, "store.recovery": INDEX, "store.index": INDEX,
    # the writer (group commits, row SQL, settle/bump, checkpoints) and the reads
    "store.writer": WRITER_READS, "store.ops": WRITER_READS, "store.rows_sql": WRITER_READS,
    "store.settle": WRITER_READS, "store.checkpoints": WRITER_READS, "store.logged": WRITER_READS,
    "store.op_groups": WRITER_READS,
    "store.readers": WRITER_READS, "store.claim_engine": WRITER_READS,
    "store.barriers": WRITER_READS, "store.requeue": WRITER_READS,
    # what the facade hands on: table DDL, versions, SQL reads, reports, maintenance, settling
    # and renewing claims, the live-row limit of a put
    "store.table_ddl": WRITER_READS, "store.versions": WRITER_READS,
    "store.sql_query": WRITER_READS, "store.reports": WRITER_READS,
    "store.maintenance": WRITER_READS, "store.settler": WRITER_READS,
    "store.live_row_limit": WRITER_READS,
    # the facade and what is built on it
    "store.embedded": FACADE, "store.subscription": FACADE, "store": FACADE,
}
LAYER_NAMES = ["model", "storage", "index", "writer/reads", "facade"]

#: Private names of other libraries that the project uses on purpose, each with its reason.
FOREIGN_PRIVATE = {
    "_exit": "os._exit: the documented way to end a process without running cleanup handlers",
    "_fields": "NamedTuple._fields: the documented list of a named tuple's fields",
    "_asdict": "NamedTuple._asdict: documented",
    "_replace": "NamedTuple._replace: documented",
}


def _modules() -> dict[str, pathlib.Path]:
    out = {}
    for package in PACKAGES:
        for path in sorted((ROOT / package).rglob("*.py")):
            parts = list(path.relative_to(ROOT).with_suffix("").parts)
            if parts[-1] == "__init__":
                parts.pop()
            out[".".join(parts)] = path
    return out


MODULES = _modules()
TREES = {name: ast.parse(path.read_text(), str(path)) for name, path in MODULES.items()}


def _package_of(name: str) -> str:
    return name if MODULES[name].name == "__init__.py" else name.rpartition(".")[0]


def _imports(name: str) -> set[str]:
    """The project modules ``name`` imports, wherever in the file (functions, TYPE_CHECKING)."""
    out: set[str] = set()
    for node in ast.walk(TREES[name]):
        if isinstance(node, ast.Import):
            targets = [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                package = _package_of(name).split(".")
                package = package[: len(package) - (node.level - 1)]
                base = ".".join(package + ([base] if base else []))
            # ``from p import m`` imports module p.m when there is one, else names of p
            targets = [f"{base}.{a.name}" if f"{base}.{a.name}" in MODULES else base
                       for a in node.names]
        else:
            continue
        for target in targets:
            while target and target not in MODULES:  # ``import a.b.c`` of a name inside a.b
                target = target.rpartition(".")[0]
            if target and target != name:
                out.add(target)
    return out


GRAPH = {name: _imports(name) for name in MODULES}


def _cycles() -> list[list[str]]:
    """Strongly connected components of more than one module (Tarjan)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    out: list[list[str]] = []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in sorted(GRAPH[v]):
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
                out.append(sorted(component))

    for v in sorted(GRAPH):
        if v not in index:
            visit(v)
    return out


def test_the_import_graph_is_found():
    # the checks below mean something only if the parser finds the imports
    assert "store.live" in GRAPH["store.recovery"]
    assert "store.errors" in GRAPH["flight_server.client"]


def test_no_import_cycle_in_the_project():
    cycles = _cycles()
    assert not cycles, "import cycles (TYPE_CHECKING and function-level imports count):\n" + \
        "\n".join(" <-> ".join(c) for c in cycles)


def test_every_store_module_has_a_layer():
    store_modules = {n for n in MODULES if n == "store" or n.startswith("store.")}
    missing = sorted(store_modules - set(STORE_LAYERS))
    assert not missing, f"give these modules a layer in STORE_LAYERS: {missing}"


def test_store_imports_run_one_way():
    wrong = []
    for name, layer in STORE_LAYERS.items():
        if name not in MODULES:
            continue
        for target in sorted(GRAPH[name]):
            if not (target == "store" or target.startswith("store.")):
                if layer < FACADE and target != "migrations":
                    wrong.append(f"{name} imports {target}, outside store/ (only the facade "
                                 "may use the service built on the store)")
                continue
            if STORE_LAYERS.get(target, FACADE) > layer:
                wrong.append(f"{name} ({LAYER_NAMES[layer]}) imports {target} "
                             f"({LAYER_NAMES[STORE_LAYERS.get(target, FACADE)]})")
    assert not wrong, "\n".join(wrong)


def test_the_model_does_not_import_duckdb():
    wrong = []
    for name, layer in STORE_LAYERS.items():
        if layer != MODEL or name not in MODULES:
            continue
        for node in ast.walk(TREES[name]):
            names = [a.name for a in node.names] if isinstance(node, ast.Import) else \
                [node.module or ""] if isinstance(node, ast.ImportFrom) else []
            if any(n == "duckdb" or n.startswith("duckdb.") for n in names):
                wrong.append(f"{name}:{node.lineno}")
    assert not wrong, f"model modules importing DuckDB: {wrong}"


def _private_members() -> dict[str, set[str]]:
    """Private member name -> the modules whose classes define it (methods, attributes set on
    ``self``/``cls``, class-level assignments)."""
    defined: dict[str, set[str]] = defaultdict(set)
    for name, tree in TREES.items():
        for cls in (n for n in ast.walk(tree) if isinstance(n, ast.ClassDef)):
            for node in ast.walk(cls):
                member = None
                if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
                    member = node.name
                elif isinstance(node, ast.Attribute) and isinstance(node.ctx, ast.Store) \
                        and isinstance(node.value, ast.Name) and node.value.id in ("self", "cls"):
                    member = node.attr
                elif isinstance(node, (ast.AnnAssign, ast.Assign)) and node in cls.body:
                    targets = node.targets if isinstance(node, ast.Assign) else [node.target]
                    for t in targets:
                        if isinstance(t, ast.Name) and t.id.startswith("_"):
                            defined[t.id].add(name)
                if member and member.startswith("_") and not member.startswith("__"):
                    defined[member].add(name)
    return defined


def test_no_module_reaches_into_another_modules_private_members():
    defined = _private_members()
    wrong = []
    for name, tree in TREES.items():
        for node in ast.walk(tree):
            if not isinstance(node, ast.Attribute) or not node.attr.startswith("_") \
                    or node.attr.startswith("__") or node.attr in FOREIGN_PRIVATE:
                continue
            if isinstance(node.value, ast.Name) and node.value.id in ("self", "cls"):
                continue
            owners = defined.get(node.attr, set())
            if owners and name not in owners:
                wrong.append(f"{MODULES[name].relative_to(ROOT)}:{node.lineno} "
                             f"{ast.unparse(node)} (defined in {', '.join(sorted(owners))})")
    assert not wrong, "private members used from another module:\n" + "\n".join(wrong)


def test_no_module_imports_another_modules_private_names():
    wrong = []
    for name, tree in TREES.items():
        for node in ast.walk(tree):
            if isinstance(node, ast.ImportFrom) and (node.level or (node.module or "").split(".")[0]
                                                     in PACKAGES):
                for alias in node.names:
                    if alias.name.startswith("_") and not alias.name.startswith("__"):
                        wrong.append(f"{MODULES[name].relative_to(ROOT)}:{node.lineno} "
                                     f"imports {alias.name}")
    assert not wrong, "private names imported from another module:\n" + "\n".join(wrong)
