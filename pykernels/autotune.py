"""Pre-fill the dispatch cache for a model: `python -m pykernels.autotune MODEL --tokens N`.

    python -m pykernels.autotune /models/Qwen3-30B-A3B --tokens 16384 --dtype bfloat16 --lora-r 16

MODEL is a Hugging Face model directory, its config.json, or a Hub model id (org/name: its config.json
fetched into the Hub's cache, or read from there offline). From it come the shapes every op sees
in training: the attention and MLP projections for LoRA (and NF4 with --qlora), the experts for
MoE models, the lm_head for logprobs. Each (op, shape bucket) is run once under ``auto``
(pykernels/dispatch.py), so a training run starts with every decision made and logged here instead
of paying the checks in its first step. Without CUDA it says so and decides nothing (exit 0);
--device cpu runs the decision with the CPU kernels standing in (how it is tested).
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import re
import sys
from pathlib import Path

import torch

from pykernels import backend, dispatch, dispatch_cache

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


class UsageError(Exception):
    """A bad argument or model config; main() prints it and exits 2."""


HUB_ID = re.compile(r"^\w[\w.-]*/\w[\w.-]*$")  # org/name (driver.config's pattern: pykernels imports no driver)


def read_config(model: str) -> dict:
    path = Path(model)
    path = path / "config.json" if path.is_dir() else path
    if not path.exists() and HUB_ID.match(model):
        path = hub_config(model)
    if not path.is_file():
        raise UsageError(f"model: {model} is neither a model directory with a config.json, a config.json file, nor "
                         "a Hub model id (org/name)")
    try:
        config = json.loads(path.read_text())
    except ValueError as error:
        raise UsageError(f"model: {path} is not valid JSON ({error})") from None
    config = config.get("text_config", config)  # multimodal configs nest the language model's
    missing = [key for key in ("hidden_size", "vocab_size", "num_attention_heads") if key not in config]
    if missing:
        raise UsageError(f"model: {path} has no {', '.join(missing)} (not a decoder LM config?)")
    return config


def hub_config(repo_id: str) -> Path:
    """The Hub model's config.json, from the Hub's cache (fetched there first when the Hub is reachable)."""
    from huggingface_hub import hf_hub_download
    from huggingface_hub.errors import HfHubHTTPError, LocalEntryNotFoundError, RepositoryNotFoundError

    try:
        return Path(hf_hub_download(repo_id, "config.json"))
    except RepositoryNotFoundError:
        raise UsageError(f"model: {repo_id} is not a model on the Hugging Face Hub (a private or gated one needs "
                         "`hf auth login`, or HF_TOKEN)") from None
    except LocalEntryNotFoundError:
        raise UsageError(f"model: {repo_id}'s config.json is not in the Hugging Face cache and the Hub cannot be "
                         f"reached (or HF_HUB_OFFLINE is set): `hf download {repo_id} config.json` where it can") \
            from None
    except (HfHubHTTPError, OSError) as error:
        raise UsageError(f"model: fetching {repo_id}'s config.json from the Hugging Face Hub failed: {error}") \
            from None


def op_shapes(config: dict) -> dict:
    """The weight shapes of each op, from a transformers config (exact: they are not bucketed)."""
    hidden, heads = config["hidden_size"], config["num_attention_heads"]
    head_dim = config.get("head_dim") or hidden // heads
    kv_heads = config.get("num_key_value_heads") or heads
    experts = config.get("num_local_experts") or config.get("num_experts") or config.get("n_routed_experts") or 0
    linears = {(hidden, heads * head_dim), (hidden, kv_heads * head_dim), (heads * head_dim, hidden)}
    moe = None
    if experts:
        inter = config.get("moe_intermediate_size") or config["intermediate_size"]
        moe = {"experts": experts, "top_k": config.get("num_experts_per_tok", 2), "hidden": hidden, "inter": inter}
    if not experts or config.get("shared_expert_intermediate_size") or config.get("n_shared_experts"):
        inter = config.get("shared_expert_intermediate_size") or config.get("intermediate_size")
        if inter:
            linears |= {(hidden, inter), (inter, hidden)}
    return {"linears": sorted(linears), "moe": moe, "vocab": config["vocab_size"], "hidden": hidden}


def _decide_all(shapes: dict, tokens: int, dtype: torch.dtype, lora_r: int, qlora: bool, device: str) -> None:
    """Call each op once on random inputs of its shapes under auto: dispatch decides and caches."""
    import pykernels.logprobs
    import pykernels.lora
    import pykernels.moe
    import pykernels.nf4

    def randn(*shape):
        return torch.randn(*shape, dtype=dtype, device=device) * 0.1

    for in_features, out_features in shapes["linears"]:
        weight = randn(out_features, in_features)
        if qlora:
            weight = pykernels.nf4.quantize(weight)
            pykernels.nf4.dequantize(weight, dtype)
        pykernels.lora.lora_linear(randn(tokens, in_features), weight, randn(lora_r, in_features),
                                   randn(out_features, lora_r), 2.0)
    moe = shapes["moe"]
    if moe:
        experts, top_k, hidden, inter = moe["experts"], moe["top_k"], moe["hidden"], moe["inter"]
        logits = torch.randn(tokens, experts, device=device)
        top_k_weights, top_k_index = logits.softmax(-1).topk(top_k, dim=-1)
        pykernels.moe.experts_forward(randn(tokens, hidden), top_k_index, top_k_weights.to(dtype),
                                      randn(experts, 2 * inter, hidden), randn(experts, hidden, inter))
    targets = torch.randint(0, shapes["vocab"], (tokens,), device=device)
    pykernels.logprobs.token_logprobs(randn(tokens, shapes["hidden"]), randn(shapes["vocab"], shapes["hidden"]),
                                      targets)


def parse_args(argv: list[str]) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="python -m pykernels.autotune", description=__doc__.splitlines()[0])
    parser.add_argument("model", help="Hugging Face model directory, config.json path, or Hub model id")
    parser.add_argument("--tokens", type=int, required=True, help="tokens per micro-batch (packed), e.g. 16384")
    parser.add_argument("--dtype", default="bfloat16", help="bfloat16 | float16 | float32 (default bfloat16)")
    parser.add_argument("--lora-r", type=int, default=16, help="LoRA rank (default 16)")
    parser.add_argument("--qlora", action="store_true", help="NF4 bases: decide nf4 and LoRA-on-NF4 too")
    parser.add_argument("--device", default="cuda", help="cuda (default), cuda:N, or cpu (the CPU kernels)")
    args = parser.parse_args(argv)
    if args.tokens < 1:
        raise UsageError(f"--tokens must be >= 1, got {args.tokens}")
    if args.lora_r < 1:
        raise UsageError(f"--lora-r must be >= 1, got {args.lora_r}")
    if args.dtype not in DTYPES:
        raise UsageError(f"--dtype must be one of {', '.join(DTYPES)}, got {args.dtype!r}")
    if not (args.device == "cpu" or args.device.startswith("cuda")):
        raise UsageError(f"--device must be cuda, cuda:N or cpu, got {args.device!r}")
    return args


def main(argv: list[str] | None = None) -> int:
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    try:
        args = parse_args(sys.argv[1:] if argv is None else argv)
        shapes = op_shapes(read_config(args.model))
    except UsageError as error:
        print(f"pykernels.autotune: {error}", file=sys.stderr)
        return 2
    if args.device.startswith("cuda") and not torch.cuda.is_available():
        print("pykernels.autotune: no CUDA device here: nothing decided (auto uses our CPU kernels on CPU; "
              "--device cpu exercises the decision with them)")
        return 0
    if args.device == "cpu":
        os.environ[dispatch.CPU_ENV_VAR] = "1"
    with backend.kernels_mode("auto"):
        _decide_all(shapes, args.tokens, DTYPES[args.dtype], args.lora_r, args.qlora, args.device)
    print(f"pykernels.autotune: decisions in {dispatch_cache.cache_path()}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
