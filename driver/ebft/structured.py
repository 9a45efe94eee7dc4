"""EBFT structured mode: vLLM samples whole completions, as for GRPO; the reward of each is feature
matching against its prompt's ground truth, read from the frozen base (adapter disabled).

FeatureScorer stands where driver/rewards/group_scorer.py's GroupScorer stands in the rollout pipeline
(submit_group / wait / discard / metrics): groups are queued as they finish and scored when the
trainer assembles the step, in the trainer's thread, because the features come from the trainer's
own model (under async prefetch the prefetch thread only drives vLLM). The sequences are the token
ids themselves (prompt + completion, prompt + tokenized ground truth), never decoded and
re-tokenized, packed into rows of train.micro_batch_size sequences; a row with later turns is the
exception: its whole conversations are rendered with the chat template (driver/ebft/multi_turn.py).

Each group's result is a [n, 3] table: cos(phi_j, phi_gt), the mean dot product with the group's other
samples, and the group's CFM loss (repeated); advantages_from_tables turns tables into rewards and
advantages (driver/ebft/advantages.py).
"""

from __future__ import annotations

import functools
import math
import time

import torch

from driver.cli import ConfigError
from driver.config import Config, EbftConfig
from driver.data.prompts import PromptSource
from driver.data.records import Group
from driver.distributed import world as distributed
from driver.ebft.advantages import ebft_advantages
from driver.ebft.features import hidden_layer_states, layer_indices, pool, token_features
from driver.ebft.multi_turn import feature_sequences as multi_turn_sequences
from driver.ebft.multi_turn import MultiTurnRollout, is_multi_turn
from driver.ebft.rewards import RewardParts, group_rewards, reward_metrics
from driver.policy.logprobs import pack
from driver.policy.model import Policy, evaluating
from driver.rewards.pool import RewardResult
from driver.rollouts.distributed_feed import on_all_ranks
from driver.rollouts.producer import GenerationHooks
from pykernels.integrations.transformers import packed_attention_kwargs

TABLE_COLUMNS = ["alignment", "diversity", "cfm"]


def adaptive_max_tokens(ground_truth_tokens: int, config: Config) -> int:
    """A group's completion budget: max(min(floor(gt x gt_length_multiplier), limit), min(min_max_tokens,
    limit)), limit = rollout.sampling.max_tokens (the limit itself when the multiplier is null).

    axolotl's adaptive max_tokens with its rounding (int()) and floor (64), but per prompt where axolotl
    takes the max over the generation batch (TRL's vLLM call has one max_tokens): a group's budget then
    depends on its own ground truth only, not on which prompts share its batch, round or re-roll. The
    floor never lifts the budget above the limit (axolotl's 64 does when max_completion_length < 64)."""
    limit, ebft = config.rollout.sampling.max_tokens, config.ebft
    if ebft.gt_length_multiplier is None:
        return limit
    scaled = math.floor(ground_truth_tokens * ebft.gt_length_multiplier)
    return max(min(scaled, limit), min(ebft.min_max_tokens, limit))


def has_ground_truth(prompt, field: str) -> bool:
    text = prompt.columns.get(field)
    return isinstance(text, str) and bool(text)


def check_ground_truths(prompts: PromptSource, field: str) -> None:
    """Every row needs its ground truth: found before the run starts, not when its prompt comes up."""
    missing = [p for p in prompts.prompts if not has_ground_truth(p, field)]
    if missing:
        raise ConfigError(f"ebft.ground_truth_field: {len(missing)} rows (first: row {missing[0].index}) have no "
                          f"text column '{field}' (the reference completion); columns are "
                          f"{sorted(missing[0].columns)}")


class GroundTruths:
    """Token ids of each prompt's ground truth (tokenized once per dataset row)."""

    def __init__(self, ebft: EbftConfig, tokenizer) -> None:
        self.field, self.tokenizer = ebft.ground_truth_field, tokenizer
        self._ids: dict[int, list[int]] = {}

    def token_ids(self, prompt) -> list[int]:
        if prompt.index not in self._ids:
            if not has_ground_truth(prompt, self.field):
                raise ValueError(f"ebft: data row {prompt.index} has no text column '{self.field}' (the ground truth; "
                                 f"ebft.ground_truth_field); columns are {sorted(prompt.columns)}")
            text = prompt.columns[self.field]
            self._ids[prompt.index] = list(self.tokenizer(text, add_special_tokens=False).input_ids)
        return self._ids[prompt.index]


def completion_ids(sample_ids: list[int], eos_token_id: int | None) -> list[int]:
    """The completion without a final EOS: ground truths have none, and features compare like with like."""
    if sample_ids and eos_token_id is not None and sample_ids[-1] == eos_token_id:
        return sample_ids[:-1]
    return sample_ids


class FeatureScorer:
    in_workers = False
    names = TABLE_COLUMNS

    def __init__(self, config: Config, policy: Policy) -> None:
        self.config, self.policy, self.ebft = config, policy, config.ebft
        self.layers = layer_indices(policy.causal_lm.config.num_hidden_layers, self.ebft.feature_layers)
        self.ground_truths = GroundTruths(self.ebft, policy.tokenizer)
        # ce_coef > 0: the rollout batch carries the ids its features read, for the cross-entropy term
        self.ground_truth_ids = self.ground_truths.token_ids if self.ebft.ce_coef > 0 else None
        self.weights = torch.tensor([2 * self.ebft.alignment_coef, -2 * self.ebft.diversity_coef, 0.0])
        self._queued: dict[int, Group] = {}
        self._seconds = 0.0

    def advantages(self, groups: list[Group]) -> tuple[torch.Tensor, torch.Tensor, dict[str, float]]:
        return advantages_from_tables(self.ebft, groups)

    def submit_group(self, group: Group) -> None:
        self._queued[group.group_id] = group

    def discard(self, keys: list[int]) -> None:
        for key in keys:
            self._queued.pop(key, None)

    def wait(self, keys: list[int]) -> dict[int, RewardResult]:
        missing = [key for key in keys if key not in self._queued]
        if missing:
            raise KeyError(f"groups {missing} were never submitted")
        started = time.perf_counter()
        groups = [self._queued.pop(key) for key in keys]
        results = {}
        if groups:
            gen, gt = self.group_features(groups)
            parts = group_rewards(gen, gt, self.ebft.alignment_coef, self.ebft.diversity_coef, self.ebft.whitening,
                                  self.ebft.whiten_tol)
            for index, group in enumerate(groups):
                table = torch.stack([parts.alignment[index], parts.diversity[index],
                                     parts.cfm[index].expand_as(parts.alignment[index])], dim=1).float()
                results[group.group_id] = RewardResult(group.group_id, table, None)
        self._seconds += time.perf_counter() - started
        return results

    @torch.no_grad()
    def group_features(self, groups: list[Group]) -> tuple[torch.Tensor, torch.Tensor]:
        """Pooled features (gen [P, n, F], gt [P, F]) of the groups' samples and ground truths."""
        prompts, completions = [], []
        for group in groups:
            for prompt_ids, completion in self.feature_sequences(group):
                prompts.append(prompt_ids)
                completions.append(completion)
        pooled = self.pooled_features(prompts, completions)
        per_group = len(groups[0].samples) + 1
        pooled = pooled.view(len(groups), per_group, -1)
        return pooled[:, :-1], pooled[:, -1]

    def feature_sequences(self, group: Group) -> list[tuple[list[int], list[int]]]:
        """(prompt, completion) token ids of the group's samples, then of its ground truth: the sampled ids
        themselves, or for a row with later turns the rendered whole conversations (driver/ebft/multi_turn.py)."""
        truth_ids = self.ground_truths.token_ids(group.prompt)  # also says which row lacks its ground truth
        if is_multi_turn(group.prompt):
            truth = group.prompt.columns[self.ebft.ground_truth_field]
            return multi_turn_sequences(self.policy.tokenizer, self.config.data, group, truth)
        prompt_ids, eos = group.prompt.token_ids, self.policy.tokenizer.eos_token_id
        return [(prompt_ids, completion_ids(s.token_ids, eos)) for s in group.samples] + [(prompt_ids, truth_ids)]

    def pooled_features(self, prompts: list[list[int]], completions: list[list[int]]) -> torch.Tensor:
        """[N, F] one pooled feature vector per (prompt, completion). Under torchrun the model is sharded:
        every rank computes a contiguous share of the sequences (driver/rollouts/distributed_feed.py
        on_all_ranks) and rank 0 concatenates them."""
        size = distributed.world().size
        bounds = [len(prompts) * rank // size for rank in range(size + 1)]
        shares = [(prompts[a:b], completions[a:b]) for a, b in zip(bounds, bounds[1:])]
        parts = on_all_ranks(features_of_share, shares, self.config, self.policy)
        return torch.cat([part for part in parts if part.numel()])  # a rank may have had no sequence

    def metrics(self) -> dict[str, float]:
        seconds, self._seconds = self._seconds, 0.0
        return {"time/ebft_features": seconds}

    def close(self) -> None:
        self._queued.clear()


def features_of_share(config: Config, policy: Policy, share: tuple[list[list[int]], list[list[int]]]) -> torch.Tensor:
    """[n, F] pooled features of this rank's (prompts, completions), packed train.micro_batch_size at a time
    through the frozen base; as many forwards as the busiest rank runs (FSDP's collectives pair up)."""
    prompts, completions = share
    size, ebft = config.train.micro_batch_size, config.ebft
    layers = layer_indices(policy.causal_lm.config.num_hidden_layers, ebft.feature_layers)
    starts = range(0, len(prompts), size)
    padding = distributed.max_int(len(starts)) - len(starts)
    out = []
    with evaluating(policy.model), policy.reference() as base:
        for start in starts:
            packed = pack(prompts[start:start + size], completions[start:start + size], device=policy.device)
            attention = packed_attention_kwargs(policy.causal_lm, packed.cu_seqlens)
            mask = attention.pop("attention_mask")
            states = hidden_layer_states(base, packed.input_ids, packed.position_ids, mask, layers, **attention)
            sequence_starts = packed.cu_seqlens[:-1].tolist()
            spans = [(s, s + p, s + p + c) for s, p, c in
                     zip(sequence_starts, packed.prompt_lengths, packed.completion_lengths)]
            out.append(pool(token_features([state.float() for state in states]), spans, ebft.embed_method))
        for _ in range(padding):
            packed = pack([[0]], [[0]], device=policy.device)
            hidden_layer_states(base, packed.input_ids, packed.position_ids, None, layers)
    return torch.cat(out).cpu() if out else torch.zeros(0, 0)


def generation_hooks(config: Config, scorer: FeatureScorer) -> GenerationHooks:
    """What structured mode changes in generation: each group's budget scaled by its ground truth's length,
    and the later turns of conversations rolled out when their first turns finish (multi_turn.py)."""
    budget = functools.partial(adaptive_max_tokens, config=config)
    return GenerationHooks(max_tokens=lambda prompt: budget(len(scorer.ground_truths.token_ids(prompt))),
                           extend_finished=MultiTurnRollout(config, scorer.policy.tokenizer, budget))


def advantages_from_tables(
    ebft: EbftConfig, groups: list[Group]
) -> tuple[torch.Tensor, torch.Tensor, dict[str, float]]:
    """(rewards [N], advantages [N], metrics) of groups whose .rewards hold FeatureScorer tables."""
    tables = torch.stack([group.rewards.double() for group in groups])  # [P, n, 3]
    alignment, diversity = tables[..., 0], tables[..., 1]
    reward = 2 * ebft.alignment_coef * alignment - 2 * ebft.diversity_coef * diversity
    parts = RewardParts(alignment=alignment, diversity=diversity, reward=reward, cfm=tables[:, 0, 2])
    advantages = ebft_advantages(parts, ebft.alignment_coef, ebft.diversity_coef, ebft.advantage_estimator)
    metrics = reward_metrics(parts)
    metrics["ebft/reward_std"] = float(reward.std(dim=1).mean()) if reward.shape[1] > 1 else 0.0
    metrics["ebft/advantage_abs_mean"] = float(advantages.abs().mean())
    return reward.reshape(-1).float(), advantages.reshape(-1).float(), metrics
