"""The docs' examples work as written: every ```python block of README.md and docs/ runs (CPU, in a fresh
namespace and a scratch directory), and every ```yaml block is a valid config of ours (its keys and values;
the files and functions it names are the reader's own). Examples that rot are worse than none."""

import json
import re
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from driver.config import Config

ROOT = Path(__file__).resolve().parents[1]
DOCUMENTS = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
# Blocks that are not ours to run, by their first line: why.
NOT_OURS = {"GRPOConfig(": "TRL's own code (docs/coming-from-trl.md): the config it becomes follows it"}

# Imports torch, transformers and peft once, then runs each example in a fork of itself: a few seconds in
# all instead of an interpreter's start-up per example, and no example sees another's state (kernel modes).
RUNNER = r"""
import json, os, sys, traceback
import torch, transformers, peft  # noqa: F401
failed = []
for name, code in json.loads(sys.stdin.read()):
    sys.stdout.flush()
    pid = os.fork()
    if pid == 0:
        status = 0
        try:
            exec(compile(code, name, "exec"), {"__name__": "__main__"})
        except BaseException:
            traceback.print_exc()
            status = 1
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(status)
    if os.waitpid(pid, 0)[1] != 0:
        failed.append(name)
print("failed: " + ", ".join(failed) if failed else "every example ran")
sys.exit(1 if failed else 0)
"""


def code_blocks(language: str) -> list[tuple[str, str]]:
    """(name, code) of every ```language block of the docs, named document#index."""
    blocks = []
    for document in DOCUMENTS:
        found = re.findall(rf"```{language}\n(.*?)```", document.read_text(), re.S)
        blocks += [(f"{document.relative_to(ROOT)}#{index}", code) for index, code in enumerate(found)]
    return blocks


def ours(code: str) -> bool:
    return not any(code.startswith(first_line) for first_line in NOT_OURS)


def test_every_python_example_runs(tmp_path):
    examples = [(name, code) for name, code in code_blocks("python") if ours(code)]
    assert len(examples) >= 9  # README's five and the docs' (a broken pattern would find none)
    result = subprocess.run([sys.executable, "-c", RUNNER], input=json.dumps(examples), capture_output=True, text=True,
                            cwd=tmp_path, timeout=900)
    assert result.returncode == 0, result.stdout[-2000:] + result.stderr[-6000:]


@pytest.mark.parametrize("text", [pytest.param(code, id=name) for name, code in code_blocks("yaml")])
def test_every_config_example_is_a_valid_config(text):
    Config.model_validate(yaml.safe_load(text))
