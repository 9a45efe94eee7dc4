"""EBFT structured mode's ebft.ce_coef and rl_coef: loss = rl_coef x the GRPO loss + ce_coef x the mean over the
step's documents of each one's token-mean NLL of its ground truth given its prompt (temperature 1, adapter on),
against each document run alone through plain transformers + PEFT in fp64; the same loss and gradient whatever
the split of the step (micro-batches, steps_per_generation, torchrun shards); the ground truths carried from
assembly through every row selection; GRPO untouched."""

import copy

import pytest
import torch

from driver.algorithms import algorithm
from driver.config import Config
from driver.data.prompts import Prompt
from driver.data.records import Group, Sample, Span
from driver.ebft.structured import FeatureScorer
from driver.rollouts.assemble import assemble
from driver.rollouts.batch import batch_from_groups
from driver.rollouts.filtering import filter_zero_advantage, split_steps
from driver.rollouts.producer import Job
from driver.rollouts.replay import ReplayBuffer
from driver.rollouts.shard_batch import shard_batch
from driver.update.optim import build_scheduler
from driver.update.step import optimize
from tests.ebft_fixtures import policy_with_random_adapter, separate_base_model

NUM_GENERATIONS = 3
PROMPTS = ["Write digits: apple river", "Write digits: stone", "Count: sky"]
GROUND_TRUTHS = [" 123 45", " 9 8 7 6 5", " 42"]  # 1 to 10 tokens: the token means differ from one global mean
ADVANTAGES = [[1.0, -0.5, 0.25], [-1.0, 0.7, 0.3], [0.9, -0.2, -0.7]]


def ebft_config(**sections) -> Config:
    base = {"algo": {"name": "ebft", "num_generations": NUM_GENERATIONS}, "lora": {"r": 4},
            "train": {"max_grad_norm": None}}
    for section, values in sections.items():
        base[section] = {**base.get(section, {}), **values}
    return Config.model_validate(base)


@pytest.fixture(scope="module")
def policy():
    torch.manual_seed(0)  # the adapter: the gradients' float error below depends on it
    return policy_with_random_adapter(ebft_config(), std=0.3)


def peft_model(policy, dtype: torch.dtype):
    """The policy rebuilt from plain transformers + PEFT (none of pykernels' layers), with its adapter."""
    from peft import get_peft_model

    model = get_peft_model(separate_base_model(policy), copy.deepcopy(policy.model.peft_config["default"]))
    loaded = model.load_state_dict({name: value for name, value in policy.model.state_dict().items()
                                    if "lora_" in name}, strict=False)
    assert not loaded.unexpected_keys and not [name for name in loaded.missing_keys if "lora_" in name]
    return model.to(dtype).train()


@pytest.fixture(scope="module")
def oracle(policy):
    return peft_model(policy, torch.float64)


def make_groups(policy, advantages=ADVANTAGES, first_id=0, identical=()) -> list[Group]:
    """One group per prompt; the groups in `identical` have equal samples (no signal)."""
    generator = torch.Generator().manual_seed(first_id)
    groups = []
    for index, (text, truth, group_advantages) in enumerate(zip(PROMPTS, GROUND_TRUTHS, advantages)):
        ids = policy.tokenizer(text, add_special_tokens=False).input_ids
        samples = []
        for j in range(NUM_GENERATIONS):
            length = 4 if index in identical else 2 + 2 * j + index
            tokens = (list(range(50, 54)) if index in identical
                      else torch.randint(10, 300, (length,), generator=generator).tolist())
            logprobs = (-torch.rand(length, generator=generator) - 0.5).tolist()
            samples.append(Sample(tokens, logprobs, "stop", [Span(0, length, 0)]))
        group = Group(group_id=first_id + index, prompt=Prompt(first_id + index, text, list(ids),
                                                               {"prompt": text, "ground_truth": truth}),
                      samples=samples, texts=["..."] * NUM_GENERATIONS)
        group.advantages = torch.tensor(group_advantages)
        groups.append(group)
    return groups


def make_batch(policy, config, groups=None):
    """The batch as assembly builds it: the ground truths the algorithm's scorer holds, one per row."""
    ids = FeatureScorer(config, policy).ground_truth_ids
    return batch_from_groups(make_groups(policy) if groups is None else groups, ground_truth_ids=ids)


def update(policy, batch, config):
    """optimize with plain SGD at lr 0 (the policy never moves: every part sees the same one), with the
    run's algorithm's loss terms (as driver/train.py passes them); the trained copy keeps the last update's
    gradients."""
    policy = copy.deepcopy(policy)
    optimizer = torch.optim.SGD(policy.trainable_parameters(), lr=0.0)
    metrics = optimize(config, policy, batch, optimizer, build_scheduler(optimizer, config.train, 100),
                       term=algorithm(config).ground_truth_loss(config))
    return policy, metrics


def adapter_grads(policy) -> dict[str, torch.Tensor]:
    return {name: param.grad.clone() for name, param in policy.model.named_parameters() if param.requires_grad}


def oracle_document_nll(model, tokenizer) -> torch.Tensor:
    """[documents] the token mean of -log p(ground truth | prompt) of each document, alone through the
    model's forward (no packing), log-softmax at temperature 1 in fp64."""
    nll = []
    for text, truth in zip(PROMPTS, GROUND_TRUTHS):
        prompt = tokenizer(text, add_special_tokens=False).input_ids
        truth_ids = tokenizer(truth, add_special_tokens=False).input_ids
        logits = model(input_ids=torch.tensor([prompt + truth_ids])).logits[0, len(prompt) - 1: -1].double()
        nll.append(-torch.log_softmax(logits, -1).gather(-1, torch.tensor(truth_ids)[:, None]).mean())
    return torch.stack(nll)


@pytest.mark.parametrize("micro_batch_size, temperature", [(9, 1.0), (2, 0.7), (1, 1.3)])
def test_the_cross_entropy_gradient_is_the_mean_over_documents_of_each_ones_token_mean_nll(
        policy, oracle, micro_batch_size, temperature):
    config = ebft_config(ebft={"rl_coef": 0.0, "ce_coef": 1.0}, train={"micro_batch_size": micro_batch_size},
                         rollout={"sampling": {"temperature": temperature}})
    trained, metrics = update(policy, make_batch(policy, config), config)
    ours = adapter_grads(trained)

    def oracle_grads(model):
        model.zero_grad(set_to_none=True)
        ce = oracle_document_nll(model, policy.tokenizer).mean()
        ce.backward()
        return float(ce.detach()), {name: param.grad.double() for name, param in model.named_parameters()
                                    if param.requires_grad}

    ce, fp64 = oracle_grads(oracle)
    _, fp32 = oracle_grads(peft_model(policy, torch.float32))
    assert fp64.keys() == ours.keys() and all(grad.any() for grad in fp64.values())
    # Ours runs in fp32 as the plain fp32 forward does, through other kernels and summation orders (packed
    # attention, fused LoRA and logprobs: the GRPO update's): within a few times that forward's error against
    # fp64 (up to ~4x measured over adapters; a wrong token or weight would be off by ~the gradient, ~1).
    fp32_error = max(float((fp32[name] - fp64[name]).abs().max()) for name in fp64)
    for name in fp64:
        assert float((ours[name].double() - fp64[name]).abs().max()) <= 6 * fp32_error, name
    assert metrics["ebft/ce_loss"] == pytest.approx(ce, rel=1e-5)
    assert metrics["loss"] == pytest.approx(ce, rel=1e-5)  # rl_coef 0: the policy loss weighs nothing
    assert "ebft/rl_loss" in metrics


SPLITS = [{"micro_batch_size": 1}, {"micro_batch_size": 2}, {"micro_batch_size": 4}, {"micro_batch_size": 5}]


@pytest.mark.parametrize("split", SPLITS)
def test_the_loss_and_its_parts_split_into_micro_batches_exactly(policy, split):
    config = ebft_config(ebft={"rl_coef": 0.7, "ce_coef": 0.3}, train={"micro_batch_size": 9})
    batch = make_batch(policy, config)
    whole, whole_metrics = update(policy, batch, config)
    parts, part_metrics = update(policy, batch, ebft_config(ebft={"rl_coef": 0.7, "ce_coef": 0.3}, train=split))
    for key in ("loss", "ebft/ce_loss", "ebft/rl_loss"):
        assert part_metrics[key] == pytest.approx(whole_metrics[key], abs=1e-6), key
    assert whole_metrics["loss"] == pytest.approx(
        0.7 * whole_metrics["ebft/rl_loss"] + 0.3 * whole_metrics["ebft/ce_loss"], abs=1e-6)
    expected = adapter_grads(whole)
    # fp32 sums over other partitions of the batch differ by rounding, which near a gradient's zero
    # crossings is all of an element: the tolerance is relative to the tensor's largest element (a
    # micro-batch weighed wrong would be off by ~1/9 of the gradient, ~1000x this).
    for name, grad in adapter_grads(parts).items():
        torch.testing.assert_close(grad, expected[name], atol=1e-4 * expected[name].abs().max().item(), rtol=1e-4)


def test_torchrun_shards_add_up_to_the_whole_step(policy):
    """Each rank's loss is its share of the step's: the shards' losses, cross-entropies and gradients sum to
    the single-process ones (in one process here, rank by rank)."""
    config = ebft_config(ebft={"ce_coef": 0.5}, train={"micro_batch_size": 2})
    batch = make_batch(policy, config)
    whole, whole_metrics = update(policy, batch, config)
    shards = [update(policy, shard_batch(batch, rank, 2, 2), config) for rank in range(2)]
    for key in ("loss", "ebft/ce_loss"):
        assert sum(metrics[key] for _, metrics in shards) == pytest.approx(whole_metrics[key], abs=1e-6), key
    expected = adapter_grads(whole)
    for name, grad in adapter_grads(shards[0][0]).items():
        torch.testing.assert_close(grad + adapter_grads(shards[1][0])[name], expected[name], atol=1e-6, rtol=1e-4)


def test_each_generation_step_trains_on_the_cross_entropy_of_its_own_documents(policy, oracle):
    """steps_per_generation = 3, one group per step: each step's CE is its document's, and their mean (the
    update's ebft/ce_loss) the mean over the documents."""
    config = ebft_config(ebft={"rl_coef": 0.0, "ce_coef": 1.0}, train={"micro_batch_size": NUM_GENERATIONS},
                         algo={"steps_per_generation": 3})
    batch = make_batch(policy, config)
    assert [len(part) for part in split_steps(batch, 3, NUM_GENERATIONS)] == [NUM_GENERATIONS] * 3
    _, metrics = update(policy, batch, config)
    with torch.no_grad():
        nll = oracle_document_nll(oracle, policy.tokenizer)
    assert metrics["ebft/ce_loss"] == pytest.approx(float(nll.mean()), rel=1e-5)
    last = split_steps(batch, 3, NUM_GENERATIONS)[2]  # a step of its own: its document is the mean
    _, last_metrics = update(policy, last, ebft_config(ebft={"rl_coef": 0.0, "ce_coef": 1.0},
                                                       train={"micro_batch_size": NUM_GENERATIONS}))
    assert last_metrics["ebft/ce_loss"] == pytest.approx(float(nll[2]), rel=1e-5)


def test_a_group_zero_advantage_filtering_removes_adds_no_cross_entropy(policy, oracle):
    config = ebft_config(ebft={"ce_coef": 1.0}, train={"micro_batch_size": 2})
    advantages = [ADVANTAGES[0], [0.0] * NUM_GENERATIONS, ADVANTAGES[2]]
    batch = make_batch(policy, config, make_groups(policy, advantages))
    filtered, _ = filter_zero_advantage(batch, 2, every_row=False)
    assert len(filtered) == 2 * NUM_GENERATIONS
    truth = [policy.tokenizer(t, add_special_tokens=False).input_ids for t in GROUND_TRUTHS]
    assert filtered.ground_truth_ids == [truth[0]] * NUM_GENERATIONS + [truth[2]] * NUM_GENERATIONS
    _, metrics = update(policy, filtered, config)
    with torch.no_grad():
        nll = oracle_document_nll(oracle, policy.tokenizer)
    assert metrics["ebft/ce_loss"] == pytest.approx(float(nll[0] + nll[2]) / 3, rel=1e-5)  # the divisor: 3 documents
    _, unfiltered = update(policy, batch, config)  # zero advantages skip no micro-batch when the CE acts on them
    assert unfiltered["skipped_micro_batch_fraction"] == 0.0
    assert unfiltered["ebft/ce_loss"] == pytest.approx(float(nll.mean()), rel=1e-5)


def test_rl_coef_weighs_the_policy_loss_and_without_ce_coef_no_ground_truth_is_carried(policy):
    config = ebft_config(ebft={"rl_coef": 0.5}, train={"micro_batch_size": 4})
    batch = make_batch(policy, config)
    assert batch.ground_truth_ids == []
    half, metrics = update(policy, batch, config)
    full, full_metrics = update(policy, batch, ebft_config(train={"micro_batch_size": 4}))
    assert "ebft/ce_loss" not in metrics and metrics["ebft/rl_loss"] == pytest.approx(full_metrics["loss"], abs=1e-7)
    assert metrics["loss"] == pytest.approx(0.5 * full_metrics["loss"], abs=1e-7)
    expected = adapter_grads(full)
    for name, grad in adapter_grads(half).items():
        torch.testing.assert_close(grad, 0.5 * expected[name], atol=1e-7, rtol=1e-5)


def test_structured_mode_accepts_ce_coef():
    config = ebft_config(ebft={"ce_coef": 0.03})
    assert config.ebft.mode == "structured" and config.ebft.ce_coef == 0.03


def test_grpo_batches_carry_no_ground_truth_and_log_no_ebft_losses(policy):
    config = Config.model_validate({"lora": {"r": 4}, "algo": {"num_generations": NUM_GENERATIONS},
                                    "train": {"micro_batch_size": 4}})
    grpo = algorithm(config)
    assert grpo.ground_truth_loss(config) is None
    batch = batch_from_groups(make_groups(policy))
    assert batch.ground_truth_ids == [] and batch.select([1, 0], None).ground_truth_ids == []
    _, metrics = update(policy, batch, config)
    assert not [key for key in metrics if key.startswith("ebft/")]


def test_assembly_gives_every_row_its_ground_truth_replayed_groups_included(policy):
    """Two steps through assemble with the FeatureScorer: the second step's group of equal samples is
    filtered out and a group of the first step replayed in its place, with its own ground truths."""
    config = ebft_config(ebft={"ce_coef": 0.1}, train={"micro_batch_size": 2},
                         algo={"replay_buffer_size": 4, "replay_max_age": 4})
    scorer = FeatureScorer(config, policy)
    replay = ReplayBuffer(4, 4)
    truth = {text: policy.tokenizer(t, add_special_tokens=False).input_ids for text, t in zip(PROMPTS, GROUND_TRUTHS)}
    batches = []
    for step in range(2):
        groups = make_groups(policy, first_id=10 * step, identical=(1,))
        batches.append(assemble(config, Job(step, 0, groups), step, scorer, submit=True, replay=replay, reroll=None))
    assert batches[1].metrics["replay/replayed_groups"] == 1.0
    for batch in batches:
        assert len(batch) == 3 * NUM_GENERATIONS - (0 if batch is batches[1] else NUM_GENERATIONS)
        prompts = {tuple(policy.tokenizer(text, add_special_tokens=False).input_ids): text for text in PROMPTS}
        assert batch.ground_truth_ids == [truth[prompts[tuple(ids)]] for ids in batch.prompt_ids]
