"""The driver's scoring path (pack -> packed_hidden_states -> token_logprobs -> backward) on a small
Qwen2 with Qwen's 151936-token vocabulary and a frozen lm_head (as under LoRA): the fused kernel
against the pure-torch chunked reference the driver used before ([2/8]).

    .venv/bin/python -m benchmarks.logprobs_in_driver      # ~2 minutes on 2 cores

A script, not part of the gated suite: the model's own forward and backward are in the timing.
"""

from __future__ import annotations

import time

import torch
import transformers

from benchmarks.conftest import peak_extra_memory
from driver.policy.logprobs import completion_logprobs, pack
from pykernels import backend


def main() -> None:
    torch.manual_seed(0)
    config = transformers.Qwen2Config(hidden_size=1024, intermediate_size=2048, num_hidden_layers=2,
                                      num_attention_heads=8, num_key_value_heads=2, vocab_size=151936)
    model = transformers.Qwen2ForCausalLM(config).to(torch.bfloat16)
    model.config._attn_implementation = "sdpa"
    model.requires_grad_(False)
    trainable = model.model.layers[-1].mlp.down_proj.weight  # stands in for the adapter
    trainable.requires_grad_(True)
    batch = pack([list(range(1, 65))] * 16, [list(range(100, 164 + 8 * i)) for i in range(16)])
    print(f"{batch.input_ids.shape[1]} packed tokens, {sum(batch.completion_lengths)} scored")

    for mode in ("auto", "reference") * 2:
        def step(mode: str = mode) -> None:
            with backend.kernels_mode(mode):
                logps, _, mask = completion_logprobs(model, batch, 0.9, return_entropy=True, entropy_grad=False)
                (logps * mask).sum().backward()
            trainable.grad = None

        step()  # warm-up
        start = time.perf_counter()
        step()
        seconds = time.perf_counter() - start
        memory = peak_extra_memory(step, torch.device("cpu"))
        print(f"kernels={mode:9} {seconds * 1e3:7.0f} ms  working memory {memory / 2**20:6.0f} MiB")


if __name__ == "__main__":
    main()
