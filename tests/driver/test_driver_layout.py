"""The driver's architecture as its imports draw it (docs/architecture.md): packages by concept, a
layered import graph with no cycles, at most eight modules at the top, and a package face that says
what each package does and offers. Read from the source (ast), so lazy imports inside functions
count too: a dependency is a dependency whenever it runs."""

import ast
from collections import defaultdict
from pathlib import Path

import pytest

DRIVER = Path(__file__).resolve().parents[2] / "driver"

# What each unit (a package, or a module at the top) may import, lowest layer first. A new edge
# belongs here only if it keeps the graph layered: docs/architecture.md draws the same picture.
ALLOWED = {
    "config": set(),
    "interrupt": set(),
    "cli": {"config"},
    "metrics": set(),
    "distributed": {"metrics"},
    "data": {"config", "cli"},
    "policy": {"config", "cli", "data", "distributed"},
    "engine": {"config", "cli", "data", "policy"},
    "rewards": {"config", "cli", "data"},
    "rollouts": {"config", "cli", "data", "distributed", "engine", "metrics", "policy", "rewards"},
    "update": {"config", "data", "distributed", "metrics", "policy", "rollouts"},
    "ebft": {"config", "cli", "data", "distributed", "engine", "metrics", "policy", "rewards", "rollouts", "update"},
    "algorithms": {"config", "cli", "data", "ebft", "policy", "rewards"},
    "checkpoint": {"config", "data", "distributed"},
    "train": {"algorithms", "checkpoint", "cli", "config", "data", "distributed", "ebft", "engine", "interrupt",
              "metrics", "policy", "rewards", "rollouts", "update"},
}


def module_name(path: Path) -> str:
    parts = path.relative_to(DRIVER.parent).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def unit(module: str) -> str:
    return module.split(".")[1]


def driver_imports(path: Path) -> set[str]:
    """The driver modules `path` imports (a `from driver.x import name` that names a module counts
    as that module)."""
    names = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.ImportFrom) and node.module and node.module.split(".")[0] == "driver":
            for alias in node.names:
                candidate = f"{node.module}.{alias.name}"
                is_module = (DRIVER.parent / (candidate.replace(".", "/") + ".py")).exists()
                names.add(candidate if is_module else node.module)
        elif isinstance(node, ast.Import):
            names.update(alias.name for alias in node.names if alias.name.split(".")[0] == "driver")
    return names


@pytest.fixture(scope="module")
def graph() -> dict[str, set[str]]:
    return {module_name(path): driver_imports(path) for path in sorted(DRIVER.rglob("*.py"))}


def test_packages_import_only_the_layers_below(graph):
    wrong = sorted(f"{source} -> {target}" for source, targets in graph.items() if source != "driver"
                   for target in targets if target != "driver" and unit(target) != unit(source)
                   and unit(target) not in ALLOWED[unit(source)])
    assert not wrong, "imports against the layering (ALLOWED, docs/architecture.md):\n" + "\n".join(wrong)


def test_every_unit_is_placed_in_the_layering(graph):
    assert {unit(m) for m in graph if m != "driver"} == set(ALLOWED)


def test_allowed_dependencies_form_a_dag():
    done, active = set(), set()

    def visit(node: str, path: list[str]) -> None:
        assert node not in active, "cycle in ALLOWED: " + " -> ".join(path + [node])
        if node in done:
            return
        active.add(node)
        for target in ALLOWED[node]:
            visit(target, path + [node])
        active.discard(node)
        done.add(node)

    for node in ALLOWED:
        visit(node, [])


def test_no_module_imports_itself_in_a_cycle(graph):
    """Within packages too: a module-level cycle makes import order matter."""
    incoming = defaultdict(set)
    for source, targets in graph.items():
        for target in targets & graph.keys():
            if target != source and not source.startswith(target + "."):  # a package's face is not a cycle
                incoming[target].add(source)
    order = []
    remaining = {m: {t for t in graph[m] & graph.keys() if t != m and not m.startswith(t + ".")} for m in graph}
    ready = [m for m, targets in remaining.items() if not targets]
    while ready:
        module = ready.pop()
        order.append(module)
        for source in incoming[module]:
            remaining[source].discard(module)
            if not remaining[source] and source not in order and source not in ready:
                ready.append(source)
    stuck = sorted(m for m in graph if m not in order)
    assert not stuck, f"modules in an import cycle or importing one: {stuck}"


def test_at_most_eight_modules_at_the_top():
    top = sorted(path.stem for path in DRIVER.glob("*.py") if path.stem != "__init__")
    assert len(top) <= 8, top


def test_every_package_says_what_it_does_and_offers():
    for package in sorted(path.parent for path in DRIVER.glob("*/__init__.py")):
        doc = ast.get_docstring(ast.parse((package / "__init__.py").read_text()))
        assert doc and len(doc) > 100, f"{package.name}/__init__.py: a docstring naming its job and interface"
        assert "Interface" in doc, f"{package.name}/__init__.py: the docstring names the interface it offers"
