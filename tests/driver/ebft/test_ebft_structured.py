"""EBFT structured mode: the config rules, per-group completion budgets, and the feature scorer
against features computed one sequence at a time by a separately loaded base model."""

import json
import math
import warnings

import pytest
import torch
from pydantic import ValidationError

from driver.config import Config
from driver.data.prompts import Prompt, PromptSource
from driver.data.records import Group, Sample, Span
from driver.ebft.advantages import ebft_advantages
from driver.ebft.rewards import RewardParts, group_rewards
from driver.ebft.structured import FeatureScorer, adaptive_max_tokens, advantages_from_tables, completion_ids
from driver.rollouts.producer import Producer
from tests.async_fakes import FakeGenerator, FakeTokenizer
from tests.ebft_fixtures import full_policy_moved_from_its_base, policy_with_random_adapter, separate_base_model

EBFT = {"algo": {"name": "ebft", "num_generations": 4}}


def ebft_config(**sections) -> Config:
    base = {section: dict(values) for section, values in EBFT.items()}
    for section, values in sections.items():
        base[section] = {**base.get(section, {}), **values}
    return Config.model_validate(base)


# -- config --

@pytest.mark.parametrize("sections, message", [
    ({"ebft": {"gt_length_multiplier": 0.05}}, "gt_length_multiplier"),
    ({"rewards": {"functions": [{"path": "driver.data.gsm8k.gsm8k_correct"}]}}, "rewards.functions are not used"),
    ({"rewards": {"reward_num_workers": 2}}, "reward_num_workers must be 0"),
    ({"algo": {"reroll_failed": True}}, "reroll_failed does not apply"),
    ({"ebft": {"mode": "strided"}, "rollout": {"async_prefetch": True}}, "rollout.async_prefetch: not supported"),
    ({"ebft": {"mode": "strided"}, "algo": {"beta": 0.1}}, "algo.beta: not supported"),
    ({"ebft": {"mode": "strided"}, "model": {"attention": "flash_attention_2"}}, "cannot take the block-parallel"),
    ({"ebft": {"feature_layers": [0.0, 0.5]}}, "fractions in \\(0, 1\\]"),
    ({"ebft": {"embed_method": "max"}}, "embed_method"),
])
def test_config_rejects_what_ebft_cannot_do_and_says_why(sections, message):
    with pytest.raises(ValidationError, match=message):
        ebft_config(**sections)


@pytest.mark.parametrize("mode", ["structured", "strided"])
def test_a_runs_own_config_yaml_loads_again(mode):
    """The end-of-run summary's resume command passes output_dir/config.yaml back: the full dump, the
    default reward functions and the values the validator filled in included, must validate to itself."""
    config = ebft_config(ebft={"mode": mode})
    assert Config.model_validate(config.model_dump(mode="json")) == config


@pytest.mark.parametrize("mode", ["structured", "strided"])
@pytest.mark.parametrize("estimator", ["rloo", "group_norm", "reinforce"])
def test_one_sample_per_prompt_falls_back_to_reinforce_without_diversity_and_says_so(mode, estimator):
    # axolotl's docs: "When n_samples_per_prompt: 1, the trainer automatically falls back to reinforce and
    # disables the diversity penalty (which requires multiple samples)."
    with pytest.warns(UserWarning, match=f"advantage_estimator {estimator} -> reinforce, diversity_coef 1.0 -> 0"):
        config = ebft_config(algo={"num_generations": 1}, ebft={"mode": mode, "advantage_estimator": estimator})
    assert (config.ebft.advantage_estimator, config.ebft.diversity_coef) == ("reinforce", 0.0)


def test_one_sample_already_configured_for_it_is_accepted_silently_and_grpo_still_needs_two():
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        config = ebft_config(algo={"num_generations": 1}, ebft={"advantage_estimator": "reinforce",
                                                                "diversity_coef": 0.0})
    assert config.algo.num_generations == 1
    with pytest.raises(ValidationError, match="grpo compares completions within a group"):
        Config.model_validate({"algo": {"num_generations": 1}})


@pytest.mark.parametrize("num_prompts, num_features", [(1, 1), (5, 7), (3, 83)])
def test_one_sample_per_prompt_is_trained_on_its_raw_reward(num_prompts, num_features):
    """reinforce after the fallback: "Raw reward as advantage (no baseline)" = 2 * alpha * cos(phi, phi_gt)."""
    with pytest.warns(UserWarning):
        config = ebft_config(algo={"num_generations": 1}, ebft={"alignment_coef": 0.7})
    generator = torch.Generator().manual_seed(num_features)
    gen = torch.randn(num_prompts, 1, num_features, generator=generator, dtype=torch.float64)
    gt = torch.randn(num_prompts, num_features, generator=generator, dtype=torch.float64)
    parts = group_rewards(gen, gt, config.ebft.alignment_coef, config.ebft.diversity_coef, whitening=False)
    groups = [Group(group_id=p, prompt=None, samples=[], rewards=torch.stack(
        [parts.alignment[p], parts.diversity[p], parts.cfm[p].expand(1)], dim=1)) for p in range(num_prompts)]
    rewards, advantages, _ = advantages_from_tables(config.ebft, groups)
    cosine = torch.nn.functional.cosine_similarity(gen[:, 0], gt, dim=-1)
    torch.testing.assert_close(advantages, (2 * 0.7 * cosine).float())
    torch.testing.assert_close(rewards, advantages)


# -- completion budgets --

def axolotl_adaptive_max_tokens(gt_token_counts: list[int], multiplier: float, max_completion: int) -> int:
    """axolotl EBFTMixin._generate_only, transcribed: one max_tokens for the whole generation batch."""
    adaptive_max = max(min(int(c * multiplier), max_completion) for c in gt_token_counts)
    return max(adaptive_max, 64)


@pytest.mark.parametrize("gt_tokens, multiplier, floor, expected", [
    (10, 1.5, 8, 15), (11, 1.5, 8, 16), (2, 1.5, 8, 8), (40, 1.5, 8, 32), (10, None, 8, 32), (1, 1.5, 64, 32),
])
def test_adaptive_max_tokens_scales_the_ground_truth_within_the_floor_and_the_sampling_limit(
        gt_tokens, multiplier, floor, expected):
    config = ebft_config(ebft={"gt_length_multiplier": multiplier, "min_max_tokens": floor},
                         rollout={"sampling": {"max_tokens": 32}})
    assert adaptive_max_tokens(gt_tokens, config) == expected


@pytest.mark.parametrize("limit", [7, 63, 64, 100, 4096])
@pytest.mark.parametrize("multiplier", [0.1, 1.0, 1.5, 2.7])
def test_adaptive_max_tokens_is_axolotls_for_a_batch_of_one_prompt_never_above_the_limit(multiplier, limit):
    config = ebft_config(ebft={"gt_length_multiplier": multiplier}, rollout={"sampling": {"max_tokens": limit}})
    assert config.ebft.min_max_tokens == 64  # axolotl's floor, as the default
    for gt_tokens in [0, 1, 7, 42, 43, 83, 769, 5125]:
        axolotl = axolotl_adaptive_max_tokens([gt_tokens], multiplier, limit)
        # axolotl's floor of 64 lifts the budget above max_completion_length when that is below 64
        assert adaptive_max_tokens(gt_tokens, config) == min(axolotl, limit), gt_tokens


def test_adaptive_max_tokens_is_per_prompt_where_axolotl_takes_the_batch_max():
    config = ebft_config(ebft={"gt_length_multiplier": 1.5}, rollout={"sampling": {"max_tokens": 4096}})
    batch = [7, 83, 769]
    ours = [adaptive_max_tokens(count, config) for count in batch]
    assert ours == [64, 124, 1153]
    assert axolotl_adaptive_max_tokens(batch, 1.5, 4096) == max(ours) == 1153  # every prompt's budget there


@pytest.mark.parametrize("partial", [None, 2])
def test_each_group_is_generated_and_finished_with_its_own_budget(tmp_path, partial):
    data = tmp_path / "rows.jsonl"
    data.write_text("".join(json.dumps({"prompt": p}) + "\n" for p in ["short", "a much longer prompt"]))
    config = ebft_config(data={"source": str(data), "shuffle": False}, train={"prompts_per_step": 2},
                         rollout={"verify_sync": False, "partial_rollout_tokens": partial,
                                  "sampling": {"max_tokens": 10}})
    tokenizer = FakeTokenizer()
    budgets = {0: 3, 1: 5}  # by dataset row
    generator = FakeGenerator(lengths=(10,))  # every sample would run to 10 tokens
    producer = Producer(config, generator, PromptSource(config.data, tokenizer, 0), tokenizer,
                        max_tokens=lambda prompt: budgets[prompt.index])
    job = producer.produce(0, version=0)
    for group in job.groups:
        for sample in group.samples:
            assert len(sample.token_ids) == budgets[group.prompt.index]
            assert sample.finish_reason == "length"
    assert max(request.max_tokens for _, request in generator.requests) <= (partial or 5)


def test_completion_ids_drop_only_a_final_eos():
    assert completion_ids([5, 6, 2], eos_token_id=2) == [5, 6]
    assert completion_ids([2, 6], eos_token_id=2) == [2, 6]
    assert completion_ids([], eos_token_id=2) == []
    assert completion_ids([5, 2], eos_token_id=None) == [5, 2]


# -- the feature scorer against a separately loaded base model --

GROUND_TRUTHS = [" 123 45", " 9 8 7 6 5"]


@pytest.fixture(scope="module")
def policy():
    return policy_with_random_adapter(ebft_config(lora={"r": 4}, ebft={"feature_layers": [0.5, 1.0]}), std=0.5)


@pytest.fixture(scope="module")
def full_policy():  # full fine-tuning: the features from the frozen copy of the base
    return full_policy_moved_from_its_base(ebft_config(ebft={"feature_layers": [0.5, 1.0]}), std=0.05)


@pytest.fixture(scope="module")
def base_model(policy):
    return separate_base_model(policy)


def make_groups(policy, num_samples=3):
    tokenizer, eos = policy.tokenizer, policy.tokenizer.eos_token_id
    generator = torch.Generator().manual_seed(0)
    groups = []
    for index, (prompt_text, gt) in enumerate(zip(["Write digits: apple river", "Write digits: stone"], GROUND_TRUTHS)):
        ids = tokenizer(prompt_text, add_special_tokens=False).input_ids
        samples = []
        for j in range(num_samples):
            tokens = torch.randint(10, 300, (3 + 2 * j + index,), generator=generator).tolist()
            if j == 1:
                tokens.append(eos)  # stopped on EOS: the EOS is not part of the features
            samples.append(Sample(tokens, [-1.0] * len(tokens), "stop", [Span(0, len(tokens), 0)]))
        prompt = Prompt(index, prompt_text, list(ids), {"prompt": prompt_text, "ground_truth": gt})
        groups.append(Group(group_id=10 + index, prompt=prompt, samples=samples))
    return groups


@torch.no_grad()
def oracle_feature(base_model, prompt_ids, completion, layers, method):
    """One sequence alone through a plain causal LM: layers' hidden states, normalized, pooled."""
    ids = torch.tensor([prompt_ids + completion])
    states = base_model(input_ids=ids, output_hidden_states=True).hidden_states
    features = torch.cat([torch.nn.functional.normalize(states[i][0], dim=-1) for i in layers], -1)
    features = features / math.sqrt(len(layers))
    start = len(prompt_ids)
    if method == "last_token" or not completion:
        return features[-1]
    return features[start:].mean(0)


@pytest.mark.parametrize("method, micro_batch_size, whitening, trained", [
    ("completion_mean", 64, False, "policy"), ("completion_mean", 3, False, "policy"),
    ("last_token", 2, True, "policy"), ("completion_mean", 3, False, "full_policy")])
def test_feature_scorer_matches_per_sequence_features_of_the_base_model(request, base_model, method,
                                                                        micro_batch_size, whitening, trained):
    policy = request.getfixturevalue(trained)
    config = ebft_config(ebft={"feature_layers": [0.5, 1.0], "embed_method": method, "whitening": whitening,
                               "diversity_coef": 0.5}, train={"micro_batch_size": micro_batch_size})
    scorer = FeatureScorer(config, policy)
    assert scorer.layers == [1, 2]
    groups = make_groups(policy)
    for group in groups:
        scorer.submit_group(group)
    results = scorer.wait([g.group_id for g in groups])
    eos = policy.tokenizer.eos_token_id
    gen, gt = [], []
    for group, truth in zip(groups, GROUND_TRUTHS):
        prompt_ids = group.prompt.token_ids
        gen.append(torch.stack([oracle_feature(base_model, prompt_ids, completion_ids(s.token_ids, eos), [1, 2], method)
                                for s in group.samples]))
        truth_ids = policy.tokenizer(truth, add_special_tokens=False).input_ids
        gt.append(oracle_feature(base_model, prompt_ids, truth_ids, [1, 2], method))
    expected = group_rewards(torch.stack(gen), torch.stack(gt), 1.0, 0.5, whitening)
    for index, group in enumerate(groups):
        table = results[group.group_id].table
        torch.testing.assert_close(table[:, 0], expected.alignment[index].float(), atol=2e-5, rtol=1e-4)
        torch.testing.assert_close(table[:, 1], expected.diversity[index].float(), atol=2e-5, rtol=1e-4)
        torch.testing.assert_close(table[:, 2], expected.cfm[index].float().expand(3), atol=2e-5, rtol=1e-4)
    assert policy.model.training or not policy.model.training  # restored below
    assert not scorer._queued


def test_feature_scorer_restores_the_training_mode_and_rejects_unknown_groups(policy):
    scorer = FeatureScorer(ebft_config(ebft={"feature_layers": [1.0]}), policy)
    policy.model.train()
    groups = make_groups(policy, num_samples=2)
    scorer.submit_group(groups[0])
    scorer.discard([groups[0].group_id])
    with pytest.raises(KeyError, match="never submitted"):
        scorer.wait([groups[0].group_id])
    scorer.submit_group(groups[1])
    scorer.wait([groups[1].group_id])
    assert policy.model.training


def test_a_missing_ground_truth_names_the_row_and_the_column(policy):
    scorer = FeatureScorer(ebft_config(ebft={"feature_layers": [1.0], "ground_truth_field": "answer"}), policy)
    group = make_groups(policy)[0]
    scorer.submit_group(group)
    with pytest.raises(ValueError, match="data row 0 has no text column 'answer'"):
        scorer.wait([group.group_id])


@pytest.mark.parametrize("estimator", ["rloo", "group_norm", "reinforce"])
def test_advantages_from_tables_are_the_ebft_advantages_of_the_groups(estimator):
    generator = torch.Generator().manual_seed(1)
    config = ebft_config(ebft={"advantage_estimator": estimator, "alignment_coef": 0.7, "diversity_coef": 0.3})
    groups = []
    for index in range(3):
        table = torch.rand(4, 3, generator=generator)
        table[:, 2] = table[0, 2]
        groups.append(Group(group_id=index, prompt=None, samples=[], rewards=table))
    rewards, advantages, metrics = advantages_from_tables(config.ebft, groups)
    tables = torch.stack([g.rewards for g in groups]).double()
    reward = 1.4 * tables[..., 0] - 0.6 * tables[..., 1]
    parts = RewardParts(tables[..., 0], tables[..., 1], reward, tables[:, 0, 2])
    torch.testing.assert_close(rewards, reward.reshape(-1).float())
    torch.testing.assert_close(advantages, ebft_advantages(parts, 0.7, 0.3, estimator).reshape(-1).float())
    assert metrics["ebft/cfm_loss"] == pytest.approx(float(tables[:, 0, 2].mean()))
    assert metrics["ebft/alignment"] == pytest.approx(2 * float(tables[..., 0].mean()))


def test_a_row_without_ground_truth_stops_the_run_before_it_starts_with_a_config_error(tmp_path, capsys):
    from driver.train import main

    data = tmp_path / "rows.jsonl"
    data.write_text(json.dumps({"prompt": "a", "ground_truth": " 1"}) + "\n" + json.dumps({"prompt": "b"}) + "\n")
    with pytest.raises(SystemExit) as exit_info:
        main(["--algo.name=ebft", "--algo.num_generations=2", f"--data.source={data}",
              f"--logging.output_dir={tmp_path / 'out'}", "--logging.progress=false"])
    assert exit_info.value.code == 2
    assert ("ebft.ground_truth_field: 1 rows (first: row 1) have no text column 'ground_truth'"
            in capsys.readouterr().err)
