"""driver.merge_lora against PEFT: the merged model's logits equal PEFT's (base + adapter) on the same
input, on the tiny dense and MoE models (LoRA on experts through target_parameters), with rsLoRA, and
for QLoRA with the NF4 round trip, where PEFT runs on the round-tripped base (the weights the adapter
trained against); plus the refusals. The merged model loading in vLLM: tests/e2e/test_driver_e2e.py."""

import json

import pytest
import torch
import yaml
from peft import PeftModel
from transformers import AutoModelForCausalLM

import driver.policy.nf4_base as nf4_base_module
from driver.cli import ConfigError
from driver.config import Config
from driver.merge_lora import main, merge
from driver.policy.model import load_policy
from driver.policy.nf4_base import nf4_base

EXPERTS = ["mlp.experts.gate_up_proj", "mlp.experts.down_proj"]
INPUT = torch.tensor([[3, 17, 101, 250, 7, 42, 99, 311, 5, 64, 128]])


@pytest.fixture(autouse=True)
def private_cache(tmp_path, monkeypatch):
    monkeypatch.setattr(nf4_base_module, "cache_root", lambda: tmp_path / "cache")


def trained_run(tmp_path, path, *, qlora=False, dtype="float32", rslora=False, seed=0):
    """A run directory as driver.train leaves it (config.yaml + adapter/), the adapter non-zero."""
    overrides = {"model": {"path": path, "qlora": qlora, "dtype": dtype},
                 "lora": {"r": 4, "alpha": 8, "rslora": rslora, "targets": ["q_proj", "v_proj", "o_proj"],
                          "expert_targets": EXPERTS if "moe" in path else []},
                 "logging": {"output_dir": str(tmp_path / "run")}}
    config = Config.model_validate(overrides)
    policy = load_policy(config)
    generator = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, param in policy.model.named_parameters():
            if "lora_" in name:  # B is zero after init: both random, so every delta is visible
                param.copy_(0.05 * torch.randn(param.shape, generator=generator).to(param.dtype))
    run = tmp_path / "run"
    run.mkdir(parents=True)
    (run / "config.yaml").write_text(yaml.safe_dump(config.model_dump(mode="json")))
    policy.save_trained(run / "adapter")
    return run, policy


def logits(model):
    with torch.no_grad():
        return model(input_ids=INPUT).logits.float()


def peft_logits(base_dir, adapter_dir, dtype):
    base = AutoModelForCausalLM.from_pretrained(base_dir, dtype=dtype)
    return logits(PeftModel.from_pretrained(base, adapter_dir).eval())


@pytest.mark.parametrize(("path", "rslora"), [("tiny://qwen2", False), ("tiny://qwen2", True),
                                              ("tiny://qwen3-moe", False)])
def test_merged_logits_equal_peft(tmp_path, path, rslora):
    run, policy = trained_run(tmp_path, path, rslora=rslora)
    out = merge(run, tmp_path / "merged")
    merged = AutoModelForCausalLM.from_pretrained(out, dtype=torch.float32)
    expected = peft_logits(policy.model_dir, run / "adapter", torch.float32)
    base = logits(AutoModelForCausalLM.from_pretrained(policy.model_dir, dtype=torch.float32))
    assert float((expected - base).abs().max()) > 1e-2  # the adapter changes the logits
    torch.testing.assert_close(logits(merged), expected, atol=2e-5, rtol=1e-5)
    assert (out / "tokenizer.json").is_file() and (out / "config.json").is_file()


@pytest.mark.parametrize(("path", "dtype", "atol"), [("tiny://qwen2", "float32", 2e-5),
                                                      ("tiny://qwen3-moe", "float32", 2e-5),
                                                      ("tiny://qwen2", "bfloat16", 0.1)])
def test_a_qlora_run_merges_into_the_nf4_round_trip(tmp_path, path, dtype, atol):
    run, policy = trained_run(tmp_path, path, qlora=True, dtype=dtype)
    out = merge(run, tmp_path / "merged")  # the run's config: model.qlora -> --simulate-nf4
    torch_dtype = getattr(torch, dtype)
    merged = logits(AutoModelForCausalLM.from_pretrained(out, dtype=torch_dtype))
    round_tripped = nf4_base(policy.model_dir, torch_dtype, blocksize=64)
    expected = peft_logits(round_tripped, run / "adapter", torch_dtype)
    torch.testing.assert_close(merged, expected, atol=atol, rtol=0)
    plain = logits(AutoModelForCausalLM.from_pretrained(merge(run, tmp_path / "plain", simulate_nf4=False),
                                                        dtype=torch_dtype))
    assert float((plain - expected).abs().max()) > 5 * atol  # without the round trip: another model


def test_experts_only_round_trip(tmp_path):
    run, policy = trained_run(tmp_path, "tiny://qwen3-moe", qlora=True)
    out = merge(run, tmp_path / "merged", simulate_nf4_experts=True)
    merged = AutoModelForCausalLM.from_pretrained(out, dtype=torch.float32)
    base = AutoModelForCausalLM.from_pretrained(policy.model_dir, dtype=torch.float32)
    round_tripped = AutoModelForCausalLM.from_pretrained(nf4_base(policy.model_dir, torch.float32, 64),
                                                         dtype=torch.float32)
    layer, original, nf4 = merged.model.layers[0], base.model.layers[0], round_tripped.model.layers[0]
    # Attention: the base's weights plus the delta (not round-tripped); the untargeted k_proj is the base's.
    assert torch.equal(layer.self_attn.k_proj.weight, original.self_attn.k_proj.weight)
    scaling = 8 / 4
    adapter = policy.causal_lm.model.layers[0].self_attn.q_proj
    delta = scaling * adapter.lora_B["default"].weight @ adapter.lora_A["default"].weight
    torch.testing.assert_close(layer.self_attn.q_proj.weight, original.self_attn.q_proj.weight + delta)
    assert not torch.equal(layer.mlp.experts.gate_up_proj, original.mlp.experts.gate_up_proj)
    assert not torch.equal(layer.mlp.experts.gate_up_proj, nf4.mlp.experts.gate_up_proj)  # round trip + delta
    assert torch.equal(layer.mlp.gate.weight, original.mlp.gate.weight)  # the router: not quantized, not adapted


def test_refusals_name_what_is_wrong(tmp_path, capsys):
    run, _ = trained_run(tmp_path, "tiny://qwen2")
    adapter_config = json.loads((run / "adapter" / "adapter_config.json").read_text())
    for change, named in (({"use_dora": True}, "DoRA"), ({"peft_type": "ADALORA"}, "ADALORA adapter"),
                          ({"rank_pattern": {"q_proj": 8}}, "rank_pattern")):
        (run / "adapter" / "adapter_config.json").write_text(json.dumps({**adapter_config, **change}))
        with pytest.raises(ConfigError, match=named):
            merge(run, tmp_path / f"out-{named}")
    (run / "adapter" / "adapter_config.json").write_text(json.dumps(adapter_config))
    assert main([str(tmp_path / "nowhere"), "--out", str(tmp_path / "x")]) == 2
    assert "neither an adapter directory" in capsys.readouterr().err
    assert main([str(run), "--out", str(tmp_path / "cli")]) == 0 and (tmp_path / "cli" / "config.json").is_file()
    assert main([str(run), "--out", str(tmp_path / "cli")]) == 2  # not empty: nothing overwritten
    assert "not empty" in capsys.readouterr().err
