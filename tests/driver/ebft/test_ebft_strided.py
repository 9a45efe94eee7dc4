"""EBFT strided mode: documents and anchors, block features and rewards against plain causal forwards of
each block alone through a separately loaded base model, and the strided loss's gradient against a loss
built block by block from plain causal forwards of the policy."""

import math

import pytest
import torch
import torch.nn.functional as F

from driver.config import Config
from driver.data.prompts import Prompt
from driver.ebft.rewards import group_rewards
from driver.ebft.strided import StridedSource, pool_blocks
from driver.ebft.strided_attention import full_row_attention, uses_flex
from driver.ebft.strided_update import chunk_loss
from driver.engine import RolloutError
from driver.update.losses import StepNormalizers
from tests.ebft_fixtures import full_policy_moved_from_its_base, policy_with_random_adapter, separate_base_model

GROUND_TRUTHS = [" 12345 678 90 1234", " 98765 4321 0"]
PROMPTS = ["Write digits: apple river", "Write digits: stone"]


def strided_config(**ebft) -> Config:
    return Config.model_validate({
        "algo": {"name": "ebft", "num_generations": 3, "loss_type": "grpo"},
        "lora": {"r": 4},
        "rollout": {"sampling": {"temperature": 0.9}},
        "ebft": {"mode": "strided", "feature_layers": [0.5, 1.0], "stride": 3, "context_length": 2,
                 "generate_max_len": 4, **ebft},
        "train": {"micro_batch_size": 64, "seed": 3}})


class ListPrompts:
    """PromptSource's next_batch over fixed prompts."""

    def __init__(self, prompts):
        self.prompts = prompts

    def next_batch(self, size):
        return self.prompts[:size]


@pytest.fixture(scope="module")
def policy():  # the policy samples (adapter on), the base gives the features (adapter off)
    return policy_with_random_adapter(strided_config(), std=0.3)


@pytest.fixture(scope="module")
def full_policy():  # full fine-tuning: the policy samples, the frozen copy of the base gives the features
    return full_policy_moved_from_its_base(strided_config(), std=0.05)


@pytest.fixture(scope="module")
def base_model(policy):
    return separate_base_model(policy)


def make_prompts(policy):
    return [Prompt(i, text, policy.tokenizer(text, add_special_tokens=False).input_ids,
                   {"prompt": text, "ground_truth": gt}) for i, (text, gt) in enumerate(zip(PROMPTS, GROUND_TRUTHS))]


def test_documents_put_the_anchors_inside_the_ground_truth_and_cut_long_documents(policy):
    prompt = make_prompts(policy)[0]
    prompt_length = len(prompt.token_ids)
    source = StridedSource(strided_config(min_completion_prefix=1), policy, ListPrompts([prompt]))
    document = source.document(prompt)
    gt_ids = policy.tokenizer(GROUND_TRUTHS[0], add_special_tokens=False).input_ids
    assert document.token_ids == prompt.token_ids + gt_ids
    assert document.layout.anchors[0] == prompt_length + 1
    assert document.layout.anchors[-1] + 4 <= len(document.token_ids)
    assert document.ce_start == prompt_length
    short = StridedSource(strided_config(max_document_length=prompt_length + 6), policy, ListPrompts([prompt]))
    assert len(short.document(prompt).token_ids) == prompt_length + 6
    text = "Write digits: apple river stone cloud green seven"  # a whole document, no ground truth
    long_prompt = Prompt(0, text, policy.tokenizer(text, add_special_tokens=False).input_ids, {"prompt": text})
    whole = StridedSource(strided_config(ground_truth_field=None), policy, ListPrompts([long_prompt]))
    document = whole.document(long_prompt)
    assert document.token_ids == long_prompt.token_ids and document.ce_start == 1
    assert document.layout.anchors == list(range(2, len(document.token_ids) - 4 + 1, 3))


def test_a_step_whose_documents_are_all_too_short_says_so(policy):
    prompt = make_prompts(policy)[0]
    source = StridedSource(strided_config(ground_truth_field=None, context_length=8, generate_max_len=8),
                           policy, ListPrompts([prompt]))
    with pytest.raises(RolloutError, match="none of the step's 1 documents is long enough for one block"):
        source.next_batch(0)


BLOCK_LENGTHS = [1, 2, 3, 7, 8]  # G


@pytest.mark.parametrize("generate_length", BLOCK_LENGTHS)
@pytest.mark.parametrize("method", ["last_token", "mean_pooling", "completion_mean", "concat"])
def test_pool_blocks(method, generate_length):
    # [..., G, F], non-contiguous
    features = torch.randn(2, 3, 5, generate_length, generator=torch.Generator().manual_seed(generate_length))
    features = features.transpose(-1, -2)
    # concat as axolotl's docs define it: the tokens at 25 / 50 / 75 % (valid_len // 4, // 2, 3 * valid_len // 4
    # in its apply_embed_method), here of the block, divided by sqrt(3) (our unit-scale convention)
    quartiles = [generate_length // 4, generate_length // 2, 3 * generate_length // 4]
    expected = {"last_token": features[..., -1, :], "mean_pooling": features.mean(-2),
                "completion_mean": features.mean(-2),
                "concat": torch.cat([features[..., q, :] for q in quartiles], -1) / math.sqrt(3)}[method]
    torch.testing.assert_close(pool_blocks(features, method), expected)


def test_pool_blocks_rejects_an_unknown_method():
    with pytest.raises(ValueError, match="last_token.*concat"):
        pool_blocks(torch.zeros(2, 4, 3), "max_pooling")


def test_strided_samples_at_axolotls_temperature_unless_one_is_given_and_grpo_keeps_its_default():
    config = Config.model_validate({"algo": {"name": "ebft", "num_generations": 3}, "ebft": {"mode": "strided"}})
    assert config.rollout.sampling.temperature == 0.6  # axolotl's ebft.temperature default
    assert strided_config().rollout.sampling.temperature == 0.9  # given: kept
    assert config.model_dump()["rollout"]["sampling"]["temperature"] == 0.6  # the resolved config says what runs
    assert Config.model_validate({"algo": {"name": "ebft", "num_generations": 3}}).rollout.sampling.temperature == 1.0
    assert Config.model_validate({}).rollout.sampling.temperature == 1.0


@torch.no_grad()
def plain_features(base_model, tokens, layers=(1, 2)):
    states = base_model(input_ids=torch.tensor([tokens]), output_hidden_states=True).hidden_states
    return torch.cat([F.normalize(states[i][0], dim=-1) for i in layers], -1) / math.sqrt(len(layers))


@pytest.mark.parametrize("method, whitening, trained", [
    ("mean_pooling", False, "policy"), ("last_token", True, "policy"), ("concat", False, "policy"),
    ("last_token", True, "full_policy")])
def test_block_rewards_match_each_block_alone_through_the_base_model(request, base_model, method, whitening, trained):
    policy = request.getfixturevalue(trained)
    config = strided_config(embed_method=method, whitening=whitening, diversity_coef=0.5)
    source = StridedSource(config, policy, ListPrompts(make_prompts(policy)))
    batch = source.next_batch(0)
    (chunk,) = batch.chunks
    gen, truth = [], []
    for index, document in enumerate(chunk.documents):
        tokens = chunk.rollout.tokens[index]  # [n, NB, G]
        for b, anchor in enumerate(document.layout.anchors):
            prefix = document.token_ids[:anchor]
            truth.append(pool_blocks(plain_features(base_model, document.token_ids[:anchor + 4])[anchor:], method))
            gen.append(torch.stack([pool_blocks(plain_features(base_model, prefix + tokens[j, b].tolist())[anchor:],
                                                method) for j in range(3)]))
    expected = group_rewards(torch.stack(gen), torch.stack(truth), 1.0, 0.5, whitening)
    rewards = torch.cat([r.t() for r in chunk.rewards])  # [blocks, n]
    torch.testing.assert_close(rewards, expected.reward.float(), atol=1e-4, rtol=1e-4)
    assert batch.metrics["ebft/cfm_loss"] == pytest.approx(float(expected.cfm.mean()), abs=1e-4)
    assert batch.metrics["ebft/num_blocks"] == sum(d.layout.num_blocks() for d in chunk.documents)


def test_the_strided_loss_has_the_gradient_of_the_loss_built_block_by_block(policy):
    config = strided_config(ce_coef=0.5, rl_coef=1.0)
    source = StridedSource(config, policy, ListPrompts(make_prompts(policy)))
    (chunk,) = source.next_batch(0).chunks
    num_sequences = sum(int(a.numel()) for a in chunk.advantages)
    normalizers = StepNormalizers(num_sequences=num_sequences, num_tokens=num_sequences * 4, num_micro_batches=1,
                                  max_completion_length=4)
    params = policy.trainable_parameters()
    policy.model.train()
    policy.model.zero_grad(set_to_none=True)
    metrics = chunk_loss(config, policy, chunk, normalizers, num_documents=2)
    ours = [p.grad.clone() for p in params]

    policy.model.zero_grad(set_to_none=True)
    pg, ce = 0.0, 0.0
    for index, document in enumerate(chunk.documents):
        tokens, advantages = chunk.rollout.tokens[index], chunk.advantages[index]
        for b, anchor in enumerate(document.layout.anchors):
            for j in range(3):
                ids = torch.tensor([document.token_ids[:anchor] + tokens[j, b].tolist()])
                logits = policy.model(input_ids=ids).logits[0, anchor - 1:anchor + 3] / 0.9
                logps = logits.log_softmax(-1).gather(-1, tokens[j, b][:, None]).squeeze(-1)
                pg = pg + (-(logps - logps.detach()).exp() * advantages[j, b]).mean() / num_sequences
        logits = policy.model(input_ids=torch.tensor([document.token_ids])).logits[0]
        targets = torch.tensor(document.token_ids[document.ce_start:])
        logps = logits[document.ce_start - 1:-1].log_softmax(-1).gather(-1, targets[:, None])
        ce = ce + (-logps.mean()) / 2
    (pg + 0.5 * ce).backward()
    assert metrics["ebft/ce_loss"] == pytest.approx(float(ce.detach()), rel=1e-4)
    for mine, oracle in zip(ours, [p.grad for p in params]):
        torch.testing.assert_close(mine, oracle, atol=1e-5, rtol=1e-3)


def test_flex_attention_is_picked_on_cuda_only_and_refused_on_cpu():
    assert uses_flex("auto", torch.device("cuda", 0)) and uses_flex("flex", torch.device("cuda", 0))
    assert not uses_flex("auto", torch.device("cpu")) and not uses_flex("dense", torch.device("cuda", 0))
    with pytest.raises(RolloutError, match="ebft.attention = flex needs a CUDA device"):
        uses_flex("flex", torch.device("cpu"))


def test_the_flex_block_mask_computes_what_the_dense_mask_computes(policy):
    """Forward only: on CPU FlexAttention has no backward (CUDA training runs this path)."""
    source = StridedSource(strided_config(), policy, ListPrompts(make_prompts(policy)))
    (chunk,) = source.next_batch(0).chunks
    hidden = {}
    with torch.no_grad():
        for flex in (False, True):
            with full_row_attention(policy, chunk.rollout, flex) as (input_ids, position_ids, mask):
                hidden[flex] = policy.model.get_base_model().get_decoder()(
                    input_ids=input_ids, position_ids=position_ids, attention_mask=mask).last_hidden_state
    assert policy.causal_lm.config._attn_implementation == "sdpa"  # restored
    torch.testing.assert_close(hidden[True], hidden[False], atol=1e-4, rtol=1e-4)
    dense = source.block_rewards(chunk.documents, chunk.rollout)
    source.flex = True
    flex = source.block_rewards(chunk.documents, chunk.rollout)
    torch.testing.assert_close(flex.reward, dense.reward, atol=1e-4, rtol=1e-4)
