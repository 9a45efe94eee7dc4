"""quantize_moe_experts (QLoRA on MoE experts): a tiny transformers MoE model with NF4 experts, with
and without PEFT LoRA on experts and attention, equals transformers' eager experts + PEFT on the
dequantized weights (logits, loss, every trainable gradient); no 16-bit expert weight is left;
the adapter can be disabled (the KL reference); what only PEFT could run is a clear error."""

import copy

import pytest
import torch
from test_moe_transformers import assert_same, build, run

from pykernels.integrations.transformers import quantize_moe_experts
from pykernels.nn import NF4ExpertWeight

LORA_TARGETS = dict(target_modules=["q_proj", "v_proj"],
                    target_parameters=["mlp.experts.gate_up_proj", "mlp.experts.down_proj"])


def dequantized_twin(model):
    """The model as eager transformers sees it after NF4 round-tripping its expert weights."""
    twin = copy.deepcopy(model)
    for module in twin.modules():
        for name in ("gate_up_proj", "down_proj"):
            weight = module._parameters.get(name) if hasattr(module, "_is_expert_parallel") else None
            if weight is not None:
                with torch.no_grad():
                    weight.copy_(NF4ExpertWeight.from_tensor(weight).weight.dequantize())
    return twin


def peft_pair(family):
    from peft import LoraConfig, get_peft_model

    config = LoraConfig(r=4, lora_alpha=8, **LORA_TARGETS)
    base = build(family)
    eager = get_peft_model(dequantized_twin(base), config)
    with torch.no_grad():  # non-zero B so that LoRA changes the output
        for name, param in eager.named_parameters():
            if "lora_B" in name:
                param.copy_(torch.randn(param.shape, generator=torch.Generator().manual_seed(len(name))))
    ours = get_peft_model(copy.deepcopy(base), config)
    # LoRA factors only: the base must stay the original, since quantizing the dequantized weights
    # again is not an identity (double quantization's statistics move).
    ours.load_state_dict({k: v for k, v in eager.state_dict().items() if "lora_" in k}, strict=False)
    return ours, eager


@pytest.mark.parametrize("family", ["qwen3_moe", "mixtral", "olmoe"])
def test_nf4_experts_with_lora_match_eager_on_the_dequantized_weights(family):
    ours, eager = peft_pair(family)
    assert quantize_moe_experts(ours) == 2
    assert not [n for n, _ in ours.named_parameters() if n.endswith(("experts.gate_up_proj", "experts.down_proj"))]
    assert sum(isinstance(m, NF4ExpertWeight) for m in ours.modules()) == 4
    ids = torch.randint(0, 128, (2, 9), generator=torch.Generator().manual_seed(1))
    result = run(ours, ids)
    assert any("experts" in n and "lora_B" in n for n in result[2])
    assert_same(result, run(eager, ids), atol=2e-6)
    with torch.no_grad(), ours.disable_adapter(), eager.disable_adapter():  # the KL reference
        torch.testing.assert_close(ours(input_ids=ids).logits, eager(input_ids=ids).logits, atol=2e-6, rtol=0)


def test_nf4_experts_without_peft_and_dtype_casts_leave_the_codes_alone():
    model = build("qwen3_moe")
    eager = dequantized_twin(model)
    assert quantize_moe_experts(model) == 2
    assert quantize_moe_experts(model) == 0  # already quantized
    ids = torch.randint(0, 128, (2, 9), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        torch.testing.assert_close(model(input_ids=ids).logits, eager(input_ids=ids).logits, atol=2e-6, rtol=0)
    weight = next(m for m in model.modules() if isinstance(m, NF4ExpertWeight))
    absmax_q, code = weight.absmax_q.clone(), weight.nested_code.clone()
    model.to(torch.bfloat16)
    assert weight.nested_code.dtype == torch.float32 and torch.equal(weight.nested_code, code)
    assert torch.equal(weight.absmax_q, absmax_q) and weight.dtype == torch.float32


def test_what_only_peft_could_run_is_a_clear_error():
    ours, _ = peft_pair("qwen3_moe")
    quantize_moe_experts(ours)
    ours.base_model.model.config._experts_implementation = "eager"  # someone switched the kernels off
    ids = torch.randint(0, 128, (1, 5))
    with pytest.raises(RuntimeError, match="holds NF4 expert weights"):
        ours(input_ids=ids)
