"""TRL's trainer_state reaches the reward functions (driver/data/trainer_state.py): the optimizer updates done
before the completion's batch is trained (TRL's global_step: train steps x num_iterations x
steps_per_generation), the run's total and the data epoch, stamped when a group finishes, in this process
and through a real reward worker process (which unpickles it without torch)."""

import pytest

from driver.config import Config
from driver.data.prompts import PromptSource
from driver.engine.transformers_backend import TransformersGenerator
from driver.policy.model import load_policy
from driver.rewards.group_scorer import GroupScorer
from driver.rollouts.producer import Producer


@pytest.fixture(scope="module")
def policy():
    return load_policy(Config.model_validate({"lora": {"r": 4}}))


@pytest.mark.parametrize("workers", [0, 1])
def test_rewards_read_the_progress_of_the_step_their_groups_are_trained_in(policy, workers):
    config = Config.model_validate({
        "lora": {"r": 4}, "train": {"steps": 5, "prompts_per_step": 2, "micro_batch_size": 2},
        "algo": {"num_generations": 2, "num_iterations": 2, "steps_per_generation": 2},
        "rollout": {"backend": "transformers", "sampling": {"max_tokens": 4}},
        "rewards": {"functions": [{"path": "tests.reward_fixtures.training_progress"}],
                    "reward_num_workers": workers}})
    prompts = PromptSource(config.data, policy.tokenizer, seed=0)
    producer = Producer(config, TransformersGenerator(config, policy), prompts, policy.tokenizer)
    groups = producer.produce(3, 3).groups  # the batch of the 4th train step: 3 x 2 x 2 updates before it
    scorer = GroupScorer(config)
    try:
        for group in groups:
            scorer.submit_group(group)
        results = scorer.wait([group.group_id for group in groups])
    finally:
        scorer.close()
    epoch = 2 / len(prompts.prompts)  # two of the data's prompts drawn so far
    for group in groups:
        assert (group.trainer_state.global_step, group.trainer_state.max_steps) == (12, 20)
        assert group.trainer_state.epoch == pytest.approx(epoch)
        assert results[group.group_id].table[:, 0].tolist() == pytest.approx([12 + 20 / 1000] * 2)
