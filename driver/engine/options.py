"""The rollout section's vLLM engine options checked against this machine and the installed vLLM, when
an engine (colocated, launched, or `python -m driver.vllm_serve`) is about to start. The config alone
checks ranges and combinations (driver/config.py RolloutConfig); what needs CUDA, how many GPUs are
visible and which quantization methods vLLM knows can only be known here."""

from __future__ import annotations

from driver.cli import ConfigError
from driver.config import Config


def check_engine_options(config: Config, cuda: bool) -> None:
    """ConfigError naming the key when this machine (cuda: a CUDA device is visible) or the installed
    vLLM cannot run the engine the rollout section describes."""
    rollout = config.rollout
    gpus = rollout.tensor_parallel_size * rollout.data_parallel_size
    if gpus > 1:
        parallel = (f"rollout.tensor_parallel_size x rollout.data_parallel_size = {rollout.tensor_parallel_size} x "
                    f"{rollout.data_parallel_size} = {gpus} GPUs")
        if not cuda:
            raise ConfigError(f"{parallel}, but no CUDA device is visible: on CPU vLLM runs one engine here (set both "
                              "to 1)")
        import torch

        if gpus > torch.cuda.device_count():
            raise ConfigError(f"{parallel}, but {torch.cuda.device_count()} CUDA device(s) are visible "
                              "(CUDA_VISIBLE_DEVICES)")
    if rollout.enable_sleep_mode:
        if not cuda:
            raise ConfigError("rollout.enable_sleep_mode needs a CUDA device: vLLM's sleep mode frees GPU memory "
                              "(on CPU set it to false)")
        if config.model.adapter == "none":
            raise ConfigError("rollout.enable_sleep_mode with model.adapter = none: full fine-tuning writes the "
                              "weights into the engine in place, which a sleeping engine cannot take")
    if rollout.quantization is not None:
        from vllm.model_executor.layers.quantization import QUANTIZATION_METHODS

        if rollout.quantization not in QUANTIZATION_METHODS:
            raise ConfigError(f"rollout.quantization = {rollout.quantization!r} is not a quantization method of the "
                              f"installed vLLM: {', '.join(QUANTIZATION_METHODS)}")
