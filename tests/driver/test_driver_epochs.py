"""train.epochs (TRL's num_train_epochs, axolotl's num_epochs): the steps are counted once the prompts are read
(held-out eval prompts left out), decide the run in place of train.steps and go to its config.yaml, which a
resume reads back; train.warmup_ratio is the fraction of the run's updates that warms up, rounded up as
transformers does, with warmup_steps winning when given."""

import json
import math

import pytest
import torch
import yaml

import driver.train
from driver.config import TrainConfig
from driver.update.optim import build_scheduler


@pytest.mark.parametrize("epochs, prompts, per_step, accumulation, steps", [
    (1, 256, 8, 1, 32), (0.25, 256, 8, 1, 8), (1, 250, 8, 1, 32),  # a last partial step counts
    (0.1, 30, 3, 1, 1),  # 0.1 x 30 / 3 is 1.0000000000000002 in floating point: still one step
    (2, 100, 5, 2, 20), (0.001, 10, 8, 1, 1)])  # at least one
def test_epochs_make_steps_of_prompts_per_step_times_accumulation(epochs, prompts, per_step, accumulation, steps):
    train = TrainConfig(epochs=epochs, prompts_per_step=per_step, gradient_accumulation_steps=accumulation)
    assert train.steps_for_epochs(prompts) == steps


def learning_rates(train: TrainConfig, updates: int) -> list[float]:
    optimizer = torch.optim.SGD([torch.nn.Parameter(torch.zeros(1))], lr=1.0)
    scheduler = build_scheduler(optimizer, train, updates)
    rates = []
    for _ in range(updates):
        rates.append(optimizer.param_groups[0]["lr"])
        optimizer.step()
        scheduler.step()
    return rates


def test_warmup_ratio_warms_up_that_fraction_of_the_updates_rounded_up():
    ratio = learning_rates(TrainConfig(warmup_ratio=0.1, schedule="cosine"), 45)  # 4.5 -> 5 updates
    assert ratio == learning_rates(TrainConfig(warmup_steps=5, schedule="cosine"), 45)
    assert ratio[:5] == pytest.approx([(update + 1) / 6 for update in range(5)]) and ratio[5] == 1.0
    given = learning_rates(TrainConfig(warmup_steps=2, warmup_ratio=0.5, schedule="linear"), 10)
    assert given == learning_rates(TrainConfig(warmup_steps=2, schedule="linear"), 10)  # warmup_steps wins


def test_a_run_by_epochs_counts_its_steps_from_the_prompts_it_trains_on(tmp_path, capsys):
    output_dir = tmp_path / "run"
    argv = ["--rollout.backend=transformers", "--rollout.sampling.max_tokens=4", "--train.epochs=0.0625",
            "--train.steps=40", "--eval.val_set_size=16", "--eval.steps=1", f"--logging.output_dir={output_dir}",
            "--logging.quiet=false", "--logging.progress=false", "--logging.report_to=[]", "--logging.plots=false"]
    assert driver.train.main(argv) == 0
    printed = capsys.readouterr().out
    steps = math.ceil(0.0625 * (256 - 16) / 8)  # 1.875: two steps of the 240 prompts left to train on
    assert steps == 2 and "train.epochs = 0.0625: 2 steps of 8 prompts (in place of train.steps = 40)" in printed
    rows = [json.loads(line) for line in (output_dir / "metrics.jsonl").read_text().splitlines()]
    assert sorted({row["step"] for row in rows}) == [1, 2]
    saved = yaml.safe_load((output_dir / "config.yaml").read_text())["train"]
    assert (saved["steps"], saved["epochs"]) == (2, 0.0625)
    assert "--checkpoint.resume=latest --train.epochs=0.125" in printed
