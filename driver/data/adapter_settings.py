"""lora.init_from: training starts from a trained LoRA adapter (an SFT run's; axolotl's lora_model_dir, TRL's
model=PeftModel.from_pretrained(base, path, is_trainable=True)) instead of PEFT's fresh one (B = 0).

The adapter's shape and scaling (r, alpha, rslora, targets, expert_targets) become the lora section's before
anything is written, so the run's config.yaml, the vLLM server's LoRA limits and a resume all see the
adapter's own; a value the config gives must agree (said by key otherwise). Its lora_dropout is taken too
(PeftModel.from_pretrained's, which TRL and axolotl train with) unless lora.dropout is given. Its weights are
loaded by driver/policy/model.py into the adapter load_policy builds on our kernels (QLoRA's NF4 base included).
"""

from __future__ import annotations

import json
from pathlib import Path

from driver.cli import ConfigError
from driver.config import Config
from driver.data.model_source import adapter_directory

# adapter_config.json's options beyond plain LoRA (A and B on named modules, one r and alpha), and what to say
# about each: neither driver/merge_lora.py merges them nor do our LoRA layers train them.
BEYOND_PLAIN_LORA = {"use_dora": "DoRA", "rank_pattern": "per-module ranks (rank_pattern)",
                     "alpha_pattern": "per-module alphas (alpha_pattern)",
                     "fan_in_fan_out": "fan_in_fan_out (Conv1D layers)"}
# ... and what training from one cannot take either (merging one is fine).
NOT_TRAINED_HERE = {"modules_to_save": "fully trained modules (modules_to_save)",
                    "layers_to_transform": "a subset of layers (layers_to_transform)"}


def beyond_plain_lora(saved: dict) -> list[str]:
    """What an adapter_config.json uses of BEYOND_PLAIN_LORA, trained biases included."""
    found = [what for key, what in BEYOND_PLAIN_LORA.items() if saved.get(key)]
    if saved.get("bias", "none") != "none" or saved.get("lora_bias"):
        found.append("trained biases")
    return found


def adopt_adapter_settings(config: Config) -> None:
    """lora.r, alpha, rslora, targets, expert_targets (and dropout) from lora.init_from's adapter_config.json; a
    ConfigError when the config gives another value, or the adapter is not one this run can train on."""
    if config.lora.init_from is None:
        return
    directory = Path(adapter_directory(config.lora.init_from))
    saved = json.loads((directory / "adapter_config.json").read_text())
    check_trainable_here(saved, config.lora.init_from)
    adopted = {"r": int(saved["r"]), "alpha": float(saved["lora_alpha"]), "rslora": bool(saved.get("use_rslora")),
               "targets": module_names(saved.get("target_modules"), config.lora.init_from),
               "expert_targets": sorted(saved.get("target_parameters") or [])}
    given = config.lora.model_fields_set
    for key, value in adopted.items():
        ours = getattr(config.lora, key)
        same = sorted(ours) == value if isinstance(value, list) else ours == value
        if key in given and not same:
            raise ConfigError(f"lora.{key} = {ours}, but the adapter lora.init_from ({config.lora.init_from}) has "
                              f"{value}: leave lora.{key} out (the adapter's is taken) or give its value")
        if not same:
            setattr(config.lora, key, value)
    if "dropout" not in given:  # a training knob, not what the adapter computes: one given wins, as in PEFT's config=
        config.lora.dropout = float(saved.get("lora_dropout") or 0.0)


def check_trainable_here(saved: dict, source: str) -> None:
    if saved.get("peft_type") != "LORA":
        raise ConfigError(f"lora.init_from: {source} is a {saved.get('peft_type')} adapter; training continues "
                          "LoRA adapters only")
    found = beyond_plain_lora(saved) + [what for key, what in NOT_TRAINED_HERE.items() if saved.get(key)]
    if found:
        raise ConfigError(f"lora.init_from: {source} uses {', '.join(found)}, which this driver's LoRA layers do not "
                          "train")


def module_names(targets, source: str) -> list[str]:
    """target_modules as lora.targets takes them: names (PEFT also saves a pattern, or "all-linear")."""
    if isinstance(targets, str):
        raise ConfigError(f"lora.init_from: {source} targets modules by the pattern {targets!r}; lora.targets takes "
                          "module names: an adapter saved with a list of them (PEFT's target_modules=[...])")
    return sorted(targets or [])
