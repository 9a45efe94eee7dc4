"""The EBFT strided update: loss = rl_coef * policy gradient + ce_coef * cross-entropy, one forward of
each micro-batch's generation-order row (the sampling mask, adapter on).

Policy gradient: every generated token is scored from its predictor row (the row whose logits
sampled it: the context's last token for step 0, the block's previous token after; the row just
before it in the row belongs to another block), at the sampling temperature, with its block's
advantage, in driver/update/losses.py's clipped loss (one sequence per (sample, block); the old logprobs
are the sampling logprobs, computed by these very weights, so the first update's ratio is 1). axolotl
samples at ebft.temperature (0.6) but scores at temperature 1, the gradient of a distribution other
than the one sampled; here both are rollout.sampling.temperature. The logprobs are of the full
tempered distribution p (sample_tokens), not of the top-k/top-p truncated q the blocks were drawn
from: with rollout.sampling.top_p < 1 or top_k set, no importance weight p / q (the kept mass, <= 1)
corrects for the truncation here, unlike the vLLM path, whose importance sampling compares the
trainer's p with vLLM's processed (truncated) logprobs.
Cross-entropy: the ground truth (the whole document without one) at temperature 1, each document's
token mean averaged over the step's documents, as in the official code. The document rows are plain
causal, so the CE costs no second forward.
"""

from __future__ import annotations

import math

import torch

from driver.config import Config
from driver.distributed import world as distributed
from driver.ebft.strided import StridedBatch, StridedChunk
from driver.ebft.strided_attention import full_row_attention, uses_flex
from driver.metrics.combine import Metrics, combine_metrics
from driver.policy.model import Policy
from driver.update.loss_scale import loss_scale
from driver.update.loss_terms import loss_options
from driver.update.losses import StepNormalizers, policy_loss
from driver.update.optim import optimizer_steps
from driver.update.step import padding_pass
from pykernels.logprobs import token_logprobs


def optimize_strided(config: Config, policy: Policy, batch: StridedBatch, optimizer, scheduler) -> dict[str, float]:
    """The update on this rank's chunks, normalized by the whole step's counts (batch.totals): under
    torchrun the ranks' losses sum to the single-process loss, each multiplied by the world size since
    FSDP averages the gradients; a rank with fewer chunks than the busiest runs zero-loss padding passes."""
    ebft, totals, world = config.ebft, batch.totals, distributed.world()
    normalizers = StepNormalizers(num_sequences=totals.num_sequences, num_tokens=totals.num_tokens,
                                  num_micro_batches=totals.num_chunks, max_completion_length=ebft.generate_max_len)
    padding = math.ceil(totals.num_chunks / world.size) - len(batch.chunks)
    chunk_metrics: list[Metrics] = []  # with their token counts: combine_metrics weighs them exactly
    policy.model.train()

    def backward_pass() -> Metrics:
        # Each chunk's losses are its share of the step's: the step's are their sums.
        step_losses = dict.fromkeys(("loss", "ebft/rl_loss", "ebft/ce_loss"), 0.0)
        scale = loss_scale(config, optimizer)
        for chunk in batch.chunks:
            metrics = chunk_loss(config, policy, chunk, normalizers, totals.num_documents, scale)
            for key in step_losses:
                step_losses[key] += metrics.values.pop(key)
            chunk_metrics.append(metrics)
        for _ in range(padding):
            padding_pass(policy, config.rollout.sampling.temperature, backward=True)
        return Metrics(step_losses)

    iterations = optimizer_steps(config, policy.trainable_parameters(), optimizer, scheduler, [backward_pass])
    values = distributed.reduce_metrics(combine_metrics(chunk_metrics).update(iterations),
                                        summed=("loss", "ebft/rl_loss", "ebft/ce_loss"))
    values["learning_rate"] = scheduler.get_last_lr()[0]
    return values


def chunk_loss(config: Config, policy: Policy, chunk: StridedChunk, normalizers: StepNormalizers,
               num_documents: int, scale: float = 1.0) -> Metrics:
    """Backward of this chunk's share of the step loss; returns its metrics. scale: float16's loss scale (the
    backward's alone)."""
    algo, ebft, rollout = config.algo, config.ebft, chunk.rollout
    device, causal_lm = policy.device, policy.causal_lm
    with full_row_attention(policy, rollout, uses_flex(ebft.attention, device)) as (input_ids, position_ids, mask):
        hidden = causal_lm.get_decoder()(input_ids=input_ids, position_ids=position_ids, attention_mask=mask,
                                         use_cache=False).last_hidden_state[0]  # PEFT's LoRA layers are in place
    weight = causal_lm.get_output_embeddings().weight
    generate_length = ebft.generate_max_len
    predictors = torch.cat([rows.reshape(-1) for rows in rollout.predictor_rows]).to(device)
    targets = torch.cat([tokens.reshape(-1) for tokens in rollout.tokens]).to(device)
    logps = token_logprobs(hidden[predictors], weight, targets, temperature=config.rollout.sampling.temperature)
    logps = logps.view(-1, generate_length)  # [(document, sample, block), G]
    old = torch.cat([lp.reshape(-1, generate_length) for lp in rollout.sampling_logprobs]).to(device)
    advantages = torch.cat([a.reshape(-1) for a in chunk.advantages]).to(device)
    rl, metrics = policy_loss(logps, old, advantages, torch.ones_like(old), loss_type=algo.loss_type,
                              epsilon_low=algo.epsilon, epsilon_high=algo.clip_high, beta=0.0, normalizers=normalizers,
                              options=loss_options(algo))
    loss = ebft.rl_coef * rl
    ce = ground_truth_cross_entropy(chunk, hidden, weight, device) / num_documents
    if ebft.ce_coef > 0:
        loss = loss + ebft.ce_coef * ce
    (loss * (distributed.world().size * scale)).backward()  # FSDP divides by the world size; the loss is a share
    return metrics.update(Metrics({"loss": float(loss.detach()), "ebft/rl_loss": float(rl.detach()),
                                   "ebft/ce_loss": float(ce.detach())}))


def ground_truth_cross_entropy(chunk: StridedChunk, hidden: torch.Tensor, weight: torch.Tensor,
                               device: torch.device) -> torch.Tensor:
    """Sum over the chunk's documents of the mean -log p(x_t | x_<t) over the ground-truth tokens."""
    predictors, targets, owners = [], [], []
    for index, (document, doc_rows) in enumerate(zip(chunk.documents, chunk.rollout.doc_rows)):
        positions = torch.arange(max(document.ce_start, 1), len(document.token_ids))
        predictors.append(doc_rows[positions - 1])
        targets.append(torch.tensor(document.token_ids)[positions])
        owners.append(torch.full((len(positions),), index))
    predictors, targets, owners = (torch.cat(x).to(device) for x in (predictors, targets, owners))
    logps = token_logprobs(hidden[predictors], weight, targets, temperature=1.0)
    count = torch.bincount(owners, minlength=len(chunk.documents)).clamp(min=1)
    per_document = torch.zeros(len(chunk.documents), device=device, dtype=logps.dtype).index_add(0, owners, -logps)
    return (per_document / count).sum()
