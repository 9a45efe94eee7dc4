"""The key tables of the axolotl translation: which keys make a file axolotl's, the defaults axolotl
(or the TRL it pins) applies where ours differ, value renames, and the keys accepted without effect or
refused with a known reason (driver/axolotl/translator.py and the *_keys.py modules read them)."""

from __future__ import annotations

# Top-level keys of axolotl's that none of our configs has: one of them, and none of OUR_SECTIONS,
# makes a file an axolotl config.
AXOLOTL_MARKERS = frozenset({"base_model", "rl", "trl", "datasets", "vllm", "adapter", "lora_r", "micro_batch_size",
                             "gradient_accumulation_steps", "learning_rate", "sequence_len", "max_steps"})
NESTED_SECTIONS = ("trl", "vllm", "ebft", "special_tokens", "gradient_checkpointing_kwargs")

# Defaults axolotl (or the TRL and transformers it pins) applies to a key left out, where ours differs.
AXOLOTL_DEFAULTS = dict(seed=42, output_dir="./model-out", lr_scheduler="cosine", sequence_len=512, lora_alpha=8,
                        max_completion_length=256, vllm_gpu_memory_utilization=0.9, vllm_host="0.0.0.0",
                        vllm_port=8000, importance_sampling_cap=3.0, strided_samples=4, strided_temperature=0.6)
# TRL's importance-sampling modes -> (algo.importance_sampling.level, .mode).
IMPORTANCE_SAMPLING_MODES = {"token_truncate": ("token", "truncate"), "token_mask": ("token", "mask"),
                             "sequence_truncate": ("sequence_product", "truncate"),
                             "sequence_mask": ("sequence_product", "mask")}
OPTIMIZERS = {"adamw_torch": "adamw_torch", "adamw_torch_fused": "adamw_torch_fused", "adamw_bnb_8bit": "adamw_8bit",
              "adamw_8bit": "adamw_8bit", "paged_adamw_8bit": "paged_adamw_8bit"}
SCHEDULES = {"cosine": "cosine", "linear": "linear", "constant_with_warmup": "constant", "constant": "constant"}
ATTENTION = {"flash_attention_2": "flash_attention_2", "sdpa": "sdpa", "eager": "eager"}
DTYPES = {"bfloat16": "bfloat16", "bf16": "bfloat16", "float16": "float16", "fp16": "float16", "half": "float16",
          "float32": "float32", "fp32": "float32", "float": "float32"}
# ebft: keys one mode reads and the other ignores (axolotl's EBFTStrategy).
EBFT_STRIDED_ONLY = ("stride", "context_length", "generate_max_len", "n_samples_per_prompt", "temperature", "top_p",
                     "rl_coef", "min_completion_prefix", "ce_coef")
EBFT_STRUCTURED_ONLY = ("adaptive_max_tokens", "gt_length_multiplier")
# Reasons for refusing keys axolotl configs often carry.
KNOWN_REFUSALS = {
    "deepspeed": "DeepSpeed is not here: one process, or torchrun + FSDP2 (README: Multi-GPU)",
    "fsdp": "axolotl's FSDP settings do not apply: torchrun shards with FSDP2 by itself (README: Multi-GPU)",
    "fsdp_config": "axolotl's FSDP settings do not apply: torchrun shards with FSDP2 by itself (README: Multi-GPU)",
    "fsdp_version": "axolotl's FSDP settings do not apply: torchrun shards with FSDP2 by itself (README: Multi-GPU)",
    "plugins": "axolotl plugins do not run here",
    "fp8": "FP8 training is not here",
    "sample_packing": "an SFT setting; completions are always packed here",
}
TRANSFORMS = "driver.axolotl.transforms"
EBFT_TRANSFORMS = "driver.ebft.transforms"
# axolotl's EBFT prompt strategies (axolotl.prompt_strategies.ebft) -> (our data.transform, or None with why not).
BUILTIN_DATASET_TYPES = {
    "ebft_opencode.transform": (f"{TRANSFORMS}.ebft_opencode", None),
    "ebft_strided_structured.transform": (f"{TRANSFORMS}.ebft_strided_structured", None),
    "ebft_pretrain.transform": (f"{TRANSFORMS}.ebft_pretrain", None),
    "ebft_chat_multiturn.transform_last_turn": (f"{EBFT_TRANSFORMS}.last_turn", None),
    "ebft_chat_multiturn.transform_all_turns": (f"{EBFT_TRANSFORMS}.all_turns", None),
    "ebft_reasoning.transform": (f"{EBFT_TRANSFORMS}.last_turn", None),
    "ebft_reasoning.transform_answer_only": (f"{EBFT_TRANSFORMS}.last_turn_answer_only", None),
    "ebft_chat_multiturn.transform": (f"{EBFT_TRANSFORMS}.first_turn", None),  # later turns rolled out
    "ebft_strided_chat.transform": (None, "anchors in every assistant turn of the chat; here a row has one ground "
                                    "truth: driver.ebft.transforms.last_turn or all_turns"),
    "ebft_reasoning.transform_split_thinking": (None, "needs the chat template's reasoning_content; not here"),
    "ebft_reasoning.transform_strided": (None, "masks thinking tokens out of the CE loss; not here"),
}
# Keys that change nothing in a run of ours, whatever their value: key -> why.
WITHOUT_EFFECT = {
    "strict": "axolotl's own schema strictness",
    "debug": "axolotl's dataset preview",
    "skip_prepare_dataset": "no dataset preparation cache here",
    "dataset_prepared_path": "no dataset cache here",
    "dataset_processes": "rows are transformed in the trainer",
    "logging_steps": "every step is logged here",
    "torch_compile": "speed only: our kernels replace compilation",
    "batch_flattening": "sequences are always packed",
    "special_tokens.pad_token": "sequences are packed, never padded",
    "gradient_checkpointing_kwargs.use_reentrant": "the same gradients either way",
    "vllm.device": "vLLM's device",
    "trl.use_data_producer": "the rollout loop is always a producer",
    "trl.vllm_lora_sync": "how the adapter reaches vLLM, not what it serves",
    "trl.streaming_partial_batch": "groups are scored as they finish anyway",
    "trl.streaming_min_groups": "groups are scored as they finish anyway",
    "trl.log_completions": "completions are always logged (completions.jsonl)",
    "trl.use_liger_loss": "the same loss; the logprobs are fused here",
    "trl.ref_model_mixup_alpha": "only with sync_ref_model",
    "trl.ref_model_sync_steps": "only with sync_ref_model",
}
