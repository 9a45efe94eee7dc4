"""The NF4 round-trip base vLLM serves under QLoRA (driver/policy/nf4_base.py): loaded back by
transformers, its quantized weights equal what the trainer's NF4 layers dequantize to, bit for bit,
in fp32 and bf16, dense and MoE (experts stored per expert in the checkpoint, fused by the trainer),
across shards; everything else is the base's; it is built once per settings and reused."""

import pytest
import torch
from transformers import AutoModelForCausalLM

import driver.policy.nf4_base as nf4_base_module
from driver.config import Config
from driver.data.tiny_model import resolve_model_path
from driver.policy.model import load_policy
from driver.policy.nf4_base import meta_model, nf4_base, quantized_tensors
from pykernels.nn import NF4ExpertWeight, NF4Linear

EXPERTS = ["mlp.experts.gate_up_proj", "mlp.experts.down_proj"]


@pytest.fixture(autouse=True)
def private_cache(tmp_path, monkeypatch):
    monkeypatch.setattr(nf4_base_module, "cache_root", lambda: tmp_path / "cache")


def qlora_policy(path, dtype, blocksize=64):
    config = Config.model_validate({"model": {"path": path, "qlora": True, "dtype": dtype,
                                              "qlora_blocksize": blocksize},
                                    "lora": {"r": 4, "targets": ["q_proj", "v_proj"],
                                             "expert_targets": EXPERTS if "moe" in path else []}})
    return load_policy(config)


def trainer_weights(policy) -> dict[str, torch.Tensor]:
    """The dense weights the trainer computes with, under transformers' (fused) names."""
    weights = {}
    for name, module in policy.causal_lm.named_modules():
        clean = name.replace(".base_layer", "")
        if isinstance(module, NF4Linear):
            weights[f"{clean}.weight"] = module.weight.dequantize()
        elif isinstance(module, NF4ExpertWeight):
            weights[clean] = module.weight.dequantize()
    return weights


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
@pytest.mark.parametrize("path", ["tiny://qwen2", "tiny://qwen3-moe"])
def test_the_served_base_is_what_the_trainer_dequantizes(path, dtype, tmp_path):
    policy = qlora_policy(path, dtype)
    served_dir = nf4_base(policy.model_dir, getattr(torch, dtype), blocksize=64)
    served = dict(AutoModelForCausalLM.from_pretrained(served_dir, dtype=getattr(torch, dtype)).named_parameters())
    original = dict(AutoModelForCausalLM.from_pretrained(policy.model_dir, dtype=getattr(torch, dtype))
                    .named_parameters())
    expected = trainer_weights(policy)
    assert len(expected) == (14 if path == "tiny://qwen2" else 8 + 4)  # 7 linears x 2 layers; 4 attn + 2 x 2 experts
    for name, weight in expected.items():
        assert torch.equal(served[name], weight), name
        assert not torch.equal(original[name], weight), name  # NF4 moved it
    for name, weight in served.items():
        if name not in expected:
            assert torch.equal(weight, original[name]), name  # head, embeddings, norms, routers untouched


def test_the_quantized_names_are_the_trainers():
    for path in ("tiny://qwen2", "tiny://qwen3-moe"):
        policy = qlora_policy(path, "float32")
        found = quantized_tensors(meta_model(policy.model_dir))
        names = set(trainer_weights(policy))
        assert found.linears == {name for name in names if name.endswith(".weight")}
        assert {f"{module}.{proj}" for module in found.experts for proj in ("gate_up_proj", "down_proj")} == \
            {name for name in names if not name.endswith(".weight")}


def test_experts_split_across_shards_and_the_cache_is_reused(tmp_path):
    source = AutoModelForCausalLM.from_pretrained(resolve_model_path("tiny://qwen3-moe"), dtype=torch.float32)
    sharded = tmp_path / "sharded"
    source.save_pretrained(sharded, max_shard_size="60KB")  # every layer's experts over several shards
    assert len(list(sharded.glob("*.safetensors"))) > 4
    served_dir = nf4_base(str(sharded), torch.float32, blocksize=32)
    shards = sorted(p.name for p in sharded.glob("*.safetensors"))
    assert sorted(p.name for p in served_dir.glob("*.safetensors")) == shards
    served = AutoModelForCausalLM.from_pretrained(served_dir, dtype=torch.float32)
    from pykernels.nf4 import quantize

    fused = source.model.layers[1].mlp.experts.gate_up_proj.detach()
    expected = quantize(fused, blocksize=32, double_quant=True).dequantize(torch.float32)
    assert torch.equal(served.model.layers[1].mlp.experts.gate_up_proj, expected)
    stamp = (served_dir / "config.json").stat().st_mtime_ns
    assert nf4_base(str(sharded), torch.float32, blocksize=32) == served_dir
    assert (served_dir / "config.json").stat().st_mtime_ns == stamp  # reused, not rebuilt
    assert nf4_base(str(sharded), torch.float32, blocksize=64) != served_dir  # other settings, other base


def test_the_engine_loads_it_and_the_sync_check_compares_values(tmp_path):
    from driver.engine import engine_model_dir
    from driver.engine.adapter_sync import make_verifier

    config = Config.model_validate({"model": {"qlora": True}, "lora": {"r": 4},
                                    "logging": {"output_dir": str(tmp_path / "run")}})
    policy = load_policy(config)
    assert engine_model_dir(config, policy) == str(nf4_base(policy.model_dir, torch.float32, blocksize=64))
    assert make_verifier(config, policy).base_tolerance is not None  # values compared, as for any base
    config.rollout.backend, config.rollout.server_url = "server", "http://127.0.0.1:1"  # a server of the user's
    assert engine_model_dir(config, policy) == policy.model_dir
    assert make_verifier(config, policy).base_tolerance is None  # movement only
