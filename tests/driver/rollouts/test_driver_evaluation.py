"""The eval section's evaluation (driver/rollouts/evaluation.py) with a real generator (rollout.backend:
transformers on the tiny model) and the run's real reward scorer: its metrics against the reward function
recomputed on the completions it logged, the same completions for the same adapter every time, training's
reward calls left alone, and a reward that fails on part of the set counted instead of stopping the run."""

import io
import json
import math
import threading

import pytest
import torch
from rich.console import Console

from driver.config import Config
from driver.data.eval_prompts import training_and_eval_prompts
from driver.data.toy_tasks import digit_fraction
from driver.engine.transformers_backend import TransformersGenerator
from driver.metrics.logger import MetricsLogger
from driver.policy.model import load_policy
from driver.rewards.group_scorer import GroupScorer
from driver.rollouts.evaluation import Evaluator
from driver.rollouts.producer import Producer
from driver.train import log_evaluation

HELD_OUT = 12


@pytest.fixture(scope="module")
def policy():
    return load_policy(Config.model_validate({"lora": {"r": 4}}))


def run_config(**sections) -> Config:
    evaluation = {"steps": 2, "val_set_size": HELD_OUT, "num_generations": 3, **sections.pop("eval", {})}
    return Config.model_validate({"lora": {"r": 4}, "rollout": {"backend": "transformers",
                                                                "sampling": {"max_tokens": 10}},
                                  "eval": evaluation, **sections})


def evaluator(config: Config, policy) -> tuple[Evaluator, GroupScorer]:
    training, evaluated = training_and_eval_prompts(config, policy.tokenizer)
    scorer = GroupScorer(config)
    return Evaluator(config, TransformersGenerator(config, policy), evaluated, policy.tokenizer, scorer), scorer


def test_eval_metrics_are_the_reward_functions_over_the_logged_completions(policy):
    config = run_config()
    evaluation_run, scorer = evaluator(config, policy)
    result = evaluation_run.evaluate(version=0, engine_lock=threading.Lock())
    scorer.close()
    metrics, table = result.metrics, result.table
    assert result.failure is None and metrics["eval/failed_groups"] == 0
    assert metrics["eval/prompts"] == HELD_OUT and len(table) == HELD_OUT * 3
    held = [prompt.text for prompt in evaluation_run.prompts[""].prompts]
    assert [row["prompt"] for row in table] == [text for text in held for _ in range(3)]  # every prompt, in order
    oracle = digit_fraction([row["prompt"] for row in table], [row["completion"] for row in table])
    assert metrics["eval/reward"] == pytest.approx(math.fsum(oracle) / len(oracle), abs=1e-6)
    assert metrics["eval/rewards/digit_fraction/mean"] == pytest.approx(metrics["eval/reward"], abs=1e-6)
    assert [row["reward"] for row in table] == pytest.approx(oracle, abs=1e-6)
    groups = torch.tensor(oracle, dtype=torch.float64).view(HELD_OUT, 3)
    assert metrics["eval/reward_std"] == pytest.approx(groups.std(dim=1).mean().item(), abs=1e-6)  # TRL's group std
    assert 0 < metrics["eval/completions/mean_length"] <= 10 and "eval/num_input_tokens" not in metrics
    assert all(key.startswith("eval/") for key in metrics) and "advantage" not in table[0]


def test_the_same_adapter_gives_the_same_completions_and_leaves_trainings_reward_calls_alone(policy):
    config = run_config()
    evaluation_run, scorer = evaluator(config, policy)
    # A training group (id 0) submitted before the evaluation and collected after it, as under prefetch.
    training_prompts = training_and_eval_prompts(config, policy.tokenizer)[0]
    producer = Producer(config, TransformersGenerator(config, policy), training_prompts, policy.tokenizer)
    producer.quota = 1
    training_group = producer.produce(0, 0).groups[0]
    scorer.submit_group(training_group)
    first = evaluation_run.evaluate(version=0, engine_lock=threading.Lock())
    second = evaluation_run.evaluate(version=0, engine_lock=threading.Lock())
    assert [row["completion"] for row in first.table] == [row["completion"] for row in second.table]
    assert first.metrics["eval/reward"] == second.metrics["eval/reward"]
    result = scorer.wait([training_group.group_id])[training_group.group_id]
    expected = digit_fraction([training_group.prompt.text] * len(training_group.texts), training_group.texts)
    assert result.table[:, 0].tolist() == pytest.approx(expected)
    scorer.close()


def test_one_completion_per_prompt_and_gdpos_aggregation(policy):
    config = run_config(eval={"num_generations": 1}, rewards={"aggregation": "normalize_then_sum"})
    evaluation_run, scorer = evaluator(config, policy)
    result = evaluation_run.evaluate(version=0, engine_lock=threading.Lock())
    scorer.close()
    assert len(result.table) == HELD_OUT
    oracle = digit_fraction([row["prompt"] for row in result.table], [row["completion"] for row in result.table])
    assert result.metrics["eval/reward"] == pytest.approx(sum(oracle) / HELD_OUT, abs=1e-6)
    assert math.isnan(result.metrics["eval/reward_std"])  # no std of one value, as TRL's nanstd


def test_groups_a_reward_cannot_score_are_counted_and_left_out(policy, tmp_path):
    config = run_config(rewards={"functions": [{"path": "driver.data.toy_tasks.digit_fraction"},
                                               {"path": "tests.reward_fixtures.raise_on_river"}]})
    evaluation_run, scorer = evaluator(config, policy)
    result = evaluation_run.evaluate(version=0, engine_lock=threading.Lock())
    scorer.close()
    rivers = sum("river" in prompt.text for prompt in evaluation_run.prompts[""].prompts)
    assert 0 < rivers < HELD_OUT  # the held-out set has both kinds
    assert result.metrics["eval/failed_groups"] == rivers and "raise_on_river refuses" in result.failure
    assert len(result.table) == (HELD_OUT - rivers) * 3 and not any("river" in row["prompt"] for row in result.table)
    oracle = digit_fraction([row["prompt"] for row in result.table], [row["completion"] for row in result.table])
    assert result.metrics["eval/rewards/digit_fraction/mean"] == pytest.approx(sum(oracle) / len(oracle), abs=1e-6)
    assert result.metrics["eval/reward"] == pytest.approx(sum(oracle) / len(oracle) + 1.0, abs=1e-6)
    # The terminal's line names the reward and the input, without the traceback run.log would have.
    terminal = io.StringIO()
    logger = MetricsLogger(tmp_path, total_steps=4, tensorboard=False, progress=False,
                           console=Console(file=terminal, width=10_000))
    log_evaluation(logger, 2, result, [""])
    logger.close()
    line = terminal.getvalue()
    assert line.startswith(f"eval after step 2: reward {result.metrics['eval/reward']:.3f} over {HELD_OUT} prompts")
    assert f"{rivers} group(s) could not be scored (first: reward 'raise_on_river' raised an exception ... input: " \
        "prompt " in line and "Traceback" not in line and line.count("\n") == 1



@torch.no_grad()
def test_temperature_zero_evaluates_one_greedy_completion_per_prompt(policy):
    config = run_config(eval={"temperature": 0.0, "num_generations": None})
    evaluation_run, scorer = evaluator(config, policy)
    result = evaluation_run.evaluate(version=0, engine_lock=threading.Lock())
    scorer.close()
    assert len(result.table) == HELD_OUT and result.metrics["eval/prompts"] == HELD_OUT
    model = policy.causal_lm.eval()
    eos = policy.tokenizer.eos_token_id
    for prompt, row in zip(evaluation_run.prompts[""].prompts, result.table):  # transformers' greedy search, alone
        output = model.generate(input_ids=torch.tensor([prompt.token_ids]), do_sample=False, max_new_tokens=10,
                                eos_token_id=eos, pad_token_id=eos)[0, len(prompt.token_ids):]
        assert row["completion"] == policy.tokenizer.decode(output, skip_special_tokens=True)


@torch.no_grad()
def test_eval_only_evaluates_the_adapter_it_is_given_and_trains_nothing(tmp_path, capsys):
    """eval.only with lora.init_from (the run as `python -m driver.train` makes it, in this process): one
    evaluation of that adapter, greedy, whose completions are PEFT's own greedy decoding with it; no adapter,
    checkpoint or training metrics written; and a training run's directory is refused, not overwritten."""
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    import driver.train
    from driver.data.tiny_model import resolve_model_path

    policy = load_policy(Config.model_validate({"lora": {"r": 4}}))  # its own: the module's stays untrained
    generator = torch.Generator().manual_seed(7)
    for name, parameter in policy.model.named_parameters():
        if ".lora_" in name:
            parameter.copy_(0.3 * torch.randn(parameter.shape, generator=generator))
    adapter = policy.save_trained(tmp_path / "sft")
    output_dir = tmp_path / "eval"
    argv = ["--rollout.backend=transformers", "--lora.r=4", f"--lora.init_from={adapter}", "--eval.only=true",
            "--eval.val_set_size=6", "--eval.temperature=0", "--rollout.sampling.max_tokens=8",
            f"--logging.output_dir={output_dir}", "--logging.quiet=false", "--logging.report_to=[]"]
    assert driver.train.main(argv) == 0
    printed = capsys.readouterr().out
    assert "evaluated in " in printed and "(eval.only: nothing trained)" in printed
    rows = [json.loads(line) for line in (output_dir / "metrics.jsonl").read_text().splitlines()]
    assert len(rows) == 1 and rows[0]["step"] == 0 and rows[0]["eval/prompts"] == 6
    assert not (output_dir / "adapter").exists() and not (output_dir / "checkpoints").exists()
    completions = [json.loads(line) for line in (output_dir / "eval_completions.jsonl").read_text().splitlines()]
    base = AutoModelForCausalLM.from_pretrained(resolve_model_path("tiny://qwen2"), dtype=torch.float32)
    peft = PeftModel.from_pretrained(base, str(adapter)).eval()
    tokenizer = policy.tokenizer
    for row in completions[:2]:
        ids = tokenizer(row["prompt"], add_special_tokens=False).input_ids
        output = peft.generate(input_ids=torch.tensor([ids]), do_sample=False, max_new_tokens=8,
                               eos_token_id=tokenizer.eos_token_id, pad_token_id=tokenizer.eos_token_id)
        assert row["completion"] == tokenizer.decode(output[0, len(ids):], skip_special_tokens=True)
    (tmp_path / "run" / "checkpoints").mkdir(parents=True)
    with pytest.raises(SystemExit) as exit_code:
        driver.train.main([*argv[:-3], f"--logging.output_dir={tmp_path / 'run'}"])
    assert exit_code.value.code == 2 and "holds a training run; evaluate into another directory" in \
        capsys.readouterr().err


def test_an_evaluations_rewards_see_the_training_progress_of_its_step(policy):
    """trainer_state: the updates before the evaluated step's (TRL's global_step at its evaluate()), the run's
    total, and the epoch of the training prompts (not of the eval set's)."""
    config = run_config(rewards={"functions": [{"path": "tests.reward_fixtures.training_progress"},
                                               {"path": "tests.reward_fixtures.training_epoch", "weight": 0.0}]},
                        algo={"num_generations": 2, "num_iterations": 2})
    training, evaluated = training_and_eval_prompts(config, policy.tokenizer)
    training.next_batch(61)  # training has drawn 61 of its prompts
    scorer = GroupScorer(config)
    evaluation_run = Evaluator(config, TransformersGenerator(config, policy), evaluated, policy.tokenizer, scorer,
                               training=training)
    result = evaluation_run.evaluate(version=5, engine_lock=threading.Lock())
    scorer.close()
    updates = config.train.steps * 2
    assert result.metrics["eval/rewards/training_progress/mean"] == pytest.approx(5 * 2 + updates / 1000)
    assert result.metrics["eval/rewards/training_epoch/mean"] == pytest.approx(61 / len(training.prompts))


def test_each_eval_set_is_evaluated_under_its_own_prefix(policy, tmp_path):
    """eval.sets (TRL's eval_dataset as a dict): the sets one after the other, each one's metrics under
    eval_<set>/; the first set's are exactly what eval.source with that dataset gives (its group ids and
    sampling seeds are the one set's), the second's are its reward function over its own rows (tagged
    with the set); the terminal line and the run summary name each set."""
    from driver.metrics.plots import plot_metrics
    from driver.metrics.summary import eval_trends

    single = run_config(eval={"val_set_size": 0, "source": "toy:digits", "max_prompts": 4})
    sets = run_config(eval={"val_set_size": 0, "max_prompts": 4,
                            "sets": {"a": {"source": "toy:digits"}, "b": {"source": "toy:digits"}}})
    results = []
    for config in (single, sets):
        evaluation_run, scorer = evaluator(config, policy)
        results.append(evaluation_run.evaluate(version=0, engine_lock=threading.Lock()))
        scorer.close()
    one, both = results
    assert {key.removeprefix("eval/"): value for key, value in one.metrics.items() if key != "eval/time"} == {
        key.removeprefix("eval_a/"): value for key, value in both.metrics.items()
        if key.startswith("eval_a/") and key != "eval_a/time"}
    assert [row["set"] for row in both.table] == ["a"] * 12 + ["b"] * 12
    assert [row["completion"] for row in both.table[:12]] == [row["completion"] for row in one.table]
    rows_b = both.table[12:]
    oracle = digit_fraction([row["prompt"] for row in rows_b], [row["completion"] for row in rows_b])
    assert both.metrics["eval_b/reward"] == pytest.approx(sum(oracle) / len(oracle), abs=1e-6)
    assert not any(key.startswith("eval/") for key in both.metrics)
    terminal = io.StringIO()
    logger = MetricsLogger(tmp_path, total_steps=4, tensorboard=False, progress=False,
                           console=Console(file=terminal, width=10_000))
    log_evaluation(logger, 2, both, sets.eval.labels())
    logger.close()
    assert terminal.getvalue().startswith(f"eval after step 2: a reward {both.metrics['eval_a/reward']:.3f} over 4 "
                                          f"prompts in ") and "; b reward " in terminal.getvalue()
    rows = [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    assert [trend.split(":")[0] for trend in eval_trends(rows)] == ["eval_a/reward", "eval_b/reward"]
    written = [path.name for path in plot_metrics(tmp_path / "metrics.jsonl", tmp_path)]
    assert written == ["eval_a_reward.png", "eval_b_reward.png", "overview.png"]
