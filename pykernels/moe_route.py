"""MoE routers: router logits -> (top_k_weights, top_k_index), the same op sequences as
transformers' own routers so that results match them bit for bit. Routing is O(T E) elementwise
work next to the expert GEMMs, so it is plain torch (CPU and CUDA alike).

    >>> weights, index = pykernels.moe.route(logits, 8, renormalize=True)                 # Qwen3-MoE
    >>> weights, index = pykernels.moe.route(logits, 8, "sigmoid_group", renormalize=True, num_groups=8,
    ...                                      top_k_groups=4, correction_bias=bias, routed_scaling_factor=2.5)
    >>> weights, index = pykernels.moe.route(logits, 4, "topk_softmax")                   # GPT-OSS
"""

from __future__ import annotations

import torch

METHODS = ("softmax", "topk_softmax", "softmax_group", "softmax_group_top2", "sigmoid_group")
_GROUPED = ("softmax_group", "softmax_group_top2", "sigmoid_group")


def _check(logits, top_k, method, num_groups, top_k_groups, correction_bias, renormalize_min, expert_scale):
    if method not in METHODS:
        raise ValueError(f"method must be one of {METHODS}, got {method!r}")
    if not isinstance(logits, torch.Tensor) or logits.dim() != 2 or not logits.dtype.is_floating_point:
        raise ValueError("logits must be a float tensor [tokens, num_experts], got "
                         f"{getattr(logits, 'shape', type(logits).__name__)}")
    num_experts = logits.shape[1]
    if not 1 <= top_k <= num_experts:
        raise ValueError(f"top_k must be in [1, {num_experts}] (num_experts), got {top_k}")
    if correction_bias is not None:
        if method not in ("softmax", "sigmoid_group"):
            raise ValueError(f"correction_bias applies to the softmax and sigmoid_group methods, not {method!r}")
        if correction_bias.shape != (num_experts,):
            raise ValueError(f"correction_bias must have shape ({num_experts},), got {tuple(correction_bias.shape)}")
    if (renormalize_min or expert_scale is not None) and method != "softmax":
        raise ValueError(f"renormalize_min and expert_scale apply to the softmax method, not {method!r}")
    if expert_scale is not None and expert_scale.shape != (num_experts,):
        raise ValueError(f"expert_scale must have shape ({num_experts},), got {tuple(expert_scale.shape)}")
    if method not in _GROUPED:
        return
    if num_groups < 1 or num_experts % num_groups:
        raise ValueError(f"num_groups ({num_groups}) must divide num_experts ({num_experts})")
    if not 1 <= top_k_groups <= num_groups:
        raise ValueError(f"top_k_groups must be in [1, {num_groups}] (num_groups), got {top_k_groups}")
    if top_k > top_k_groups * (num_experts // num_groups):
        raise ValueError(f"top_k ({top_k}) exceeds the experts of the top_k_groups ({top_k_groups}) kept groups")
    if method != "softmax_group" and num_experts // num_groups < 2:
        raise ValueError(f"{method} scores a group by its top 2 experts: each group needs at least 2")


def _group_mask(group_scores: torch.Tensor, top_k_groups: int, num_experts: int) -> torch.Tensor:
    """True for the experts of each token's top_k_groups groups."""
    num_groups = group_scores.shape[1]
    group_idx = torch.topk(group_scores, k=top_k_groups, dim=-1, sorted=False)[1]
    group_mask = torch.zeros_like(group_scores).scatter_(1, group_idx, 1)
    return group_mask.unsqueeze(-1).expand(-1, num_groups, num_experts // num_groups).reshape(-1, num_experts).bool()


def _top2_group_mask(choice: torch.Tensor, num_groups: int, top_k_groups: int) -> torch.Tensor:
    """_group_mask with a group scored by the sum of its 2 best experts (DeepSeek-V3, Mistral 4)."""
    num_experts = choice.shape[1]
    group_scores = choice.view(-1, num_groups, num_experts // num_groups).topk(2, dim=-1)[0].sum(dim=-1)
    return _group_mask(group_scores, top_k_groups, num_experts)


def route(logits: torch.Tensor, top_k: int, method: str = "softmax", renormalize: bool = False,
          num_groups: int = 1, top_k_groups: int = 1, correction_bias: torch.Tensor | None = None,
          routed_scaling_factor: float = 1.0, weights_dtype: torch.dtype | None = None,
          renormalize_min: float = 0.0, expert_scale: torch.Tensor | None = None
          ) -> tuple[torch.Tensor, torch.Tensor]:
    """Top-k experts per token and their weights from router logits [T, E].

    method:
      "softmax": fp32 softmax over all experts, top-k (descending), renormalized over the k when
        asked (dividing by max(sum, renormalize_min) when renormalize_min > 0); correction_bias
        [E], when given, is added to the probabilities for the choice only; expert_scale [E]
        multiplies each chosen expert's weight last; weights in logits' dtype unless weights_dtype
        (Qwen2/3-MoE, OLMoE, Qwen3-Next: renormalize = norm_topk_prob; Qwen3.5-MoE: True; Mixtral:
        True, weights_dtype=float32; Ernie 4.5: True, correction_bias = the router's
        moe_statics.e_score_correction_bias[0], renormalize_min = moe_norm_min, weights_dtype = the
        hidden states' dtype; Gemma 4: True, weights_dtype=float32, expert_scale = the router's
        per_expert_scale).
      "topk_softmax": GPT-OSS: the top-k logits (descending), softmax over those k in logits' dtype.
      "softmax_group": DeepSeek-V2's group-limited greedy: a group scores its best expert, the
        top_k_groups best groups are kept, top-k among their experts, times routed_scaling_factor.
      "softmax_group_top2": Mistral 4: softmax in logits' dtype; a group scores the sum of its top 2
        experts, the other groups' experts get 0 (below any softmax score); weights are the scores,
        renormalized (+1e-20) when asked, times routed_scaling_factor, in logits' dtype.
      "sigmoid_group": DeepSeek-V3 / GLM4-MoE: sigmoid scores; correction_bias is added for the
        choice only; a group scores the sum of its top 2; experts of the other groups get -inf (a
        0 fill would let them beat negative biased scores); weights are the unbiased scores,
        renormalized (+1e-20) when asked, then times routed_scaling_factor.
    The logits are the router's linear output, its bias included (GPT-OSS); softmax_group and
    sigmoid_group compute in fp32 and return fp32 weights. Returns (weights [T, k], index [T, k]
    int64), ready for pykernels.moe.experts_forward.
    """
    _check(logits, top_k, method, num_groups, top_k_groups, correction_bias, renormalize_min, expert_scale)
    num_experts = logits.shape[1]
    if method == "softmax":
        probs = torch.nn.functional.softmax(logits, dtype=torch.float, dim=-1)
        if correction_bias is None:
            weights, index = torch.topk(probs, top_k, dim=-1)
        else:
            index = torch.topk(probs + correction_bias, top_k, dim=-1)[1]
            weights = probs.gather(1, index)
        if renormalize:
            total = weights.sum(dim=-1, keepdim=True)
            weights = weights / (total.clamp(min=renormalize_min) if renormalize_min > 0 else total)
        if expert_scale is not None:
            weights = weights * expert_scale[index]
        return weights.to(weights_dtype or logits.dtype), index
    if method == "topk_softmax":
        top_logits, index = torch.topk(logits, top_k, dim=-1)
        return torch.nn.functional.softmax(top_logits, dim=1, dtype=top_logits.dtype), index
    if method == "softmax_group_top2":
        scores = logits.softmax(-1)
        choice = scores.masked_fill(~_top2_group_mask(scores, num_groups, top_k_groups), 0.0)
        index = torch.topk(choice, k=top_k, dim=-1, sorted=False)[1]
        weights = scores.gather(1, index)
        if renormalize:
            weights = weights / (weights.sum(dim=-1, keepdim=True) + 1e-20)
        return weights * routed_scaling_factor, index
    logits = logits.float()
    if method == "softmax_group":
        scores = logits.softmax(dim=-1, dtype=torch.float32)
        group_scores = scores.view(-1, num_groups, num_experts // num_groups).max(dim=-1).values
        choice = scores.masked_fill(~_group_mask(group_scores, top_k_groups, num_experts), float("-inf"))
        index = torch.topk(choice, k=top_k, dim=-1, sorted=False)[1]
        weights = scores.gather(1, index)
        if renormalize:
            weights = weights / weights.sum(dim=-1, keepdim=True)
        return weights * routed_scaling_factor, index
    scores = logits.sigmoid()
    choice = scores if correction_bias is None else scores + correction_bias
    choice = choice.masked_fill(~_top2_group_mask(choice, num_groups, top_k_groups), float("-inf"))
    index = torch.topk(choice, k=top_k, dim=-1, sorted=False)[1]
    weights = scores.gather(1, index)
    if renormalize:
        weights = weights / (weights.sum(dim=-1, keepdim=True) + 1e-20)
    return weights * routed_scaling_factor, index
