"""Let a source checkout use the extension that `pip install .` built from it.

`pip install ".[cpu]"` compiles pykernels/_C into site-packages, and the README then runs
`python -m driver.train ...` from the clone. Python puts the working directory first on sys.path,
so `pykernels` is this source tree, which holds no _C (only `make build` or `pip install -e .` put
one here). When the installed distribution was installed from this very directory (pip records the
directory in direct_url.json), its package directory is appended to `pykernels.__path__`: `_C` is
found there while every Python module still comes from the tree. An install from anywhere else is
never used, since its kernels need not match these sources.
"""

from __future__ import annotations

import importlib.machinery
import importlib.metadata
import json
from pathlib import Path
from urllib.parse import unquote, urlparse


def has_extension(package_dir: Path) -> bool:
    """Whether a compiled `_C` module sits in this package directory."""
    return any((package_dir / f"_C{suffix}").is_file() for suffix in importlib.machinery.EXTENSION_SUFFIXES)


def installed_from(distribution: importlib.metadata.Distribution) -> Path | None:
    """The local directory pip installed this distribution from, or None (an index, a wheel file)."""
    text = distribution.read_text("direct_url.json")
    try:
        record = json.loads(text) if text else {}
    except ValueError:
        return None
    url = urlparse(str(record.get("url", ""))) if isinstance(record, dict) else None
    if url is None or url.scheme != "file" or "dir_info" not in record:
        return None
    return Path(unquote(url.path)).resolve()


def installed_extension_dir(source_package: Path, search_path: list[str]) -> Path | None:
    """The installed pykernels package directory whose `_C` this source tree should load, or None
    (the tree has its own build, or nothing on the path was installed from this tree)."""
    if has_extension(source_package):
        return None
    source_root = source_package.resolve().parent
    for distribution in importlib.metadata.distributions(name="pykernels", path=search_path):
        if installed_from(distribution) != source_root:
            continue
        package = Path(distribution.locate_file("pykernels")).resolve()
        if package != source_package.resolve() and has_extension(package):
            return package
    return None
