"""checkpoint.push_to_hub (driver/data/hub_upload.py) through huggingface_hub's real client against a local
stand-in for the Hub's write API (tests/hub_stand_in.py: the Hub cannot be reached here): the repository is created
before training (a bare name under the token's user, private when asked) and problems stop the run there; a whole
training run uploads its final adapter, every checkpoint's with every_save and eval.save_best's to best/, and
whole checkpoints with hub_strategy checkpoint / all_checkpoints (from which a run resumes as from its own); a
failed upload loses nothing and says how to upload by hand."""

import json
import time

import huggingface_hub.constants
import pytest
from huggingface_hub import ModelCard
from safetensors.torch import load

import driver.train
from driver.checkpoint import CHECKPOINTS
from driver.cli import ConfigError, load_config
from driver.config import CheckpointConfig
from driver.data.hub_upload import HubUploader, Upload, create_repository, upload, upload_commands
from tests.hub_stand_in import TOKEN, USER, HubStandIn


@pytest.fixture
def hub(monkeypatch):
    stand_in = HubStandIn()
    monkeypatch.setattr(huggingface_hub.constants, "ENDPOINT", stand_in.url)
    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_OFFLINE", False)
    monkeypatch.setenv("HF_TOKEN", TOKEN)
    yield stand_in
    stand_in.close()


def test_the_repository_is_created_under_the_token_s_user_or_found(hub, tmp_path):
    output_dir = tmp_path / "my-grpo-run"
    assert create_repository(CheckpointConfig(push_to_hub=True), output_dir) == f"{USER}/my-grpo-run"
    assert hub.repos[f"{USER}/my-grpo-run"].private is None  # the Hub's default
    named = CheckpointConfig(push_to_hub=True, hub_model_id="org/adapter", hub_private_repo=True)
    assert create_repository(named, output_dir) == "org/adapter"
    assert hub.repos["org/adapter"].private is True
    assert create_repository(named, output_dir) == "org/adapter"  # found: a resumed run pushes to it again


def test_no_token_offline_or_a_refusal_is_a_config_error_before_training(hub, tmp_path, monkeypatch):
    config = CheckpointConfig(push_to_hub=True)
    monkeypatch.setenv("HF_TOKEN", "hf_wrong")
    with pytest.raises(ConfigError, match=r"checkpoint.hub_model_id: the Hub refused to create or find run "
                                          r"\(HTTP 401: "):
        create_repository(config, tmp_path / "run")
    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_OFFLINE", True)
    with pytest.raises(ConfigError, match="HF_HUB_OFFLINE is set"):
        create_repository(config, tmp_path / "run")
    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_OFFLINE", False)
    monkeypatch.delenv("HF_TOKEN")
    monkeypatch.setattr(huggingface_hub.constants, "HF_TOKEN_PATH", str(tmp_path / "no-token"))
    monkeypatch.setattr(huggingface_hub.constants, "HF_STORED_TOKENS_PATH", str(tmp_path / "no-tokens"))
    with pytest.raises(ConfigError, match=r"no Hugging Face token; log in \(`hf auth login`\) or set HF_TOKEN"):
        create_repository(config, tmp_path / "run")
    monkeypatch.setenv("HF_TOKEN", TOKEN)
    monkeypatch.setattr(huggingface_hub.constants, "ENDPOINT", "http://127.0.0.1:9")  # nothing listens
    with pytest.raises(ConfigError, match=r"the Hugging Face Hub \(http://127.0.0.1:9\) could not be reached"):
        create_repository(config, tmp_path / "run")


def test_hub_keys_without_push_to_hub_and_push_to_hub_with_eval_only_are_refused():
    with pytest.raises(ConfigError, match="checkpoint.hub_model_id is set but checkpoint.push_to_hub is false"):
        load_config(None, {"checkpoint.hub_model_id": "me/x"})
    with pytest.raises(ConfigError, match="checkpoint.push_to_hub with eval.only: nothing is trained"):
        load_config(None, {"checkpoint.push_to_hub": "true", "eval.only": "true", "eval.val_set_size": "4"})
    with pytest.raises(ConfigError, match="hub_strategy"):
        load_config(None, {"checkpoint.push_to_hub": "true", "checkpoint.hub_strategy": "every_checkpoint"})


def test_background_uploads_survive_the_checkpoint_s_removal_and_the_newest_waiting_one_wins(hub, tmp_path):
    """Also: a crashed run's staging directory is removed when the next uploader starts."""
    create_repository(CheckpointConfig(push_to_hub=True, hub_model_id="me/x"), tmp_path)
    crashed = tmp_path / ".hub-upload-k3j2"  # a crashed run's staged upload
    (crashed / "0").mkdir(parents=True)
    (crashed / "0" / "adapter_model.safetensors").write_bytes(b"old")
    uploader = HubUploader("me/x", tmp_path, each_save=True)
    assert not crashed.exists()
    for step in (1, 2, 3):
        adapter = tmp_path / f"step-{step}" / "adapter"
        adapter.mkdir(parents=True)
        (adapter / "adapter_model.safetensors").write_bytes(f"weights {step}".encode())
        uploader.push(Upload({"": adapter}, f"adapter after step {step}", {"README.md": f"card {step}".encode()}))
        for path in sorted(adapter.parent.rglob("*"), reverse=True):  # rotated away at once, as keep=1 would
            path.unlink() if path.is_file() else path.rmdir()
    assert uploader.finish(None) == []
    commits = hub.repos["me/x"].commits
    # Steps 1 and 2 may have been folded into a later one while waiting (all of them, on a busy machine).
    assert commits[-1] == "adapter after step 3" and len(set(commits)) == len(commits) <= 3
    assert hub.repos["me/x"].files["adapter_model.safetensors"] == b"weights 3"
    assert hub.repos["me/x"].files["README.md"] == b"card 3"  # the model card travels with a background upload
    assert not list(tmp_path.glob(".hub-upload-*"))  # the staged links are gone


def tiny_run_argv(output_dir, *extra, push: bool = True) -> list[str]:
    return ["--rollout.backend=transformers", "--rollout.sampling.max_tokens=4", "--train.steps=4",
            "--train.prompts_per_step=2", "--algo.num_generations=2", "--logging.report_to=[]",
            "--logging.plots=false", "--logging.quiet=false", "--logging.progress=false",
            f"--logging.output_dir={output_dir}", *(["--checkpoint.push_to_hub=true"] if push else []), *extra]


def test_a_run_uploads_each_checkpoint_and_its_final_and_best_adapters(hub, tmp_path, capsys):
    output_dir = tmp_path / "run"
    argv = tiny_run_argv(output_dir, "--checkpoint.every=2", "--checkpoint.hub_strategy=every_save",
                         "--checkpoint.hub_model_id=me/grpo", "--eval.steps=2", "--eval.val_set_size=4",
                         "--eval.save_best=true")
    assert driver.train.main(argv) == 0
    printed = " ".join(capsys.readouterr().out.split())  # rich wraps long lines
    repository = hub.repos["me/grpo"]
    assert repository.commits[-1] == "adapter after step 4"  # the final adapter's, after each checkpoint's
    assert repository.commits[:-1] in (["adapter after step 2", "adapter after step 4"],
                                       ["adapter after step 4"])  # step 2's replaced while still waiting
    local = output_dir / "adapter"
    assert repository.files["adapter_model.safetensors"] == (local / "adapter_model.safetensors").read_bytes()
    assert repository.files["adapter_config.json"] == (local / "adapter_config.json").read_bytes()
    assert load(repository.files["best/adapter_model.safetensors"]).keys() == \
        load((local / "adapter_model.safetensors").read_bytes()).keys()
    assert json.loads(repository.files["best/best.json"])["step"] in (2, 4)
    assert f"will upload to {hub.url}/me/grpo (each checkpoint and the end)" in printed
    assert f"uploaded to {hub.url}/me/grpo" in printed and f"hub {hub.url}/me/grpo (the uploaded adapter" in printed
    assert not list(output_dir.glob(".hub-upload-*"))
    card = ModelCard(repository.files["README.md"].decode())  # huggingface_hub's own reading of it
    assert card.data.library_name == "peft" and {"pykernels", "grpo", "lora"} <= set(card.data.tags)
    assert card.data.base_model is None  # a tiny local base: no Hub id to name
    assert 'AutoPeftModelForCausalLM.from_pretrained("me/grpo")' in card.text and "for 4 steps" in card.text


def test_the_model_card_names_a_hub_base_and_a_whole_model(tmp_path):
    from driver.data.hub_upload import model_card

    adapter = tmp_path / "adapter"
    adapter.mkdir()
    (adapter / "adapter_config.json").write_text("{}")
    (adapter / "README.md").write_text("---\nbase_model: Qwen/Qwen2.5-0.5B-Instruct\nlibrary_name: peft\ntags:\n"
                                       "- base_model:adapter:Qwen/Qwen2.5-0.5B-Instruct\n- lora\n---\n# Model Card\n")
    config = load_config(None, {"model.path": "Qwen/Qwen2.5-0.5B-Instruct", "model.qlora": "true",
                                "rewards.functions": "[{path: driver.data.toy_tasks.digit_fraction}]"})
    card = ModelCard(model_card(config, "me/qwen-grpo", adapter, 7).decode())
    assert card.data.base_model == "Qwen/Qwen2.5-0.5B-Instruct"
    assert card.data.tags == ["base_model:adapter:Qwen/Qwen2.5-0.5B-Instruct", "lora", "pykernels", "grpo", "qlora"]
    assert "[Qwen/Qwen2.5-0.5B-Instruct](https://huggingface.co/Qwen/Qwen2.5-0.5B-Instruct)" in card.text
    assert "digit_fraction" in card.text and "NF4 (QLoRA)" in card.text and "# Model Card" not in card.text
    model = tmp_path / "model"
    model.mkdir()
    whole = ModelCard(model_card(load_config(None, {"model.adapter": "none"}), "me/full", model, 3).decode())
    assert whole.data.library_name == "transformers"
    assert 'AutoModelForCausalLM.from_pretrained("me/full")' in whole.text


def test_a_failed_upload_keeps_everything_and_says_how_to_upload_by_hand(hub, tmp_path, capsys):
    output_dir = tmp_path / "run"
    hub.fail_commits = 1
    assert driver.train.main(tiny_run_argv(output_dir)) == 1
    error = " ".join(capsys.readouterr().err.split())
    assert (f"error: uploading to {hub.url}/{USER}/run failed (adapter after step 4: HTTP 503" in error
            and f"upload it with `hf upload {USER}/run {output_dir / 'adapter'}`" in error), error
    assert "Traceback" not in error
    assert (output_dir / "adapter" / "adapter_model.safetensors").is_file()
    assert (output_dir / CHECKPOINTS).is_dir()
    assert hub.repos[f"{USER}/run"].files == {}


def test_a_stopped_run_or_one_that_trained_nothing_uploads_nothing(hub, tmp_path):
    from io import StringIO
    from types import SimpleNamespace

    config = load_config(None, {"checkpoint.push_to_hub": "true", "logging.output_dir": str(tmp_path)})
    policy = SimpleNamespace(trained_name="adapter")
    for interrupted, trained, said in ((True, True, "the run stopped early (continued to its end, it uploads)"),
                                       (False, False, "")):  # a resume of a finished run: nothing new
        out = StringIO()
        uploader = HubUploader(create_repository(config.checkpoint, tmp_path), tmp_path, each_save=False)
        assert driver.train.push_final(uploader, config, policy, None, 4, interrupted, trained, out) == []
        assert said in out.getvalue() and "uploading" not in out.getvalue()
    assert hub.repos[f"{USER}/{tmp_path.name}"].commits == []


def test_a_run_stopped_early_uploads_its_checkpoint_alone_under_the_checkpoint_strategies(hub, tmp_path):
    """hub_strategy checkpoint: the checkpoint saved at Ctrl-C or SIGTERM goes up (a resume elsewhere needs it), the
    adapter at the repository's root waits for the run's end; a run that trained nothing uploads nothing."""
    from io import StringIO
    from types import SimpleNamespace

    config = load_config(None, {"checkpoint.push_to_hub": "true", "checkpoint.hub_strategy": "checkpoint",
                                "logging.output_dir": str(tmp_path)})
    checkpoint = tmp_path / CHECKPOINTS / "step-000003"
    (checkpoint / "adapter").mkdir(parents=True)
    (checkpoint / "trainer_state.pt").write_bytes(b"state 3")
    (checkpoint / "adapter" / "adapter_model.safetensors").write_bytes(b"weights 3")
    policy = SimpleNamespace(trained_name="adapter")
    for trained in (False, True):
        out = StringIO()
        uploader = HubUploader(create_repository(config.checkpoint, tmp_path), tmp_path, each_save=False)
        assert driver.train.push_final(uploader, config, policy, None, 3, True, trained, out, checkpoint) == []
    repository = hub.repos[f"{USER}/{tmp_path.name}"]
    assert repository.commits == ["checkpoint after step 3 (stopped early)"]
    assert repository.files == {"last-checkpoint/trainer_state.pt": b"state 3",
                                "last-checkpoint/adapter/adapter_model.safetensors": b"weights 3"}
    assert "uploading the checkpoint to" in out.getvalue() and "the adapter goes up at its end" in out.getvalue()
    hub.fail_commits = 1  # then the message's command uploads that checkpoint, where a resume looks for it
    uploader = HubUploader(create_repository(config.checkpoint, tmp_path), tmp_path, each_save=False)
    assert driver.train.push_final(uploader, config, policy, None, 3, True, True, StringIO(), checkpoint)
    assert (upload_commands(uploader.repo_id, uploader.unsent.folders)
            == f"`hf upload {USER}/{tmp_path.name} {checkpoint} last-checkpoint`")


def test_last_checkpoint_and_best_hold_the_newest_copy_alone_and_the_rest_of_the_repository_stays(hub, tmp_path):
    """A mirrored folder's files the newer copy lacks (a rank's optimizer shard of a run at another world size) are
    deleted in the same commit; a download of last-checkpoint/ is then the checkpoint as saved. Files outside the
    mirrored folders (the adapter at the root, all_checkpoints' folders) stay."""
    create_repository(CheckpointConfig(push_to_hub=True, hub_model_id="me/m"), tmp_path)
    files = hub.repos["me/m"].files

    def saved(name: str, contents: dict[str, bytes]):
        for path, data in contents.items():
            (tmp_path / name / path).parent.mkdir(parents=True, exist_ok=True)
            (tmp_path / name / path).write_bytes(data)
        return tmp_path / name

    two_ranks = saved("step-2", {"optimizer/__0_0.distcp": b"a", "optimizer/__1_0.distcp": b"b", "state.pt": b"2"})
    one_rank = saved("step-3", {"optimizer/__0_0.distcp": b"c", "state.pt": b"3"})
    adapter = saved("adapter", {"adapter_model.safetensors": b"w"})
    upload("me/m", Upload({"": adapter, "last-checkpoint": two_ranks, "best": two_ranks,
                           "checkpoints/step-000002": two_ranks}, "step 2"))
    assert len(files) == 10
    upload("me/m", Upload({"last-checkpoint": one_rank, "best": one_rank}, "step 3"))
    for mirrored in ("last-checkpoint", "best"):
        assert {name: data for name, data in files.items() if name.startswith(mirrored + "/")} == {
            f"{mirrored}/optimizer/__0_0.distcp": b"c", f"{mirrored}/state.pt": b"3"}
    assert files["adapter_model.safetensors"] == b"w"
    assert files["checkpoints/step-000002/optimizer/__1_0.distcp"] == b"b"
    assert hub.repos["me/m"].commits == ["step 2", "step 3"]


def test_a_waiting_upload_is_folded_into_the_next_and_what_only_it_uploads_goes_too(hub, tmp_path):
    """all_checkpoints: a checkpoint whose upload still waits when the next is saved is not lost; the adapter both
    carry is the newer's. The first upload is held in flight (the stand-in's commits closed) so the next two meet
    waiting."""
    create_repository(CheckpointConfig(push_to_hub=True, hub_model_id="me/x"), tmp_path)
    uploader = HubUploader("me/x", tmp_path, each_save=True)
    hub.commits_open.clear()

    def push(step: int) -> None:
        checkpoint = tmp_path / "checkpoints" / f"step-{step:06d}"
        (checkpoint / "adapter").mkdir(parents=True)
        (checkpoint / "adapter" / "adapter_model.safetensors").write_bytes(f"weights {step}".encode())
        (checkpoint / "trainer_state.pt").write_bytes(f"state {step}".encode())
        uploader.push(Upload({"": checkpoint / "adapter", f"checkpoints/{checkpoint.name}": checkpoint},
                             f"adapter after step {step}"))

    push(1)
    deadline = time.monotonic() + 30
    while uploader.waiting is not None and time.monotonic() < deadline:  # the worker took it: held at the stand-in
        time.sleep(0.01)
    assert uploader.waiting is None
    push(2)
    push(3)
    hub.commits_open.set()
    assert uploader.finish(None) == []
    repository = hub.repos["me/x"]
    assert repository.commits == ["adapter after step 1", "adapter after step 3"]
    assert repository.files["adapter_model.safetensors"] == b"weights 3"
    for step in (1, 2, 3):
        assert repository.files[f"checkpoints/step-{step:06d}/trainer_state.pt"] == f"state {step}".encode()
    assert not list(tmp_path.glob(".hub-upload-*"))


@pytest.mark.parametrize("strategy", ["checkpoint", "all_checkpoints"])
def test_whole_checkpoints_go_up_and_a_run_resumes_from_the_hub_s_copy_as_from_its_own(hub, tmp_path, capsys,
                                                                                      strategy):
    """hub_strategy checkpoint: each checkpoint to last-checkpoint/ (the newest, the final one at the end);
    all_checkpoints: each to checkpoints/step-NNNNNN/, those checkpoint.keep rotated away locally included. The
    oracle for what went up: a run resumed from a download of it trains what a run resumed from the local
    checkpoint trains, bit for bit."""
    output_dir = tmp_path / "run"
    argv = tiny_run_argv(output_dir, "--checkpoint.every=1", "--checkpoint.keep=1", "--checkpoint.hub_model_id=me/c",
                         f"--checkpoint.hub_strategy={strategy}")
    assert driver.train.main(argv) == 0
    printed = " ".join(capsys.readouterr().out.split())
    files = hub.repos["me/c"].files
    folder = "last-checkpoint" if strategy == "checkpoint" else "checkpoints/step-000004"
    assert f"itself in {folder.split('/')[0]}/" in printed
    if strategy == "all_checkpoints":  # every one, though only the newest is kept here
        assert {name.split("/")[1] for name in files if name.startswith("checkpoints/")} == {
            f"step-{step:06d}" for step in (1, 2, 3, 4)}
    local = output_dir / CHECKPOINTS / "step-000004"
    assert {name.removeprefix(folder + "/") for name in files if name.startswith(folder + "/")} == {
        path.relative_to(local).as_posix() for path in local.rglob("*") if path.is_file()}
    downloaded = tmp_path / "downloaded"  # what `hf download me/c --include "<folder>/*"` writes
    for name, content in files.items():
        if name.startswith(folder + "/"):
            (downloaded / name).parent.mkdir(parents=True, exist_ok=True)
            (downloaded / name).write_bytes(content)

    resumed = {}
    for source, checkpoint in (("hub", downloaded / folder), ("local", local)):
        again = tmp_path / f"from-{source}"
        assert driver.train.main(tiny_run_argv(again, f"--checkpoint.resume={checkpoint}", "--train.steps=6",
                                               push=False)) == 0
        resumed[source] = (again / "adapter" / "adapter_model.safetensors").read_bytes()
    assert resumed["hub"] == resumed["local"]
