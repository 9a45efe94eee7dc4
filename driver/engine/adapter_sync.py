"""Adapter sync: save the trainer's adapter as a new version, make the engine serve it (as an adapter, or
merged into its weights: rollout.weight_sync), and verify with a probe that it does
(driver/engine/sync_check.py)."""

from __future__ import annotations

import shutil
import time

import torch

from driver.config import Config
from driver.engine import serves_trained_base
from driver.engine.base import Generator
from driver.engine.sync_check import PROBE_TEXT, SyncVerifier
from driver.policy.logprobs import completion_logprobs, pack
from driver.policy.model import Policy, evaluating

ADAPTERS_KEPT = 2  # the synchronous loop's: the version being served and the one before it


def make_verifier(config: Config, policy: Policy) -> SyncVerifier | None:
    if not config.rollout.verify_sync or config.rollout.backend == "transformers":  # one set of weights: no gap
        return None
    probe = policy.tokenizer(PROBE_TEXT, add_special_tokens=False).input_ids
    # QLoRA: the engine serves the NF4 round-trip of the base (driver/engine/__init__.py), the same base.
    # The noise is the coarser dtype's, the trainer's or the engine's (rollout.dtype).
    dtype = max((getattr(torch, name) for name in (config.model.dtype, config.rollout.dtype or config.model.dtype)),
                key=lambda candidate: torch.finfo(candidate).eps)
    return SyncVerifier(probe, dtype=dtype, same_base=serves_trained_base(config),
                        tolerance=config.rollout.sync_tolerance)


@torch.no_grad()
def trainer_probe(policy: Policy, token_ids: list[int]) -> torch.Tensor:
    with evaluating(policy.model):
        packed = pack([token_ids[:1]], [token_ids[1:]], device=policy.device)
        logps, _, _ = completion_logprobs(policy.model, packed, temperature=1.0)
    return logps[0]


def push_adapter(config: Config, policy: Policy, generator: Generator, verifier: SyncVerifier | None,
                 version: int, keep: int = ADAPTERS_KEPT) -> dict[str, float]:
    """Save version `version` of the adapter, serve it, verify; keep the newest `keep` directories
    (an engine loads an adapter from disk lazily, when a request first names its version). An engine
    that takes the weights by reference (the colocated merged engine: reads_saved_weights False) gets
    no directory: nothing is written."""
    started = time.perf_counter()
    if getattr(generator, "shares_weights", False):  # samples with the trainer's weights: nothing to move
        generator.sync(None, version)
        return {"time/sync": time.perf_counter() - started}
    adapters = config.output_dir / "adapters"
    # Under torchrun the gather and the probe forward are collectives of every rank
    # (driver/rollouts/distributed_feed.py): both run before the engine is called, so an engine failure
    # cannot leave the other ranks waiting in one.
    directory = (policy.save_trained(adapters / f"v{version:06d}") if getattr(generator, "reads_saved_weights", True)
                 else None)
    trainer = trainer_probe(policy, verifier.probe_ids) if verifier is not None else None
    generator.sync(directory, version)
    metrics = {}
    if verifier is not None:
        verify_each = getattr(generator, "verify_each", None)  # servers: every one probed (server.py)
        metrics = (verify_each(verifier, trainer, version) if verify_each is not None
                   else verifier.check(generator.prompt_logprobs(verifier.probe_ids), trainer, version))
    for old in sorted(adapters.glob("v*"))[:-keep]:
        shutil.rmtree(old, ignore_errors=True)
    metrics["time/sync"] = time.perf_counter() - started
    return metrics
