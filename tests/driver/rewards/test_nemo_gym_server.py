"""driver.rewards.nemo_gym_server's set-up, on a stand-in venv laid out as `make nemo-gym` leaves one
(bin/ng_run, the package's resources_servers/<name>/{app.py, configs/}): what it hands ng_run and how
it fails. Starting the real server is tests/e2e/test_nemo_gym_e2e.py's job.
"""

from __future__ import annotations

import yaml

import pytest

from driver.rewards.nemo_gym_server import NemoGymSetupError, ResourcesServer

PACKAGE_CONFIG = {  # as resources_servers/equivalence_rule/configs/lc.yaml: the server, and an agent using it
    "lc_equivalence_rule": {"resources_servers": {"equivalence_rule": {
        "entrypoint": "app.py", "grading_rule": "exact", "domain": "knowledge"}}},
    "lc_equivalence_rule_simple_agent": {"responses_api_agents": {"simple_agent": {
        "entrypoint": "app.py", "resources_server": {"type": "resources_servers", "name": "lc_equivalence_rule"}}}},
}


@pytest.fixture
def venv(tmp_path):
    venv = tmp_path / "venv"
    server = venv / "lib" / "python3.12" / "site-packages" / "resources_servers" / "equivalence_rule"
    (server / "configs").mkdir(parents=True)
    (server / "app.py").touch()
    (server / "configs" / "lc.yaml").write_text(yaml.safe_dump(PACKAGE_CONFIG))
    (venv / "bin").mkdir()
    (venv / "bin" / "ng_run").write_text("#!/bin/sh\necho 'ng_run: cannot start (stand-in)'\nexit 3\n")
    (venv / "bin" / "ng_run").chmod(0o755)
    return venv


def test_the_config_holds_the_packages_settings_the_options_and_a_local_port(venv, tmp_path):
    server = ResourcesServer("equivalence_rule", {"grading_rule": "seq_match"}, venv=venv, work_dir=tmp_path / "w")
    assert server.block == {"entrypoint": "app.py", "domain": "knowledge", "grading_rule": "seq_match",
                            "host": "127.0.0.1", "port": server.block["port"]}
    assert server.url == f"http://127.0.0.1:{server.block['port']}"


def test_ng_run_exiting_is_reported_with_its_log(venv, tmp_path):
    server = ResourcesServer("equivalence_rule", venv=venv, work_dir=tmp_path / "w", startup_timeout=30)
    with pytest.raises(NemoGymSetupError, match=r"(?s)ng_run exited \(3\).*cannot start \(stand-in\).*whole log"):
        server.start()
    config = yaml.safe_load((tmp_path / "w" / "equivalence_rule.yaml").read_text())
    assert list(config) == ["equivalence_rule"]  # the server alone: no agent, no model server
    linked = tmp_path / "w" / "venvs" / "resources_servers" / "equivalence_rule" / ".venv"
    assert linked.resolve() == venv.resolve()  # ng_run's per-server venv is ours: it installs nothing


def test_a_missing_venv_or_server_says_what_to_do(venv, tmp_path):
    with pytest.raises(NemoGymSetupError, match="no NeMo Gym venv at .*: run `make nemo-gym`"):
        ResourcesServer("equivalence_rule", venv=tmp_path / "nowhere")
    with pytest.raises(NemoGymSetupError, match="no resources server 'mcqa' in .*; there are: equivalence_rule"):
        ResourcesServer("mcqa", venv=venv)
