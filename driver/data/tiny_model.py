"""Tiny random models and a local tokenizer, built deterministically and cached.

Nothing can be downloaded at run time, so the default config, the tests and the demo train
models built here: `tiny://qwen2` (dense), `tiny://qwen2-wide` (hidden 512), `tiny://qwen3-moe` (8
experts, top-2), `tiny://qwen3-moe-wide` (hidden 512, 32 experts, top-4), `tiny://llama`, and the
other MoE architectures `tiny://gpt-oss`, `tiny://ernie4.5-moe`, `tiny://gemma4-moe` (8 experts,
top-2). Head
dim is 64 (vLLM's CPU attention does not support 16), embeddings are untied (they were while vLLM's weight
reload left a tied lm_head stale; tied models are tested in tests/driver/distributed/
test_driver_full_finetuning_tied.py). The same name always gives the same bytes.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import tempfile
from pathlib import Path

TINY_PREFIX = "tiny://"
BUILDER_VERSION = 3  # bump when anything below changes the files produced (3: the chat template)
SEED = 1234
SPECIAL_TOKENS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
VOCAB_SIZE = 384
# ChatML, as Qwen's, with Qwen3's enable_thinking switch, so that chat data and chat_template_kwargs work on
# the tiny models (no download).
CHAT_TEMPLATE = ("{% for message in messages %}<|im_start|>{{ message['role'] }}\n{{ message['content'] }}"
                 "<|im_end|>\n{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n"
                 "{% if enable_thinking is defined and not enable_thinking %}<think>\n\n</think>\n\n{% endif %}"
                 "{% endif %}")

# initializer_range 0.1 (transformers' default is 0.02): at 0.02 a 128-wide random model's logits are
# so flat (entropy ~ ln V) that no adapter can move its output distribution far; at 0.1 its logit
# range resembles a trained model's and RL on the toy tasks learns within a few dozen steps.
_COMMON = dict(hidden_size=128, num_hidden_layers=2, num_attention_heads=2, num_key_value_heads=1,
               max_position_embeddings=1024, tie_word_embeddings=False, rms_norm_eps=1e-6,
               initializer_range=0.1)
ARCHITECTURES = {
    "qwen2": ("Qwen2Config", "Qwen2ForCausalLM", dict(intermediate_size=256)),
    # Wide enough for activations, weights and optimizer states to differ by megabytes between training
    # options: what docs/memory.md measures besides tiny://qwen2 (benchmarks/memory_table.py).
    "qwen2-wide": ("Qwen2Config", "Qwen2ForCausalLM",
                   dict(hidden_size=512, num_attention_heads=8, num_key_value_heads=2, intermediate_size=1536)),
    "llama": ("LlamaConfig", "LlamaForCausalLM", dict(intermediate_size=256, head_dim=64)),
    "qwen3-moe": ("Qwen3MoeConfig", "Qwen3MoeForCausalLM",
                  dict(intermediate_size=256, moe_intermediate_size=64, num_local_experts=8,
                       num_experts_per_tok=2, norm_topk_prob=True, head_dim=64)),
    # Wide enough (32 experts of 512 x 256, top-4) for the experts' GEMMs to dominate a training
    # step on CPU: what the driver's MoE step time is measured on (results/cpu.md).
    "qwen3-moe-wide": ("Qwen3MoeConfig", "Qwen3MoeForCausalLM",
                       dict(hidden_size=512, num_attention_heads=8, num_key_value_heads=2, intermediate_size=1024,
                            moe_intermediate_size=256, num_local_experts=32, num_experts_per_tok=4,
                            norm_topk_prob=True, head_dim=64)),
    # More MoE architectures (8 experts, top-2, experts of 64), each as transformers defines it: GPT-OSS
    # (clamped SwiGLU, interleaved gate/up, expert biases, attention sinks: model.attention eager),
    # Ernie 4.5 (a shared expert, a router correction bias) and Gemma 4's text model with its MoE block
    # beside the dense MLP (LoRA on experts: lora.expert_targets [experts.gate_up_proj,
    # experts.down_proj]). No Mistral 4: transformers 5.19 does not map it to AutoModelForCausalLM.
    "gpt-oss": ("GptOssConfig", "GptOssForCausalLM",
                dict(intermediate_size=64, num_local_experts=8, num_experts_per_tok=2, head_dim=64,
                     layer_types=["sliding_attention", "full_attention"], sliding_window=128,
                     # GPT-OSS' YaRN (vLLM requires it), its factor 32 stretching 32 positions to 1024
                     rope_parameters=dict(rope_type="yarn", factor=32.0, beta_fast=32.0, beta_slow=1.0,
                                          truncate=False, original_max_position_embeddings=32,
                                          rope_theta=150000.0))),
    "ernie4.5-moe": ("Ernie4_5_MoeConfig", "Ernie4_5_MoeForCausalLM",
                     dict(intermediate_size=256, moe_intermediate_size=64, moe_num_experts=8, moe_k=2,
                          moe_num_shared_experts=1, moe_layer_start_index=0, head_dim=64)),
    "gemma4-moe": ("Gemma4TextConfig", "Gemma4ForCausalLM",
                   dict(intermediate_size=256, enable_moe_block=True, num_experts=8, top_k_experts=2,
                        moe_intermediate_size=64, head_dim=64, global_head_dim=64, hidden_size_per_layer_input=0,
                        layer_types=["sliding_attention", "full_attention"], sliding_window=128)),
}


def cache_root() -> Path:
    return Path(os.environ.get("PYKERNELS_CACHE", Path.home() / ".cache" / "pykernels"))


def is_tiny(path: str) -> bool:
    return path.startswith(TINY_PREFIX)


def resolve_model_path(path: str) -> str:
    """A local model directory for `path`: tiny:// names are built (once) into the cache."""
    if not is_tiny(path):
        return path
    kind = path[len(TINY_PREFIX):]
    if kind not in ARCHITECTURES:
        raise ValueError(f"unknown tiny model {path!r}; choose one of "
                         + ", ".join(TINY_PREFIX + k for k in ARCHITECTURES))
    return str(build_tiny_model(kind))


def _fingerprint(kind: str) -> str:
    spec = json.dumps([BUILDER_VERSION, SEED, VOCAB_SIZE, _COMMON, ARCHITECTURES[kind]], sort_keys=True)
    return hashlib.sha256(spec.encode()).hexdigest()[:12]


def build_tiny_model(kind: str) -> Path:
    target = cache_root() / "tiny-models" / f"{kind}-{_fingerprint(kind)}"
    if (target / "config.json").exists():
        return target
    target.parent.mkdir(parents=True, exist_ok=True)
    staging = Path(tempfile.mkdtemp(prefix=f".{kind}-", dir=target.parent))
    try:
        _write_model(kind, staging)
        try:
            staging.rename(target)  # atomic: concurrent builders agree on one result
        except OSError:
            if not (target / "config.json").exists():
                raise
    finally:
        shutil.rmtree(staging, ignore_errors=True)
    return target


def _write_model(kind: str, directory: Path) -> None:
    import torch
    import transformers

    tokenizer = build_tokenizer()
    tokenizer.save_pretrained(directory)
    config_name, model_name, extra = ARCHITECTURES[kind]
    config = getattr(transformers, config_name)(
        vocab_size=len(tokenizer), bos_token_id=tokenizer.bos_token_id, eos_token_id=tokenizer.eos_token_id,
        pad_token_id=tokenizer.pad_token_id, **{**_COMMON, **extra})
    generator_state = torch.random.get_rng_state()
    try:
        torch.manual_seed(SEED)
        model = getattr(transformers, model_name)(config).to(torch.float32)
    finally:
        torch.random.set_rng_state(generator_state)
    model.generation_config.eos_token_id = tokenizer.eos_token_id
    model.generation_config.pad_token_id = tokenizer.pad_token_id
    model.save_pretrained(directory, safe_serialization=True)


def tokenizer_corpus() -> list[str]:
    """Fixed training text for the byte-level BPE: the toy tasks' words plus plain English."""
    from driver.data.toy_tasks import corpus

    return corpus()


def build_tokenizer():
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    bpe = Tokenizer(models.BPE())
    bpe.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    bpe.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=VOCAB_SIZE, special_tokens=SPECIAL_TOKENS, show_progress=False,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    bpe.train_from_iterator(tokenizer_corpus(), trainer)
    tokenizer = PreTrainedTokenizerFast(tokenizer_object=bpe, bos_token="<|endoftext|>", eos_token="<|endoftext|>",
                                        pad_token="<|endoftext|>")
    tokenizer.chat_template = CHAT_TEMPLATE
    return tokenizer
