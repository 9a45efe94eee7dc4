"""A cross-entropy term on each prompt's ground truth beside the policy loss (EBFT's ce_coef in structured
mode; driver/algorithms.py says which algorithm has one): loss = policy_coef x the policy loss of
driver/update/losses.py + ce_coef x CE, CE the mean over the step's documents (prompt + ground truth) of the
token mean of -log p(ground-truth token | prompt, earlier ground-truth tokens), at temperature 1 whatever the
sampling temperature, through the trained policy (adapter on, dropout as in training).

Exact under every split of the step (micro-batches, steps_per_generation, torchrun shards): each row adds
CE(its document) / num_sequences, the step's rows before zero-advantage filtering, so with num_generations
rows per group every document weighs 1 / (the step's documents). A micro-batch scores each distinct document
once, weighted by the number of its rows that share it, as extra sequences of the completions' packed
forward: the CE costs no second forward. Rows that zero-advantage filtering removed take their share of the
CE with them (the divisor still counts them), as a group whose rewards are all equal takes its document.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from driver.metrics.combine import Metrics
from driver.policy.logprobs import causal_lm_of, hidden_states, pack
from driver.rollouts.batch import RolloutBatch
from pykernels.logprobs import packed_targets, token_logprobs


@dataclass(frozen=True)
class GroundTruthLoss:
    """loss = policy_coef x policy loss + ce_coef x CE; the two parts are logged (unweighted) as
    {metric_prefix}rl_loss and {metric_prefix}ce_loss, the latter only when ce_coef > 0 (no document is
    scored otherwise)."""

    policy_coef: float
    ce_coef: float
    metric_prefix: str

    @property
    def trains_ground_truth(self) -> bool:
        return self.ce_coef > 0

    @property
    def metric_names(self) -> tuple[str, ...]:
        ce = (f"{self.metric_prefix}ce_loss",) if self.trains_ground_truth else ()
        return (f"{self.metric_prefix}rl_loss", *ce)

    def total(self, policy_loss: torch.Tensor, documents: Documents | None, document_nll: torch.Tensor | None,
              num_sequences: int) -> tuple[torch.Tensor, Metrics]:
        """(this micro-batch's share of the step loss, its parts), from its share of the policy loss and
        its documents' token-mean NLL [D]; num_sequences: the step's rows before filtering."""
        values = {f"{self.metric_prefix}rl_loss": float(policy_loss.detach())}
        loss = self.policy_coef * policy_loss
        if self.trains_ground_truth:
            ce = (documents.rows.to(document_nll) * document_nll).sum() / num_sequences
            loss = loss + self.ce_coef * ce
            values[f"{self.metric_prefix}ce_loss"] = float(ce.detach())
        return loss, Metrics(values)


@dataclass
class Documents:
    """The distinct documents (prompt + ground truth) of a micro-batch's rows, in first-seen order."""

    prompt_ids: list[list[int]]
    ground_truth_ids: list[list[int]]
    rows: torch.Tensor  # [D] how many of the micro-batch's rows share each document


def check_ground_truths(batch: RolloutBatch) -> None:
    if len(batch.ground_truth_ids) != len(batch):
        raise ValueError(f"the loss has a cross-entropy term on the ground truth, but the rollout batch carries "
                         f"{len(batch.ground_truth_ids)} ground truths for its {len(batch)} rows "
                         "(RolloutBatch.ground_truth_ids, filled by batch_from_groups)")


def micro_batch_documents(prompt_ids: list[list[int]], ground_truth_ids: list[list[int]]) -> Documents:
    rows: dict[tuple[tuple[int, ...], tuple[int, ...]], int] = {}
    for prompt, truth in zip(prompt_ids, ground_truth_ids):
        key = (tuple(prompt), tuple(truth))
        rows[key] = rows.get(key, 0) + 1
    return Documents([list(prompt) for prompt, _ in rows], [list(truth) for _, truth in rows],
                     torch.tensor(list(rows.values()), dtype=torch.float32))


def logprobs_and_document_nll(model: torch.nn.Module, prompt_ids: list[list[int]], completion_ids: list[list[int]],
                              documents: Documents, temperature: float, entropy_grad: bool, device: torch.device):
    """(logprobs, entropy, mask) of the completions [N, T], as driver/policy/logprobs.py's
    completion_logprobs gives them at `temperature`, and the token-mean NLL [D] of each document's ground
    truth at temperature 1: one packed forward, the documents' sequences after the completions'."""
    packed = pack(prompt_ids + documents.prompt_ids, completion_ids + documents.ground_truth_ids, device=device)
    causal_lm = causal_lm_of(model)
    positions = packed.completion_positions()
    targets = packed_targets(packed.input_ids[0], packed.cu_seqlens)[positions]
    hidden = hidden_states(model, packed)[positions]
    weight = causal_lm.get_output_embeddings().weight  # after the forward: under FSDP, the gathered weight
    lengths = torch.tensor(packed.completion_lengths, device=hidden.device)
    completion_lengths, truth_lengths = lengths[: len(completion_ids)], lengths[len(completion_ids):]
    split = int(completion_lengths.sum())
    logps, entropy = token_logprobs(hidden[:split], weight, targets[:split], temperature=temperature,
                                    return_entropy=True, entropy_grad=entropy_grad)
    truth_logps = token_logprobs(hidden[split:], weight, targets[split:], temperature=1.0)
    owners = torch.repeat_interleave(torch.arange(len(truth_lengths), device=hidden.device), truth_lengths)
    nll = truth_logps.new_zeros(len(truth_lengths)).index_add(0, owners, -truth_logps) / truth_lengths.clamp(min=1)
    width = int(completion_lengths.max()) if len(completion_ids) else 0
    mask = (torch.arange(width, device=hidden.device) < completion_lengths[:, None]).float()
    flat = mask.bool()
    return (logps.new_zeros(mask.shape).masked_scatter(flat, logps),
            entropy.new_zeros(mask.shape).masked_scatter(flat, entropy), mask, nll)
