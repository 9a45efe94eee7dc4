"""The sync check passes a served adapter and fails a stale one at every dtype.

Synthetic probes shaped like the measured ones (tiny Qwen2 / Qwen3-MoE, 40 versions): the trainer's
logprobs drift as it learns; a served engine follows them plus bf16 noise (~0.015 per token, more as
the adapter grows), plus an occasional router flip (one token off by ~1.5); QLoRA's engine follows at
0.7-0.9 of the trainer's movement (the adapter acts on a different base).
"""

import pytest
import torch

from driver.engine.base import SyncError
from driver.engine.sync_check import SyncVerifier

TOKENS = 50
PROBE = list(range(TOKENS + 1))
VERSIONS = 30


def trajectory(seed: int, step: float = 0.06) -> list[torch.Tensor]:
    """Trainer probe logprobs per version: a random walk from a fixed start."""
    generator = torch.Generator().manual_seed(seed)
    start = -8 * torch.rand(TOKENS, generator=generator, dtype=torch.float64)
    walk = step * torch.randn(VERSIONS, TOKENS, generator=generator, dtype=torch.float64).cumsum(0)
    return [start] + [start + walk[v] for v in range(VERSIONS)]


def served(trainer: list[torch.Tensor], seed: int, noise: float = 0.015, scale: float = 1.0,
           flips: int = 0, offset: float = 0.0) -> list[torch.Tensor]:
    """What an engine serving every version returns: its movement (times scale) plus fresh noise per
    version, `flips` tokens per version off by 1.5 (an MoE router choosing other experts)."""
    generator = torch.Generator().manual_seed(seed)
    out = []
    for logprobs in trainer:
        value = trainer[0] + offset + scale * (logprobs - trainer[0])
        value = value + noise * torch.randn(TOKENS, generator=generator, dtype=torch.float64)
        if flips:
            value[torch.randperm(TOKENS, generator=generator)[:flips]] += 1.5
        out.append(value)
    return out


def run(verifier: SyncVerifier, engine: list[torch.Tensor], trainer: list[torch.Tensor]) -> list[dict]:
    return [verifier.check(e.tolist(), t.float(), version) for version, (e, t) in enumerate(zip(engine, trainer))]


def bf16(same_base: bool = True) -> SyncVerifier:
    return SyncVerifier(PROBE, dtype=torch.bfloat16, same_base=same_base, tolerance=1e-3)


@pytest.mark.parametrize("seed", range(5))
@pytest.mark.parametrize("case", ["dense", "moe", "qlora"])
def test_a_served_engine_passes_every_version_in_bf16(seed, case):
    trainer = trajectory(seed)
    if case == "qlora":  # NF4 base in the trainer, bf16 base in vLLM: a constant gap and a smaller response
        engine = served(trainer, seed + 100, scale=0.75, offset=0.4)
    else:
        engine = served(trainer, seed + 100, flips=2 if case == "moe" else 0)
    rows = run(bf16(same_base=case != "qlora"), engine, trainer)
    verified = [row for row in rows[1:] if row["sync/probe_verified"] == 1.0]
    assert len(verified) >= VERSIONS - 3  # all but the first few, whose movement is still within the noise
    assert all(0.6 < row["sync/probe_move_ratio"] < 1.4 for row in verified)


@pytest.mark.parametrize("stuck_at", [0, 5])
@pytest.mark.parametrize("case", ["dense", "moe", "qlora"])
def test_a_stale_engine_is_caught_in_bf16(case, stuck_at):
    trainer = trajectory(7)
    engine = served(trainer, 8, scale=0.75 if case == "qlora" else 1.0, flips=2 if case == "moe" else 0)
    stale = engine[: stuck_at + 1] + [engine[stuck_at]] * (len(engine) - stuck_at - 1)
    with pytest.raises(SyncError, match="vLLM's moved .* times as much .* not serving the weights just saved") as error:
        run(bf16(same_base=case != "qlora"), stale, trainer)
    if stuck_at == 0:  # serving the anchor: caught at the first version that moved enough to tell
        assert "adapter version 1:" in str(error.value) or "adapter version 2:" in str(error.value)


def test_movement_within_the_noise_is_not_judged_yet():
    trainer = trajectory(3, step=0.001)  # far below bf16's noise threshold
    rows = run(bf16(), [trainer[0]] * len(trainer), trainer)  # stale, yet harmless: nothing moved
    assert all(row["sync/probe_verified"] == 0.0 for row in rows[1:])


def test_the_first_sync_must_match_the_trainer_within_the_dtype_noise():
    trainer = trajectory(0)
    verifier = bf16()
    verifier.check(served(trainer, 1, noise=0.015)[0].tolist(), trainer[0].float(), 0)  # bf16 kernel noise: fine
    flipped = served(trainer, 1, flips=2)[0]  # an MoE router off on two tokens: still the same model
    bf16().check(flipped.tolist(), trainer[0].float(), 0)
    with pytest.raises(SyncError, match=r"version 0 \(first sync\).* by more than 0.25 \(the noise of "
                                        r"torch.bfloat16\) on 50 of 50 tokens.* does not serve the model"):
        bf16().check((trainer[0] + 1.0).tolist(), trainer[0].float(), 0)
    bf16(same_base=False).check((trainer[0] + 1.0).tolist(), trainer[0].float(), 0)  # QLoRA: other base, no check


def test_float32_with_a_dense_base_requires_equality_at_every_version():
    trainer = trajectory(0)
    verifier = SyncVerifier(PROBE, dtype=torch.float32, same_base=True, tolerance=1e-3)
    engine = served(trainer, 1, noise=1e-6)
    run(verifier, engine[:5], trainer[:5])
    # One version behind: moved as far as the trainer did up to the version before, so only the
    # float32 equality can tell.
    with pytest.raises(SyncError, match=r"adapter version 5: vLLM's probe logprobs differ .* \(tolerance 0.001\)"):
        verifier.check(engine[4].tolist(), trainer[5].float(), 5)


def test_bad_arguments():
    with pytest.raises(ValueError, match="at least two tokens"):
        SyncVerifier([1], dtype=torch.float32, same_base=True, tolerance=1e-3)
    with pytest.raises(ValueError, match="tolerance must be > 0"):
        SyncVerifier(PROBE, dtype=torch.float32, same_base=True, tolerance=0.0)
    with pytest.raises(SyncError, match="returned 3 logprobs, the trainer 11"):
        bf16().check([0.0] * 3, torch.zeros(11), 1)
