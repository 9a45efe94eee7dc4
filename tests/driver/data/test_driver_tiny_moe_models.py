"""The tiny MoE presets beyond Qwen3-MoE (tiny://gpt-oss, tiny://ernie4.5-moe, tiny://gemma4-moe): built
deterministically, loaded by AutoModelForCausalLM as the driver loads them, seen as MoE, and every
experts module running on pykernels' grouped kernels with the same logits as transformers' experts."""

import pytest
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

from driver.data.tiny_model import ARCHITECTURES, build_tiny_model
from driver.policy.model import is_moe
from pykernels.integrations.transformers import apply_moe_kernels

PRESETS = {"gpt-oss": "eager", "ernie4.5-moe": "sdpa", "gemma4-moe": "sdpa"}  # GPT-OSS has no SDPA (sinks)


@pytest.mark.parametrize("kind", list(PRESETS))
def test_preset_loads_and_runs_its_experts_on_the_kernels(kind, tmp_path, monkeypatch):
    monkeypatch.setenv("PYKERNELS_CACHE", str(tmp_path))
    assert kind in ARCHITECTURES
    directory = build_tiny_model(kind)
    assert build_tiny_model(kind) == directory  # cached under its fingerprint
    model = AutoModelForCausalLM.from_pretrained(directory, dtype=torch.float32,
                                                 attn_implementation=PRESETS[kind]).eval()
    assert is_moe(model.config)
    ids = AutoTokenizer.from_pretrained(directory)("2 + 3 = 5, 7 + 1 = 8", return_tensors="pt").input_ids
    with torch.no_grad():
        expected = model(input_ids=ids).logits
        assert apply_moe_kernels(model) == 2
        torch.testing.assert_close(model(input_ids=ids).logits, expected, atol=1e-5, rtol=0)
