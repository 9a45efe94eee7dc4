"""EBFT rewards: feature matching between each prompt's n samples and its ground truth.

Per prompt, with phi_j the pooled features of sample j and phi_gt those of the ground truth
(Jelassi et al. 2026, https://arxiv.org/abs/2603.12248, eq. 7, as both the official code and axolotl
implement it):

    r_j = 2 * alpha * cos(phi_j, phi_gt) - 2 * beta / (n - 1) * sum_{k != j} phi_j . phi_k

Maximizing E[r] follows the gradient of the feature-matching loss ||E phi(y_hat) - phi(y)||^2, with
the mean of the *other* samples estimating E phi for sample j (diversity is 0 when n = 1).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F


def whiten(
    gen: torch.Tensor,  # [n, F] pooled features of one prompt's samples
    gt: torch.Tensor,  # [F] pooled features of its ground truth
    tol: float = 1e-5,
) -> tuple[torch.Tensor, torch.Tensor]:  # (gen @ W [n, F], gt @ W [F])
    """Whiten both sides with W = U diag(1/S) U^T = (gen^T gen)^{+1/2} from the generated samples.

    This is axolotl's form, and the issue's ("from the generated embeddings ... applied to both").
    The official code transforms the ground truth differently: in sample space, so its whitened GT
    is a scalar multiple of the raw GT.

    W is never formed: with the thin SVD gen = V S U^T (float64), gen @ W = V U^T and
    gt @ W = ((gt @ U) / S) @ U^T. Singular values <= tol * max(S) are cut (near-duplicate samples).
    With rank n (n <= F and no duplicates) the whitened samples are orthonormal, so every diversity
    dot product is 0; only near-duplicates keep a non-zero Gram entry (two equal samples -> 0.5).
    """
    v, s, u_t = torch.linalg.svd(gen.double(), full_matrices=False)  # v [n, r], s [r], u_t [r, F]
    keep = s > tol * s.max()
    v, s, u_t = v[:, keep], s[keep], u_t[keep]
    gen_white = v @ u_t
    gt_white = ((gt.double() @ u_t.T) / s) @ u_t
    return gen_white.to(gen.dtype), gt_white.to(gt.dtype)


@dataclass
class RewardParts:
    alignment: torch.Tensor  # [P, n] cos(phi_j, phi_gt) (whitened if whitening)
    diversity: torch.Tensor  # [P, n] mean of phi_j . phi_k over the group's other samples; 0 when n = 1
    reward: torch.Tensor  # [P, n] 2 * alpha * alignment - 2 * beta * diversity
    cfm: torch.Tensor  # [P] ||mean_j phi_j - phi_gt||^2 on the un-whitened features


def group_rewards(
    gen: torch.Tensor,  # [P, n, F] pooled features of each prompt's n samples
    gt: torch.Tensor,  # [P, F] pooled features of each prompt's ground truth
    alignment_coef: float,
    diversity_coef: float,
    whitening: bool,
    tol: float = 1e-5,
) -> RewardParts:
    """Alignment, diversity and reward per sample, and the CFM loss per prompt.

    Alignment is a cosine and diversity a raw dot product (axolotl's "variant (i)"; the same on unit
    features). The CFM loss (paper eq. 2, plug-in estimate) is computed before whitening: whitening
    uses a new basis every step, and the loss must be comparable across steps.
    """
    if gen.dim() != 3:
        raise ValueError(f"gen must have shape (P, n, F), got {tuple(gen.shape)}")
    num_prompts, num_samples, num_features = gen.shape
    if tuple(gt.shape) != (num_prompts, num_features):
        raise ValueError(f"gt must have shape (P, F) = {(num_prompts, num_features)}, got {tuple(gt.shape)}")
    cfm = (gen.mean(dim=1) - gt).pow(2).sum(dim=-1)
    if whitening:
        pairs = [whiten(gen[p], gt[p], tol) for p in range(num_prompts)]
        gen = torch.stack([gen_white for gen_white, _ in pairs])
        gt = torch.stack([gt_white for _, gt_white in pairs])
    alignment = F.cosine_similarity(gen, gt.unsqueeze(1), dim=-1)
    if num_samples > 1:
        gram = gen @ gen.transpose(1, 2)
        off_diagonal_sum = gram.sum(dim=-1) - gram.diagonal(dim1=1, dim2=2)
        diversity = off_diagonal_sum / (num_samples - 1)
    else:
        diversity = torch.zeros_like(alignment)
    reward = 2 * alignment_coef * alignment - 2 * diversity_coef * diversity
    return RewardParts(alignment=alignment, diversity=diversity, reward=reward, cfm=cfm)


def reward_metrics(parts: RewardParts) -> dict[str, float]:
    """Batch means. Alignment and diversity are logged with their factor 2 (2 * cos in [-2, 2], and
    2 * mean dot), as axolotl logs them, so ebft/reward = alpha * alignment - beta * diversity."""
    return {
        "ebft/alignment": 2 * parts.alignment.mean().item(),
        "ebft/diversity": 2 * parts.diversity.mean().item(),
        "ebft/cfm_loss": parts.cfm.mean().item(),
        "ebft/reward": parts.reward.mean().item(),
    }
