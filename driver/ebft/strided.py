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

Under torchrun every rank samples, scores and trains whole chunks (chunk k on rank k % world; rank 0
reads the step's prompts and broadcasts them), and each chunk draws from its own generator seeded by
(train.seed, step, chunk), so the run samples the same blocks at any world size. A rank with fewer
chunks than the busiest runs padding forwards in their place (FSDP's collectives pair up); the update
divides by the counts of the whole step (StridedBatch.totals), so the ranks' gradients sum to the
single-process gradient.
"""

from __future__ import annotations

import math
import time
import zlib
from dataclasses import dataclass, field

import torch

from driver.config import Config
from driver.data.prompts import Prompt, PromptSource
from driver.distributed import world as distributed
from driver.ebft.advantages import ebft_advantages
from driver.ebft.features import (POOL_METHODS, concat_tokens, hidden_layer_states, layer_indices, quarter_offsets,
                                  token_features)
from driver.ebft.rewards import group_rewards, reward_metrics
from driver.ebft.strided_attention import attention_mask_dtype, full_row_attention, uses_flex
from driver.ebft.strided_generate import StridedRollout, sample_strided
from driver.ebft.strided_layout import StridedLayout, strided_layout
from driver.ebft.structured import GroundTruths
from driver.engine import RolloutError
from driver.metrics.combine import Metrics, combine_metrics
from driver.policy.logprobs import pack
from driver.policy.model import Policy, evaluating

ADVANTAGE_MEAN, ADVANTAGE_SQUARE_MEAN = "_advantage_mean", "_advantage_square_mean"  # reduced, then dropped
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


@dataclass(frozen=True)
class StepTotals:
    """What the update of the whole step divides by, whichever chunks this rank holds."""
    num_sequences: int  # (document, sample, block) units
    num_tokens: int  # generated tokens
    num_chunks: int
    num_documents: int


@dataclass
class StridedBatch:
    chunks: list[StridedChunk]  # this rank's
    totals: StepTotals
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


def advantage_spread(metrics: dict[str, float], count: int) -> dict[str, float]:
    """ebft/advantages_std, the sample standard deviation (torch.std) of the step's `count` advantages,
    from their first two moments (popped from metrics), which combine over chunks and ranks."""
    mean, square = metrics.pop(ADVANTAGE_MEAN), metrics.pop(ADVANTAGE_SQUARE_MEAN)
    variance = max(square - mean * mean, 0.0) * count / (count - 1) if count > 1 else 0.0
    return {"ebft/advantages_std": math.sqrt(variance)}


class StridedSource:
    def __init__(self, config: Config, policy: Policy, prompts: PromptSource, state: dict | None = None) -> None:
        self.config, self.policy, self.prompts, self.ebft = config, policy, prompts, config.ebft
        self.layers = layer_indices(policy.causal_lm.config.num_hidden_layers, self.ebft.feature_layers)
        self.ground_truths = GroundTruths(self.ebft, policy.tokenizer) if self.ebft.ground_truth_field else None
        self.documents_per_chunk = max(1, config.train.micro_batch_size // config.algo.num_generations)
        self.flex = uses_flex(self.ebft.attention, policy.device)  # the full-row forwards' mask
        # state: nothing to restore (each chunk's generator is seeded by its step); older checkpoints
        # kept one generator's state, which a resume no longer needs.

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

    def next_batch(self, step: int, abandon=lambda: False) -> StridedBatch | None:
        world = distributed.world()
        count = self.config.train.prompts_per_step * self.config.train.gradient_accumulation_steps
        # Rank 0 holds the data position (and decides to stop on Ctrl-C); the others get its prompts.
        prompts = None if world.is_main and abandon() else (self.prompts.next_batch(count) if world.is_main else None)
        prompts = distributed.broadcast(prompts)
        if prompts is None:
            return None
        documents = [self.document(prompt) for prompt in prompts]
        kept = [document for document in documents if document.layout.num_blocks() > 0]
        if not kept:  # a run-stopping error (main prints it), but with the fix in the message
            raise RolloutError(f"ebft strided: none of the step's {len(documents)} documents is long enough for "
                               f"one block (context_length {self.ebft.context_length} + generate_max_len "
                               f"{self.ebft.generate_max_len} tokens after the prompt); lower those or use longer "
                               "documents")
        all_chunks = [kept[start:start + self.documents_per_chunk]
                      for start in range(0, len(kept), self.documents_per_chunk)]
        mine = list(range(world.rank, len(all_chunks), world.size))
        chunks, parts = [], []
        generation = features = 0.0
        for index in mine:
            chunk_documents = all_chunks[index]
            began = time.perf_counter()
            rollout = self.sample(chunk_documents, self.chunk_generator(step, index))
            between = time.perf_counter()
            chunk_parts = self.block_rewards(chunk_documents, rollout)
            generation, features = generation + between - began, features + time.perf_counter() - between
            chunks.append(StridedChunk(chunk_documents, rollout))
            parts.append(chunk_parts)
        for _ in range(math.ceil(len(all_chunks) / world.size) - len(mine)):
            self.padding_chunk()
        num_sequences = self.config.algo.num_generations * sum(d.layout.num_blocks() for d in kept)
        # One reduction over the ranks: sample-weighted means, and the mean of the ranks' times.
        times = Metrics({"time/generation": generation, "time/ebft_features": features})
        metrics = distributed.reduce_metrics(combine_metrics([*self._advantages(chunks, parts), times]))
        metrics.update(advantage_spread(metrics, num_sequences))
        metrics.update({"ebft/documents": float(len(kept)), "ebft/dropped_documents": float(len(documents) - len(kept)),
                        "ebft/num_blocks": float(sum(d.layout.num_blocks() for d in kept))})
        totals = StepTotals(num_sequences=num_sequences, num_tokens=num_sequences * self.ebft.generate_max_len,
                            num_chunks=len(all_chunks), num_documents=len(kept))
        return StridedBatch(chunks, totals, metrics, self._shown(chunks))

    def chunk_generator(self, step: int, chunk: int) -> torch.Generator:
        seed = zlib.crc32(f"{self.config.train.seed}:strided:{step}:{chunk}".encode()) & 0x7FFFFFFF
        return torch.Generator(device=self.policy.device).manual_seed(seed)

    @torch.no_grad()
    def padding_chunk(self) -> None:
        """The forwards a chunk's sampling and scoring run (generate_max_len steps, then the frozen base's),
        on one token each: FSDP's collectives of a rank with fewer chunks pair up with the others'."""
        policy = self.policy
        packed = pack([[0]], [[0]], device=policy.device)
        with evaluating(policy.model):
            for _ in range(self.ebft.generate_max_len):
                policy.model(input_ids=packed.input_ids, position_ids=packed.position_ids, use_cache=False)
            with policy.reference() as base:
                hidden_layer_states(base, packed.input_ids, packed.position_ids, None, self.layers)

    def sample(self, documents: list[Document], generator: torch.Generator) -> StridedRollout:
        sampling = self.config.rollout.sampling  # temperature 0.6 unless given (Config._check_ebft)
        return sample_strided(self.policy.model, [d.token_ids for d in documents], [d.layout for d in documents],
                              self.config.algo.num_generations, temperature=sampling.temperature,
                              top_p=sampling.top_p, top_k=sampling.top_k, generator=generator,
                              kv_cache=self.ebft.kv_cache, additive_mask_dtype=attention_mask_dtype(self.policy))

    @torch.no_grad()
    def block_rewards(self, documents: list[Document], rollout: StridedRollout):
        """Reward parts of every (document, block) group over its n samples, from one forward of the
        chunk's row through the frozen base (adapter disabled, eval mode)."""
        policy = self.policy
        with evaluating(policy.model), policy.reference() as base, \
                full_row_attention(policy, rollout, self.flex, base) as (input_ids, position_ids, mask):
            states = hidden_layer_states(base, input_ids, position_ids, mask, self.layers)
        features = token_features([state.float() for state in states]).cpu()  # [L, F]
        generate_length = self.ebft.generate_max_len
        gen, truth = [], []
        for document, doc_rows, gen_rows in zip(documents, rollout.doc_rows, rollout.gen_rows):
            spans = torch.tensor(document.layout.anchors)[:, None] + torch.arange(generate_length)  # [NB, G]
            truth.append(pool_blocks(features[doc_rows[spans]], self.ebft.embed_method))  # [NB, F']
            gen.append(pool_blocks(features[gen_rows], self.ebft.embed_method).transpose(0, 1))  # [NB, n, F']
        return group_rewards(torch.cat(gen), torch.cat(truth), self.ebft.alignment_coef, self.ebft.diversity_coef,
                             self.ebft.whitening, self.ebft.whiten_tol)

    def _advantages(self, chunks: list[StridedChunk], parts: list) -> list[Metrics]:
        """Advantages per (document, block) group, split back per document as [n, NB_d]; each chunk's
        metrics, means weighted by their samples."""
        ebft, chunk_metrics = self.ebft, []
        for chunk, chunk_parts in zip(chunks, parts):
            advantages = ebft_advantages(chunk_parts, ebft.alignment_coef, ebft.diversity_coef,
                                         ebft.advantage_estimator)  # [sum NB, n]
            blocks = [document.layout.num_blocks() for document in chunk.documents]
            chunk.advantages = [part.t().float() for part in advantages.split(blocks)]
            chunk.rewards = [part.t().float() for part in chunk_parts.reward.split(blocks)]
            values = {**reward_metrics(chunk_parts), "ebft/advantage_abs_mean": float(advantages.abs().mean()),
                      ADVANTAGE_MEAN: float(advantages.double().mean()),
                      ADVANTAGE_SQUARE_MEAN: float(advantages.double().pow(2).mean())}
            count = float(advantages.numel())
            chunk_metrics.append(Metrics(values, dict.fromkeys(values, count)))
        return chunk_metrics

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

    def evaluate(self, step: int) -> None:
        return None  # eval scores with reward functions, which ebft has none of (the config says so)

    def state_dict(self) -> dict:
        return {}

    def close(self) -> None:
        pass
