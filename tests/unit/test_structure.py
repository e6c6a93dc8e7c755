"""The package's shape, read from its source with ``ast`` (nothing of it is imported):

* only ``sgl_nixl_plugin/adapter/`` (the SGLang facade) imports SGLang;
* the internal import graph has no cycle;
* imports between the subpackages follow the layers: ``engine`` <- ``wire`` <- ``protocol``
  <- ``transport`` <- ``sides`` <- ``adapter`` <- ``bench`` <- ``cli``, with ``registry``
  beside them (it imports nothing of the package) and ``bridge`` (SGLang's entry point)
  using only the registry, the settings and the adapter's hooks and release gate.

Every ``import`` counts, at any depth: module level, inside functions and under
``if TYPE_CHECKING:``. A type-only import still ties the two modules together.
"""

from __future__ import annotations

import ast
from collections import deque
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

PACKAGE = "sgl_nixl_plugin"
PACKAGE_DIR = Path(__file__).resolve().parents[2] / PACKAGE
REPO_ROOT = PACKAGE_DIR.parent


@dataclass(frozen=True)
class Edge:
    source: str  # importing module, dotted
    target: str  # imported module of the package, dotted
    where: str  # path:line of the import statement


def _module_files() -> dict[str, Path]:
    """Dotted module name -> file, for every .py of the package (a package is its __init__)."""
    modules = {}
    for path in sorted(PACKAGE_DIR.rglob("*.py")):
        parts = path.relative_to(REPO_ROOT).with_suffix("").parts
        if parts[-1] == "__init__":
            parts = parts[:-1]
        modules[".".join(parts)] = path
    return modules


MODULES = _module_files()


def _where(path: Path, node: ast.stmt) -> str:
    return f"{path.relative_to(REPO_ROOT)}:{node.lineno}"


def _imports(path: Path) -> Iterator[ast.Import | ast.ImportFrom]:
    """Every import statement of the file, at any depth."""
    tree = ast.parse(path.read_text(encoding="utf-8"), filename=str(path))
    for node in ast.walk(tree):
        if isinstance(node, (ast.Import, ast.ImportFrom)):
            yield node


def _absolute_from(module: str, path: Path, node: ast.ImportFrom) -> str:
    """The module a ``from X import ...`` names, relative imports resolved."""
    if node.level == 0:
        return node.module or ""
    package = module if path.name == "__init__.py" else module.rpartition(".")[0]
    base = package.split(".")
    if node.level > 1:
        base = base[: -(node.level - 1)]
    return ".".join([*base, node.module] if node.module else base)


def _known(name: str) -> str | None:
    """``name`` if it is a module of the package, else its closest enclosing one."""
    while name:
        if name in MODULES:
            return name
        name = name.rpartition(".")[0]
    return None


def _is_ours(name: str) -> bool:
    return name == PACKAGE or name.startswith(PACKAGE + ".")


def _edges() -> list[Edge]:
    """Module -> package-internal module, one per imported name.

    ``import a.b.c`` is an edge to ``a.b.c`` only (not to ``a`` or ``a.b``), and
    ``from a.b import c`` to the module ``a.b.c`` when that is a file, else to ``a.b``:
    the graph then says which module's names a module needs, so a package ``__init__``
    that re-exports its submodules does not turn every ``from pkg.sub import x`` into a
    cycle. A module importing itself is no dependency and is left out.
    """
    edges = []
    for module, path in MODULES.items():
        for node in _imports(path):
            targets: list[str | None] = []
            if isinstance(node, ast.Import):
                targets = [_known(a.name) for a in node.names if _is_ours(a.name)]
            else:
                base = _absolute_from(module, path, node)
                if not _is_ours(base):
                    continue
                for alias in node.names:
                    sub = f"{base}.{alias.name}"
                    targets.append(sub if sub in MODULES else _known(base))
            edges += [Edge(module, t, _where(path, node)) for t in targets if t and t != module]
    return list(dict.fromkeys(edges))  # one per statement and target


# -- SGLang only in the adapter ----------------------------------------------------------


def test_only_the_adapter_imports_sglang() -> None:
    adapter = PACKAGE_DIR / "adapter"
    offenders = []
    for path in MODULES.values():
        if path.is_relative_to(adapter):
            continue
        for node in _imports(path):
            if isinstance(node, ast.Import):
                names = [a.name for a in node.names]
            else:
                names = [node.module or ""] if node.level == 0 else []
            offenders += [
                f"{_where(path, node)}: {name}"
                for name in names
                if name == "sglang" or name.startswith("sglang.")
            ]
    assert not offenders, (
        "SGLang is imported outside sgl_nixl_plugin/adapter/ (move the call into the adapter, "
        "e.g. adapter/harness.py):\n  " + "\n  ".join(offenders)
    )


# -- no import cycle ---------------------------------------------------------------------


def _strongly_connected(graph: dict[str, set[str]]) -> list[list[str]]:
    """Tarjan's strongly connected components (iterative), each sorted."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    on_stack: set[str] = set()
    stack: list[str] = []
    components = []
    counter = 0
    for root in sorted(graph):
        if root in index:
            continue
        work = [(root, iter(sorted(graph[root])))]
        index[root] = low[root] = counter
        counter += 1
        stack.append(root)
        on_stack.add(root)
        while work:
            node, children = work[-1]
            child = next(children, None)
            if child is not None:
                if child not in index:
                    index[child] = low[child] = counter
                    counter += 1
                    stack.append(child)
                    on_stack.add(child)
                    work.append((child, iter(sorted(graph[child]))))
                elif child in on_stack:
                    low[node] = min(low[node], index[child])
                continue
            work.pop()
            if work:
                parent = work[-1][0]
                low[parent] = min(low[parent], low[node])
            if low[node] == index[node]:
                component = []
                while True:
                    member = stack.pop()
                    on_stack.discard(member)
                    component.append(member)
                    if member == node:
                        break
                components.append(sorted(component))
    return components


def _shortest_cycle(graph: dict[str, set[str]], start: str) -> list[str]:
    """A shortest path start -> ... -> start (breadth first), or [] if there is none."""
    previous: dict[str, str] = {}
    queue = deque([start])
    while queue:
        node = queue.popleft()
        for child in sorted(graph[node]):
            if child == start:
                path = [node]
                while path[-1] != start:
                    path.append(previous[path[-1]])
                return [*reversed(path), start]
            if child not in previous:
                previous[child] = node
                queue.append(child)
    return []


def test_package_import_graph_has_no_cycle() -> None:
    edges = _edges()
    graph: dict[str, set[str]] = {m: set() for m in MODULES}
    for e in edges:
        graph[e.source].add(e.target)
    reports = []
    for component in _strongly_connected(graph):
        if len(component) < 2:
            continue
        members = set(component)
        cycles = {" -> ".join(c) for c in (_shortest_cycle(graph, m) for m in component) if c}
        inside = sorted(
            f"{e.source} -> {e.target}  ({e.where})"
            for e in edges
            if e.source in members and e.target in members
        )
        reports.append(
            f"cycle among {len(component)} modules: {', '.join(component)}\n"
            "    e.g. " + "\n    e.g. ".join(sorted(cycles)) + "\n"
            "    imports inside it:\n      " + "\n      ".join(inside)
        )
    assert not reports, "import cycles in the package:\n  " + "\n  ".join(reports)


# -- layers ------------------------------------------------------------------------------

#: Modules that import nothing of the package (checked below), so any layer may use them
#: without an arrow pointing up or a cycle becoming possible: only the Prometheus metrics,
#: which every layer reports to (a shared leaf, not an exception: it imports nothing of the
#: package). ``settings`` imports nothing of the package either but is no leaf here: reading
#: the operator's configuration stays above the transport (engine, wire, protocol and the
#: transport get values).
LEAVES = frozenset({f"{PACKAGE}.metrics"})

#: Importable from anywhere too: the package's ``__init__`` (``__version__``, and the
#: registry's public names, re-exported lazily). It may import only ``registry`` (its row
#: below), which is beside the layers and imports nothing but itself and LEAVES.
ANYONE = LEAVES | {PACKAGE}

#: What each part may import besides itself and LEAVES: a top-level subpackage or module
#: name, or a dotted ``part.module`` for one module of another part.
ALLOWED: dict[str, frozenset[str]] = {
    # bottom: NIXL agent, descriptors, staging, copy kernels; takes the agent's settings as
    # a protocol of its own (``engine.agent.AgentSettings``) that the registry's AgentConfig
    # satisfies
    "engine": frozenset(),
    # the messages on the wire, built over the engine's regions
    "wire": frozenset({"engine"}),
    # the SGLang-free transfer protocol (state machines over engine and wire)
    "protocol": frozenset({"engine", "wire"}),
    # moving messages between ranks (ZMQ, liveness, the bootstrap's HTTP client): no policy
    "transport": frozenset({"engine", "wire"}),
    # the per-side threads and their policy, SGLang-free (SGLang's room tables come in as
    # the sides.room_tables protocol); settings for the operator's configuration, registry
    # for the observer hooks
    "sides": frozenset({"engine", "wire", "protocol", "transport", "registry", "settings"}),
    # the SGLang facade: SGLang's classes built over the sides; registry for the backend
    # hooks
    "adapter": frozenset(
        {"engine", "wire", "protocol", "transport", "sides", "registry", "settings"}
    ),
    # drives SGLang's classes through the facade (adapter.harness); observes via registry
    "bench": frozenset(
        {"engine", "wire", "protocol", "transport", "sides", "adapter", "registry", "settings"}
    ),
    # the command line may use everything
    "cli": frozenset(
        {
            "engine",
            "wire",
            "protocol",
            "transport",
            "sides",
            "adapter",
            "registry",
            "bridge",
            "bench",
            "settings",
        }
    ),
    "__main__": frozenset({"cli"}),
    # beside the layers: the third-party plugin API, SGLang-free
    "registry": frozenset(),
    # SGLang's entry point: gates on the version (adapter.release_gate), then installs
    # adapter.hooks (both lazily)
    "bridge": frozenset({"registry", "settings", "adapter.hooks", "adapter.release_gate"}),
    # the package's __init__: __version__ and the registry's public names
    "": frozenset({"registry"}),
    # top-level modules: the operator's configuration
    "settings": frozenset(),
    "metrics": frozenset(),
}


def _part(module: str) -> str:
    """``sgl_nixl_plugin.<part>...`` -> ``<part>``; the package's own __init__ -> ``""``."""
    return module.split(".")[1] if "." in module else ""


def _short(module: str) -> str:
    return module.partition(".")[2]


def test_leaves_import_nothing_of_the_package() -> None:
    bad = [f"{e.source} -> {e.target}  ({e.where})" for e in _edges() if e.source in LEAVES]
    assert not bad, "a LEAVES module imports the package:\n  " + "\n  ".join(bad)


def test_layers_point_one_way() -> None:
    unknown = sorted({_part(m) for m in MODULES if m not in LEAVES} - set(ALLOWED))
    assert not unknown, f"parts missing from ALLOWED in {__file__}: {unknown}"
    offending = []
    for e in _edges():
        source, target = _part(e.source), _part(e.target)
        if e.source in LEAVES or e.target in ANYONE or source == target:
            continue
        allowed = ALLOWED[source]
        if target in allowed or _short(e.target) in allowed:
            continue
        offending.append(f"{_short(e.source)} -> {_short(e.target)}  ({e.where})")
    assert not offending, "imports against the layers:\n  " + "\n  ".join(sorted(offending))
