"""eval.save_best (driver/checkpoint.py BestAdapter): output_dir/best holds the weights the policy had at the
best evaluation so far, by eval.best_metric in either direction, across a resume; evaluations without the
metric or with a NaN never replace it; a best_metric no evaluation has is refused before training."""

import json
import math

import pytest
import torch
from safetensors.torch import load_file

from driver.checkpoint import BestAdapter
from driver.cli import ConfigError, load_config
from driver.config import Config
from driver.policy.model import load_policy
from driver.rollouts.evaluation import check_best_metric


@pytest.fixture(scope="module")
def policy():
    return load_policy(Config.model_validate({"lora": {"r": 2, "targets": ["q_proj"]}}))


def set_lora(policy, value: float) -> None:
    with torch.no_grad():
        for name, parameter in policy.model.named_parameters():
            if ".lora_B" in name:
                parameter.fill_(value)


def saved_lora_b(directory) -> float:
    state = load_file(directory / "adapter_model.safetensors")
    values = {float(tensor.flatten()[0]) for key, tensor in state.items() if ".lora_B" in key}
    assert len(values) == 1
    return values.pop()


@pytest.mark.parametrize("greater, expected_step", [(True, 3), (False, 2)])
def test_the_best_evaluation_keeps_the_weights_of_its_step(policy, tmp_path, greater, expected_step):
    best = BestAdapter(tmp_path, "eval/rewards/f/mean", greater)
    outcomes = []
    for step, value in ((1, 0.5), (2, 0.25), (3, 0.75), (4, math.nan), (5, None)):
        set_lora(policy, float(step))  # the weights at this step: B filled with the step
        metrics = {"eval/reward": 9.0} if value is None else {"eval/rewards/f/mean": value, "eval/reward": 9.0}
        outcomes.append(best.consider(step, metrics, policy))
    assert outcomes == ([True, False, True, False, False] if greater else [True, True, False, False, False])
    assert saved_lora_b(tmp_path / "best") == expected_step
    record = json.loads((tmp_path / "best" / "best.json").read_text())
    assert record == {"step": expected_step, "eval/rewards/f/mean": 0.75 if greater else 0.25}
    assert not (tmp_path / "best.tmp").exists()
    resumed = BestAdapter(tmp_path, "eval/rewards/f/mean", greater)  # a resumed run compares with the saved best
    set_lora(policy, 7.0)
    assert not resumed.consider(7, {"eval/rewards/f/mean": 0.5}, policy)
    assert saved_lora_b(tmp_path / "best") == expected_step


def test_a_best_metric_no_evaluation_has_is_refused_before_training():
    config = Config.model_validate({"eval": {"steps": 2, "val_set_size": 4, "save_best": True,
                                             "best_metric": "rewards/digit_fraction/mean"}})
    check_best_metric(config, ["digit_fraction"])
    with pytest.raises(ConfigError, match=r"eval.best_metric: rewards/nope/mean is none of the evaluations' reward "
                                          r"metrics \(reward, reward_std, rewards/digit_fraction/mean, "):
        check_best_metric(config.model_copy(update={"eval": config.eval.model_copy(
            update={"best_metric": "rewards/nope/mean"})}), ["digit_fraction"])
    with pytest.raises(ConfigError, match="eval.save_best with eval.only: nothing is trained"):
        load_config(None, {"eval.only": "true", "eval.save_best": "true", "eval.val_set_size": "4"})
