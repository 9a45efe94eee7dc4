"""The Makefile's uv installs get pip's package sources (.ci/uv_options.py): without them uv would
resolve from PyPI alone on a machine whose pip is pointed at local wheels or capped by constraints.
And both installs (torch and the build tools, then the rest) follow one resolution."""

import importlib.util
import shlex
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
spec = importlib.util.spec_from_file_location("uv_options", ROOT / ".ci" / "uv_options.py")
uv_options_module = importlib.util.module_from_spec(spec)
spec.loader.exec_module(uv_options_module)
uv_options = uv_options_module.uv_options


def test_every_scope_s_sources_are_passed_once_each_and_the_environment_s_index_wins():
    lines = [
        "global.cert='/etc/ssl/certs/ca.crt'",
        "global.constraint='/etc/xdg/pip/constraints.txt'",
        "global.extra-index-url='file:///opt/a/simple file:///opt/b/simple'",
        "global.find-links='/opt/wheels'",
        "global.index-url='https://mirror.example/simple'",
        ":env:.find-links='/opt/wheels /srv/more wheels'",
        ":env:.index-url='https://env.example/simple'",
        "install.no-index='false'",
    ]
    assert uv_options(lines) == [
        "--find-links", "/opt/wheels", "--find-links", "/srv/more", "--find-links", "wheels",
        "--extra-index-url", "file:///opt/a/simple", "--extra-index-url", "file:///opt/b/simple",
        "--constraint", "/etc/xdg/pip/constraints.txt",
        "--index-url", "https://env.example/simple",
    ]


def test_no_index_is_passed_when_set_and_nothing_without_configuration():
    assert uv_options([":env:.no-index='1'", "global.find-links='/w'"]) == ["--find-links", "/w", "--no-index"]
    assert uv_options([]) == []
    assert uv_options(["not a setting", "global.timeout='60'"]) == []


def test_the_script_prints_options_uv_parses_for_this_machine_s_pip():
    """The script against this machine's real `pip config list` (whatever it holds): a line shlex can
    split into --flag value pairs, each flag one uv knows."""
    result = subprocess.run([sys.executable, str(ROOT / ".ci" / "uv_options.py")], capture_output=True,
                            text=True, timeout=60, check=True)
    words = shlex.split(result.stdout)
    flags = [w for w in words if w.startswith("--")]
    assert set(flags) <= {"--find-links", "--extra-index-url", "--constraint", "--index-url", "--no-index"}, words


def test_both_installs_take_one_resolution_as_constraints(tmp_path):
    """make test compiles (cuda-check imports torch) while the second install runs: that install must not
    move a package the first put in (it once replaced numpy under cmake's `import torch`). Both take the
    pins one `uv pip compile` of everything wrote, the tools' and the rest's requirements together."""
    venv = tmp_path / "venv"
    result = subprocess.run(["make", "-n", f"VENV={venv}", f"{venv}/.installed"], cwd=ROOT, capture_output=True,
                            text=True, timeout=60, check=True)
    commands = result.stdout.replace("\\\n", " ").splitlines()
    pins, tools, rest = venv / "pins.txt", venv / "tools.txt", venv / "requirements.txt"
    [compile_line] = [c for c in commands if "uv pip compile" in c]
    assert f"-o {pins}" in compile_line and f"{rest} {tools}" in compile_line
    installs = [c for c in commands if "uv pip install" in c]
    assert [f"-r {tools}" in c for c in installs] == [True, False]
    assert [f"-r {rest}" in c for c in installs] == [False, True]
    assert all(f"--constraint {pins}" in c for c in installs)
    assert commands.index(compile_line) < commands.index(installs[0])
