"""rollout.weight_sync = merged end to end: `python -m driver.train` against the session's shared vLLM
server, which reloads the merged weights at every sync and gets its own base back when the run ends.

(The colocated merged engine is the tiny default's: auto picks it for a float32 colocated run, so the
demo run of test_driver_e2e.py trains through it.)
"""

import json
import subprocess
import sys
from pathlib import Path

import pytest
import requests
import torch

from driver.data.tiny_model import resolve_model_path

pytestmark = pytest.mark.slow
ROOT = Path(__file__).resolve().parents[2]
QUIET = ["--logging.progress=false", "--logging.log_completions=0", "--logging.plots=false",
         "--logging.report_to=[]"]
STEPS = 4
PROBE = list(range(40, 70))


def prompt_logprobs(url: str, token_ids: list[int]) -> torch.Tensor:
    model = requests.get(f"{url}/v1/models", timeout=30).json()["data"][0]["id"]
    response = requests.post(f"{url}/v1/completions", timeout=120, json={
        "model": model, "prompt": token_ids, "max_tokens": 1, "temperature": 1.0, "prompt_logprobs": 0})
    response.raise_for_status()
    entries = response.json()["choices"][0]["prompt_logprobs"][1:]
    return torch.tensor([entry[str(token)]["logprob"] for entry, token in zip(entries, token_ids[1:])])


def test_a_merged_run_on_a_server_is_verified_and_leaves_the_servers_base(tmp_path, tiny_vllm_server):
    from transformers import AutoModelForCausalLM

    output_dir = tmp_path / "run"
    result = subprocess.run(
        [sys.executable, "-m", "driver.train", str(ROOT / "examples" / "tiny-grpo.yaml"), *QUIET,
         f"--logging.output_dir={output_dir}", f"--train.steps={STEPS}", "--rollout.backend=server",
         f"--rollout.server_url={tiny_vllm_server}", "--rollout.weight_sync=merged"],
        capture_output=True, text=True, timeout=300, cwd=ROOT)
    assert result.returncode == 0, result.stderr[-3000:]
    rows = [json.loads(line) for line in (output_dir / "metrics.jsonl").read_text().splitlines()]
    assert len(rows) == STEPS
    assert max(row["sync/probe_max_abs_diff"] for row in rows) < 1e-4  # float32: every version by value
    gaps = [row["sampling/sampling_logp_difference/max"] for row in rows
            if row.get("sampling/sampling_logp_difference/max") is not None]
    assert gaps and max(gaps) < 1e-3  # the trainer scores what the merged server sampled
    assert [path.name for path in (output_dir / "adapters").iterdir()] == [f"v{STEPS:06d}"]  # one version kept
    # The server serves the base it was started with again (the oracle: transformers on that base).
    base = AutoModelForCausalLM.from_pretrained(resolve_model_path("tiny://qwen2"), dtype=torch.float32)
    with torch.no_grad():
        logits = base(torch.tensor([PROBE])).logits[0, :-1]
    expected = torch.log_softmax(logits, -1).gather(1, torch.tensor(PROBE[1:])[:, None])[:, 0]
    torch.testing.assert_close(prompt_logprobs(tiny_vllm_server, PROBE), expected, atol=1e-4, rtol=0)
