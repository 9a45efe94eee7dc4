"""`python -m driver.vllm_serve cfg.yaml` as production runs it: started on its own (here: a subprocess on
a free port, with the tiny default config), it prints the URL; a separate `python -m driver.train` run
connects to it with rollout.server_url, trains with the adapters it loads into it (each sync verified by
the probe) and leaves it running and clean; Ctrl-C then stops the server and exits with status 0.
Real vLLM (CPU) on both sides, no stand-ins: ~50 s on 2 cores.
"""

import json
import os
import queue
import re
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest
import requests

from driver.engine.launch import free_port

pytestmark = pytest.mark.slow
ROOT = Path(__file__).resolve().parents[2]
EXAMPLE = ROOT / "examples" / "tiny-grpo.yaml"
QUIET = ["--logging.progress=false", "--logging.log_completions=0", "--logging.plots=false", "--logging.report_to=[]"]
START_TIMEOUT_S = 240
# Ctrl-C: ~1 s on an idle machine (the server's SIGTERM grace is 20 s, then SIGKILL): the bound is for a hung
# stop, not a slow one.
STOP_TIMEOUT_S = 180


def lines_of(process: subprocess.Popen) -> queue.Queue:
    """The process's output, line by line, read by a thread (so that its pipe never fills: a reader that
    died, say on bytes that are not UTF-8, would leave vllm_serve and its server blocked on a full pipe;
    hence errors="replace")."""
    lines: queue.Queue = queue.Queue()

    def read() -> None:
        for line in process.stdout:
            lines.put(line)
        lines.put(None)

    threading.Thread(target=read, daemon=True).start()
    return lines


def wait_for_url(lines: queue.Queue, output: list[str]) -> str:
    deadline = time.monotonic() + START_TIMEOUT_S
    while time.monotonic() < deadline:
        try:
            line = lines.get(timeout=deadline - time.monotonic())
        except queue.Empty:
            break
        if line is None:
            break
        output.append(line)
        found = re.search(r"--rollout\.server_url=(\S+)", line)
        if found:
            return found.group(1)
    pytest.fail("vllm_serve printed no URL:\n" + "".join(output[-40:]))


@pytest.fixture(scope="module")
def served(tmp_path_factory):
    """(URL, the vllm_serve process, its output so far) of one vllm_serve run for the tiny config."""
    port = free_port()
    # Started with SIGINT ignored, as a background job's children are (CI run with nohup ... &): Ctrl-C must
    # still stop it (it did not, before vllm_serve restored the handler: the test hung on its wait).
    process = subprocess.Popen([sys.executable, "-m", "driver.vllm_serve", str(EXAMPLE), "--port", str(port),
                                "--rollout.server_timeout=200"], cwd=ROOT, stdout=subprocess.PIPE,
                               stderr=subprocess.STDOUT, encoding="utf-8", errors="replace",
                               env={**os.environ, "PYTHONUNBUFFERED": "1"},
                               preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_IGN))
    output: list[str] = []
    try:
        lines = lines_of(process)
        url = wait_for_url(lines, output)
        yield url, process, output
    finally:
        if process.poll() is None:  # a failed test: SIGTERM stops the server too (vllm_serve's handler)
            process.terminate()
            try:
                process.wait(STOP_TIMEOUT_S)
            except subprocess.TimeoutExpired:
                process.kill()


def test_a_separate_training_run_uses_the_served_engine_and_ctrl_c_stops_it(served, tmp_path):
    url, process, output = served
    assert url == f"http://127.0.0.1:{url.rsplit(':', 1)[1]}"  # 127.0.0.1 when the config names no server
    models = requests.get(f"{url}/v1/models", timeout=30).json()["data"]
    assert [model["id"] for model in models] == [models[0]["id"]] and "tiny-models/qwen2" in models[0]["id"]

    output_dir = tmp_path / "run"
    result = subprocess.run([sys.executable, "-m", "driver.train", str(EXAMPLE), "--rollout.backend=server",
                             f"--rollout.server_url={url}", "--train.steps=2", f"--logging.output_dir={output_dir}",
                             *QUIET], cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stderr[-3000:]
    rows = [json.loads(line) for line in (output_dir / "metrics.jsonl").read_text().splitlines()]
    assert len(rows) == 2
    # Every sync (the start version and the one after step 1) was served by vLLM and verified in float32.
    assert all(row["sync/probe_verified"] == 1.0 and row["sync/probe_max_abs_diff"] < 1e-4 for row in rows)
    assert not (output_dir / "vllm-server.log").exists()  # connected, not launched
    # The run freed the adapters it loaded; the server keeps serving.
    assert [model["id"] for model in requests.get(f"{url}/v1/models", timeout=30).json()["data"]] == [models[0]["id"]]

    process.send_signal(signal.SIGINT)  # Ctrl-C
    assert process.wait(STOP_TIMEOUT_S) == 0
    with pytest.raises(requests.ConnectionError):
        requests.get(f"{url}/health", timeout=5)
