"""Reward models (rewards.functions[].model): a tiny random Qwen2 sequence classifier built here. The
batched, right-padded scores must equal each text scored alone (the oracle: one unpadded forward per
completion, first logit), for text prompts (prompt + completion) and conversations (the reward model's
chat template over the messages + the assistant's completion), beside a Python reward function."""

import pytest
import torch

from driver.cli import ConfigError, load_config
from driver.config import RewardFunction, RewardsConfig
from driver.data.tiny_model import resolve_model_path
from driver.rewards.functions import RewardFunctions

PROMPTS = ["Write digits: apple", "Write digits: river stone green"]
COMPLETIONS = [" 12 34", " seven", "", " 9" * 7, " house"]


@pytest.fixture(scope="module")
def reward_model_dir(tmp_path_factory):
    from transformers import AutoConfig, AutoModelForSequenceClassification, AutoTokenizer

    source = resolve_model_path("tiny://qwen2")
    config = AutoConfig.from_pretrained(source, num_labels=1)
    torch.manual_seed(0)
    model = AutoModelForSequenceClassification.from_config(config)
    directory = tmp_path_factory.mktemp("reward-model")
    model.save_pretrained(directory)
    AutoTokenizer.from_pretrained(source).save_pretrained(directory)
    return str(directory)


def alone(model_dir: str, texts: list[str]) -> list[float]:
    from transformers import AutoModelForSequenceClassification, AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    model = AutoModelForSequenceClassification.from_pretrained(model_dir).eval()
    with torch.no_grad():
        return [model(input_ids=torch.tensor([tokenizer(text, add_special_tokens=False).input_ids])).logits[0, 0].item()
                for text in texts]


def score(model_dir, prompts, completions, batch_size=2):
    config = RewardsConfig(functions=[RewardFunction(model=model_dir, batch_size=batch_size),
                                      RewardFunction(path="driver.data.toy_tasks.digit_fraction")])
    rewards = RewardFunctions(config, device="cpu")
    table = rewards(prompts, completions, [{}] * len(completions), [[1]] * len(completions))
    return rewards.names, table


def test_text_prompts_are_scored_as_prompt_plus_completion(reward_model_dir):
    prompts = [PROMPTS[i % 2] for i in range(len(COMPLETIONS))]
    names, table = score(reward_model_dir, prompts, COMPLETIONS)
    expected = alone(reward_model_dir, [p + c for p, c in zip(prompts, COMPLETIONS)])
    torch.testing.assert_close(table[:, 0], torch.tensor(expected), atol=1e-5, rtol=1e-5)
    assert names[0] == reward_model_dir.rstrip("/").split("/")[-1] and len(set(table[:, 0].tolist())) > 1
    assert table[0, 1] == 1.0  # the Python function beside it


def test_conversations_are_rendered_with_the_reward_models_chat_template(reward_model_dir):
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(reward_model_dir)
    conversation = [{"role": "system", "content": "Digits only."}, {"role": "user", "content": PROMPTS[0]}]
    completions = [[{"role": "assistant", "content": text}] for text in COMPLETIONS[:3]]
    _, table = score(reward_model_dir, [conversation] * 3, completions, batch_size=3)
    texts = [tokenizer.apply_chat_template(conversation + c, tokenize=False) for c in completions]
    assert texts[0].endswith("<|im_start|>assistant\n 12 34<|im_end|>\n")
    torch.testing.assert_close(table[:, 0], torch.tensor(alone(reward_model_dir, texts)), atol=1e-5, rtol=1e-5)


def test_reward_model_mistakes_are_config_errors(reward_model_dir):
    with pytest.raises(ConfigError, match="give exactly one of path .* and model"):
        load_config(None, {"rewards.functions": f"[{{path: driver.data.toy_tasks.digit_fraction, model: "
                                                f"{reward_model_dir}}}]"})
    with pytest.raises(ConfigError, match="score on the trainer's device, in its process: set reward_num_workers"):
        load_config(None, {"rewards.functions": f"[{{model: {reward_model_dir}}}]", "rewards.reward_num_workers": "2"})
    with pytest.raises(ConfigError, match="/no/such/model is neither a local model directory nor a Hub model id"):
        load_config(None, {"rewards.functions": "[{model: /no/such/model}]"})
    assert load_config(None, {"rewards.functions": f"[{{model: {reward_model_dir}, weight: 0.5}}]"})
