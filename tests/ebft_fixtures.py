"""Shared by the EBFT tests: a policy whose adapter is not zero (so that reading features with the
adapter still enabled would show), and the base model loaded separately as the features' oracle."""

import torch


def policy_with_random_adapter(config, std: float):
    from driver.policy.model import load_policy

    policy = load_policy(config)
    with torch.no_grad():
        for name, param in policy.model.named_parameters():
            if "lora_B" in name:
                param.normal_(0, std)
    return policy


def separate_base_model(policy):
    """The base weights loaded afresh: no adapter, no pykernels layers, plain transformers."""
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(policy.model_dir, dtype=torch.float32).eval()


def full_policy_moved_from_its_base(config, std: float):
    """Full fine-tuning (model.adapter: none) with every weight moved away from the base's, as training moves
    them: EBFT's features must come from the frozen copy of the base, which reading the policy would miss."""
    from driver.policy.model import load_policy

    config = config.model_copy(deep=True)
    config.model.adapter = "none"
    policy = load_policy(config)
    assert policy.frozen_reference is not None  # EBFT keeps the copy without a KL term
    generator = torch.Generator().manual_seed(1)
    with torch.no_grad():
        for param in policy.model.parameters():
            param.add_(torch.randn(param.shape, generator=generator) * std)
    return policy
