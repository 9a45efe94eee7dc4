"""Full-weight sync (driver/engine/weight_sync.py): an in-process vLLM engine serves base + LoRA merged.

The oracle is transformers + PEFT running the adapter unmerged, in fp32: after every push the
engine's prompt logprobs must equal theirs to fp32 noise. The MoE model adapts attention and the
fused experts (PEFT target_parameters), the case where vLLM's own in-place reload is wrong on CPU.
One engine at a time: the module fixture builds one per model and shuts it down before the next.
"""

import copy
import os

import pytest
import torch

from driver.data.tiny_model import resolve_model_path

pytestmark = pytest.mark.slow
pytest.importorskip("vllm")

TOLERANCE = 1e-4  # fp32: measured gaps are ~2e-6 (dense) and ~3e-6 (MoE)
PROBE = "The quick brown fox jumps over the lazy dog. Write digits: 0123456789 apple river stone"
ATTENTION = ["q_proj", "k_proj", "v_proj", "o_proj"]
LORA_TARGETS = {
    "qwen2": dict(target_modules=ATTENTION + ["gate_proj", "up_proj", "down_proj"]),
    "qwen3-moe": dict(target_modules=ATTENTION,
                      target_parameters=["mlp.experts.gate_up_proj", "mlp.experts.down_proj"]),
    # A router correction bias that transformers names differently from the checkpoint (weight_sync's
    # CHECKPOINT_RENAMES) and a shared expert.
    "ernie4.5-moe": dict(target_modules=ATTENTION,
                         target_parameters=["mlp.experts.gate_up_proj", "mlp.experts.down_proj"]),
}
# Longer than one KV block (128 tokens on CPU), so that generating from it fills the prefix cache.
LONG_PROMPT_TOKENS = 200


def transformers_logprobs(model, token_ids: list[int]) -> torch.Tensor:
    with torch.no_grad():
        logits = model(input_ids=torch.tensor([token_ids])).logits[0].float()
    return torch.log_softmax(logits, -1)[:-1].gather(1, torch.tensor(token_ids[1:])[:, None])[:, 0]


def engine_prompt_logprobs(llm, token_ids: list[int]) -> torch.Tensor:
    from vllm import SamplingParams
    from vllm.inputs import TokensPrompt

    params = SamplingParams(max_tokens=1, temperature=1.0, prompt_logprobs=0)
    output = llm.generate([TokensPrompt(prompt_token_ids=token_ids)], params, use_tqdm=False)[0]
    return torch.tensor([entry[token].logprob for entry, token in zip(output.prompt_logprobs[1:], token_ids[1:])])


def engine_greedy(llm, token_ids: list[int], max_tokens: int = 4) -> tuple[list[int], torch.Tensor]:
    from vllm import SamplingParams
    from vllm.inputs import TokensPrompt

    params = SamplingParams(max_tokens=max_tokens, temperature=0.0, logprobs=0)
    sample = llm.generate([TokensPrompt(prompt_token_ids=token_ids)], params, use_tqdm=False)[0].outputs[0]
    tokens = list(sample.token_ids)
    return tokens, torch.tensor([entry[token].logprob for entry, token in zip(sample.logprobs, tokens)])


def randomize_lora_B(peft_model, seed: int) -> None:
    generator = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, param in peft_model.named_parameters():
            if "lora_B" in name:
                param.copy_(torch.randn(param.shape, generator=generator) * 0.1)


def max_gap(a: torch.Tensor, b: torch.Tensor) -> float:
    assert a.shape == b.shape
    return float((a - b).abs().max())


@pytest.fixture(scope="module", params=list(LORA_TARGETS))
def served(request):
    """(kind, PEFT model with non-zero LoRA, probe ids, in-process engine on the base model)."""
    import vllm.envs
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from driver.engine.weight_sync import create_inprocess_engine, shutdown_engine

    kind = request.param
    model_dir = resolve_model_path(f"tiny://{kind}")
    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    probe = tokenizer(PROBE, add_special_tokens=False).input_ids
    base = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    torch.manual_seed(0)
    lora = LoraConfig(r=4, lora_alpha=8, init_lora_weights=False, **LORA_TARGETS[kind])
    peft_model = get_peft_model(base, lora).eval()
    saved_env = dict(os.environ)
    llm = create_inprocess_engine(model=model_dir, dtype="float32", seed=0, max_model_len=256,
                                  gpu_memory_utilization=0.3, enforce_eager=True)
    try:
        yield kind, peft_model, probe, llm
    finally:
        shutdown_engine(llm)
        del llm
        # An in-process engine caches vLLM's environment variables for the whole process.
        os.environ.clear()
        os.environ.update(saved_env)
        vllm.envs.disable_envs_cache()


def test_merged_weights_equal_peft_merge_and_unload(served):
    kind, peft_model, _, _ = served
    from driver.engine.weight_sync import _checkpoint_name, merged_weights

    model_type = peft_model.config.model_type
    expected = {_checkpoint_name(model_type, name): tensor
                for name, tensor in copy.deepcopy(peft_model).merge_and_unload().state_dict().items()}
    merged = dict(merged_weights(peft_model))
    assert sorted(merged) == sorted(expected)
    for name, tensor in merged.items():
        torch.testing.assert_close(tensor, expected[name], atol=1e-6, rtol=1e-5, msg=name)
    if kind == "qwen3-moe":
        assert merged["model.layers.0.mlp.experts.gate_up_proj"].shape == (8, 128, 128)  # [E, 2I, H]


def test_engine_serves_the_merged_adapter(served):
    _, peft_model, probe, llm = served
    from driver.engine.weight_sync import push_merged

    base_weights = {name: p.detach().clone() for name, p in peft_model.named_parameters() if "lora_" not in name}
    with peft_model.disable_adapter():
        base_logprobs = transformers_logprobs(peft_model, probe)
    gap = max_gap(engine_prompt_logprobs(llm, probe), base_logprobs)
    assert gap < TOLERANCE, f"before any push the engine must serve the base model: gap {gap:.3g}"

    push_merged(llm, peft_model)

    expected = transformers_logprobs(peft_model, probe)
    assert max_gap(expected, base_logprobs) > 0.1, "the adapter must change the probe for the test to mean anything"
    gap = max_gap(engine_prompt_logprobs(llm, probe), expected)
    assert gap < TOLERANCE, f"engine vs transformers+PEFT after the push: gap {gap:.3g}"
    for name, param in peft_model.named_parameters():  # the trainer's model is not merged into
        if "lora_" not in name:
            assert torch.equal(param, base_weights[name]), name


def test_a_second_push_is_served_and_the_prefix_cache_is_dropped(served):
    _, peft_model, probe, llm = served
    from driver.engine.weight_sync import push_merged

    long_prompt = (probe * (LONG_PROMPT_TOKENS // len(probe) + 1))[:LONG_PROMPT_TOKENS]
    randomize_lora_B(peft_model, seed=1)
    push_merged(llm, peft_model)
    first = transformers_logprobs(peft_model, probe)
    engine_greedy(llm, long_prompt)  # fills the prefix cache with KV of the first weights

    randomize_lora_B(peft_model, seed=2)
    push_merged(llm, peft_model)

    second = transformers_logprobs(peft_model, probe)
    assert max_gap(first, second) > 0.1
    gap = max_gap(engine_prompt_logprobs(llm, probe), second)
    assert gap < TOLERANCE, f"probe after the second push: gap {gap:.3g}"
    # Prompt-logprob requests never read the prefix cache; generation does, so only it can show stale KV.
    tokens, sampled_logprobs = engine_greedy(llm, long_prompt)
    expected = transformers_logprobs(peft_model, long_prompt + tokens)[-len(tokens):]
    gap = max_gap(sampled_logprobs, expected)
    assert gap < TOLERANCE, f"generation after the second push (stale prefix cache?): gap {gap:.3g}"
