"""The start-up hook that applies pykernels/startup_guard.py in every interpreter of an environment.

`pykernels-startup.pth` is one line in site-packages; Python runs .pth lines that start with
"import" at start-up. setup.py puts it in the wheel; editable installs do not install .pth files,
so `python -m pykernels.startup_hook --install` writes it (the Makefile does).
`python -m pykernels.startup_hook` prints what the guard hides in this environment and why.
"""

from __future__ import annotations

import os
import sys

from pykernels.startup_guard import COMPANIONS, DISABLE_VARIABLE, installed_versions, unloadable_companions

PTH_NAME = "pykernels-startup.pth"
# Loads startup_guard.py by path: importing the pykernels package at start-up would fix which
# pykernels every later import gets, shadowing a source checkout for the whole session.
PTH_LINE = ('import importlib.util as _u; _s = _u.find_spec("pykernels"); '
            '_g = _s and _s.submodule_search_locations and _u.spec_from_file_location('
            '"_pykernels_startup_guard", _s.submodule_search_locations[0] + "/startup_guard.py"); '
            '_g and _g.loader.exec_module(_u.module_from_spec(_g))\n')


def install_pth(site_dir: str) -> str:
    path = os.path.join(site_dir, PTH_NAME)
    with open(path, "w") as file:
        file.write(PTH_LINE)
    return path


def main(argv: list[str]) -> int:
    if argv == ["--install"]:
        import sysconfig

        print(f"wrote {install_pth(sysconfig.get_path('purelib'))}")
        return 0
    if argv:
        print("usage: python -m pykernels.startup_hook [--install]", file=sys.stderr)
        return 2
    hidden = unloadable_companions(installed_versions(("torch", *COMPANIONS), sys.path))
    for why in hidden.values():
        print(f"hidden: {why}")
    if not hidden:
        print("nothing hidden: torch is not a +cpu build, or its companions match it")
    elif os.environ.get(DISABLE_VARIABLE, "") not in ("", "0"):
        print(f"(not applied: {DISABLE_VARIABLE} is set)")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
