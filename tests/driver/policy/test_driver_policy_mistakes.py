"""Mistakes in the policy's settings, named by key before they cost a run: LoRA targets the model has nothing
for (PEFT fails with a traceback only when none matches, and ignores the rest), and a checkpoint resumed under
other LoRA settings (a rank fails deep in PEFT; alpha and rslora would load and silently change the update)."""

import pytest

from driver.cli import ConfigError
from driver.config import Config
from driver.policy.model import load_policy


def policy(**sections):
    return load_policy(Config.model_validate(sections))


@pytest.mark.parametrize("model, lora, message", [
    ("tiny://qwen2", {"targets": ["q_proj", "qproj"]},
     r"lora.targets: qproj matches nothing in tiny://qwen2 \(its linear modules: down_proj, gate_proj, k_proj, "),
    ("tiny://qwen2", {"targets": ["a", "b"]}, r"lora.targets: a, b match nothing"),
    ("tiny://qwen2", {"expert_targets": ["mlp.experts.gate_up_proj"]}, r"tiny://qwen2 \(it has no MoE experts\)"),
    ("tiny://qwen3-moe", {"targets": ["q_proj"], "expert_targets": ["mlp.experts.gate_up"]},
     r"lora.expert_targets: mlp.experts.gate_up matches nothing in tiny://qwen3-moe \(its expert parameters: "
     r"mlp.experts.down_proj, mlp.experts.gate_up_proj\)"),
])
def test_lora_targets_the_model_lacks_are_named(model, lora, message):
    with pytest.raises(ConfigError, match=message):
        policy(model={"path": model}, lora=lora)


def test_the_default_targets_take_the_projections_an_moe_model_has():
    """gate_proj, up_proj and down_proj are fused into the experts of a transformers 5 MoE: the defaults (and
    axolotl's lora_target_linear) adapt what exists, as PEFT does."""
    adapted = policy(model={"path": "tiny://qwen3-moe"}).model.peft_config["default"].target_modules
    assert {"q_proj", "k_proj", "v_proj", "o_proj"} <= set(adapted) and "gate_proj" not in adapted


@pytest.mark.parametrize("changed, message", [
    ({"r": 16}, "lora.r = 8, this run has lora.r = 16"),
    ({"alpha": 8.0}, "lora.alpha = 16.0, this run has lora.alpha = 8.0"),
    ({"rslora": True}, "lora.rslora = False, this run has lora.rslora = True"),
])
def test_a_checkpoint_resumed_under_other_lora_settings_is_named(tmp_path, changed, message):
    policy().save_trained(tmp_path / "adapter")
    with pytest.raises(ValueError, match=f"adapter was trained with {message}: resume with the settings"):
        policy(lora=changed).load_trained(tmp_path / "adapter")
    policy().load_trained(tmp_path / "adapter")  # the same settings load
