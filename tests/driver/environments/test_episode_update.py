"""The update on episodes: the environment's tokens are context, never trained. A tool episode (scripted
engine, tests/environment_fixtures.py) goes through batch assembly and driver/update/step.py's optimize:
garbage in the environment tokens' sampling logprobs changes nothing, while the same batch with the
environment tokens' mask flipped on trains differently (the check can fail)."""

import copy

import pytest
import torch

from driver.rollouts.batch import batch_from_groups
from driver.update.optim import build_scheduler
from driver.update.step import optimize
from tests.ebft_fixtures import policy_with_random_adapter
from tests.driver.environments.test_episodes import ADD, ADD_ROW, add_script, make_config, produce


@pytest.fixture(scope="module")
def tokenizer():
    from transformers import AutoTokenizer

    from driver.data.tiny_model import resolve_model_path

    return AutoTokenizer.from_pretrained(resolve_model_path("tiny://qwen2"))


def gradients(policy, config, batch) -> list[torch.Tensor]:
    policy = copy.deepcopy(policy)
    optimizer = torch.optim.SGD(policy.trainable_parameters(), lr=0.0)
    optimize(config, policy, batch, optimizer, build_scheduler(optimizer, config.train, 10))
    return [param.grad.clone() for param in policy.trainable_parameters()]


def test_environment_tokens_carry_no_loss_and_no_importance_weight(tmp_path, tokenizer):
    config = make_config(tmp_path, [ADD_ROW], {"name": "tools", "tools": [ADD]},
                         algo={"num_generations": 2, "loss_type": "dapo"})
    (group,), _ = produce(config, tokenizer, add_script)
    group.advantages, group.total = torch.tensor([1.0, -1.0]), torch.tensor([1.0, 0.0])
    batch = batch_from_groups([group])
    (start, end), = group.samples[0].episode.environment_spans
    policy = policy_with_random_adapter(config, std=0.05)
    expected = gradients(policy, config, batch)

    garbage = copy.deepcopy(batch)
    garbage.sampling_logprobs[0, start:end] = torch.linspace(-9.0, 3.0, end - start)
    for ours, theirs in zip(gradients(policy, config, garbage), expected):
        torch.testing.assert_close(ours, theirs, atol=0, rtol=0)

    flipped = copy.deepcopy(batch)
    flipped.mask[0, start:end] = 1.0
    differences = [float((ours - theirs).abs().max()) for ours, theirs in zip(gradients(policy, config, flipped),
                                                                               expected)]
    assert max(differences) > 1e-4
