"""Names vulture (`make lint`'s dead-code check, [tool.vulture] in pyproject.toml) sees no caller of,
each used from outside the Python it reads. A name belongs here only with its reason; anything
else it reports is dead and goes.
"""
# ruff: noqa: B018 (bare attribute accesses are how vulture whitelists are written)

import benchmarks.async_in_driver
import driver.axolotl.transforms
import driver.data.gsm8k
import driver.data.toy_tasks
import driver.ebft.transforms
import driver.rewards.builtin
import driver.rewards.pool
import pykernels.dispatch_cache
import pykernels.integrations.peft
import pykernels.nn.nf4_linear

# Reward functions and data transforms: named by path in YAML configs (rewards.functions, ebft.transform).
driver.data.gsm8k.gsm8k_correct
driver.data.gsm8k.boxed_format
driver.data.gsm8k.gsm8k_prompt
driver.data.toy_tasks.digit_fraction_steps
benchmarks.async_in_driver.slow_digit_fraction
driver.ebft.transforms.first_turn
driver.ebft.transforms.all_turns
driver.ebft.transforms.last_turn_answer_only
# axolotl's EBFT dataset types: named by path in the configs driver/axolotl/ translates.
driver.axolotl.transforms.ebft_opencode
driver.axolotl.transforms.ebft_strided_structured
driver.axolotl.transforms.ebft_pretrain
# Built-in rewards and their factories: named by rewards.functions[].path in YAML (docs/rewards.md).
driver.rewards.builtin.get_soft_overlong_punishment
driver.rewards.builtin.think_format_reward
driver.rewards.builtin.accuracy_reward
driver.rewards.builtin.reasoning_accuracy_reward
driver.rewards.builtin.get_cosine_scaled_reward
driver.rewards.builtin.get_reasoning_accuracy_reward
driver.rewards.builtin.get_repetition_penalty_reward
# The toy tool-calling task's tool and reward, and the environment's reward: named by path in YAML
# (examples/tiny-tools-grpo.yaml, docs/environments.md).
driver.environments.toy.add
driver.environments.toy.sum_reward
driver.environments.rewards.environment_reward

# vLLM's worker extension, named by a string in the server's command line; its method is called by name
# through /collective_rpc (driver/engine/server_worker.py).
driver.engine.server_worker.ReloadExtension
driver.engine.server_worker.ReloadExtension.reload_weights_rearmed

# Attributes set on library objects, which read them (tokenizers' Tokenizer, transformers' config, PEFT's
# LoraConfig: written into adapter_config.json).
_.pre_tokenizer  # noqa: F821
_.use_cache  # noqa: F821
_.base_model_name_or_path  # noqa: F821

# Public API (README, docs/): users call these; tests do too.
pykernels.dispatch_cache.forget
pykernels.integrations.peft.unpatch
pykernels.nn.nf4_linear.NF4Linear.from_bnb
driver.rewards.pool.RewardPool.pids
# Read by users' reward functions (docs/rewards.md), not by the driver: TRL's trainer_state.global_step.
driver.data.trainer_state.TrainerState.global_step

# Parameters of the ops' fakes (pykernels/ops/*.py) that a fake does not read: they carry the op schema's
# argument names, by which torch passes keyword arguments to a fake.
_.xa  # noqa: F821
_.grad_inner  # noqa: F821
