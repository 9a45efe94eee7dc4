"""A clone run after `pip install .` (README's first command) loads the _C that pip built from it,
and never one installed from somewhere else."""

import json
import shutil
import subprocess
import sys
import sysconfig
from pathlib import Path

import pytest

from pykernels.source_tree import installed_extension_dir

ROOT = Path(__file__).resolve().parents[2]
BUILT = sorted((ROOT / "pykernels").glob("_C*.so"))


def fake_install(site: Path, source_root: Path | None, extension: bool = True, url: str | None = None,
                 dir_info: bool = True) -> Path:
    """site-packages as `pip install <source_root>` leaves it: pykernels/ and its dist-info."""
    package = site / "pykernels"
    package.mkdir(parents=True)
    if extension:
        (package / "_C.cpython-311-x86_64-linux-gnu.so").write_bytes(b"")
        (package / "_C.so").write_bytes(b"")
    info = site / "pykernels-0.1.0.dist-info"
    info.mkdir()
    (info / "METADATA").write_text("Metadata-Version: 2.1\nName: pykernels\nVersion: 0.1.0\n")
    if source_root is not None or url is not None:
        record = {"url": url or source_root.resolve().as_uri()}
        if dir_info:
            record["dir_info"] = {}
        (info / "direct_url.json").write_text(json.dumps(record))
    return package


def source_package(root: Path, extension: bool = False) -> Path:
    package = root / "pykernels"
    package.mkdir(parents=True)
    (package / "__init__.py").write_text("")
    if extension:
        (package / "_C.so").write_bytes(b"")
    return package


def test_installed_from_this_tree_is_used(tmp_path):
    tree = source_package(tmp_path / "clone")
    installed = fake_install(tmp_path / "site", tmp_path / "clone")
    assert installed_extension_dir(tree, [str(tmp_path / "site")]) == installed.resolve()


@pytest.mark.parametrize("case", ["other tree", "from an index", "from a wheel file", "no _C installed",
                                  "tree has its own _C", "bad record"])
def test_anything_else_is_not(tmp_path, case):
    tree = source_package(tmp_path / "clone", extension=case == "tree has its own _C")
    site = tmp_path / "site"
    if case == "other tree":
        (tmp_path / "elsewhere").mkdir()
        fake_install(site, tmp_path / "elsewhere")
    elif case == "from an index":
        fake_install(site, None)
    elif case == "from a wheel file":
        fake_install(site, None, url=(tmp_path / "clone").resolve().as_uri(), dir_info=False)
    elif case == "no _C installed":
        fake_install(site, tmp_path / "clone", extension=False)
    elif case == "bad record":
        fake_install(site, None, url="{not json")
        (site / "pykernels-0.1.0.dist-info" / "direct_url.json").write_text("{not json")
    else:
        fake_install(site, tmp_path / "clone")
    assert installed_extension_dir(tree, [str(site)]) is None


@pytest.mark.skipif(not BUILT, reason="needs the built extension (make build)")
def test_a_clone_without_a_build_imports_the_installed_extension(tmp_path):
    """The real thing: python run inside a copy of the tree that has no _C, with a site directory
    holding the built _C as `pip install .` from that copy would have left it."""
    clone = tmp_path / "clone"
    shutil.copytree(ROOT / "pykernels", clone / "pykernels",
                    ignore=shutil.ignore_patterns("_C*.so", "__pycache__"))
    site = tmp_path / "site"
    installed = fake_install(site, clone, extension=False)
    shutil.copy(BUILT[0], installed / BUILT[0].name)
    # -S: no .pth files, so the development install's editable finder cannot supply this tree's _C.
    env = {"PYTHONPATH": f"{site}:{sysconfig.get_paths()['purelib']}", "PATH": ""}
    probe = ("import pykernels, torch; from pykernels import nf4; "
             "print(pykernels.__file__); print(pykernels._C.__file__); print(pykernels.build_info()['families'])")
    run = subprocess.run([sys.executable, "-S", "-c", probe], cwd=clone, env=env, capture_output=True, text=True,
                         timeout=120)
    assert run.returncode == 0, run.stderr
    module_file, extension_file, families = run.stdout.splitlines()
    assert Path(module_file).parent == clone / "pykernels"
    assert Path(extension_file).parent == installed
    assert "nf4" in families

    (installed.parent / "pykernels-0.1.0.dist-info" / "direct_url.json").write_text(
        json.dumps({"url": (tmp_path / "another").as_uri(), "dir_info": {}}))
    run = subprocess.run([sys.executable, "-S", "-c", probe], cwd=clone, env=env, capture_output=True, text=True,
                         timeout=120)
    assert run.returncode != 0 and "pykernels._C is missing" in run.stderr
