"""The house in rooms: the folders show the architecture, and imports only go down.

docs/architecture.md is the map these checks keep true:

- runtime/ and launcher/ hold at most 12 modules directly; the rest live in rooms (sub-packages
  named for what they do), and no toy model lives in the runtime;
- the rooms of a package stand on floors: a room imports only the rooms below it, even lazily;
- a base module of a package (the vocabulary every room uses) imports none of its rooms: only
  the package's conductors (the trainer, the agent and its transition, the command line) and its
  ``__init__`` (the public names) stand above the rooms;
- no module over 600 lines, no function over 80 lines; the agent (the loop and its wiring, each
  concern in a room) at most 350.

Everything is read with ``ast`` from the files; nothing is imported.
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest
from test_import_cycles import MODULES, PACKAGE, import_graph

#: per package: its rooms from the lowest floor up, and the modules that stand above the rooms
FLOORS = {
    "chameleon_elastic.runtime": (("world", "state", "execution", "recovery"), ("trainer",)),
    "chameleon_elastic.launcher": (("detection", "coordination", "workers", "observation"),
                                   ("agent", "transition", "launch", "cli")),
}
MAX_DIRECT = 12
MAX_MODULE_LINES = 600
MAX_FUNCTION_LINES = 80
MAX_AGENT_LINES = 350


def _room(package: str, module: str) -> str | None:
    """The room of ``module`` in ``package`` (None: a module of the package itself)."""
    rest = module[len(package) + 1:].split(".")
    return rest[0] if len(rest) > 1 else None


def _edges_within(package: str) -> list[tuple[str, str]]:
    graph = import_graph(import_time_only=False)
    inside = f"{package}."
    return [(a, b) for a, b in graph.edges if a.startswith(inside) and b.startswith(inside)]


@pytest.mark.parametrize("package", sorted(FLOORS))
def test_a_package_holds_few_modules_directly_and_its_rooms_exist(package):
    folder = PACKAGE.parent.joinpath(*package.split("."))
    direct = sorted(p.name for p in folder.glob("*.py"))
    assert len(direct) <= MAX_DIRECT, f"{folder} holds {len(direct)} modules: {direct}"
    rooms, _ = FLOORS[package]
    for room in rooms:
        assert (folder / room / "__init__.py").is_file(), f"{package}.{room} is not a room"
    unknown = {p.parent.name for p in folder.glob("*/__init__.py")} - set(rooms)
    assert not unknown, f"{package} has rooms that are on no floor: {sorted(unknown)}"


@pytest.mark.parametrize("package", sorted(FLOORS))
def test_rooms_import_only_the_rooms_below_them(package):
    rooms, _ = FLOORS[package]
    upward = [(a, b) for a, b in _edges_within(package)
              if _room(package, a) in rooms and _room(package, b) in rooms
              and rooms.index(_room(package, b)) > rooms.index(_room(package, a))]
    assert not upward, f"imports up a floor: {upward}"


@pytest.mark.parametrize("package", sorted(FLOORS))
def test_base_modules_import_no_room(package):
    rooms, conductors = FLOORS[package]
    above = {package, *(f"{package}.{c}" for c in conductors)}
    wrong = [(a, b) for a, b in _edges_within(package)
             if _room(package, a) is None and a not in above and _room(package, b) in rooms]
    assert not wrong, f"base modules that import a room (move them into it, or up): {wrong}"


def test_no_toy_model_in_the_runtime():
    runtime = [m for m in MODULES if m.startswith("chameleon_elastic.runtime")]
    assert not [m for m in runtime if "toy" in m.rsplit(".", 1)[-1]]
    assert "chameleon_elastic.models.toy" in MODULES


def test_no_module_over_600_lines_and_no_function_over_80():
    long_modules, long_functions = [], []
    for module, path in sorted(MODULES.items()):
        text = Path(path).read_text()
        if text.count("\n") > MAX_MODULE_LINES:
            long_modules.append((module, text.count("\n")))
        for node in ast.walk(ast.parse(text)):
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
                lines = node.end_lineno - node.lineno + 1
                if lines > MAX_FUNCTION_LINES:
                    long_functions.append((f"{module}.{node.name}", lines))
    assert not long_modules, f"modules over {MAX_MODULE_LINES} lines: {long_modules}"
    assert not long_functions, f"functions over {MAX_FUNCTION_LINES} lines: {long_functions}"
    agent = Path(MODULES["chameleon_elastic.launcher.agent"]).read_text().count("\n")
    assert agent <= MAX_AGENT_LINES, f"launcher/agent.py has {agent} lines: move a concern out"


def test_the_checks_see_the_rooms():
    """The room of a module is read from its name, and the floors name real rooms."""
    assert _room("chameleon_elastic.runtime", "chameleon_elastic.runtime.world.abort") == "world"
    assert _room("chameleon_elastic.runtime", "chameleon_elastic.runtime.trainer") is None
    edges = _edges_within("chameleon_elastic.runtime")
    assert ("chameleon_elastic.runtime.recovery.entering",
            "chameleon_elastic.runtime.execution.executor") in edges
