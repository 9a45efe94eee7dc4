"""apply_moe_kernels on tiny random GPT-OSS, Ernie 4.5 MoE, Mistral 4 and Gemma 4 (MoE) models: logits,
loss and every trainable gradient equal transformers' "eager" experts, full fine-tuning and PEFT
LoRA on experts (target_parameters, fused in the grouped GEMM) with attention LoRA, odd token
counts; each model's experts really run on pykernels (not a fallback). Also Aria's experts (weights
stored [E, in, out] with transformers' default gate) and an experts class with its own gate (left
to transformers)."""

import contextlib
import copy

import pytest
import torch
import transformers
from transformers.models.qwen3_moe.modeling_qwen3_moe import Qwen3MoeExperts

from pykernels import moe
from pykernels.integrations import moe_experts
from pykernels.integrations.transformers import apply_moe_kernels, quantizable_experts

COMMON = dict(vocab_size=128, hidden_size=32, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
              max_position_embeddings=64, experts_implementation="eager")
TWO_LAYER_TYPES = dict(layer_types=["sliding_attention", "full_attention"], sliding_window=8)
# name: (config, model, config extras, the experts' parameter path for PEFT, the expected layout)
FAMILIES = {
    "gpt_oss": (transformers.GptOssConfig, transformers.GptOssForCausalLM,
                dict(head_dim=8, intermediate_size=24, num_local_experts=6, num_experts_per_tok=2, **TWO_LAYER_TYPES),
                "mlp.experts", moe_experts.ExpertsLayout(moe.ClampedSwiGLU(1.702, 7.0), interleaved=True,
                                                         transposed=True, bias=True)),
    "ernie4_5_moe": (transformers.Ernie4_5_MoeConfig, transformers.Ernie4_5_MoeForCausalLM,
                     dict(intermediate_size=64, moe_intermediate_size=24, moe_num_experts=6, moe_k=2,
                          moe_num_shared_experts=1, moe_layer_start_index=0),
                     "mlp.experts", moe_experts.ExpertsLayout("silu")),
    "mistral4": (transformers.Mistral4Config, transformers.Mistral4ForCausalLM,
                 dict(intermediate_size=64, moe_intermediate_size=24, n_routed_experts=8, n_shared_experts=1,
                      num_experts_per_tok=2, n_group=2, topk_group=1, num_key_value_heads=4, q_lora_rank=16,
                      kv_lora_rank=16, qk_rope_head_dim=8, qk_nope_head_dim=8, v_head_dim=8),
                 "mlp.experts", moe_experts.ExpertsLayout("silu")),
    "gemma4": (transformers.Gemma4TextConfig, transformers.Gemma4ForCausalLM,
               dict(head_dim=8, intermediate_size=64, enable_moe_block=True, num_experts=6, top_k_experts=2,
                    moe_intermediate_size=24, hidden_size_per_layer_input=0, per_layer_config={}, **TWO_LAYER_TYPES),
               "experts", moe_experts.ExpertsLayout("gelu_tanh")),
}
SHAPES = [(1, 7), (3, 5)]  # [batch, sequence]: 7 and 15 tokens


def build(family: str) -> torch.nn.Module:
    config_cls, model_cls, extra, _, _ = FAMILIES[family]
    torch.manual_seed(0)
    model = model_cls(config_cls(**{**COMMON, **extra})).eval()
    g = torch.Generator().manual_seed(1)
    with torch.no_grad():  # transformers zero-initializes biases: make every router and expert term count
        for name, param in model.named_parameters():
            if name.endswith(("_bias", "router.bias", "e_score_correction_bias", "per_expert_scale")):
                param.copy_(torch.randn(param.shape, generator=g) * 0.5 + (1.0 if "scale" in name else 0.0))
            elif family == "gpt_oss" and name.endswith("experts.gate_up_proj"):
                param.copy_(torch.randn(param.shape, generator=g) * 2.0)  # pre-activations beyond the clamps
    return model


def experts_calls(monkeypatch) -> list:
    """Every call of pykernels.moe.experts_forward from here on (the integration imports it per call)."""
    calls, original = [], moe.experts_forward
    monkeypatch.setattr(moe, "experts_forward", lambda *args, **kwargs: calls.append(1) or original(*args, **kwargs))
    return calls


def run(model, ids):
    model.zero_grad(set_to_none=True)
    out = model(input_ids=ids, labels=ids)
    out.loss.backward()
    grads = {n: p.grad.clone() for n, p in model.named_parameters() if p.requires_grad}
    return out.logits.detach(), out.loss.detach(), grads


def assert_same(ours, eager, atol):
    (logits, loss, grads), (logits_e, loss_e, grads_e) = ours, eager
    scale = max(logits_e.abs().max().item(), 1.0)
    torch.testing.assert_close(logits, logits_e, atol=atol * scale, rtol=0)
    torch.testing.assert_close(loss, loss_e, atol=atol * scale, rtol=0)
    assert grads.keys() == grads_e.keys()
    for name in grads_e:
        assert grads[name] is not None and grads_e[name] is not None, name
        grad_scale = max(grads_e[name].abs().max().item(), 1.0)
        assert (grads[name] - grads_e[name]).abs().max().item() <= atol * grad_scale, name


def ids_of(shape):
    return torch.randint(0, 128, shape, generator=torch.Generator().manual_seed(2))


@pytest.mark.parametrize("family", list(FAMILIES))
def test_experts_layout_is_recognized(family):
    model = build(family)
    experts = moe_experts._experts_modules(model)
    assert len(experts) == 2 and all(moe_experts._layout(e) == FAMILIES[family][4] for e in experts)
    assert len(quantizable_experts(model)) == (0 if family == "gpt_oss" else 2)  # NF4 reads [E, out, in] only


@pytest.mark.parametrize("shape", SHAPES, ids=[f"{b}x{s}" for b, s in SHAPES])
@pytest.mark.parametrize("family", list(FAMILIES))
def test_full_fine_tuning_matches_eager_experts(family, shape, monkeypatch):
    model = build(family)
    ids = ids_of(shape)
    eager = run(model, ids)
    ours_model = copy.deepcopy(model)
    assert apply_moe_kernels(ours_model) == 2
    calls = experts_calls(monkeypatch)
    ours = run(ours_model, ids)
    assert len(calls) == 2  # one per layer: nothing fell back to transformers' experts
    assert any("experts" in name for name in ours[2])
    assert_same(ours, eager, atol=5e-6)


@pytest.mark.parametrize("shape", SHAPES, ids=[f"{b}x{s}" for b, s in SHAPES])
@pytest.mark.parametrize("family", list(FAMILIES))
def test_peft_lora_on_experts_and_attention_matches_eager(family, shape, monkeypatch):
    from peft import LoraConfig, get_peft_model

    path = FAMILIES[family][3]
    config = LoraConfig(r=4, lora_alpha=8, target_modules=["o_proj"],
                        target_parameters=[f"{path}.gate_up_proj", f"{path}.down_proj"])
    eager_model = get_peft_model(build(family), config)
    with torch.no_grad():  # non-zero B so that LoRA changes the output
        for name, param in eager_model.named_parameters():
            if "lora_B" in name:
                param.copy_(torch.randn(param.shape, generator=torch.Generator().manual_seed(len(name))) * 0.3)
    ours_model = get_peft_model(build(family), config)
    ours_model.load_state_dict(eager_model.state_dict())
    assert apply_moe_kernels(ours_model) == 2
    ids = ids_of(shape)
    eager = run(eager_model, ids)
    calls = experts_calls(monkeypatch)

    def no_parametrization(*args, **kwargs):
        raise AssertionError("PEFT's dense W + B A path ran")

    with monkeypatch.context() as patch:
        patch.setattr(torch.nn.utils.parametrize, "register_parametrization", no_parametrization)
        ours = run(ours_model, ids)
    assert len(calls) == 2
    assert any("experts" in n and "lora_A" in n for n in ours[2]) and any("o_proj" in n for n in ours[2])
    assert_same(ours, eager, atol=5e-6)


@pytest.mark.parametrize("family", ["gpt_oss", "mistral4"])
def test_lora_factors_read_from_peft_parametrization_rebuild_its_weight(family):
    """When PEFT's own parametrized forward runs, the experts function reads the LoRA factors back
    from the parametrization (weights stored [E, in, out] for GPT-OSS, [E, out, in] otherwise)."""
    from peft import LoraConfig, get_peft_model

    path = FAMILIES[family][3]
    model = get_peft_model(build(family), LoraConfig(r=3, lora_alpha=6, target_parameters=[f"{path}.gate_up_proj",
                                                                                            f"{path}.down_proj"]))
    with torch.no_grad():
        for name, param in model.named_parameters():
            if "lora_B" in name:
                param.normal_(0, 0.5)
    wrappers = [m for m in model.modules() if moe_experts._is_param_wrapper(m)][:2]  # layer 0's two parameters
    experts, layout = wrappers[-1].base_layer, FAMILIES[family][4]
    assert not moe_experts._is_param_wrapper(experts)
    with contextlib.ExitStack() as stack:
        for wrapper in wrappers:  # PEFT's own forward: each wrapper parametrizes its expert weight
            stack.enter_context(wrapper._activate_lora(wrapper.active_adapters))
        for name in ("gate_up_proj", "down_proj"):
            weight, factors = moe_experts._weight_and_lora(experts, name, layout)
            dense = getattr(experts, name)  # PEFT's W + s B A, as stored
            num_experts = weight.shape[0]
            rebuilt = torch.stack([weight[e] + factors.scaling * factors.expert(e, num_experts)[1]
                                   @ factors.expert(e, num_experts)[0] for e in range(num_experts)])
            torch.testing.assert_close(rebuilt.transpose(1, 2) if layout.transposed else rebuilt, dense)


def test_bf16_gpt_oss_is_as_close_to_fp32_as_eager_bf16():
    model = build("gpt_oss")
    ids = ids_of((3, 5))
    exact = model(input_ids=ids).logits
    eager_bf16 = copy.deepcopy(model).bfloat16()
    ours_bf16 = copy.deepcopy(eager_bf16)
    apply_moe_kernels(ours_bf16)
    err_eager = (eager_bf16(input_ids=ids).logits.float() - exact).abs().max()
    err_ours = (ours_bf16(input_ids=ids).logits.float() - exact).abs().max()
    assert err_ours <= 2 * err_eager + 1e-3


class _ClampedGateExperts(Qwen3MoeExperts):
    """An experts class with its own gate (as DeepSeek-V4's, GLM-5's, Step-3.7's clamped SwiGLUs)."""

    def _apply_gate(self, gate_up):
        gate, up = gate_up.chunk(2, dim=-1)
        return self.act_fn(gate.clamp(max=1.0)) * up.clamp(-1.0, 1.0)


def test_experts_with_their_own_gate_run_transformers_forward():
    config = transformers.Qwen3MoeConfig(**COMMON, head_dim=8, moe_intermediate_size=24, num_experts=4,
                                         num_experts_per_tok=2)
    experts = _ClampedGateExperts(config)
    assert moe_experts._layout(experts) is None
    assert moe_experts._layout(Qwen3MoeExperts(config)) == moe_experts.ExpertsLayout("silu")


@pytest.mark.parametrize("with_lora", [False, True], ids=["base", "lora"])
def test_transposed_experts_with_the_default_gate_match_eager(with_lora, monkeypatch):
    """Aria's experts: weights stored [E, in, out] (is_transposed) with transformers' default gate."""
    from peft import LoraConfig, get_peft_model
    from transformers.models.aria.modeling_aria import AriaTextConfig, AriaTextMoELayer

    config = AriaTextConfig(hidden_size=32, intermediate_size=24, moe_num_experts=6, moe_topk=2,
                            moe_num_shared_experts=1, hidden_act="silu", experts_implementation="eager")
    torch.manual_seed(3)
    layer = AriaTextMoELayer(config)
    with torch.no_grad():
        for param in layer.parameters():
            param.normal_(0, 0.3)
    layer = torch.nn.Sequential(layer)  # a root module for PEFT
    if with_lora:
        layer = get_peft_model(layer, LoraConfig(r=3, target_parameters=["experts.gate_up_proj",
                                                                         "experts.down_proj"]))
        with torch.no_grad():
            for name, param in layer.named_parameters():
                if "lora_B" in name:
                    param.normal_(0, 0.3)
    x = torch.randn(1, 13, 32, generator=torch.Generator().manual_seed(4))

    def forward_backward(module):
        inputs = x.clone().requires_grad_()
        out = module(inputs)
        params = [p for p in module.parameters() if p.requires_grad]
        return [out, *torch.autograd.grad(out.square().sum(), [inputs, *params])]

    eager = forward_backward(layer)
    ours_layer = copy.deepcopy(layer)
    assert apply_moe_kernels(ours_layer) == 1
    assert moe_experts._layout(moe_experts._experts_modules(ours_layer)[0]) == moe_experts.ExpertsLayout(
        "silu", transposed=True)
    calls = experts_calls(monkeypatch)
    ours = forward_backward(ours_layer)
    assert len(calls) == 1
    for a, b in zip(ours, eager):
        assert (a - b).abs().max() <= 5e-6 * max(b.abs().max().item(), 1.0)
