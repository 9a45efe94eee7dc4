"""pykernels.moe.route against the routers of GPT-OSS, Ernie 4.5 MoE, Mistral 4 and Gemma 4 (transformers'
own modules, tiny random configs, fp32 and bf16): the same experts in the same order and the same
weights, bit for bit."""

import pytest
import torch
import transformers
from transformers.models.ernie4_5_moe.modeling_ernie4_5_moe import Ernie4_5_MoeTopKRouter
from transformers.models.gemma4.modeling_gemma4 import Gemma4TextRouter
from transformers.models.gpt_oss.modeling_gpt_oss import GptOssTopKRouter
from transformers.models.mistral4.modeling_mistral4 import Mistral4TopkRouter

from pykernels import moe

HIDDEN = 32
DTYPES = [torch.float32, torch.bfloat16]


def hidden(tokens=37, dtype=torch.float32):
    return torch.randn(tokens, HIDDEN, generator=torch.Generator().manual_seed(0)).to(dtype)


def randomize(router, seed=1):
    """Every parameter of the router random (weights, router bias, correction bias, scales)."""
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for param in router.parameters():
            param.copy_(torch.randn(param.shape, generator=g) * 0.5 + (1.0 if param.dim() == 1 else 0.0))
    return router


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("top_k", [1, 4])
def test_topk_softmax_matches_gpt_oss(dtype, top_k):
    config = transformers.GptOssConfig(hidden_size=HIDDEN, num_local_experts=16, num_experts_per_tok=top_k)
    router = randomize(GptOssTopKRouter(config)).to(dtype)
    assert router.bias.abs().min() > 0  # the router bias is part of the logits
    logits, weights, index = router(hidden(dtype=dtype))
    ours_weights, ours_index = moe.route(logits, top_k, "topk_softmax")
    assert torch.equal(ours_index, index) and torch.equal(ours_weights, weights) and ours_weights.dtype == dtype


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("norm_min", [1e-12, 0.9])  # 0.9: above most top-k sums of 24 experts, the clamp bites
def test_softmax_with_correction_bias_matches_ernie4_5_moe(dtype, norm_min):
    config = transformers.Ernie4_5_MoeConfig(hidden_size=HIDDEN, moe_num_experts=24, moe_k=3, moe_norm_min=norm_min)
    router = randomize(Ernie4_5_MoeTopKRouter(config))  # fp32 like the checkpoint's router (computed in fp32)
    with torch.no_grad():  # a correction large enough to change the choice
        router.moe_statics.e_score_correction_bias.mul_(0.1)
    x = hidden(dtype=dtype)
    logits, weights, index = router(x)
    ours_weights, ours_index = moe.route(logits, 3, renormalize=True,
                                         correction_bias=router.moe_statics.e_score_correction_bias[0],
                                         renormalize_min=norm_min, weights_dtype=x.dtype)
    assert torch.equal(ours_index, index) and torch.equal(ours_weights, weights) and ours_weights.dtype == dtype
    plain_index = moe.route(logits, 3, renormalize=True)[1]
    assert not torch.equal(plain_index, index)  # the bias did change some choices
    if norm_min > 0.5:
        assert (ours_weights.float().sum(-1) < 0.99).any()  # and the clamp some weights


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize(("n_group", "topk_group", "top_k", "norm"), [(1, 1, 4, True), (4, 2, 3, True),
                                                                     (8, 3, 2, False)])
def test_softmax_group_top2_matches_mistral4(dtype, n_group, topk_group, top_k, norm):
    config = transformers.Mistral4Config(hidden_size=HIDDEN, n_routed_experts=32, num_experts_per_tok=top_k,
                                         n_group=n_group, topk_group=topk_group, norm_topk_prob=norm,
                                         routed_scaling_factor=1.5)
    router = randomize(Mistral4TopkRouter(config)).to(dtype)
    logits, weights, index = router(hidden(dtype=dtype))
    ours_weights, ours_index = moe.route(logits, top_k, "softmax_group_top2", renormalize=norm, num_groups=n_group,
                                         top_k_groups=topk_group, routed_scaling_factor=1.5)
    assert torch.equal(ours_index, index) and torch.equal(ours_weights, weights) and ours_weights.dtype == dtype
    groups = ours_index // (32 // n_group)
    assert all(len(set(row.tolist())) <= topk_group for row in groups)  # only kept groups chosen


@pytest.mark.parametrize("dtype", DTYPES)
def test_softmax_with_expert_scale_matches_gemma4(dtype):
    config = transformers.Gemma4TextConfig(hidden_size=HIDDEN, num_experts=16, top_k_experts=4,
                                           enable_moe_block=True, moe_intermediate_size=8)
    router = randomize(Gemma4TextRouter(config)).to(dtype)
    logits = {}
    router.proj.register_forward_hook(lambda module, args, out: logits.setdefault("scores", out))
    _, weights, index = router(hidden(dtype=dtype))
    ours_weights, ours_index = moe.route(logits["scores"], 4, renormalize=True, weights_dtype=torch.float32,
                                         expert_scale=router.per_expert_scale)
    assert torch.equal(ours_index, index) and torch.equal(ours_weights, weights)
    assert ours_weights.dtype == weights.dtype == torch.float32


def test_new_options_are_refused_where_they_do_not_apply():
    logits = torch.randn(5, 12)
    with pytest.raises(ValueError, match="correction_bias applies to the softmax and sigmoid_group methods"):
        moe.route(logits, 2, "topk_softmax", correction_bias=torch.zeros(12))
    with pytest.raises(ValueError, match="correction_bias must have shape \\(12,\\)"):
        moe.route(logits, 2, correction_bias=torch.zeros(1, 12))
    with pytest.raises(ValueError, match="renormalize_min and expert_scale apply to the softmax method"):
        moe.route(logits, 2, "sigmoid_group", expert_scale=torch.ones(12))
    with pytest.raises(ValueError, match="expert_scale must have shape \\(12,\\)"):
        moe.route(logits, 2, expert_scale=torch.ones(11))
    with pytest.raises(ValueError, match="softmax_group_top2 scores a group by its top 2"):
        moe.route(logits, 2, "softmax_group_top2", num_groups=12, top_k_groups=2)
