"""What the driver refuses rather than silently differ from TRL / the model: models whose logits are not
hidden @ lm_head.weight^T (the fused logprobs op applies no bias, soft-cap or scale), and the renamed
importance-sampling level ('sequence' is TRL's GSPO name for another method)."""

import shutil

import pytest
import torch
from pydantic import ValidationError

from driver.cli import ConfigError, config_from_argv
from driver.config import Config
from driver.data.tiny_model import resolve_model_path
from driver.policy.model import check_output_head, load_policy

TINY = dict(vocab_size=384, hidden_size=32, intermediate_size=64, num_hidden_layers=1, num_attention_heads=2,
            num_key_value_heads=1)


def tiny_model(config_name: str, model_name: str, **overrides):
    import transformers

    config = getattr(transformers, config_name)(**(TINY | overrides))
    torch.manual_seed(0)
    return getattr(transformers, model_name)(config)


REFUSED = [
    ("Gemma2Config", "Gemma2ForCausalLM", dict(head_dim=16), "final_logit_softcapping = 30.0"),
    ("CohereConfig", "CohereForCausalLM", dict(), "logit_scale = 0.0625"),
    ("GraniteConfig", "GraniteForCausalLM", dict(logits_scaling=8.0), "logits_scaling = 8.0"),
    ("PhiConfig", "PhiForCausalLM", dict(), "a bias on the output head"),
]
ACCEPTED = [
    ("Qwen2Config", "Qwen2ForCausalLM", dict()),
    ("Gemma2Config", "Gemma2ForCausalLM", dict(head_dim=16, final_logit_softcapping=None)),
    ("GraniteConfig", "GraniteForCausalLM", dict(logits_scaling=1.0)),
]


@pytest.mark.parametrize("config_name,model_name,overrides,named", REFUSED, ids=[case[1] for case in REFUSED])
def test_models_whose_logits_the_fused_op_would_miss_are_refused(config_name, model_name, overrides, named):
    model = tiny_model(config_name, model_name, **overrides)
    with pytest.raises(ConfigError, match=f"model.path = some/model: {named}"):
        check_output_head(model, "some/model")


@pytest.mark.parametrize("config_name,model_name,overrides", ACCEPTED, ids=[case[1] for case in ACCEPTED])
def test_plain_output_heads_are_accepted(config_name, model_name, overrides):
    check_output_head(tiny_model(config_name, model_name, **overrides), "some/model")


def test_a_bias_added_to_a_plain_head_is_refused():
    model = tiny_model("Qwen2Config", "Qwen2ForCausalLM")
    model.lm_head = torch.nn.Linear(TINY["hidden_size"], TINY["vocab_size"], bias=True)
    with pytest.raises(ConfigError, match=r"bias on the output head \(Linear with bias of shape \(384,\)\)"):
        check_output_head(model, "some/model")


def test_load_policy_refuses_a_soft_capped_model(tmp_path):
    """The check runs where the driver loads the policy: a Gemma 2 checkpoint fails before any training."""
    tiny_model("Gemma2Config", "Gemma2ForCausalLM", head_dim=16).save_pretrained(tmp_path)
    tokenizer_dir = resolve_model_path("tiny://qwen2")
    for name in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copy(f"{tokenizer_dir}/{name}", tmp_path / name)
    with pytest.raises(ConfigError, match="final_logit_softcapping = 30.0.*not supported"):
        load_policy(Config.model_validate({"model": {"path": str(tmp_path)}, "lora": {"r": 4}}))


def test_sequence_level_was_renamed_and_says_so(tmp_path):
    with pytest.raises(ValidationError, match="'sequence' is now called 'sequence_product'"):
        Config.model_validate({"algo": {"importance_sampling": {"level": "sequence"}}})
    with pytest.raises(ConfigError, match="algo.importance_sampling.level.*sequence_product"):
        config_from_argv(["--algo.importance_sampling.level=sequence"])
    config = Config.model_validate({"algo": {"importance_sampling": {"level": "sequence_product"}}})
    assert config.algo.importance_sampling.level == "sequence_product"
