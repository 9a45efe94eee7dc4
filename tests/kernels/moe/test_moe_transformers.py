"""apply_moe_kernels on tiny random transformers MoE models: logits, loss and every trainable
gradient equal transformers' "eager" experts, without and with PEFT LoRA on experts
(target_parameters) and attention at the same time."""

import copy

import pytest
import torch
import transformers

from pykernels.integrations.transformers import apply_moe_kernels

COMMON = dict(vocab_size=128, hidden_size=32, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
              max_position_embeddings=64, experts_implementation="eager")
# moe_intermediate_size 24 keeps gate_up_proj [E, 48, 32] non-square: a transposed layout would fail.
FAMILIES = {
    "qwen3_moe": (transformers.Qwen3MoeConfig, transformers.Qwen3MoeForCausalLM,
                  dict(head_dim=8, intermediate_size=64, moe_intermediate_size=24, num_experts=6,
                       num_experts_per_tok=2, norm_topk_prob=True)),
    "qwen2_moe": (transformers.Qwen2MoeConfig, transformers.Qwen2MoeForCausalLM,
                  dict(intermediate_size=64, moe_intermediate_size=24, shared_expert_intermediate_size=32,
                       num_experts=6, num_experts_per_tok=3)),
    "mixtral": (transformers.MixtralConfig, transformers.MixtralForCausalLM,
                dict(head_dim=8, intermediate_size=24, num_local_experts=4, num_experts_per_tok=2)),
    "olmoe": (transformers.OlmoeConfig, transformers.OlmoeForCausalLM,
              dict(intermediate_size=24, num_experts=8, num_experts_per_tok=1)),
    "deepseek_v3": (transformers.DeepseekV3Config, transformers.DeepseekV3ForCausalLM,
                    dict(intermediate_size=64, moe_intermediate_size=24, n_routed_experts=8, n_shared_experts=1,
                         num_experts_per_tok=2, n_group=2, topk_group=1, first_k_dense_replace=1,
                         num_key_value_heads=4, q_lora_rank=16, kv_lora_rank=16, qk_rope_head_dim=8,
                         qk_nope_head_dim=8, v_head_dim=8)),
}


def build(family: str) -> torch.nn.Module:
    config_cls, model_cls, extra = FAMILIES[family]
    torch.manual_seed(0)
    return model_cls(config_cls(**{**COMMON, **extra})).eval()


def run(model, ids):
    model.zero_grad(set_to_none=True)
    out = model(input_ids=ids, labels=ids)
    out.loss.backward()
    grads = {n: p.grad.clone() for n, p in model.named_parameters() if p.requires_grad}
    return out.logits.detach(), out.loss.detach(), grads


def assert_same(ours, eager, atol):
    (logits, loss, grads), (logits_e, loss_e, grads_e) = ours, eager
    torch.testing.assert_close(logits, logits_e, atol=atol, rtol=0)
    torch.testing.assert_close(loss, loss_e, atol=atol, rtol=0)
    assert grads.keys() == grads_e.keys()
    for name in grads_e:
        assert grads[name] is not None and grads_e[name] is not None, name
        scale = grads_e[name].abs().max().item() + 1e-12
        assert (grads[name] - grads_e[name]).abs().max().item() <= atol * max(scale, 1.0), name


@pytest.mark.parametrize("family", list(FAMILIES))
def test_full_model_matches_eager_experts(family):
    model = build(family)
    ids = torch.randint(0, 128, (2, 9), generator=torch.Generator().manual_seed(1))
    eager = run(model, ids)
    ours_model = copy.deepcopy(model)
    assert apply_moe_kernels(ours_model) >= 1
    assert ours_model.config._experts_implementation == "pykernels"
    assert_same(run(ours_model, ids), eager, atol=2e-6)


def test_experts_modules_without_the_expert_parallel_flag_are_found():
    """transformers 5.17 (the CUDA images' version) sets no _is_expert_parallel on its experts
    modules: apply_moe_kernels found none there and the benchmark failed on an H100."""
    model = build("qwen3_moe")
    ids = torch.randint(0, 128, (2, 9), generator=torch.Generator().manual_seed(1))
    eager = run(model, ids)
    ours_model = copy.deepcopy(model)
    stripped = [m for m in ours_model.modules() if vars(m).pop("_is_expert_parallel", None) is not None]
    assert len(stripped) == 2
    assert apply_moe_kernels(ours_model) == 2
    assert_same(run(ours_model, ids), eager, atol=2e-6)


@pytest.mark.parametrize("family", ["qwen3_moe", "mixtral", "olmoe"])
def test_peft_lora_on_experts_and_attention_matches_eager(family):
    from peft import LoraConfig, get_peft_model

    config = LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj"],
                        target_parameters=["mlp.experts.gate_up_proj", "mlp.experts.down_proj"])
    eager_model = get_peft_model(build(family), config)
    with torch.no_grad():  # non-zero B so that LoRA changes the output
        for name, param in eager_model.named_parameters():
            if "lora_B" in name:
                param.copy_(torch.randn(param.shape, generator=torch.Generator().manual_seed(len(name))))
    ours_model = get_peft_model(build(family), config)
    ours_model.load_state_dict(eager_model.state_dict())
    assert apply_moe_kernels(ours_model) == 2
    ids = torch.randint(0, 128, (2, 9), generator=torch.Generator().manual_seed(1))
    eager = run(eager_model, ids)
    ours = run(ours_model, ids)
    assert any("experts" in n and "lora_A" in n for n in ours[2]) and any("q_proj" in n for n in ours[2])
    assert_same(ours, eager, atol=2e-6)


def test_bf16_model_is_as_close_to_fp32_as_eager_bf16():
    model = build("mixtral")  # its router returns fp32 weights for bf16 activations
    ids = torch.randint(0, 128, (2, 9), generator=torch.Generator().manual_seed(1))
    exact = model(input_ids=ids).logits
    eager_bf16 = copy.deepcopy(model).bfloat16()
    ours_bf16 = copy.deepcopy(eager_bf16)
    apply_moe_kernels(ours_bf16)
    err_eager = (eager_bf16(input_ids=ids).logits.float() - exact).abs().max()
    err_ours = (ours_bf16(input_ids=ids).logits.float() - exact).abs().max()
    assert err_ours <= 1.5 * err_eager + 1e-3


def test_a_dense_model_is_left_alone():
    config = transformers.Qwen2Config(vocab_size=64, hidden_size=16, intermediate_size=32, num_hidden_layers=1,
                                      num_attention_heads=2, num_key_value_heads=1)
    model = transformers.Qwen2ForCausalLM(config)
    assert apply_moe_kernels(model) == 0


def test_peft_experts_run_fused_without_dense_deltas_and_honour_disabled_and_merged_adapters(monkeypatch):
    from peft import LoraConfig, get_peft_model

    config = LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj"],
                        target_parameters=["mlp.experts.gate_up_proj", "mlp.experts.down_proj"])
    base = build("qwen3_moe")
    ids = torch.randint(0, 128, (2, 9), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        base_logits = base(input_ids=ids).logits
    reference = get_peft_model(copy.deepcopy(base), config)
    with torch.no_grad():
        for name, param in reference.named_parameters():
            if "lora_B" in name:
                param.normal_(0, 0.5)
        expected = reference(input_ids=ids).logits
    model = get_peft_model(copy.deepcopy(base), config)
    model.load_state_dict(reference.state_dict())
    apply_moe_kernels(model)

    def no_parametrization(*args, **kwargs):
        raise AssertionError("PEFT's dense W + B A path ran")

    with torch.no_grad():
        with monkeypatch.context() as patch:
            patch.setattr(torch.nn.utils.parametrize, "register_parametrization", no_parametrization)
            torch.testing.assert_close(model(input_ids=ids).logits, expected, atol=2e-6, rtol=0)
        with model.disable_adapter():
            torch.testing.assert_close(model(input_ids=ids).logits, base_logits, atol=2e-6, rtol=0)
        model.merge_adapter()
        torch.testing.assert_close(model(input_ids=ids).logits, expected, atol=2e-5, rtol=0)
        model.unmerge_adapter()
        torch.testing.assert_close(model(input_ids=ids).logits, expected, atol=2e-5, rtol=0)
