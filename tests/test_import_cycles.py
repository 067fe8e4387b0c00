"""No import cycles in chameleon_elastic, lazy imports included.

The graph is built with ``ast`` over the package's files (no module is imported): an edge
``a -> b`` for every ``import b`` / ``from b import x`` / ``from . import b`` in ``a`` that names
a chameleon_elastic module (``from pkg import name`` points at ``pkg.name`` when that is a
module, else at ``pkg``).

Two checks:

- **At import time**: the imports that run when a module is imported (module level, including
  inside ``try`` / ``if`` blocks, but not ``if TYPE_CHECKING:`` nor
  ``if __name__ == "__main__":``) form no cycle. This is the cycle that can break an import.
- **Every import** (module level, inside functions, and under ``TYPE_CHECKING``): no cycle
  either. A lazy import inside a function forms no import-time cycle, but a lazy back-edge
  hides a module calling back into its caller: the layers stop showing which way they depend.
  Where two modules needed each other (``models.hf`` and ``models.hf_export``;
  ``rendezvous.local_etcd``'s command line, which starts a ``local_cluster``), the shared part
  moved below both (``hf_layers.copy_config``) or the command line got its own module
  (``rendezvous.dev_etcd``).
"""

from __future__ import annotations

import ast
from pathlib import Path

import networkx as nx

PACKAGE = Path(__file__).resolve().parent.parent / "chameleon_elastic"


def _name(path: Path) -> str:
    parts = list(path.relative_to(PACKAGE.parent).with_suffix("").parts)
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


MODULES = {_name(p): p for p in PACKAGE.rglob("*.py")}


def _never_on_import(node: ast.AST) -> bool:
    """``if TYPE_CHECKING:`` and ``if __name__ == "__main__":`` blocks."""
    if not isinstance(node, ast.If):
        return False
    test = ast.unparse(node.test)
    return "TYPE_CHECKING" in test or "__main__" in test


def _import_time_nodes(tree: ast.Module) -> list[ast.AST]:
    """The statements that run on import: module level, into try/if/with blocks and class
    bodies, not into functions, ``if TYPE_CHECKING:`` or ``if __name__ == "__main__":``."""
    out: list[ast.AST] = []
    todo = list(tree.body)
    while todo:
        node = todo.pop()
        if _never_on_import(node) or isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
            continue
        out.append(node)
        for field in ("body", "orelse", "finalbody", "handlers"):
            todo.extend(getattr(node, field, []))
    return out


def _targets(module: str, is_package: bool, node: ast.AST) -> list[str]:
    if isinstance(node, ast.Import):
        return [a.name for a in node.names]
    if not isinstance(node, ast.ImportFrom):
        return []
    if node.level:
        base = module.split(".") if is_package else module.split(".")[:-1]
        base = base[:len(base) - (node.level - 1)]
        source = ".".join(base + ([node.module] if node.module else []))
    else:
        source = node.module or ""
    return [f"{source}.{a.name}" if f"{source}.{a.name}" in MODULES else source
            for a in node.names]


def import_graph(import_time_only: bool) -> nx.DiGraph:
    graph = nx.DiGraph()
    graph.add_nodes_from(MODULES)
    for module, path in MODULES.items():
        tree = ast.parse(path.read_text(), str(path))
        nodes = _import_time_nodes(tree) if import_time_only else list(ast.walk(tree))
        for node in nodes:
            for target in _targets(module, path.name == "__init__.py", node):
                if target in MODULES and target != module:
                    graph.add_edge(module, target)
    return graph


def test_the_graph_sees_known_imports():
    graph = import_graph(import_time_only=False)
    assert graph.has_edge("chameleon_elastic.runtime.trainer",
                          "chameleon_elastic.runtime.recovery.in_place")
    assert graph.has_edge("chameleon_elastic.planning.cache", "chameleon_elastic.planning.search")
    # a lazy import (inside run()) is seen by the full graph only
    assert graph.has_edge("chameleon_elastic.launcher.launch", "chameleon_elastic.launcher.agent")
    assert not import_graph(import_time_only=True).has_edge(
        "chameleon_elastic.launcher.launch", "chameleon_elastic.launcher.agent")


def test_no_import_cycle_at_import_time():
    cycles = list(nx.simple_cycles(import_graph(import_time_only=True)))
    assert not cycles, f"import cycles: {cycles}"


def test_no_import_cycle_even_lazily():
    cycles = list(nx.simple_cycles(import_graph(import_time_only=False)))
    assert not cycles, f"import cycles (lazy imports included): {cycles}"
