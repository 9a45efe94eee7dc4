"""EBFT strided mode: the trainer samples its own blocks (no vLLM) and rewards them by feature matching.

Each step takes train.prompts_per_step documents (prompt + ground truth, or the prompt column alone
when ebft.ground_truth_field is null), lays anchors every ebft.stride tokens inside the ground truth
(driver/ebft/strided_layout.py), samples num_generations generations of every block in one row per
micro-batch (driver/ebft/strided_generate.py, policy with its adapter), then reads the frozen base's
features of that same row under the same mask (adapter disabled; driver/ebft/strided_attention.py):
block b's ground-truth features are those of x[a_b : a_b + G), computed causally with the same
context as its generations. The samples of one (document, block) form a group: rewards and
advantages as in structured mode, one advantage per generated block. StridedSource has the surface
train.run uses of driver/rollouts/feed.py.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field

import torch

from driver.config import Config
from driver.data.prompts import Prompt, PromptSource
from driver.ebft.advantages import ebft_advantages
from driver.ebft.features import (POOL_METHODS, concat_tokens, hidden_layer_states, layer_indices, quarter_offsets,
                                  token_features)
from driver.ebft.rewards import group_rewards, reward_metrics
from driver.ebft.strided_attention import attention_mask_dtype, full_row_attention, uses_flex
from driver.ebft.strided_generate import StridedRollout, sample_strided
from driver.ebft.strided_layout import StridedLayout, strided_layout
from driver.ebft.structured import GroundTruths
from driver.engine import RolloutError
from driver.policy.model import Policy, evaluating

SHOWN_CONTEXT_TOKENS = 12  # tokens of context before a block shown with its sample in the logs


@dataclass
class Document:
    prompt: Prompt
    token_ids: list[int]
    layout: StridedLayout
    ce_start: int  # first document position the cross-entropy term trains (the ground truth's first token)


@dataclass
class StridedChunk:
    """The documents of one micro-batch: one row, one forward."""
    documents: list[Document]
    rollout: StridedRollout
    advantages: list[torch.Tensor] = field(default_factory=list)  # per document [n, NB_d]
    rewards: list[torch.Tensor] = field(default_factory=list)  # per document [n, NB_d]


@dataclass
class StridedBatch:
    chunks: list[StridedChunk]
    metrics: dict[str, float] = field(default_factory=dict)
    samples: list[tuple[str, str, float]] = field(default_factory=list)  # (context, block, reward) for the logs
    table: list[dict] = field(default_factory=list)  # no completions table: blocks are not completions


def pool_blocks(features: torch.Tensor, method: str) -> torch.Tensor:  # [..., G, F] -> [..., F'] per block
    """The methods of driver/ebft/features.py's `pool` on a block, which is all completion:
    last_token: its last token; mean_pooling / completion_mean: the mean over it; concat: its tokens at
    offsets floor(G * q / 4), q = 1, 2, 3, as axolotl's docs define `concat` (axolotl's strided trainer
    silently pools concat and completion_mean as last_token; the official code's concat takes all G)."""
    if method == "last_token":
        return features[..., -1, :]
    if method in ("mean_pooling", "completion_mean"):
        return features.mean(dim=-2)
    if method == "concat":
        return concat_tokens(features[..., quarter_offsets(features.shape[-2]), :])
    raise ValueError(f"method must be one of {list(POOL_METHODS)}, got {method!r}")


class StridedSource:
    def __init__(self, config: Config, policy: Policy, prompts: PromptSource, state: dict | None = None) -> None:
        self.config, self.policy, self.prompts, self.ebft = config, policy, prompts, config.ebft
        self.layers = layer_indices(policy.causal_lm.config.num_hidden_layers, self.ebft.feature_layers)
        self.ground_truths = GroundTruths(self.ebft, policy.tokenizer) if self.ebft.ground_truth_field else None
        self.generator = torch.Generator(device=policy.device).manual_seed(config.train.seed)
        self.documents_per_chunk = max(1, config.train.micro_batch_size // config.algo.num_generations)
        self.flex = uses_flex(self.ebft.attention, policy.device)  # the full-row forwards' mask
        if state is not None:
            self.generator.set_state(state["generator"])

    def document(self, prompt: Prompt) -> Document:
        ebft, ids = self.ebft, list(prompt.token_ids)
        first_anchor_min, ce_start = 0, 1
        if self.ground_truths is not None:
            first_anchor_min = len(ids) + ebft.min_completion_prefix
            ce_start = len(ids)
            ids = ids + self.ground_truths.token_ids(prompt)
        ids = ids[: ebft.max_document_length]
        layout = strided_layout(len(ids), ebft.stride, ebft.context_length, ebft.generate_max_len, first_anchor_min)
        return Document(prompt, ids, layout, min(ce_start, len(ids)))

    def next_batch(self, step: int, abandon=lambda: False) -> StridedBatch:
        count = self.config.train.prompts_per_step * self.config.train.gradient_accumulation_steps
        documents = [self.document(prompt) for prompt in self.prompts.next_batch(count)]
        kept = [document for document in documents if document.layout.num_blocks() > 0]
        if not kept:  # a run-stopping error (main prints it), but with the fix in the message
            raise RolloutError(f"ebft strided: none of the step's {len(documents)} documents is long enough for "
                               f"one block (context_length {self.ebft.context_length} + generate_max_len "
                               f"{self.ebft.generate_max_len} tokens after the prompt); lower those or use longer "
                               "documents")
        chunks, parts = [], []
        generation = features = 0.0
        for start in range(0, len(kept), self.documents_per_chunk):
            chunk_documents = kept[start:start + self.documents_per_chunk]
            began = time.perf_counter()
            rollout = self.sample(chunk_documents)
            between = time.perf_counter()
            chunk_parts = self.block_rewards(chunk_documents, rollout)
            generation, features = generation + between - began, features + time.perf_counter() - between
            chunks.append(StridedChunk(chunk_documents, rollout))
            parts.append(chunk_parts)
        metrics = self._advantages(chunks, parts)
        metrics.update({"ebft/documents": float(len(kept)), "ebft/dropped_documents": float(len(documents) - len(kept)),
                        "ebft/num_blocks": float(sum(d.layout.num_blocks() for d in kept)),
                        "time/generation": generation, "time/ebft_features": features})
        return StridedBatch(chunks, metrics, self._shown(chunks))

    def sample(self, documents: list[Document]) -> StridedRollout:
        sampling = self.config.rollout.sampling  # temperature 0.6 unless given (Config._check_ebft)
        return sample_strided(self.policy.model, [d.token_ids for d in documents], [d.layout for d in documents],
                              self.config.algo.num_generations, temperature=sampling.temperature,
                              top_p=sampling.top_p, top_k=sampling.top_k, generator=self.generator,
                              kv_cache=self.ebft.kv_cache, additive_mask_dtype=attention_mask_dtype(self.policy))

    @torch.no_grad()
    def block_rewards(self, documents: list[Document], rollout: StridedRollout):
        """Reward parts of every (document, block) group over its n samples, from one forward of the
        chunk's row through the frozen base (adapter disabled, eval mode)."""
        policy = self.policy
        with evaluating(policy.model), policy.reference(), \
                full_row_attention(policy, rollout, self.flex) as (input_ids, position_ids, mask):
            states = hidden_layer_states(policy.model, input_ids, position_ids, mask, self.layers)
        features = token_features([state.float() for state in states]).cpu()  # [L, F]
        generate_length = self.ebft.generate_max_len
        gen, truth = [], []
        for document, doc_rows, gen_rows in zip(documents, rollout.doc_rows, rollout.gen_rows):
            spans = torch.tensor(document.layout.anchors)[:, None] + torch.arange(generate_length)  # [NB, G]
            truth.append(pool_blocks(features[doc_rows[spans]], self.ebft.embed_method))  # [NB, F']
            gen.append(pool_blocks(features[gen_rows], self.ebft.embed_method).transpose(0, 1))  # [NB, n, F']
        return group_rewards(torch.cat(gen), torch.cat(truth), self.ebft.alignment_coef, self.ebft.diversity_coef,
                             self.ebft.whitening, self.ebft.whiten_tol)

    def _advantages(self, chunks: list[StridedChunk], parts: list) -> dict[str, float]:
        """Advantages per (document, block) group, split back per document as [n, NB_d]."""
        ebft, all_metrics = self.ebft, []
        for chunk, chunk_parts in zip(chunks, parts):
            advantages = ebft_advantages(chunk_parts, ebft.alignment_coef, ebft.diversity_coef,
                                         ebft.advantage_estimator)  # [sum NB, n]
            blocks = [document.layout.num_blocks() for document in chunk.documents]
            chunk.advantages = [part.t().float() for part in advantages.split(blocks)]
            chunk.rewards = [part.t().float() for part in chunk_parts.reward.split(blocks)]
            all_metrics.append((reward_metrics(chunk_parts), chunk_parts.reward.numel(), advantages))
        total = sum(count for _, count, _ in all_metrics)
        metrics = {key: sum(m[key] * count for m, count, _ in all_metrics) / total for key in all_metrics[0][0]}
        all_advantages = torch.cat([a.reshape(-1) for _, _, a in all_metrics])
        metrics["ebft/advantage_abs_mean"] = float(all_advantages.abs().mean())
        metrics["ebft/advantages_std"] = float(all_advantages.std()) if all_advantages.numel() > 1 else 0.0
        return metrics

    def _shown(self, chunks: list[StridedChunk]) -> list[tuple[str, str, float]]:
        """The first sample of each document's first block, with the context just before it."""
        decode, shown = self.policy.tokenizer.decode, []
        for chunk in chunks:
            for index, document in enumerate(chunk.documents):
                anchor = document.layout.anchors[0]
                context = decode(document.token_ids[max(0, anchor - SHOWN_CONTEXT_TOKENS):anchor])
                block = decode(chunk.rollout.tokens[index][0, 0].tolist())
                shown.append((context, block, float(chunk.rewards[index][0, 0])))
        return shown

    def push(self, step: int) -> dict[str, float]:
        return {}  # the trainer samples with its own weights: nothing to sync

    def state_dict(self) -> dict:
        return {"generator": self.generator.get_state()}

    def close(self) -> None:
        pass
