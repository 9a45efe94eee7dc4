"""The sync check passes a served adapter and fails a stale one, in both modes."""

import pytest
import torch

from driver.rollout.base import SyncError
from driver.rollout.sync_check import SyncVerifier

PROBE = list(range(12))


def test_absolute_mode_accepts_noise_and_rejects_a_gap():
    verifier = SyncVerifier(PROBE, tolerance=1e-3, mode="absolute")
    trainer = -torch.rand(11)
    metrics = verifier.check((trainer + 1e-6).tolist(), trainer, version=1)
    assert metrics["sync/probe_max_abs_diff"] == pytest.approx(1e-6, rel=0.1)  # fp32 rounding of the +1e-6
    with pytest.raises(SyncError, match="adapter version 2: vLLM's probe logprobs differ .* by 0.0"):
        verifier.check((trainer + 0.01).tolist(), trainer, version=2)


def test_delta_mode_follows_changes_on_a_different_base():
    generator = torch.Generator().manual_seed(0)
    verifier = SyncVerifier(PROBE, tolerance=1e-3, mode="delta")
    trainer = -torch.rand(11, generator=generator)
    engine = trainer + 0.3 * torch.randn(11, generator=generator)  # a different (unquantized) base
    verifier.check(engine.tolist(), trainer, version=0)
    change = 0.2 * torch.randn(11, generator=generator)
    served = engine + change * 1.3 + 0.02 * torch.randn(11, generator=generator)
    metrics = verifier.check(served.tolist(), trainer + change, version=1)
    assert metrics["sync/probe_change_cosine"] > 0.9 and 1.0 < metrics["sync/probe_change_ratio"] < 1.6


def test_delta_mode_catches_a_stale_engine():
    verifier = SyncVerifier(PROBE, tolerance=1e-3, mode="delta")
    trainer, engine = -torch.rand(11), -torch.rand(11)
    verifier.check(engine.tolist(), trainer, version=0)
    with pytest.raises(SyncError, match="adapter version 1: .* but vLLM's by 0"):
        verifier.check(engine.tolist(), trainer + 0.1, version=1)


def test_delta_mode_skips_updates_too_small_to_judge():
    verifier = SyncVerifier(PROBE, tolerance=1e-3, mode="delta")
    trainer, engine = -torch.rand(11), -torch.rand(11)
    verifier.check(engine.tolist(), trainer, version=0)
    assert "sync/probe_change_cosine" not in verifier.check(engine.tolist(), trainer + 1e-5, version=1)


def test_bad_arguments():
    with pytest.raises(ValueError, match="mode must be"):
        SyncVerifier(PROBE, 1e-3, "relative")
    with pytest.raises(ValueError, match="at least two tokens"):
        SyncVerifier([1], 1e-3, "absolute")
    with pytest.raises(SyncError, match="returned 3 logprobs, the trainer 11"):
        SyncVerifier(PROBE, 1e-3, "absolute").check([0.0] * 3, torch.zeros(11), 1)
