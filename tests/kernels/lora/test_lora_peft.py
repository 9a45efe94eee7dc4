"""apply_fused_lora on PEFT models of tiny Llama and Qwen2: same logits and LoRA gradients as PEFT."""

import copy

import pytest
import torch
from peft import LoraConfig, get_peft_model

from driver.data.tiny_model import resolve_model_path
from driver.policy.model import quantize_linears
from pykernels.integrations.peft import apply_fused_lora, unpatch

TARGETS = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]
IDS = torch.tensor([[5, 60, 7, 80, 9, 100, 11, 12, 200, 14], [21, 22, 230, 24, 25, 26, 270, 28, 29, 30]])


def peft_model(kind: str, dtype=torch.float32, nf4_base=False, **lora):
    from transformers import AutoModelForCausalLM

    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_pretrained(resolve_model_path(f"tiny://{kind}"), dtype=dtype)
    if nf4_base:
        quantize_linears(model, 64)
    config = LoraConfig(r=lora.pop("r", 8), lora_alpha=16, target_modules=TARGETS, init_lora_weights=False, **lora)
    return get_peft_model(model, config)


def logits_and_grads(model):
    model.zero_grad()
    logits = model(input_ids=IDS).logits
    (logits.float().square().mean()).backward()
    grads = {name: p.grad.detach().double().clone() for name, p in model.named_parameters() if p.requires_grad}
    return logits.detach().double(), grads


def assert_close_to(ours, theirs, exact, name, eps):
    """Within 2x PEFT's mean error against the precise reference (what a systematic error, such as a
    16-bit rounding PEFT does not do, moves) and 4x its worst element's, plus eps: a whole model's
    gradients compound the rounding of every layer, so one element's error is partly luck (layer 0's
    k_proj lora_A: 2.07x PEFT's worst on a CPU without AVX-512, 2.38x on an AVX-512 one without BF16,
    1.40x its mean)."""
    ours, theirs = (ours - exact).abs(), (theirs - exact).abs()
    for what, err_ours, err_theirs, factor in (("mean", ours.mean().item(), theirs.mean().item(), 2),
                                               ("max", ours.max().item(), theirs.max().item(), 4)):
        assert err_ours <= factor * err_theirs + eps, (f"{name}: {what} |fused - ref| {err_ours:.3g} > "
                                                       f"{factor} * {what} |peft - ref| {err_theirs:.3g} + {eps:.3g}")


@pytest.mark.parametrize("nf4_base", [False, True])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("kind", ["llama", "qwen2"])
def test_fused_matches_peft(kind, dtype, nf4_base):
    model = peft_model(kind, dtype, nf4_base)
    # The precise reference: the same weights in a wider dtype (fp64 for dense bases; for NF4
    # bases, fp32 arithmetic on the very same dequantized weights).
    reference = copy.deepcopy(model).to(torch.float32 if nf4_base else torch.float64)
    exact_logits, exact_grads = logits_and_grads(reference)
    peft_logits, peft_grads = logits_and_grads(model)
    assert apply_fused_lora(model) == 14  # 7 projections x 2 layers
    fused_logits, fused_grads = logits_and_grads(model)
    # eps: half an ulp of the dtype at the tensor's magnitude for bf16 (tests/cuda_oracle.py's rule):
    # the fused ops round at other points than PEFT, and a whole model's gradients compound it.
    eps = 1e-5 if dtype == torch.float32 else 2.0**-8
    assert_close_to(fused_logits, peft_logits, exact_logits, "logits", eps * exact_logits.abs().max().item())
    assert fused_grads.keys() == peft_grads.keys() and len(fused_grads) == 28
    for name, grad in fused_grads.items():
        scale = exact_grads[name].abs().max().item()
        assert_close_to(grad, peft_grads[name], exact_grads[name], name, eps * scale + 1e-12)


def test_unpatch_restores_peft_and_saved_adapters_are_unchanged(tmp_path):
    model = peft_model("qwen2")
    before = model(input_ids=IDS).logits.detach()
    model.save_pretrained(tmp_path / "plain")
    assert apply_fused_lora(model) == 14 and apply_fused_lora(model) == 0  # idempotent
    model.save_pretrained(tmp_path / "fused")
    for name in ("adapter_model.safetensors", "adapter_config.json"):
        assert (tmp_path / "fused" / name).read_bytes() == (tmp_path / "plain" / name).read_bytes()
    assert unpatch(model) == 14
    torch.testing.assert_close(model(input_ids=IDS).logits.detach(), before, atol=0, rtol=0)


def test_multiple_adapters_use_the_active_one():
    model = peft_model("llama")
    model.add_adapter("second", LoraConfig(r=4, lora_alpha=8, target_modules=TARGETS, init_lora_weights=False))
    for adapter in ("default", "second"):
        model.set_adapter(adapter)
        expected = model(input_ids=IDS).logits.detach()
        apply_fused_lora(model)
        torch.testing.assert_close(model(input_ids=IDS).logits.detach(), expected, atol=2e-5, rtol=1e-4)
        unpatch(model)


def test_rslora_and_disabled_adapter():
    model = peft_model("llama", use_rslora=True)
    expected = model(input_ids=IDS).logits.detach()
    apply_fused_lora(model)
    torch.testing.assert_close(model(input_ids=IDS).logits.detach(), expected, atol=2e-5, rtol=1e-4)
    with model.disable_adapter():
        base = model(input_ids=IDS).logits.detach()
    assert (base - expected).abs().max() > 1e-3


def test_dora_layers_stay_on_peft_with_a_warning():
    model = peft_model("llama", use_dora=True)
    with pytest.warns(UserWarning, match="DoRA"):
        assert apply_fused_lora(model) == 0


def test_dropout_runs_in_training_only():
    model = peft_model("qwen2", lora_dropout=0.3)
    apply_fused_lora(model)
    model.eval()
    evaluation = [model(input_ids=IDS).logits.detach() for _ in range(2)]
    assert torch.equal(*evaluation)
    model.train()
    assert not torch.equal(model(input_ids=IDS).logits.detach(), model(input_ids=IDS).logits.detach())


def test_bitsandbytes_linear4bit_bases_are_used_without_requantizing():
    import bitsandbytes as bnb
    from torch import nn

    torch.manual_seed(0)
    model = torch.nn.Sequential()
    linear = nn.Linear(128, 64)
    quantized = bnb.nn.Linear4bit(128, 64, compress_statistics=True, quant_type="nf4")
    quantized.load_state_dict(linear.state_dict())
    model.add_module("proj", quantized.to("cpu"))
    peft = get_peft_model(model, LoraConfig(r=8, lora_alpha=16, target_modules=["proj"], init_lora_weights=False))
    x = torch.randn(5, 128)
    expected = peft(x).detach()
    assert apply_fused_lora(peft) == 1
    torch.testing.assert_close(peft(x).detach(), expected, atol=1e-4, rtol=1e-4)
