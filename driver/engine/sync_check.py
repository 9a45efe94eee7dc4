"""After every adapter sync, prove the engine serves the new weights.

The same fixed probe sequence is scored by the engine (prompt logprobs) and by the trainer after
each sync, whatever the engine serves: the adapter (rollout.weight_sync: adapter), or base + adapter
merged into its weights (merged), against the trainer's unmerged PEFT forward, so a merge that went
wrong (a stale, partial or accumulated one) shows as any stale engine does. The two never agree
exactly outside float32: vLLM's and transformers' bf16 kernels differ by up to ~0.05 per token on
the same weights, by more as the adapter grows, and an MoE
router near a tie can send one token to other experts in each (one token off by 1.5 while the rest
agree). With QLoRA the trainer's base is NF4 while vLLM serves the unquantized one, so the same
adapter acts on different weights. What a stale engine cannot fake is movement: the trainer's
probe logprobs change as it learns, and an engine serving old weights does not follow. So:

1. At the first sync of the run the engine and the trainer hold the same weights: with a dense base
   their probe logprobs must agree within the dtype's noise (`base_tolerance`) on 90% of the tokens,
   which catches a wrong model or dtype. The first sync is the anchor of every later comparison.
2. At every later version, on the probe tokens whose trainer logprob moved by more than the dtype's
   noise (`move_threshold`) since the anchor, the median over tokens of engine move / trainer move
   must lie in (1/2, 2): a served adapter gives ~1 (measured in bf16 on the tiny models: 0.92-1.02
   dense and MoE, 0.69-0.93 QLoRA), an engine still serving the anchor's weights gives 0, one stuck
   at an older version falls below 1/2 once the trainer has moved twice as far. The median ignores
   the few tokens a router flip throws off. With fewer than `min_moved_tokens` tokens moved, the
   version cannot be judged yet (sync/probe_verified = 0): staleness that small changes no sample.
3. In float32 with a dense base both sides compute the same function to ~1e-6, so every version
   must also agree within `tolerance` (rollout.sync_tolerance): the sharpest check, which also
   catches an engine one version behind.
"""

from __future__ import annotations

import torch

from driver.engine.base import SyncError

PROBE_TEXT = "The quick brown fox jumps over the lazy dog. Write digits: 0123456789 apple river stone"
MOVE_RATIO_RANGE = (0.5, 2.0)  # median engine move / trainer move of a served adapter
NOISE_EPS_MULTIPLE = 8  # per-token noise between engine and trainer, in machine epsilons of the dtype
BASE_EPS_MULTIPLE = 32  # the first sync's gap on the same weights, in machine epsilons
MIN_MOVED_FRACTION = 0.1  # a version is judged once this fraction of the probe (and 3 tokens) moved
MAX_OFF_FRACTION = 0.1  # first sync: tokens allowed beyond the noise (router flips)


class SyncVerifier:
    def __init__(self, probe_ids: list[int], *, dtype: torch.dtype, same_base: bool, tolerance: float) -> None:
        if len(probe_ids) < 2:
            raise ValueError("the probe needs at least two tokens")
        if not tolerance > 0:
            raise ValueError(f"tolerance must be > 0, got {tolerance}")
        eps = torch.finfo(dtype).eps
        self.probe_ids, self.dtype, self.tolerance = probe_ids, dtype, tolerance
        self.move_threshold = max(tolerance, NOISE_EPS_MULTIPLE * eps)
        self.base_tolerance = max(tolerance, BASE_EPS_MULTIPLE * eps) if same_base else None
        self.exact = same_base and dtype == torch.float32
        self.min_moved_tokens = max(3, round(MIN_MOVED_FRACTION * (len(probe_ids) - 1)))
        self._anchor: tuple[int, torch.Tensor, torch.Tensor] | None = None  # (version, engine, trainer)

    def check(self, engine_logprobs: list[float], trainer_logprobs: torch.Tensor, version: int) -> dict[str, float]:
        engine = torch.tensor(engine_logprobs, dtype=torch.float64)
        trainer = trainer_logprobs.detach().to(torch.float64).cpu()
        if engine.shape != trainer.shape:
            raise SyncError(f"probe: the engine returned {engine.numel()} logprobs, the trainer {trainer.numel()}")
        gap = float((engine - trainer).abs().max())
        metrics = {"sync/probe_max_abs_diff": gap}
        if self._anchor is None:
            self._check_same_model(engine, trainer, version)
            self._anchor = (version, engine, trainer)
            return metrics
        if self.exact and gap > self.tolerance:
            raise SyncError(
                f"adapter version {version}: vLLM's probe logprobs differ from the trainer's by {gap:.3g} "
                f"(tolerance {self.tolerance:g}); the engine is not serving the weights just saved")
        metrics.update(self._check_movement(engine, trainer, version))
        return metrics

    def _check_same_model(self, engine: torch.Tensor, trainer: torch.Tensor, version: int) -> None:
        """Most tokens agree within the dtype's noise. Not all: a router flip may throw one token off,
        while a wrong model or dtype moves nearly every token."""
        if self.base_tolerance is None:
            return
        off = int(((engine - trainer).abs() > self.base_tolerance).sum())
        if off > MAX_OFF_FRACTION * engine.numel():
            raise SyncError(
                f"adapter version {version} (first sync): vLLM's probe logprobs differ from the trainer's by more "
                f"than {self.base_tolerance:.3g} (the noise of {self.dtype}) on {off} of {engine.numel()} tokens; "
                "the engine does not serve the model the trainer holds")

    def _check_movement(self, engine: torch.Tensor, trainer: torch.Tensor, version: int) -> dict[str, float]:
        anchor_version, anchor_engine, anchor_trainer = self._anchor
        trainer_move, engine_move = trainer - anchor_trainer, engine - anchor_engine
        moved = trainer_move.abs() > self.move_threshold
        count = int(moved.sum())
        if count < self.min_moved_tokens:
            return {"sync/probe_verified": 0.0, "sync/probe_moved_tokens": float(count)}
        ratio = float((engine_move[moved] / trainer_move[moved]).median()) + 0.0  # + 0.0: no '-0.00'
        low, high = MOVE_RATIO_RANGE
        if not low < ratio < high:
            raise SyncError(
                f"adapter version {version}: since version {anchor_version} the trainer's probe logprobs moved by "
                f"more than {self.move_threshold:.3g} on {count} of {trainer.numel()} tokens, and vLLM's moved "
                f"{ratio:.2f} times as much (median; a served adapter gives about 1); the engine is not serving "
                "the weights just saved")
        return {"sync/probe_verified": 1.0, "sync/probe_moved_tokens": float(count), "sync/probe_move_ratio": ratio}

