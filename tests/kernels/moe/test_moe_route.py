"""pykernels.moe.route against transformers' own routers (tiny random configs, fp32 and bf16):
the same weights and experts, bit for bit where transformers' op sequence is ours."""

import pytest
import torch
import transformers
from transformers.models.deepseek_v2.modeling_deepseek_v2 import DeepseekV2TopkRouter
from transformers.models.deepseek_v3.modeling_deepseek_v3 import DeepseekV3TopkRouter
from transformers.models.mixtral.modeling_mixtral import MixtralTopKRouter
from transformers.models.qwen3_moe.modeling_qwen3_moe import Qwen3MoeTopKRouter

from pykernels import moe

HIDDEN = 32


def hidden(tokens=37, dtype=torch.float32):
    return torch.randn(tokens, HIDDEN, generator=torch.Generator().manual_seed(0)).to(dtype)


def init(router):
    with torch.no_grad():
        router.weight.normal_(0, 0.5, generator=torch.Generator().manual_seed(1))
    return router


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("norm_topk_prob", [False, True])
def test_softmax_matches_qwen3_moe(dtype, norm_topk_prob):
    config = transformers.Qwen3MoeConfig(hidden_size=HIDDEN, num_experts=16, num_experts_per_tok=4,
                                         norm_topk_prob=norm_topk_prob)
    router = init(Qwen3MoeTopKRouter(config)).to(dtype)
    x = hidden(dtype=dtype)
    logits, weights, index = router(x)
    ours_weights, ours_index = moe.route(logits, 4, renormalize=norm_topk_prob)
    assert torch.equal(ours_index, index) and torch.equal(ours_weights, weights) and ours_weights.dtype == dtype


def test_softmax_matches_mixtral_fp32_weights():
    config = transformers.MixtralConfig(hidden_size=HIDDEN, num_local_experts=8, num_experts_per_tok=2)
    router = init(MixtralTopKRouter(config)).bfloat16()
    logits, weights, index = router(hidden(dtype=torch.bfloat16))
    ours_weights, ours_index = moe.route(logits, 2, renormalize=True, weights_dtype=torch.float32)
    assert torch.equal(ours_index, index) and torch.equal(ours_weights, weights)
    assert ours_weights.dtype == torch.float32


@pytest.mark.parametrize(("n_group", "topk_group", "top_k"), [(4, 2, 6), (1, 1, 8), (8, 3, 3)])
def test_sigmoid_group_matches_deepseek_v3_with_a_negative_bias(n_group, topk_group, top_k):
    config = transformers.DeepseekV3Config(hidden_size=HIDDEN, n_routed_experts=32, num_experts_per_tok=top_k,
                                           n_group=n_group, topk_group=topk_group, norm_topk_prob=True,
                                           routed_scaling_factor=2.5)
    router = init(DeepseekV3TopkRouter(config))
    with torch.no_grad():  # negative corrections: a 0-filled masked expert would beat them
        router.e_score_correction_bias.copy_(-1.0 - torch.rand(32, generator=torch.Generator().manual_seed(2)))
    logits, weights, index = router(hidden())
    ours_weights, ours_index = moe.route(logits, top_k, "sigmoid_group", renormalize=True, num_groups=n_group,
                                         top_k_groups=topk_group, correction_bias=router.e_score_correction_bias,
                                         routed_scaling_factor=2.5)
    assert torch.equal(ours_index, index) and torch.equal(ours_weights, weights)
    groups = ours_index // (32 // n_group)
    assert all(len(set(row.tolist())) <= topk_group for row in groups)  # only kept groups chosen


def test_softmax_group_matches_deepseek_v2():
    config = transformers.DeepseekV2Config(hidden_size=HIDDEN, n_routed_experts=16, num_experts_per_tok=3,
                                           n_group=4, topk_group=2, topk_method="group_limited_greedy",
                                           routed_scaling_factor=1.5)
    router = init(DeepseekV2TopkRouter(config))
    logits, weights, index = router(hidden())
    ours_weights, ours_index = moe.route(logits, 3, "softmax_group", num_groups=4, top_k_groups=2,
                                         routed_scaling_factor=1.5)
    # transformers fills masked experts with 0, we with -inf: the same experts are chosen, and
    # top-k(sorted=False) may list them in another order.
    order, ours_order = index.sort(dim=-1), ours_index.sort(dim=-1)
    assert torch.equal(ours_order.values, order.values)
    assert torch.equal(ours_weights.gather(1, ours_order.indices), weights.gather(1, order.indices))


def test_bad_arguments_are_clear_errors():
    logits = torch.randn(5, 12)
    with pytest.raises(ValueError, match="method must be one of"):
        moe.route(logits, 2, "topk")
    with pytest.raises(ValueError, match="top_k must be in \\[1, 12\\]"):
        moe.route(logits, 13)
    with pytest.raises(ValueError, match="num_groups \\(5\\) must divide num_experts \\(12\\)"):
        moe.route(logits, 2, "sigmoid_group", num_groups=5)
    with pytest.raises(ValueError, match="top_k_groups must be in"):
        moe.route(logits, 2, "sigmoid_group", num_groups=4, top_k_groups=5)
    with pytest.raises(ValueError, match="exceeds the experts"):
        moe.route(logits, 7, "softmax_group", num_groups=4, top_k_groups=2)
    with pytest.raises(ValueError, match="at least 2"):
        moe.route(logits, 2, "sigmoid_group", num_groups=12, top_k_groups=2)
    with pytest.raises(ValueError, match="correction_bias must have shape \\(12,\\)"):
        moe.route(logits, 2, "sigmoid_group", num_groups=4, top_k_groups=2, correction_bias=torch.zeros(11))
    with pytest.raises(ValueError, match="logits must be a float tensor"):
        moe.route(torch.zeros(5, 12, dtype=torch.long), 2)
