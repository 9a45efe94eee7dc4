"""NeMo Gym single-turn verify end to end, against a real resources server: equivalence_rule from the
nemo-gym package, started with its own `ng_run` from the `make nemo-gym` venv by
driver.rewards.nemo_gym_server, scores a GRPO run of the tiny model (`python -m driver.train`, on the
session's vLLM server) on the package's own example rows, loaded as users load them (data.source: the
jsonl, data.transform: driver.rewards.nemo_gym.prompt_from_row).

The server grades by sequence similarity (grading_rule: seq_match), so its rewards are fractions that
no reward in this process computes, and it logs every request: the run's reward statistics must come
with exactly one /verify per completion.
"""

import json
import subprocess
import sys
from pathlib import Path

import pytest

from driver.rewards.nemo_gym_server import DEFAULT_VENV, ResourcesServer, resources_servers_dir

# Checked before any fixture: the session's vLLM server must not start for a test that will skip.
pytestmark = [pytest.mark.slow, pytest.mark.skipif(not (DEFAULT_VENV / "bin" / "ng_run").is_file(),
                                                   reason=f"no NeMo Gym venv at {DEFAULT_VENV}: run `make nemo-gym`")]
ROOT = Path(__file__).resolve().parents[2]
EXAMPLE = ROOT / "examples" / "tiny-grpo.yaml"
QUIET = ["--logging.progress=false", "--logging.log_completions=0", "--logging.plots=false",
         "--logging.report_to=[]"]
STEPS, PROMPTS, GENERATIONS = 2, 4, 4


@pytest.fixture(scope="module")
def resources_server(tmp_path_factory):
    with ResourcesServer("equivalence_rule", {"grading_rule": "seq_match"}, access_log=True,
                         work_dir=tmp_path_factory.mktemp("nemo-gym")) as server:
        yield server


def verify_calls(server: ResourcesServer) -> int:
    return server.log_path.read_text(errors="replace").count('"POST /verify HTTP/1.1" 200')


def test_a_grpo_run_is_scored_by_a_real_nemo_gym_resources_server(tmp_path, resources_server, tiny_vllm_server):
    rows = resources_servers_dir(DEFAULT_VENV) / "equivalence_rule" / "data" / "example.jsonl"
    output_dir = tmp_path / "run"
    before = verify_calls(resources_server)
    command = [sys.executable, "-m", "driver.train", str(EXAMPLE), f"--logging.output_dir={output_dir}", *QUIET,
               "--rollout.backend=server", f"--rollout.server_url={tiny_vllm_server}",
               f"--train.steps={STEPS}", f"--train.prompts_per_step={PROMPTS}", f"--algo.num_generations={GENERATIONS}",
               f"--data.source={rows}", "--data.transform=driver.rewards.nemo_gym.prompt_from_row",
               "--rewards.functions=[{path: driver.rewards.nemo_gym.verify, kwargs: {url: "
               f"{resources_server.url}, max_concurrency: 4}}}}]"]
    result = subprocess.run(command, capture_output=True, text=True, timeout=600, cwd=ROOT)
    assert result.returncode == 0, result.stderr[-3000:]
    metrics = [json.loads(line) for line in (output_dir / "metrics.jsonl").read_text().splitlines()]
    assert len(metrics) == STEPS
    assert verify_calls(resources_server) - before == STEPS * PROMPTS * GENERATIONS, resources_server.log_tail()
    means = [row["rewards/reward_nemo_gym_verify/mean"] for row in metrics]
    assert all(0 < mean < 1 for mean in means), means  # similarities to the expected answers
    assert all(row.get("rewards/failed_groups", 0) == 0 for row in metrics)

