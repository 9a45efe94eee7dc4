"""After every adapter sync, prove the engine serves the new weights.

The same fixed probe sequence is scored by the engine (prompt logprobs) and by the trainer. With a
dense base both compute the same function, so their logprobs must agree to numerical noise
("absolute" mode). With QLoRA the trainer's base is NF4 while vLLM serves the unquantized base, so
neither the logprobs nor their changes agree exactly (the same adapter acts on different weights).
"delta" mode checks that the engine's probe logprobs moved since the previous version the way the
trainer's did: in a similar direction (cosine) and by a similar amount (norm ratio). An engine still
serving the old adapter shows no change at all.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from driver.rollout.base import SyncError

PROBE_TEXT = "The quick brown fox jumps over the lazy dog. Write digits: 0123456789 apple river stone"
MIN_CHANGE_COSINE = 0.5  # delta mode: engine and trainer probe changes point the same way
CHANGE_RATIO_RANGE = (0.2, 5.0)  # delta mode: and have comparable sizes


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
            metrics.update(self._check_change(engine - self._previous[0], trainer - self._previous[1], version))
        self._previous = (engine, trainer)
        return metrics

    def _check_change(self, engine_change: torch.Tensor, trainer_change: torch.Tensor, version: int) -> dict:
        trainer_norm, engine_norm = float(trainer_change.norm()), float(engine_change.norm())
        if float(trainer_change.abs().max()) <= self.tolerance:
            return {}  # the update was too small to tell a served adapter from a stale one
        cosine = float(engine_change @ trainer_change) / max(trainer_norm * engine_norm, 1e-30)
        ratio = engine_norm / trainer_norm
        if cosine < MIN_CHANGE_COSINE or not CHANGE_RATIO_RANGE[0] <= ratio <= CHANGE_RATIO_RANGE[1]:
            raise SyncError(
                f"adapter version {version}: since the last sync the trainer's probe logprobs moved by "
                f"{trainer_norm:.3g} (L2) but vLLM's by {engine_norm:.3g}, cosine {cosine:.2f}; the engine is not "
                "serving the weights just saved")
        return {"sync/probe_change_cosine": cosine, "sync/probe_change_ratio": ratio}


def verify_sync(verifier: SyncVerifier, engine_probe: Callable[[list[int]], list[float]],
                trainer_probe: Callable[[list[int]], torch.Tensor], version: int) -> dict[str, float]:
    return verifier.check(engine_probe(verifier.probe_ids), trainer_probe(verifier.probe_ids), version)
