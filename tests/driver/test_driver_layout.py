"""The driver's architecture as its imports draw it (docs/architecture.md): packages by concept, a
layered import graph with no cycles, at most eight modules at the top, and a package face that says
what each package does and offers. Read from the source (ast), so lazy imports inside functions
count too: a dependency is a dependency whenever it runs."""

import ast
import graphlib
from pathlib import Path

import pytest

DRIVER = Path(__file__).resolve().parents[2] / "driver"

# What each unit (a package, or a module at the top) may import, lowest layer first. A new edge
# belongs here only if it keeps the graph layered: docs/architecture.md draws the same picture.
ALLOWED = {
    "config": set(),
    "interrupt": set(),
    "axolotl": {"config"},
    "cli": {"config", "axolotl"},
    "metrics": set(),
    "distributed": {"metrics"},
    "data": {"config", "cli"},
    "policy": {"config", "cli", "data", "distributed"},
    "engine": {"config", "cli", "data", "distributed", "policy"},
    "rewards": {"config", "cli", "data"},
    "environments": {"config", "cli", "data"},
    "rollouts": {"config", "cli", "data", "distributed", "engine", "environments", "metrics", "policy", "rewards"},
    "update": {"config", "data", "distributed", "metrics", "policy", "rollouts"},
    "ebft": {"config", "cli", "data", "distributed", "engine", "metrics", "policy", "rewards", "rollouts", "update"},
    "algorithms": {"config", "cli", "data", "ebft", "policy", "rewards", "rollouts", "update"},
    "checkpoint": {"config", "data", "distributed"},
    "merge_lora": {"cli", "data", "policy"},  # a tool of its own: the adapter of a finished run into its base
    "vllm_serve": {"cli", "config", "data", "engine"},  # a tool of its own: the server a run would launch
    "train": {"algorithms", "checkpoint", "cli", "config", "data", "distributed", "engine", "environments",
              "interrupt",
              "metrics", "policy", "rewards", "rollouts", "update"},  # EBFT only through algorithms
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


def assert_acyclic(dependencies: dict[str, set[str]], what: str) -> None:
    try:
        tuple(graphlib.TopologicalSorter(dependencies).static_order())
    except graphlib.CycleError as error:
        pytest.fail(f"cycle in {what}: {' -> '.join(error.args[1])}")


def test_allowed_dependencies_form_a_dag():
    assert_acyclic(ALLOWED, "ALLOWED")


def test_no_module_imports_itself_in_a_cycle(graph):
    """Within packages too: a module-level cycle makes import order matter. A package's face
    (driver/x/__init__.py) is imported with each of its modules and is no cycle."""
    assert_acyclic({module: {target for target in targets & graph.keys()
                             if target != module and not module.startswith(target + ".")}
                    for module, targets in graph.items()}, "the driver's imports")


def test_at_most_eight_modules_at_the_top():
    top = sorted(path.stem for path in DRIVER.glob("*.py") if path.stem != "__init__")
    assert len(top) <= 8, top


def test_every_package_says_what_it_does_and_offers():
    for package in sorted(path.parent for path in DRIVER.glob("*/__init__.py")):
        doc = ast.get_docstring(ast.parse((package / "__init__.py").read_text()))
        assert doc and len(doc) > 100, f"{package.name}/__init__.py: a docstring naming its job and interface"
        assert "Interface" in doc, f"{package.name}/__init__.py: the docstring names the interface it offers"
