"""One rollout batch: prompts -> vLLM completions (with sampling logprobs) -> rewards -> advantages."""

from __future__ import annotations

import zlib

import torch

from driver.advantages import combine_rewards
from driver.batch import RolloutBatch
from driver.config import Config
from driver.data import Prompt, PromptSource
from driver.rewards import RewardFunctions
from driver.rollout.base import Completion, Generator


def step_seed(seed: int, step: int, round_: int) -> int:
    """vLLM sampling seed of a step: a pure function of the config, so a resumed run samples the same."""
    return zlib.crc32(f"{seed}:{step}:{round_}".encode()) & 0x7FFFFFFF


def collect(config: Config, generator: Generator, source: PromptSource, rewards: RewardFunctions, tokenizer,
            step: int, round_: int) -> RolloutBatch:
    group = config.algo.num_generations
    prompts = source.next_batch(config.train.prompts_per_step)
    groups = generator.generate([p.token_ids for p in prompts], n=group, seed=step_seed(config.train.seed, step, round_))
    per_completion: list[tuple[Prompt, Completion]] = [(p, c) for p, g in zip(prompts, groups) for c in g]
    completion_texts = [tokenizer.decode(c.token_ids, skip_special_tokens=True) for _, c in per_completion]
    table = rewards(prompts=[p.text for p, _ in per_completion], completions=completion_texts,
                    columns=[p.columns for p, _ in per_completion],
                    completion_ids=[c.token_ids for _, c in per_completion])
    total, advantages, stats = combine_rewards(
        table, rewards.weights, group, config.rewards.aggregation, config.algo.scale_rewards, names=rewards.names)

    completions = [c for _, c in per_completion]
    width = max((len(c.token_ids) for c in completions), default=0)
    sampling = torch.zeros(len(completions), width)
    mask = torch.zeros(len(completions), width)
    for row, completion in enumerate(completions):
        length = len(completion.token_ids)
        sampling[row, :length] = torch.tensor(completion.logprobs, dtype=torch.float32)
        mask[row, :length] = 1.0
    metrics = {**stats, **completion_stats(completions)}
    samples = [(p.text, text, float(r)) for (p, _), text, r in zip(per_completion, completion_texts, total)]
    return RolloutBatch([p.token_ids for p, _ in per_completion], [c.token_ids for c in completions],
                        sampling, mask, advantages, metrics, samples)


def completion_stats(completions: list[Completion]) -> dict[str, float]:
    lengths = torch.tensor([len(c.token_ids) for c in completions], dtype=torch.float32)
    terminated = torch.tensor([len(c.token_ids) for c in completions if c.finish_reason == "stop"],
                              dtype=torch.float32)
    return {
        "completions/mean_length": float(lengths.mean()),
        "completions/min_length": float(lengths.min()),
        "completions/max_length": float(lengths.max()),
        "completions/clipped_ratio": float(sum(c.finish_reason == "length" for c in completions) / len(completions)),
        "completions/mean_terminated_length": float(terminated.mean()) if len(terminated) else 0.0,
    }
