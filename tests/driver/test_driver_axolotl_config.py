"""axolotl configs translated into ours (driver/axolotl/): axolotl's own example configs
(tests/driver/axolotl_configs/, copied from the reference documents) translate to valid configs with
the values axolotl would run, every key that cannot be honoured is named in one message, and the
command line recognizes, prints and refuses as docs/axolotl-differences.md says."""

import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from driver.axolotl import (BUILTIN_DATASET_TYPES, UntranslatableConfig, is_axolotl_config, translate,
                            translation_yaml)
from driver.axolotl import transforms as axolotl_transforms
from driver.cli import ConfigError, config_from_argv, import_dotted, load_config
from driver.config import Config

EXAMPLES = Path(__file__).parent / "axolotl_configs"
REPOSITORY = Path(__file__).resolve().parents[2]
SEVEN_PROJECTIONS = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]


def example(name: str) -> dict:
    return yaml.safe_load((EXAMPLES / name).read_text())


def translated(data: dict) -> Config:
    return Config.model_validate(translate(data).config)


def refused(data: dict) -> dict[str, str]:
    with pytest.raises(UntranslatableConfig) as error:
        translate(data)
    return error.value.refused


# Example -> what the translation must say about the keys that matter (the rest is Config's defaults).
EXPECTED = {
    "grpo-quickstart.yaml": {  # mbs 2 x ga 4 = 8 completions = 1 prompt x 8 per optimizer step, as TRL
        "model.path": "Qwen/Qwen2.5-1.5B-Instruct", "model.dtype": "bfloat16", "model.attention": "flash_attention_2",
        "model.gradient_checkpointing": True, "lora.r": 32, "lora.alpha": 64.0, "lora.targets": SEVEN_PROJECTIONS,
        "data.source": "openai/gsm8k", "data.name": "main", "data.split": "train",
        "data.transform": "rewards.prompt_transform", "data.max_prompt_length": 2048 - 512,
        "rewards.functions": [("rewards.accuracy_reward", 1.0), ("rewards.format_reward", 0.5)],
        "rollout.backend": "server", "rollout.server_url": "http://0.0.0.0:8000", "rollout.server_timeout": 300.0,
        "rollout.max_model_len": 2048, "rollout.sampling.max_tokens": 512, "rollout.sampling.temperature": 0.7,
        "algo.name": "grpo", "algo.num_generations": 8, "algo.importance_sampling.level": "token",
        "algo.importance_sampling.mode": "truncate", "algo.importance_sampling.cap": 3.0,
        "train.prompts_per_step": 1, "train.micro_batch_size": 2, "train.gradient_accumulation_steps": 1,
        "train.steps": 200, "train.lr": 5e-6, "train.optim": "adamw_torch_fused", "train.schedule": "cosine",
        "train.warmup_steps": 10, "train.seed": 42, "logging.output_dir": "./grpo-output", "logging.report_to": []},
    "grpo-quickstart-flash-attention.yaml": {"model.attention": "flash_attention_2", "train.steps": 200},
    "ebft-quickstart.yaml": {  # use_data_producer: axolotl's async trainer, token_truncate at 3
        "algo.name": "ebft", "ebft.mode": "structured", "ebft.feature_layers": [0.25, 0.5, 0.75],
        "ebft.embed_method": "last_token", "ebft.gt_length_multiplier": 1.5, "ebft.advantage_estimator": "group_norm",
        "data.transform": "driver.axolotl.transforms.ebft_opencode", "data.split": "train[:500]",
        "rollout.backend": "server", "rollout.vllm_sync_interval": 3, "rollout.async_prefetch": False,
        "rollout.max_model_len": 1024, "rollout.sampling.max_tokens": 256, "algo.loss_type": "grpo",
        "algo.num_generations": 4, "algo.importance_sampling.mode": "truncate", "train.prompts_per_step": 2,
        "train.micro_batch_size": 2, "train.steps": 20, "train.warmup_steps": 0},
    "llama-1b-ebft-strided.yaml": {  # strided: documents x samples per micro-batch, ebft:'s own sampling
        "ebft.mode": "strided", "ebft.ground_truth_field": None, "ebft.whitening": True, "ebft.stride": 8,
        "ebft.context_length": 8, "ebft.generate_max_len": 8, "ebft.max_document_length": 256,
        "ebft.advantage_estimator": "rloo", "data.transform": "driver.axolotl.transforms.ebft_pretrain",
        "data.max_prompt_length": 256, "algo.num_generations": 4, "rollout.sampling.temperature": 0.6,
        "train.prompts_per_step": 2, "train.micro_batch_size": 4, "train.steps": 5, "train.lr": 1e-6,
        "train.warmup_steps": 2, "lora.dropout": 0.05, "logging.report_to": ["wandb"], "logging.project": "ebft",
        "checkpoint.every": 100},
    "llama-1b-ebft-strided-structured.yaml": {"train.epochs": 1.0},  # num_epochs: steps counted from the data
    "llama-3b-ebft-strided-fft.yaml": {
        "model.dtype": "bfloat16", "model.device": "auto", "lora.r": 32, "train.prompts_per_step": 4,
        "train.micro_batch_size": 4, "train.weight_decay": 0.01, "logging.run_name": "llama3b-strided-lora-100steps",
        "checkpoint.every": 50},
    "llama-8b-ebft-strided-fft.yaml": {  # no adapter key: every weight trains, the features from a frozen copy
        "model.adapter": "none", "model.dtype": "bfloat16", "algo.name": "ebft", "ebft.mode": "strided",
        "train.lr": 1e-6, "train.weight_decay": 0.01, "model.gradient_checkpointing": True},
}


def value(config: Config, dotted: str):
    node = config
    for part in dotted.split("."):
        node = getattr(node, part)
    return node


@pytest.mark.parametrize("name", sorted(EXPECTED))
def test_axolotl_examples_translate_to_valid_configs(name):
    config = translated(example(name))
    for key, expected in EXPECTED[name].items():
        got = value(config, key)
        if key == "rewards.functions":
            got = [(function.path, function.weight) for function in got]
        assert got == expected, key


# Examples that use what is not here: exactly these keys are refused, and with the change the messages
# ask for (or, for the docs' fragments, the keys a whole config has) each translates.
REFUSED_EXAMPLES = {
    "llama-1b-ebft-opencode.yaml": ({"chat_template"}, {"chat_template": None}),
    "llama-1b-ebft-opencode-novllm.yaml": ({"chat_template"}, {"chat_template": None}),
    "qwen35-4b-ebft-structured.yaml": ({"lora_target_modules"}, {"lora_target_modules": SEVEN_PROJECTIONS}),
    "qwen35-4b-ebft-structured-async.yaml": ({"lora_target_modules"}, {"lora_target_modules": SEVEN_PROJECTIONS}),
    "qwen35-9b-ebft-structured.yaml": ({"lora_target_modules"}, {"lora_target_modules": SEVEN_PROJECTIONS}),
    "ebft-strided-docs.yaml": ({"learning_rate", "max_steps"}, {"learning_rate": 1e-6, "max_steps": 10}),
    "rlhf-ebft-structured.yaml": ({"learning_rate", "max_steps", "micro_batch_size"},
                                  {"learning_rate": 1e-6, "max_steps": 10, "micro_batch_size": 4}),
    "rlhf-ebft-strided.yaml": ({"learning_rate", "max_steps"}, {"learning_rate": 1e-6, "max_steps": 10}),
    "vllm-serving-minimal-server.yaml": (
        {"datasets", "trl.reward_funcs", "trl.max_completion_length", "micro_batch_size", "learning_rate",
         "max_steps"},
        {"datasets": [{"path": "openai/gsm8k", "name": "main"}], "learning_rate": 1e-6, "max_steps": 10,
         "micro_batch_size": 8, "trl": {"use_vllm": True, "vllm_server_host": "0.0.0.0", "vllm_server_port": 8000,
                                        "vllm_server_timeout": 300, "reward_funcs": ["rewards.accuracy"],
                                        "max_completion_length": 256}}),
}
# NeMo Gym's configs need its plugin, its reward functions and axolotl's chat_template dataset type.
NEMO_GYM = ["nemo-gym-async-agent.yaml", "nemo-gym-single-turn.yaml", "rlhf-nemo-gym-multi-turn.yaml",
            "rlhf-nemo-gym-single-turn.yaml"]


@pytest.mark.parametrize("name", sorted(REFUSED_EXAMPLES))
def test_axolotl_examples_using_what_is_not_here_are_refused_by_key(name):
    keys, change = REFUSED_EXAMPLES[name]
    data = example(name)
    assert set(refused(data)) == keys
    translated({**data, **change})


@pytest.mark.parametrize("name", NEMO_GYM)
def test_nemo_gym_configs_are_refused(name):
    reasons = refused(example(name))
    assert reasons["plugins"] == "axolotl plugins do not run here"
    assert "axolotl's prompt strategies" in reasons["datasets[0].type"]
    assert {key for key in reasons if key.startswith("nemo_gym")}


def test_every_example_in_the_reference_documents_is_covered():
    assert {path.name for path in EXAMPLES.glob("*.yaml")} == {*EXPECTED, *REFUSED_EXAMPLES, *NEMO_GYM}


def quickstart(**changes) -> dict:
    """The GRPO quick start with top-level keys replaced (None deletes one) and trl: keys merged."""
    data = example("grpo-quickstart.yaml")
    data["trl"] = {**data["trl"], **changes.pop("trl", {})}
    data.update(changes)
    return {key: value for key, value in data.items() if value is not None}


def test_one_message_names_every_key_it_cannot_honour():
    data = quickstart(deepspeed="zero3.json", tf32=True, max_steps=None, warmup_ratio=0.1,
                      colour="blue", trl={"sync_ref_model": True, "rollout_func": "x.y", "typo_key": 1})
    with pytest.raises(UntranslatableConfig) as error:
        translate(data)
    message = str(error.value)
    for key in ("deepspeed", "tf32", "max_steps", "colour", "trl.sync_ref_model", "trl.rollout_func",
                "trl.typo_key"):
        assert f"\n  {key}: " in message, key
    assert "missing (nor num_epochs)" in error.value.refused["max_steps"]


@pytest.mark.parametrize("ratio", [None, 0.1])
def test_num_epochs_without_max_steps_counts_steps_once_the_data_is_read(ratio):
    translation = translate(quickstart(num_epochs=3, max_steps=None, warmup_steps=None, warmup_ratio=ratio))
    config = Config.model_validate(translation.config)
    assert config.train.epochs == 3 and "steps" not in translation.config["train"]
    assert config.train.warmup_ratio == (0.03 if ratio is None else ratio) and config.train.warmup_steps == 0


@pytest.mark.parametrize("changes,expected", [
    # TRL: a generated batch of generation_batch_size completions is split into optimizer steps of mbs x ga.
    ({"trl": {"generation_batch_size": 32}}, {"train.prompts_per_step": 4, "algo.steps_per_generation": 4,
                                              "train.steps": 50}),
    ({"trl": {"num_iterations": 2}}, {"algo.num_iterations": 2, "train.steps": 100}),
    ({"trl": {"top_k": 0, "min_p": 0.05, "generation_kwargs": {"stop_token_ids": [7]}}},
     {"rollout.sampling.top_k": -1, "rollout.sampling.min_p": 0.05,
      "rollout.sampling.generation_kwargs": {"stop_token_ids": [7]}}),
    ({"trl": {"vllm_guided_decoding_regex": "[0-9]+", "chat_template_kwargs": {"enable_thinking": False}}},
     {"rollout.sampling.structured_outputs": {"regex": "[0-9]+"},
      "data.chat_template_kwargs": {"enable_thinking": False}}),
    # Importance sampling: axolotl's async trainer (use_data_producer) token_truncate, TRL 1.8 sequence_mask.
    ({"trl": {"use_data_producer": False}}, {"algo.importance_sampling.level": "sequence_product",
                                             "algo.importance_sampling.mode": "mask"}),
    ({"trl": {"vllm_importance_sampling_mode": "sequence_truncate", "vllm_importance_sampling_cap": 5.0}},
     {"algo.importance_sampling.level": "sequence_product", "algo.importance_sampling.cap": 5.0}),
    ({"trl": {"vllm_importance_sampling_correction": False}}, {"algo.importance_sampling.level": "none"}),
    # axolotl's async trainer floors the ratios at 1 / cap (seed 004's async_trainer.py); TRL 1.6+'s names.
    ({"trl": {"async_prefetch": True, "vllm_importance_sampling_cap": 4.0}},
     {"algo.importance_sampling.cap": 4.0, "algo.importance_sampling.cap_min": 0.25}),
    ({"trl": {"async_prefetch": True, "vllm_importance_sampling_mode": "token_mask"}},
     {"algo.importance_sampling.mode": "mask", "algo.importance_sampling.cap_min": 1 / 3}),
    ({"trl": {"use_data_producer": False, "vllm_importance_sampling_clip_max": 5.0,
              "vllm_importance_sampling_clip_min": 0.5}},
     {"algo.importance_sampling.cap": 5.0, "algo.importance_sampling.cap_min": 0.5}),
    # A KL term: axolotl's skip_zero_advantage_batches (default true) is our skip; without one, our filter is
    # the same update.
    ({"trl": {"beta": 0.04}}, {"algo.beta": 0.04, "algo.zero_advantage": "skip"}),
    ({"trl": {"beta": 0.04, "skip_zero_advantage_batches": False}}, {"algo.zero_advantage": "keep"}),
    ({"trl": {"scale_rewards": False, "loss_type": "dr_grpo"}}, {"algo.scale_rewards": "none",
                                                                "algo.loss_type": "dr_grpo"}),
    ({"trl": {"reward_num_workers": 1}}, {"rewards.reward_num_workers": 0}),  # axolotl's 1 is in-process
    ({"trl": {"reroll_start_fraction": 0.25, "reroll_max_groups": 2}},
     {"algo.reroll_failed": True, "algo.reroll_start_fraction": 0.25, "algo.reroll_max_groups": 2,
      "algo.reroll_after": 0.0}),
    ({"trl": {"async_prefetch": True, "prefetch_depth": 2, "replay_buffer_size": 64, "reward_num_workers": 4}},
     {"rollout.async_prefetch": True, "rollout.prefetch_depth": 2, "algo.replay_buffer_size": 64,
      "rewards.reward_num_workers": 4}),
    ({"trl": {"vllm_mode": "colocate"}}, {"rollout.backend": "colocate", "rollout.gpu_memory_utilization": 0.85}),
    # The vllm: section's engine options configure the colocated engine and driver.vllm_serve alike.
    ({"trl": {"vllm_mode": "colocate", "vllm_enable_sleep_mode": True}, "vllm": {"tensor_parallel_size": 2}},
     {"rollout.enable_sleep_mode": True, "rollout.tensor_parallel_size": 2, "rollout.gpu_memory_utilization": 0.9}),
    ({"vllm": {"host": "0.0.0.0", "port": 8000, "tensor_parallel_size": 2, "data_parallel_size": 4,
               "enforce_eager": True, "enable_prefix_caching": False, "dtype": "float16"}},
     {"rollout.server_url": "http://0.0.0.0:8000", "rollout.tensor_parallel_size": 2,
      "rollout.data_parallel_size": 4, "rollout.enforce_eager": True, "rollout.enable_prefix_caching": False,
      "rollout.dtype": "float16", "model.dtype": "bfloat16", "rollout.gpu_memory_utilization": 0.9}),
    ({"vllm": {"dtype": "bfloat16"}}, {"rollout.dtype": None}),  # the trainer's: nothing to say
    ({"trl": {"use_vllm": False, "async_prefetch": None}}, {"rollout.backend": "transformers"}),
    ({"trl": {"reward_funcs": ["OpenAssistant/reward-model-deberta-v3-large-v2", "rewards.format_reward"],
              "reward_weights": [1.0, 0.3], "multi_objective_aggregation": "normalize_then_sum"}},
     {"rewards.aggregation": "normalize_then_sum"}),
    ({"rl": "gdpo"}, {"algo.name": "grpo", "rewards.aggregation": "normalize_then_sum"}),
    # Precision: axolotl's bf16 default is auto; fp16 without bf16; neither is float32.
    ({"bf16": None}, {"model.dtype": "bfloat16"}),
    ({"bf16": False, "fp16": True}, {"model.dtype": "float16"}),
    ({"bf16": False}, {"model.dtype": "float32"}),
    # Warm-up: warmup_ratio x max_steps; absent, 3% of max_steps (at most 100); 1 becomes 2; none with constant.
    ({"warmup_steps": None, "warmup_ratio": 0.1}, {"train.warmup_steps": 20}),
    ({"warmup_steps": None}, {"train.warmup_steps": 6}),
    ({"warmup_steps": 1}, {"train.warmup_steps": 2}),
    ({"lr_scheduler": "constant"}, {"train.schedule": "constant", "train.warmup_steps": 0}),
    ({"lr_scheduler": "constant_with_warmup"}, {"train.schedule": "constant", "train.warmup_steps": 10}),
    ({"optimizer": "adamw_bnb_8bit", "weight_decay": 0.1, "max_grad_norm": 0.5, "seed": 3},
     {"train.optim": "adamw_8bit", "train.weight_decay": 0.1, "train.max_grad_norm": 0.5, "train.seed": 3}),
    ({"adam_beta1": 0.8, "adam_beta2": 0.95, "adam_epsilon": 1e-6, "cosine_min_lr_ratio": 0.1},
     {"train.adam_beta1": 0.8, "train.adam_beta2": 0.95, "train.adam_epsilon": 1e-6, "train.schedule": "cosine",
      "train.min_lr_rate": 0.1}),
    ({"adapter": None, "lora_r": None, "lora_alpha": None, "lora_target_linear": None}, {"model.adapter": "none"}),
    ({"adapter": "qlora", "load_in_4bit": True}, {"model.qlora": True}),
    ({"lora_alpha": None, "lora_target_linear": None, "lora_target_modules": ["q_proj", "v_proj"],
      "peft_use_rslora": True, "lora_target_parameters": ["mlp.experts.gate_up_proj"]},
     {"lora.alpha": 8.0, "lora.targets": ["q_proj", "v_proj"], "lora.rslora": True,
      "lora.expert_targets": ["mlp.experts.gate_up_proj"]}),
    ({"use_tensorboard": True, "wandb_project": "p", "wandb_name": "n", "save_steps": 25, "save_total_limit": 3},
     {"logging.report_to": ["tensorboard", "wandb"], "logging.project": "p", "logging.run_name": "n",
      "checkpoint.every": 25, "checkpoint.keep": 3}),
    ({"hub_model_id": "me/grpo-adapter", "hub_strategy": "every_save", "hub_private_repo": True},
     {"checkpoint.push_to_hub": True, "checkpoint.hub_model_id": "me/grpo-adapter",
      "checkpoint.hub_strategy": "every_save", "checkpoint.hub_private_repo": True}),
    ({"hub_strategy": "end"}, {"checkpoint.push_to_hub": False, "checkpoint.hub_strategy": "end"}),
    ({"hub_model_id": "me/x", "hub_strategy": "checkpoint"}, {"checkpoint.hub_strategy": "checkpoint"}),
    ({"auto_resume_from_checkpoints": True}, {"checkpoint.resume": "auto"}),
    ({"auto_resume_from_checkpoints": False}, {"checkpoint.resume": None}),
    ({"attn_implementation": "sdpa"}, {"model.attention": "sdpa"}),
    ({"adapter": None, "lora_r": None, "lora_alpha": None, "lora_target_linear": None,
      "trl": {"beta": 0.04, "sync_ref_model": True, "ref_model_sync_steps": 64}},
     {"algo.sync_ref_model": True, "algo.ref_model_sync_steps": 64, "algo.ref_model_mixup_alpha": 0.6}),
    ({"trl": {"ref_model_sync_steps": 64, "top_entropy_quantile": 0.2, "use_adaptive_entropy": True,
              "entropy_target": 0.3}},
     {"algo.sync_ref_model": False, "algo.top_entropy_quantile": 0.2, "algo.use_adaptive_entropy": True,
      "algo.entropy_target": 0.3}),
    ({"device_map": {"": 1}}, {"model.device": "cuda:1"}),
    ({"base_model": "Qwen/Qwen2.5-0.5B-Instruct", "revision_of_model": "v2"},  # a Hub id, fetched when it runs
     {"model.path": "Qwen/Qwen2.5-0.5B-Instruct", "model.revision": "v2"}),
])
def test_keys_map_as_axolotl_runs_them(changes, expected):
    config = translated(quickstart(**changes))
    for key, wanted in expected.items():
        got = value(config, key)
        assert (got.model_dump() if hasattr(got, "model_dump") else got) == wanted, key
    if "reward_weights" in changes.get("trl", {}):
        model, function = config.rewards.functions
        assert (model.model, model.weight, function.path) == ("OpenAssistant/reward-model-deberta-v3-large-v2", 1.0,
                                                             "rewards.format_reward")


@pytest.mark.parametrize("changes,key,reason", [
    ({"rl": "dpo"}, "rl", "this driver trains grpo (gdpo) and ebft"),
    ({"rl": None}, "rl", "supervised fine-tuning"),
    ({"trl": {"num_generations": 3}}, "micro_batch_size", "not a multiple of trl.num_generations = 3"),
    ({"trl": {"num_generations": 4, "generation_batch_size": 12}}, "trl.generation_batch_size",
     "not a whole number of optimizer steps"),
    ({"trl": {"num_iterations": 3}}, "max_steps", "not a whole number of generated batches of 3"),
    ({"trl": {"replay_recompute_logps": False}}, "trl.replay_recompute_logps", "always recomputed"),
    ({"trl": {"vllm_importance_sampling_mode": "sequence_clip"}}, "trl.vllm_importance_sampling_mode", "token_mask"),
    ({"trl": {"reward_weights": [1.0]}}, "trl.reward_weights", "one weight per reward function (2)"),
    ({"datasets": [{"path": "a/b"}, {"path": "c/d"}]}, "datasets", "2 datasets: one here"),
    ({"datasets": [{"path": "rows.jsonl", "split": "train[:10]"}]}, "datasets[0].split", "read whole"),
    ({"datasets": [{"path": "a/b", "type": "alpaca"}]}, "datasets[0].type", "axolotl's prompt strategies"),
    ({"datasets": [{"path": "a/b", "type": "rewards.t", "data_files": "x.json"}]}, "datasets[0].data_files",
     "not translated"),
    ({"lora_target_modules": ".*proj", "lora_target_linear": None}, "lora_target_modules", "regular expression"),
    ({"lora_target_linear": None}, "lora_target_modules", "PEFT's per-architecture default"),
    ({"load_in_8bit": True}, "load_in_8bit", "8-bit bases are not here"),
    ({"optimizer": "lion_8bit"}, "optimizer", "adamw_torch_fused"),
    ({"lr_scheduler": "one_cycle"}, "lr_scheduler", "cosine"),
    ({"lr_scheduler": "linear", "cosine_min_lr_ratio": 0.1}, "cosine_min_lr_ratio", "only with lr_scheduler cosine"),
    ({"torch_dtype": "float16"}, "torch_dtype", "disagrees with bf16 / fp16 (bfloat16)"),
    ({"attn_implementation": "flex_attention"}, "attn_implementation", "model.attention takes"),
    ({"special_tokens": {"pad_token": "<pad>", "eos_token": "<|im_end|>"}}, "special_tokens.eos_token",
     "pad_token only"),
    ({"val_set_size": 0.05}, "val_set_size", "add eval_steps"),
    ({"val_set_size": 0.05, "evals_per_epoch": 4}, "evals_per_epoch", "give eval_steps"),
    ({"val_set_size": 0.05, "eval_steps": 30, "trl": {"num_iterations": 4}, "max_steps": 200}, "eval_steps",
     "not a whole number of train steps here, each 4 optimizer step(s)"),
    ({"vllm": {"max_model_len": 512}}, "vllm.max_model_len", "leaves no room for a prompt"),
    ({"trl": {"vllm_mode": "colocate"}, "vllm": {"data_parallel_size": 2}}, "vllm.data_parallel_size",
     "one in-process engine"),
    ({"trl": {"vllm_mode": "colocate", "vllm_enable_sleep_mode": True, "async_prefetch": True}},
     "trl.vllm_enable_sleep_mode", "never idle to sleep"),
    ({"vllm": {"dtype": "int4"}}, "vllm.dtype", "auto, bfloat16"),
    ({"resume_from_checkpoint": "./grpo-output/checkpoint-100"}, "resume_from_checkpoint", "--checkpoint.resume"),
    ({"plugins": ["axolotl.integrations.liger.LigerPlugin"]}, "plugins", "do not run here"),
])
def test_what_cannot_be_honoured_is_refused_with_its_reason(changes, key, reason):
    reasons = refused(quickstart(**changes))
    assert reason in reasons[key], reasons


@pytest.mark.parametrize("eval_steps", [20, 0.1])  # optimizer steps, or transformers' fraction of max_steps
def test_a_validation_split_is_held_out_and_evaluated_every_eval_steps(eval_steps):
    config = translated(quickstart(val_set_size=0.05, eval_steps=eval_steps))
    assert config.eval.val_set_size == 0.05 and config.eval.source is None
    assert config.eval.steps == 20 and config.train.steps == 200  # one optimizer step per train step here
    four_updates = translated(quickstart(val_set_size=32, eval_steps=40, max_steps=200, trl={"num_iterations": 4}))
    assert four_updates.eval.steps == 10 and four_updates.eval.val_set_size == 32


def test_lora_model_dir_starts_from_that_adapter_with_its_own_settings():
    translation = translate(quickstart(lora_model_dir="./outputs/sft/adapter", lora_dropout=0.05))
    config = Config.model_validate(translation.config)
    assert config.lora.init_from == "./outputs/sft/adapter"
    assert not {"r", "dropout", "targets"} & translation.config["lora"].keys()  # the adapter's, as axolotl's
    assert any(note.startswith("lora_r, lora_alpha, lora_dropout, lora_target_linear: the adapter's own settings")
               for note in translation.notes)
    assert "needs adapter: lora or qlora" in refused(quickstart(lora_model_dir="x", adapter=None))["lora_model_dir"]


def test_the_importance_corrected_kl_carries_over():
    from driver.update.loss_terms import loss_options

    config = translated(quickstart(trl={"beta": 0.04, "use_bias_correction_kl": True}))
    assert config.algo.beta == 0.04 and loss_options(config.algo).bias_correction_kl  # what the loss reads


def test_eval_steps_without_a_validation_split_is_noted_and_ignored():
    translation = translate(quickstart(eval_steps=20))
    assert not Config.model_validate(translation.config).eval.enabled
    assert any("ignored without val_set_size" in note for note in translation.notes)


def test_keys_that_change_nothing_here_are_accepted():
    config = translated(quickstart(strict=False, debug=True, torch_compile=True, logging_steps=10, tf32=False,
                                   dataset_prepared_path="last_run_prepared", num_epochs=3,
                                   gradient_checkpointing_kwargs={"use_reentrant": False},
                                   trl={"use_liger_loss": True, "log_completions": True,
                                        "streaming_partial_batch": True, "num_completions_to_print": 4}))
    assert config.train.steps == 200 and config.logging.log_completions == 4  # max_steps wins over num_epochs


def test_ebft_keys_map_and_the_other_modes_are_ignored():
    structured = example("ebft-quickstart.yaml")
    # axolotl's structured trainer reads neither the strided keys nor ce_coef
    structured["ebft"] |= {"adaptive_max_tokens": False, "use_whitening": True, "advantage_estimator": "group_norm",
                           "stride": 4, "ce_coef": 0.03}
    translation = translate(structured)
    config = Config.model_validate(translation.config)
    assert config.ebft.gt_length_multiplier is None and config.ebft.whitening
    assert config.ebft.advantage_estimator == "group_norm" and config.ebft.stride == 8 and config.ebft.ce_coef == 0
    assert any("ebft.stride, ebft.ce_coef: ignored" in note for note in translation.notes)
    strided = example("llama-1b-ebft-strided.yaml")
    strided["ebft"] |= {"n_samples_per_prompt": 2, "adaptive_max_tokens": False, "ce_coef": 0.03}
    strided["trl"] = {"beta": 0.1}  # ignored by axolotl's strided trainer, and here
    translation = translate(strided)
    config = Config.model_validate(translation.config)
    assert config.algo.num_generations == 2 and config.train.micro_batch_size == 2 and config.ebft.ce_coef == 0.03
    assert config.algo.beta == 0 and config.ebft.gt_length_multiplier == 1.5
    assert {"trl.beta: ignored, ebft mode strided samples in the trainer (axolotl ignores trl: there too)",
            "ebft.adaptive_max_tokens: ignored, ebft mode strided does not use them (nor does axolotl)"} <= set(
        translation.notes)


@pytest.mark.parametrize("kind", sorted(BUILTIN_DATASET_TYPES))
def test_axolotls_ebft_dataset_types_become_our_transforms_or_are_refused(kind):
    base = "llama-1b-ebft-strided.yaml" if "pretrain" in kind or "strided" in kind else "ebft-quickstart.yaml"
    data = {**example(base), "datasets": [{"path": "nvidia/OpenCodeInstruct", "type": kind}]}
    transform, why_not = BUILTIN_DATASET_TYPES[kind]
    if why_not is not None:
        assert why_not in refused(data)["datasets[0].type"]
        return
    assert translated(data).data.transform == transform
    import_dotted(transform, "data.transform")


def test_axolotl_transforms_give_what_axolotls_give():
    row = {"input": "Write fib.", "output": "def fib(n): ...", "id": 7, "domain": "code"}
    assert axolotl_transforms.ebft_opencode(row) == {"prompt": [{"role": "user", "content": "Write fib."}],
                                                    "ground_truth": "def fib(n): ..."}
    assert axolotl_transforms.ebft_strided_structured(row) == {"prompt": "Write fib.",
                                                               "ground_truth": "def fib(n): ..."}
    assert axolotl_transforms.ebft_strided_structured({"question": "q", "answer": "a"}) == {"prompt": "q",
                                                                                          "ground_truth": "a"}
    assert axolotl_transforms.ebft_pretrain({"text": "def f(): pass", "answer": "x"}) == {"prompt": "def f(): pass"}
    with pytest.raises(ValueError, match="needs 'input' and 'output' columns; columns are \\['question'\\]"):
        axolotl_transforms.ebft_opencode({"question": "q"})


def ebft_docs_transform(cfg, **kwargs):
    """axolotl's EBFT docs, "Custom Transforms" (seed 004): "__all__" removes every original column."""
    def transform_fn(example, tokenizer=None):
        return {"prompt": [{"role": "user", "content": example["question"]}], "ground_truth": example["answer"]}
    return transform_fn, {"remove_columns": "__all__"}


def one_column_transform(cfg):
    return (lambda example, tokenizer=None: {"prompt": example["question"], "answer": example["answer"].strip()},
            {"remove_columns": "question"})


def test_translations_kept_from_before_the_move_still_load():
    """The dataset types moved from driver/data/axolotl_transforms.py to driver/axolotl/transforms.py."""
    with pytest.warns(FutureWarning, match="is now driver.axolotl.transforms.ebft_opencode"):
        assert import_dotted("driver.data.axolotl_transforms.ebft_opencode", "data.transform") is \
            axolotl_transforms.ebft_opencode


def test_axolotl_transforms_remove_columns_as_datasets_map_does():
    from driver.data.prompts import apply_transform

    rows = [{"question": "2+2?", "answer": " 4", "id": 1}]
    assert apply_transform(rows, f"{__name__}.ebft_docs_transform") == [
        {"prompt": [{"role": "user", "content": "2+2?"}], "ground_truth": " 4"}]
    assert apply_transform(rows, f"{__name__}.one_column_transform") == [{"answer": "4", "id": 1, "prompt": "2+2?"}]


def test_the_server_command_says_how_to_start_vllm():
    notes = "\n".join(translate(example("grpo-quickstart.yaml")).notes)
    assert "python -m driver.vllm_serve <this file>" in notes and "on 0.0.0.0:8000" in notes
    full = "\n".join(translate(quickstart(adapter=None, lora_r=None, lora_alpha=None, lora_target_linear=None)).notes)
    assert "VLLM_SERVER_DEV_MODE=1" in full and "VLLM_SERVER_DEV_MODE=1" not in notes
    ignored = translate(quickstart(trl={"vllm_enable_sleep_mode": True})).notes
    assert any("trl.vllm_enable_sleep_mode: ignored with rollout.backend server" in note for note in ignored)


@pytest.mark.parametrize("path", sorted(REPOSITORY.glob("examples/*.yaml")), ids=lambda path: path.name)
def test_our_configs_are_never_taken_for_axolotls(path):
    assert not is_axolotl_config(yaml.safe_load(path.read_text()))


def test_detection():
    assert is_axolotl_config({"base_model": "m", "rl": "grpo"}) and is_axolotl_config({"rl": "ebft", "ebft": {}})
    assert not is_axolotl_config({"ebft": {"mode": "strided"}})  # our section alone
    assert not is_axolotl_config({"base_model": "m", "model": {"path": "m"}})  # mixed: ours, refused as such
    assert not is_axolotl_config({})


def local_axolotl_config(tmp_path: Path, trl: dict | None = None, **changes) -> Path:
    """A GRPO axolotl config this machine can load: a tiny model built locally and a toy dataset."""
    data = {"base_model": "tiny://qwen2", "rl": "grpo", "adapter": "lora", "lora_r": 8, "lora_alpha": 16,
            "lora_target_linear": True, "datasets": [{"path": "toy:digits"}], "micro_batch_size": 8,
            "gradient_accumulation_steps": 2, "max_steps": 3, "learning_rate": 1e-3, "bf16": False,
            "output_dir": str(tmp_path / "out"),
            "trl": {"use_vllm": True, "vllm_mode": "colocate", "num_generations": 4, "max_completion_length": 8,
                    "reward_funcs": ["driver.data.toy_tasks.digit_fraction"], **(trl or {})}, **changes}
    path = tmp_path / "axolotl.yml"
    path.write_text(yaml.safe_dump(data))
    return path


def test_cli_translates_prints_and_validates(tmp_path, capsys):
    path = local_axolotl_config(tmp_path)
    config = config_from_argv([str(path), "--train.steps=2"])  # our keys override the translation
    printed = capsys.readouterr().out
    assert printed.startswith(f"# {path}, an axolotl config, translated by `python -m driver.train`")
    assert config.model.path == "tiny://qwen2" and config.train.prompts_per_step == 4 and config.train.steps == 2
    assert config.rollout.backend == "colocate" and config.rollout.gpu_memory_utilization == 0.9
    kept = tmp_path / "ours.yaml"  # what the user keeps runs as it is, as our config
    kept.write_text(printed)
    assert load_config(kept, {"train.steps": "2"}) == config


def test_cli_from_axolotl_forces_the_translation(tmp_path, capsys):
    path = local_axolotl_config(tmp_path)
    assert config_from_argv([str(path), "--from", "axolotl"]).algo.num_generations == 4
    with pytest.raises(ConfigError, match="model: not translated"):
        config_from_argv([str(REPOSITORY / "examples/tiny-grpo.yaml"), "--from=axolotl"])
    with pytest.raises(ConfigError, match="--from takes axolotl, got 'trl'"):
        config_from_argv([str(path), "--from", "trl"])


def test_mixing_axolotl_keys_into_ours_is_named(tmp_path):
    path = tmp_path / "mixed.yaml"
    path.write_text("model: {path: tiny://qwen2}\nbase_model: Qwen/Qwen2.5-0.5B\n")
    with pytest.raises(ConfigError, match="base_model: axolotl's keys; a whole axolotl config"):
        load_config(path, {})


def test_cli_refusal_is_one_message_exit_2_without_traceback(tmp_path):
    """The real process: the message names every refused key, nothing is printed on stdout, no traceback."""
    path = local_axolotl_config(tmp_path, deepspeed="zero3.json", trl={"sync_ref_model": True})
    result = subprocess.run([sys.executable, "-m", "driver.train", str(path)], capture_output=True, text=True,
                            cwd=REPOSITORY, timeout=120)
    assert result.returncode == 2 and "Traceback" not in result.stderr and result.stdout == ""
    assert result.stderr.startswith(f"error: {path}: this axolotl config cannot be translated")
    assert "\n  deepspeed: DeepSpeed is not here" in result.stderr
    assert "\n  trl.sync_ref_model: with an adapter the KL reference is the base with the adapter off" in result.stderr


def test_translation_yaml_reloads_as_the_same_config():
    translation = translate(example("llama-1b-ebft-strided.yaml"))
    text = translation_yaml(translation, "llama-1b-ebft-strided.yaml")
    assert Config.model_validate(yaml.safe_load(text)) == Config.model_validate(translation.config)
