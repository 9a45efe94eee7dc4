"""model.disable_dropout (TRL's disable_dropout): in training mode two forwards of a model with attention dropout
differ, and with it on they are equal (TRL's switch zeroes nn.Dropout layers only and leaves attention dropout,
a float the attention modules read, on); LoRA's dropout is off too; the model's config.json keeps its value."""

import json
import shutil
from pathlib import Path

import pytest
import torch

from driver.config import Config
from driver.data.tiny_model import resolve_model_path
from driver.policy.model import load_policy

TOKENS = torch.tensor([[3, 17, 42, 99, 7, 250, 31, 5, 11, 64]])


@pytest.fixture(scope="module")
def model_with_dropout(tmp_path_factory) -> Path:
    directory = tmp_path_factory.mktemp("models") / "qwen2-dropout"
    shutil.copytree(resolve_model_path("tiny://qwen2"), directory)
    config = json.loads((directory / "config.json").read_text())
    config["attention_dropout"] = 0.5
    (directory / "config.json").write_text(json.dumps(config))
    return directory


@pytest.mark.parametrize("adapter", ["lora", "none"])
def test_training_forwards_are_deterministic_only_with_dropout_disabled(model_with_dropout, adapter):
    def two_training_forwards(disable: bool):
        policy = load_policy(Config.model_validate({
            "model": {"path": str(model_with_dropout), "adapter": adapter, "disable_dropout": disable},
            "lora": {"dropout": 0.3}}))
        policy.model.train()
        with torch.no_grad():
            outputs = [policy.model(input_ids=TOKENS).logits for _ in range(2)]
        return policy, outputs

    _, (first, second) = two_training_forwards(False)
    assert not torch.equal(first, second)  # the oracle: attention dropout is live in training
    policy, (first, second) = two_training_forwards(True)
    assert torch.equal(first, second)
    dropouts = [module.p for module in policy.model.modules() if isinstance(module, torch.nn.Dropout)]
    assert all(p == 0.0 for p in dropouts) and (adapter == "none" or dropouts)  # LoRA's dropout layers too
    assert json.loads((Path(model_with_dropout) / "config.json").read_text())["attention_dropout"] == 0.5
