"""Config and CLI: every key documented, overrides, and config mistakes as one message + exit 2."""

import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
from pydantic import BaseModel

from driver.cli import ConfigError, apply_override, exit_on_config_error, help_text, load_config
from driver.config import Config


def leaf_keys(model: type[BaseModel], prefix: str = "") -> list[str]:
    keys = []
    for name, field in model.model_fields.items():
        annotation = field.annotation
        if isinstance(annotation, type) and issubclass(annotation, BaseModel):
            keys += leaf_keys(annotation, prefix + name + ".")
        else:
            keys.append(prefix + name)
    return keys


def test_help_lists_every_key_with_its_description():
    text = help_text()
    for key in leaf_keys(Config):
        assert f"{key} = " in text, key
    assert all(field.description for field in Config.model_fields.values())


def test_every_field_has_help_text():
    def walk(model):
        for name, field in model.model_fields.items():
            assert field.description, f"{model.__name__}.{name} has no description"
            if isinstance(field.annotation, type) and issubclass(field.annotation, BaseModel):
                walk(field.annotation)
    walk(Config)


def test_defaults_validate_and_examples_load():
    assert Config().train.steps > 0
    config = load_config(Path("examples/tiny-grpo.yaml"), {})
    assert config.model.path == "tiny://qwen2"


def test_dotted_overrides_are_parsed_as_yaml(tmp_path):
    config = load_config(None, {"train.lr": "1e-4", "lora.targets": "[q_proj, v_proj]", "model.qlora": "true",
                                "algo.epsilon_high": "0.28", "rollout.sampling.max_tokens": "64"})
    assert config.train.lr == 1e-4 and config.lora.targets == ["q_proj", "v_proj"] and config.model.qlora
    assert config.algo.epsilon_high == 0.28 and config.rollout.sampling.max_tokens == 64


@pytest.mark.parametrize("overrides,message", [
    ({"train.lrr": "1"}, "train.lrr: unknown key"),
    ({"train.lr": "fast"}, "train.lr: Input should be a valid number"),
    ({"algo.loss_type": "ppo"},
     "algo.loss_type: Input should be 'grpo', 'bnpo', 'dr_grpo', 'dapo', 'cispo', 'sapo', 'luspo' or 'vespo'"),
    ({"algo.loss_type": "luspo"}, "luspo scales GSPO's sequence term by the sequence's length: set "
     "importance_sampling_level: sequence"),
    ({"algo.loss_type": "vespo", "algo.importance_sampling_level": "sequence"}, "set importance_sampling_level: token"),
    ({"algo.advantage_estimator": "rloo", "algo.scale_rewards": "batch"},
     "scale_rewards applies to advantage_estimator grpo only"),
    ({"algo.advantage_estimator": "rloo", "rewards.aggregation": "normalize_then_sum"},
     "algo.advantage_estimator = rloo needs rewards.aggregation = sum_then_normalize"),
    ({"algo.importance_sampling.cap_min": "3"}, "cap_min = 3.0 must be below cap = 2.0"),
    ({"algo.delta": "0.5"}, "algo.delta: Input should be greater than 1"),
    ({"algo.top_entropy_quantile": "1.5"}, "algo.top_entropy_quantile: Input should be less than or equal to 1"),
    ({"algo.name": "ebft", "ebft.mode": "strided", "algo.entropy_coef": "0.01", "algo.mask_truncated_completions":
      "true"}, "algo.entropy_coef, algo.mask_truncated_completions: not supported by ebft.mode = strided"),
    ({"algo.name": "ebft", "algo.advantage_estimator": "rloo"},
     "algo.advantage_estimator does not apply to ebft: set ebft.advantage_estimator"),
    ({"model.qlora_blocksize": "48"}, "model.qlora_blocksize: Value error, must be a power of two"),
    ({"rewards.functions": "[{path: no_such_module.reward}]"}, "rewards.functions[0].path: cannot import module"),
    ({"rewards.functions": "[{path: driver.data.toy_tasks.nope}]"}, "module 'driver.data.toy_tasks' has no 'nope'"),
    ({"data.source": "/nonexistent/prompts.jsonl"},
     "data.source: dataset file /nonexistent/prompts.jsonl does not exist"),
    ({"model.path": "/nonexistent/model"}, "model.path: /nonexistent/model is neither a local model directory nor a "
                                           "Hugging Face Hub model id"),
    ({"model.path": "models/a/b"}, "model.path: models/a/b is neither a local model directory"),
    ({"model.revision": "v2"}, "model.revision: v2 applies to a Hub model id; model.path tiny://qwen2 is not one"),
    ({"algo.epsilon": "0.3", "algo.epsilon_high": "0.1"}, "algo.epsilon_high must be >= algo.epsilon"),
    ({"algo.use_bias_correction_kl": "true"}, "use_bias_correction_kl corrects the loss's KL term, which beta = 0 "
     "leaves out"),
    ({"algo.use_bias_correction_kl": "true", "algo.beta": "0.1", "algo.kl_in_reward": "true"},
     "which kl_in_reward moves into the reward"),
])
def test_config_mistakes_name_the_key(overrides, message):
    with pytest.raises(ConfigError) as error:
        load_config(None, overrides)
    assert message in str(error.value)


def test_cispo_caps_at_scalerls_epsilon_max_unless_epsilon_high_is_set():
    assert load_config(None, {"algo.loss_type": "cispo"}).algo.clip_high == 5.0
    assert load_config(None, {"algo.loss_type": "cispo", "algo.epsilon_high": "3"}).algo.clip_high == 3.0
    assert load_config(None, {"algo.epsilon_high": "0.28"}).algo.clip_high == 0.28
    assert load_config(None, {}).algo.clip_high == 0.2


def test_override_into_a_value_is_rejected():
    with pytest.raises(ConfigError, match="'lr' is a value, not a section"):
        apply_override({"train": {"lr": 1.0}}, "train.lr.x", "1")


def run_cli(*args, cwd=None):
    return subprocess.run([sys.executable, "-m", "driver.train", *args], capture_output=True, text=True,
                          cwd=cwd, timeout=120)


def test_cli_exit_code_2_without_traceback(tmp_path):
    bad = tmp_path / "bad.yaml"
    bad.write_text(textwrap.dedent("""
        train:
          lr: not-a-number
        logging:
          colour: blue
    """))
    result = run_cli(str(bad))
    assert result.returncode == 2
    assert "Traceback" not in result.stderr
    assert "train.lr:" in result.stderr and "logging.colour: unknown key" in result.stderr


@pytest.mark.parametrize("rank, says_it", [("0", True), ("1", False), (None, True)])
def test_under_torchrun_only_rank_0_reports_a_config_error(monkeypatch, capsys, rank, says_it):
    """Every rank finds the same mistake; printed by each, the lines interleave on one line."""
    if rank is None:
        monkeypatch.delenv("RANK", raising=False)
    else:
        monkeypatch.setenv("RANK", rank)
    with pytest.raises(SystemExit) as exited:
        exit_on_config_error(ConfigError("train.lr: not a number"))
    assert exited.value.code == 2
    assert (capsys.readouterr().err == "error: train.lr: not a number\n") == says_it


def run_main(capsys, *args) -> tuple[int, str, str]:
    """driver.train.main in this process (the entry point `python -m driver.train` runs; one test
    above runs the real process): its exit code, stdout and stderr. Any exception but the exit
    fails the test, so a config mistake that reached a traceback would show here."""
    from driver.train import main

    try:
        code = main(list(args))
    except SystemExit as exited:
        code = exited.code
    out = capsys.readouterr()
    return code, out.out, out.err


TRL_LIKE_REWARD = """
import os

os.environ["VLLM_LOGGING_LEVEL"] = os.getenv("VLLM_LOGGING_LEVEL", "ERROR")  # trl/_compat.py, at `import trl`


def score(completions, **kwargs):
    return [0.0 for _ in completions]
"""


@pytest.mark.parametrize("user_level", [None, "DEBUG"])
def test_a_reward_module_importing_trl_leaves_vllm_at_the_drivers_log_level(tmp_path, monkeypatch, capsys,
                                                                           user_level):
    """A reward module that imports trl (trl.rewards, or a script written for TRL) runs trl's _compat on import,
    which sets VLLM_LOGGING_LEVEL=ERROR unless it is set: the driver's engine (and a server it launches) then
    logged no warnings. The module here does what trl's import does (the real trl may already be imported in
    this process, where importing it again would do nothing); the driver's default, or the user's own setting,
    must be what the run sees."""
    (tmp_path / "trl_like_reward.py").write_text(TRL_LIKE_REWARD)
    monkeypatch.syspath_prepend(str(tmp_path))
    monkeypatch.delitem(sys.modules, "trl_like_reward", raising=False)  # the other case's import runs again
    if user_level is None:
        monkeypatch.delenv("VLLM_LOGGING_LEVEL", raising=False)
    else:
        monkeypatch.setenv("VLLM_LOGGING_LEVEL", user_level)
    config = tmp_path / "run.yaml"
    config.write_text(Path("examples/tiny-grpo.yaml").read_text().replace(
        "driver.data.toy_tasks.digit_fraction", "trl_like_reward.score"))
    seen = []
    monkeypatch.setattr("driver.train.run", lambda _config: seen.append(os.environ.get("VLLM_LOGGING_LEVEL")))
    code, _, err = run_main(capsys, str(config), f"--logging.output_dir={tmp_path / 'out'}")
    assert (code, err) == (0, "")
    assert sys.modules.pop("trl_like_reward").__file__ == str(tmp_path / "trl_like_reward.py")  # imported
    assert seen == [user_level or "WARNING"]


def test_an_output_dir_that_cannot_be_written_is_named_before_anything_loads(tmp_path, capsys):
    (tmp_path / "a-file").write_text("")
    code, _, err = run_main(capsys, "examples/tiny-grpo.yaml", f"--logging.output_dir={tmp_path / 'a-file' / 'run'}")
    assert code == 2
    assert err == f"error: logging.output_dir: cannot write {tmp_path / 'a-file' / 'run'} (Not a directory)\n"


@pytest.mark.parametrize("resume, message", [
    ("/no/such/checkpoint", "checkpoint.resume: /no/such/checkpoint is not a checkpoint (no trainer_state.pt)"),
    ("latest", "checkpoint.resume: latest requested but {output_dir}/checkpoints has none (auto starts the run "
               "when there is none)"),
])
def test_a_checkpoint_that_is_not_there_is_named_in_one_line(tmp_path, capsys, resume, message):
    code, _, err = run_main(capsys, "examples/tiny-grpo.yaml", f"--logging.output_dir={tmp_path}",
                            f"--checkpoint.resume={resume}", "--rollout.backend=transformers", "--logging.quiet=false")
    assert code == 2 and err.endswith(f"\nerror: {message.format(output_dir=tmp_path)}\n")  # after transformers'
    assert "Traceback" not in err


@pytest.mark.parametrize("args,message", [
    (["missing.yaml"], "config file missing.yaml does not exist"),
    (["--train.steps"], "must look like --section.key=value"),
    (["a.yaml", "b.yaml"], "one config file only"),
])
def test_cli_argument_mistakes(capsys, args, message):
    code, _, err = run_main(capsys, *args)
    assert code == 2 and message in err


def test_cli_rejects_yaml_that_is_not_a_mapping(capsys, tmp_path):
    path = tmp_path / "list.yaml"
    path.write_text("- a\n- b\n")
    code, _, err = run_main(capsys, str(path))
    assert code == 2 and "must hold a mapping of sections" in err


def test_cli_help_exits_zero(capsys):
    code, out, _ = run_main(capsys, "--help")
    assert code == 0 and "train.lr = " in out and "rollout.backend" in out


@pytest.mark.parametrize("name", ["qwen2.5-1.5b-gsm8k-lora.yaml", "qwen2.5-0.5b-deepmath-lora.yaml",
                                  "qwen3-30b-a3b-qlora.yaml"])
def test_gpu_examples_are_valid_configs(name):
    """They cannot run here (no GPU, no model download) but must validate and name real functions."""
    from driver.cli import import_dotted, read_yaml

    config = Config.model_validate(read_yaml(Path("examples") / name))
    for function in config.rewards.functions:
        import_dotted(function.path, "rewards")
    if config.data.transform is not None:
        import_dotted(config.data.transform, "data.transform")


def test_gsm8k_reward():
    from driver.data.gsm8k import boxed_format, gsm8k_correct, gsm8k_prompt

    answers = ["Natalia sold 48/2 = 24 clips in May.\n#### 72", "#### 1,000"]
    completions = ["so the answer is \\boxed{72}", "It is 1000 dollars. Wait, 999."]
    assert gsm8k_correct(["p", "p"], completions, answer=answers) == [1.0, 0.0]
    assert gsm8k_correct(["p"], ["Total: 1,000"], answer=["#### 1000"]) == [1.0]
    assert boxed_format(["p", "p"], completions) == [1.0, 0.0]
    assert "\\boxed{number}" in gsm8k_prompt({"question": "2+2?", "answer": "#### 4"})["prompt"]


def test_config_reference_doc_is_current():
    from driver.cli import markdown_reference

    assert Path("docs/config.md").read_text() == markdown_reference(), \
        "docs/config.md is stale: regenerate with `python -m driver.cli > docs/config.md`"


@pytest.mark.parametrize("old, new", [("driver.reward_functions.gsm8k_correct", "driver.data.gsm8k.gsm8k_correct"),
                                      ("driver.toy_tasks.digit_fraction", "driver.data.toy_tasks.digit_fraction")])
def test_moved_reward_modules_still_resolve_with_a_warning(old, new):
    """Configs written before the driver's packages keep working and are told the new name."""
    from driver.cli import import_dotted

    with pytest.warns(FutureWarning, match=new.replace(".", r"\.")):
        assert import_dotted(old, "rewards.functions[0].path") is import_dotted(new, "x")


@pytest.mark.parametrize("old, new", [
    ({}, "filter"),
    ({"algo.filter_zero_advantage": "true"}, "filter"),
    ({"algo.skip_zero_advantage": "false"}, "filter"),  # filtered batches have no zero micro-batch to skip
    ({"algo.filter_zero_advantage": "false"}, "skip"),
    ({"algo.filter_zero_advantage": "false", "algo.skip_zero_advantage": "false"}, "keep"),
])
def test_the_two_old_zero_advantage_keys_become_one_with_a_warning(old, new, recwarn):
    """filter_zero_advantage / skip_zero_advantage were two keys for one idea: old configs keep their
    behaviour under algo.zero_advantage and are told the new spelling."""
    assert load_config(None, old).algo.zero_advantage == new
    warned = [w for w in recwarn if issubclass(w.category, FutureWarning) and "algo.zero_advantage" in str(w.message)]
    assert len(warned) == (1 if old else 0)


@pytest.mark.parametrize("overrides, message", [
    ({"algo.zero_advantage": "skip", "algo.filter_zero_advantage": "true"},
     "algo: Value error, zero_advantage replaces filter_zero_advantage: give it alone"),
    ({"algo.skip_zero_advantage": "sometimes"}, "skip_zero_advantage must be true or false"),
    ({"algo.zero_advantage": "drop"}, "algo.zero_advantage: Input should be 'filter', 'skip' or 'keep'"),
])
def test_zero_advantage_mistakes_name_the_key(overrides, message):
    with pytest.raises(ConfigError, match="invalid config") as error:
        load_config(None, overrides)
    assert message in str(error.value)
