"""The worker extension of the vLLM servers the driver starts (`--worker-extension-cls`, as TRL's vllm-serve
adds its own): a weight reload from a directory that first re-arms the MoE experts' post-load prepacking.

vLLM's own reload_weights skips that prepacking on CPU after the first load and copies the checkpoint's
expert layout into storage its kernel reads as prepacked, corrupting every MoE layer
(driver/engine/weight_sync.py, whose in-process engine runs the same fix). A server reaches this method
through /collective_rpc by name: driver/engine/server.py calls it on servers whose config names this class
(/server_info), and vLLM's reload_weights on others.
"""

from __future__ import annotations

EXTENSION = "driver.engine.server_worker.ReloadExtension"
RELOAD_METHOD = "reload_weights_rearmed"


class ReloadExtension:
    """Mixed into vLLM's worker class: `self` is the worker."""

    def reload_weights_rearmed(self, weights_path: str) -> None:
        from driver.engine.weight_sync import rearm_expert_prepacking

        rearm_expert_prepacking(self.model_runner.get_model())
        self.reload_weights(weights_path=weights_path)
