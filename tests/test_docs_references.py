"""Every path, link and module the docs name exists: README.md, docs/, examples/, the Makefile, .ci/run.

Checked: relative markdown links, repo paths (`driver/config.py`, `benchmarks/results/`), bare file
names (`collect.py` in a listing: some file of the repo must have the name), and dotted Python
names (`python -m driver.train`, `driver.data.toy_tasks.digit_fraction`) down to the module file and
the name it defines. Paths with placeholders (`<family>`, `*`, `vNNNNNN`) and
paths of a run's outputs (`outputs/...`, `output_dir/...`) are not references to the repo.
"""

import ast
import functools
import os
import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
DOCUMENTS = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md")), *sorted((ROOT / "examples").glob("*.yaml")),
             ROOT / "Makefile", ROOT / ".ci" / "run"]
TOP_LEVEL = ("csrc", "pykernels", "driver", "benchmarks", "tests", "examples", "docs", "cmake", ".ci")
REPO_PATH = re.compile(r"(?<![\w./-])((?:%s)/[\w./*-]*)" % "|".join(re.escape(name) for name in TOP_LEVEL))
MARKDOWN_LINK = re.compile(r"\]\(([^)\s]+)\)")
# A bare file name ("config.py, collect.py" in a layout listing): some file of the repo has it.
FILE_NAME = re.compile(r"(?<![\w/.*-])([\w-]+\.(?:md|py|yaml|toml|cpp|cu|cuh|h|cmake))\b")
DOTTED_NAME = re.compile(r"(?<![\w./-])((?:driver|pykernels|benchmarks)(?:\.\w+)+)")
PLACEHOLDER = re.compile(r"[<>*{}]|NNN|\.\.\.")


NOT_REPO_FILES = {  # file names the docs use that are not files of this repository
    "cfg.yaml": "the user's own config in command lines",
    "config.yaml": "the resolved config a run writes to output_dir",
    "grpo_config.py": "TRL's", "grpo_trainer.py": "TRL's", "core_algos.py": "verl's",
}


@functools.cache
def repo_file_names() -> frozenset[str]:
    skip = {".git", ".venv", "build", "outputs", "__pycache__", ".pytest_cache", ".hypothesis"}
    names = set()
    for _, subdirectories, files in os.walk(ROOT):
        subdirectories[:] = [name for name in subdirectories if name not in skip]
        names.update(files)
    return frozenset(names)


def references(document: Path) -> list[tuple[str, str]]:
    """(kind, reference) pairs named in a document."""
    text = document.read_text()
    found = [("path", match.rstrip(".,:;")) for match in REPO_PATH.findall(text)]
    if document.suffix == ".md":
        found += [("link", target) for target in MARKDOWN_LINK.findall(text)
                  if not target.startswith(("http://", "https://", "#", "mailto:"))]
    found += [("file", name) for name in FILE_NAME.findall(text)]
    found += [("module", name.rstrip(".")) for name in DOTTED_NAME.findall(text)]
    return sorted({(kind, ref) for kind, ref in found if not PLACEHOLDER.search(ref)})


def module_defines(path: Path, name: str) -> bool:
    tree = ast.parse(path.read_text())
    for node in tree.body:
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)) and node.name == name:
            return True
        targets = (node.targets if isinstance(node, ast.Assign)
                   else [node.target] if isinstance(node, ast.AnnAssign) else [])
        if any(isinstance(target, ast.Name) and target.id == name for target in targets):
            return True
        if isinstance(node, (ast.Import, ast.ImportFrom)) and any((a.asname or a.name) == name for a in node.names):
            return True
    return False


def dotted_name_exists(name: str) -> bool:
    """a.b.c is a package or module a/b/c(.py), a compiled extension a/b/c*.so (built before the
    tests run), or a module a/b.py defining c."""
    parts = name.split(".")
    if list(ROOT.joinpath(*parts[:-1]).glob(f"{parts[-1]}.*.so")):
        return True
    for split in range(len(parts), 0, -1):
        base = ROOT.joinpath(*parts[:split])
        module = base.with_suffix(".py") if not base.is_dir() else base / "__init__.py"
        if module.exists():
            rest = parts[split:]
            return not rest or (len(rest) == 1 and module_defines(module, rest[0]))
    return False


def exists(document: Path, kind: str, reference: str) -> bool:
    if kind == "link":
        return (document.parent / reference.split("#")[0]).exists()
    if kind == "file":
        return reference in repo_file_names() or reference in NOT_REPO_FILES
    if kind == "module":
        return dotted_name_exists(reference)
    return (ROOT / reference).exists()


@pytest.mark.parametrize("document", DOCUMENTS, ids=lambda path: str(path.relative_to(ROOT)))
def test_every_reference_exists(document):
    missing = [f"{kind} {reference}" for kind, reference in references(document)
               if not exists(document, kind, reference)]
    assert not missing, f"{document.relative_to(ROOT)} names what does not exist: {missing}"


def test_the_checker_catches_what_the_issue_found(tmp_path):
    stale = tmp_path / "stale.md"
    stale.write_text("driver/collect.py (rollouts), see DESIGN.md and [it](docs/nowhere.md); "
                     "`python -m driver.nothing`, `driver.data.toy_tasks.no_such_function`, driver/config.py")
    kinds = {(kind, ref): exists(stale, kind, ref) for kind, ref in references(stale)}
    assert kinds == {("path", "driver/collect.py"): False, ("file", "DESIGN.md"): False,
                     ("link", "docs/nowhere.md"): False, ("path", "docs/nowhere.md"): False,
                     ("module", "driver.nothing"): False, ("module", "driver.data.toy_tasks.no_such_function"): False,
                     ("path", "driver/config.py"): True}
