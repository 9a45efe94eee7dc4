"""After every adapter sync, prove the engine serves the new weights.

The same fixed probe sequence is scored by the engine (prompt logprobs) and by the trainer. With a
dense base both compute the same function, so their logprobs must agree to numerical noise
("absolute" mode). With QLoRA the trainer's base is NF4 while vLLM serves the bf16 base, so the
two never agree exactly; instead the *change* of the probe logprobs since the previous version must
agree ("delta" mode): an engine that still serves the old adapter shows no change at all.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from driver.rollout.base import SyncError

PROBE_TEXT = "The quick brown fox jumps over the lazy dog. Write digits: 0123456789 apple river stone"


class SyncVerifier:
    def __init__(self, probe_ids: list[int], tolerance: float, mode: str) -> None:
        if mode not in ("absolute", "delta"):
            raise ValueError(f"mode must be 'absolute' or 'delta', got {mode!r}")
        if len(probe_ids) < 2:
            raise ValueError("the probe needs at least two tokens")
        self.probe_ids, self.tolerance, self.mode = probe_ids, tolerance, mode
        self._previous: tuple[torch.Tensor, torch.Tensor] | None = None

    def check(self, engine_logprobs: list[float], trainer_logprobs: torch.Tensor, version: int) -> dict[str, float]:
        engine = torch.tensor(engine_logprobs, dtype=torch.float64)
        trainer = trainer_logprobs.detach().to(torch.float64).cpu()
        if engine.shape != trainer.shape:
            raise SyncError(f"probe: the engine returned {engine.numel()} logprobs, the trainer {trainer.numel()}")
        gap = float((engine - trainer).abs().max())
        metrics = {"sync/probe_max_abs_diff": gap}
        if self.mode == "absolute" and gap > self.tolerance:
            raise SyncError(
                f"adapter version {version}: vLLM's probe logprobs differ from the trainer's by {gap:.3g} "
                f"(tolerance {self.tolerance:g}); the engine is not serving the weights just saved")
        if self.mode == "delta" and self._previous is not None:
            engine_change, trainer_change = engine - self._previous[0], trainer - self._previous[1]
            mismatch = float((engine_change - trainer_change).abs().max())
            metrics["sync/probe_change_mismatch"] = mismatch
            if mismatch > self.tolerance:
                raise SyncError(
                    f"adapter version {version}: the trainer's probe logprobs moved by up to "
                    f"{float(trainer_change.abs().max()):.3g} since the last sync but vLLM's moved by "
                    f"{float(engine_change.abs().max()):.3g} (mismatch {mismatch:.3g} > {self.tolerance:g}); "
                    "the engine is not serving the adapter just saved")
        self._previous = (engine, trainer)
        return metrics


def verify_sync(verifier: SyncVerifier, engine_probe: Callable[[list[int]], list[float]],
                trainer_probe: Callable[[list[int]], torch.Tensor], version: int) -> dict[str, float]:
    return verifier.check(engine_probe(verifier.probe_ids), trainer_probe(verifier.probe_ids), version)
