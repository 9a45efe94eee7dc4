"""algo.kl_in_reward (verl's use_kl_in_reward): the penalty against each completion scored alone by
transformers (unpacked, with and without the adapter), the advantages against verl's form (the
penalty added to the reward before the group normalization), and the loss left without a KL term."""

import pytest
import torch

from driver.cli import ConfigError, load_config
from driver.config import Config
from driver.data.prompts import Prompt
from driver.data.records import Group, Sample
from driver.rewards.advantages import combine_rewards
from driver.rollouts.kl_penalty import set_kl_penalties
from tests.driver.rollouts.test_driver_filtering import make_base_policy
from tests.driver.update.test_driver_update import ADVANTAGES, adapter_grads, make_batch, run_update

BETA = 0.05


@pytest.fixture(scope="module")
def policy():
    return make_base_policy()  # rank-4 adapter with non-zero lora_B: the policy differs from its base


def groups():
    generator = torch.Generator().manual_seed(3)
    made = []
    for index, lengths in enumerate([(3, 5, 1), (4, 2, 6)]):
        samples = [Sample(torch.randint(40, 300, (n,), generator=generator).tolist(), [-1.0] * n, "stop")
                   for n in lengths]
        made.append(Group(index, Prompt(index, f"p{index}", [10 + index, 20, 30]), samples))
    return made


@torch.no_grad()
def alone(policy, prompt, completion, reference):
    ids = torch.tensor([prompt + completion])
    model = policy.model
    model.eval()
    if reference:
        with model.disable_adapter():
            logits = model(input_ids=ids).logits[0]
    else:
        logits = model(input_ids=ids).logits[0]
    logps = logits.float().log_softmax(-1)[len(prompt) - 1:-1]
    return logps.gather(1, torch.tensor(completion)[:, None])[:, 0]


@pytest.mark.parametrize("estimator", ["k1", "k3"])
def test_the_penalty_is_beta_times_each_completions_summed_kl(policy, estimator):
    config = Config.model_validate({"lora": {"r": 4}, "train": {"micro_batch_size": 4},
                                    "algo": {"beta": BETA, "kl_in_reward": True, "kl_estimator": estimator}})
    made = groups()
    set_kl_penalties(config, policy, made)
    for group in made:
        for sample, penalty in zip(group.samples, group.kl_penalty.tolist()):
            gap = alone(policy, group.prompt.token_ids, sample.token_ids, False) - \
                alone(policy, group.prompt.token_ids, sample.token_ids, True)
            kl = gap if estimator == "k1" else (-gap).exp() + gap - 1
            assert penalty == pytest.approx(-BETA * kl.sum().item(), abs=1e-5)
    assert any(abs(p) > 1e-4 for group in made for p in group.kl_penalty.tolist())


def test_advantages_see_the_penalised_reward_and_the_logs_the_functions_reward():
    rewards = torch.tensor([[1.0], [0.0], [0.5], [0.2], [0.9], [0.4]])
    penalty = torch.tensor([-0.1, -0.02, -0.3, 0.0, -0.05, -0.2])
    total, advantages, stats = combine_rewards(rewards, torch.ones(1), 3, "sum_then_normalize", "group",
                                               penalty=penalty)
    _, expected, _ = combine_rewards(torch.cat([rewards, penalty[:, None]], dim=1), torch.ones(2), 3,
                                     "sum_then_normalize", "group")
    torch.testing.assert_close(advantages, expected)
    torch.testing.assert_close(total, rewards[:, 0])
    assert stats["rewards/kl_penalty/mean"] == pytest.approx(penalty.mean().item())


def test_the_loss_has_no_kl_term_when_it_moved_into_the_reward(policy):
    batch = make_batch(policy, ADVANTAGES)
    in_reward = run_update(policy, batch, algo={"beta": 0.1, "kl_in_reward": True})
    without = run_update(policy, batch, algo={"beta": 0.0})
    grads_a, grads_b = adapter_grads(in_reward[0]), adapter_grads(without[0])
    for name in grads_b:
        torch.testing.assert_close(grads_a[name], grads_b[name], rtol=0, atol=0)
    assert "kl" not in in_reward[1]


@pytest.mark.parametrize("overrides,message", [
    ({"algo.kl_in_reward": "true"}, "kl_in_reward moves beta from the loss to the reward: set beta > 0"),
    ({"algo.kl_in_reward": "true", "algo.beta": "0.1", "rewards.aggregation": "normalize_then_sum"},
     "algo.kl_in_reward needs rewards.aggregation = sum_then_normalize"),
    ({"algo.kl_in_reward": "true", "algo.beta": "0.1", "algo.name": "ebft"}, "kl_in_reward applies to grpo"),
])
def test_kl_in_reward_mistakes_are_config_errors(overrides, message):
    with pytest.raises(ConfigError, match=message):
        load_config(None, overrides)
