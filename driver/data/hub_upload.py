"""checkpoint.push_to_hub: the trained adapter (under full fine-tuning the model) uploaded to a Hugging Face Hub
repository, as TRL's push_to_hub / hub_model_id / hub_strategy / hub_private_repo do.

The repository is created (or found) before the model loads, so a missing token, HF_HUB_OFFLINE or a name the
token cannot write stops the run at its start, not after hours of training. hub_strategy end uploads the final
adapter once the run ends (with eval.save_best, the best evaluation's adapter goes to best/ in the same commit);
every_save also uploads each checkpoint's adapter as it is saved, from a background thread (training does not
wait; a newer save folds in one still waiting, replacing what both upload). checkpoint and all_checkpoints (as
transformers names them) upload the whole checkpoint with it, to last-checkpoint/ (each replacing the files of
the one before, and deleting what the newer one lacks, say a rank's optimizer shard of a run at another world
size, so a download is the checkpoint as saved) or to checkpoints/step-NNNNNN/ as in output_dir: a run
resumes from a download of it (`hf download REPO --include "last-checkpoint/*" --local-dir DIR`, then
checkpoint.resume=DIR/last-checkpoint), on another machine once this one is gone. Each upload's README.md is a
model card (model_card). A failed upload never costs the run: everything is on disk, and the message says how to
upload it by hand. Only rank 0 talks to the Hub.
"""

from __future__ import annotations

import contextlib
import importlib
import os
import shutil
import tempfile
import threading
from dataclasses import dataclass, field
from pathlib import Path

from driver.cli import ConfigError
from driver.config import CheckpointConfig, Config, is_hub_id

BEST_FOLDER = "best"  # where eval.save_best's adapter goes in the repository
LAST_CHECKPOINT = "last-checkpoint"  # hub_strategy checkpoint's folder (transformers' name)
# Folders that hold a copy of one local directory, replaced at each upload: a file the newer copy lacks (an earlier
# checkpoint's replay state, a shard of a run at another world size) would otherwise stay there and be resumed from.
MIRRORED = (BEST_FOLDER, LAST_CHECKPOINT)
STAGING_PREFIX = ".hub-upload-"  # the background uploads' staging directories in output_dir


class HubUploadError(RuntimeError):
    """An upload failed (the run's files are all on disk): said in a line, the run's exit code 1."""


@dataclass(frozen=True)
class Upload:
    """Folders to commit at once: {folder in the repository ("" = its root): local directory}, and files written
    here instead of a folder's (the model card: {path in the repository: contents})."""
    folders: dict[str, Path]
    message: str
    files: dict[str, bytes] = field(default_factory=dict)


def create_repository(checkpoint: CheckpointConfig, output_dir: Path) -> str:
    """The repository's full id (user/name) once it exists; a ConfigError naming what is wrong otherwise."""
    from huggingface_hub import HfApi, constants, get_token
    from huggingface_hub.errors import HfHubHTTPError

    name = checkpoint.hub_model_id or output_dir.resolve().name  # TRL's default: output_dir's name
    if constants.HF_HUB_OFFLINE:
        raise ConfigError("checkpoint.push_to_hub: HF_HUB_OFFLINE is set; unset it, or push_to_hub: false and "
                          f"upload {output_dir} by hand later (`hf upload`)")
    if get_token() is None:
        raise ConfigError("checkpoint.push_to_hub: no Hugging Face token; log in (`hf auth login`) or set HF_TOKEN "
                          "to a token that can write to the Hub")
    try:
        url = HfApi().create_repo(name, private=checkpoint.hub_private_repo, exist_ok=True)
    except HfHubHTTPError as error:
        raise ConfigError(f"checkpoint.hub_model_id: the Hub refused to create or find {name} "
                          f"({hub_reason(error)})") from None
    except unreachable() as error:
        raise ConfigError(f"checkpoint.push_to_hub: the Hugging Face Hub ({constants.ENDPOINT}) could not be "
                          f"reached: {error}") from None
    return url.repo_id


def unreachable() -> tuple[type[BaseException], ...]:
    """The errors of a Hub that cannot be reached (refused, DNS, timeouts): the HTTP client's transport errors
    (huggingface_hub 1.x uses httpx, 2.x httpx2), which are no OSError."""
    errors: list[type[BaseException]] = [OSError]
    for client in ("httpx2", "httpx"):
        with contextlib.suppress(ImportError):
            errors.append(importlib.import_module(client).TransportError)
    return tuple(errors)


def hub_reason(error: Exception) -> str:
    """The Hub's answer in one line (the status and its message, without huggingface_hub's request ids)."""
    response = getattr(error, "response", None)
    status = f"HTTP {response.status_code}: " if response is not None else ""
    return status + str(error).splitlines()[0]


def upload(repo_id: str, job: Upload) -> None:
    """One commit with every file of job's folders; in a mirrored folder (last-checkpoint/, best/) it also deletes
    what an earlier upload left there and this one lacks."""
    from huggingface_hub import CommitOperationAdd, CommitOperationDelete, HfApi

    api = HfApi()
    files = {"/".join(filter(None, (folder, path.relative_to(local).as_posix()))): str(path)
             for folder, local in job.folders.items() for path in sorted(local.rglob("*")) if path.is_file()}
    files.update(job.files)
    stale = [path for folder in job.folders if folder in MIRRORED for path in remote_files(api, repo_id, folder)
             if path not in files]
    operations = [*(CommitOperationDelete(path_in_repo=path) for path in stale),
                  *(CommitOperationAdd(path_in_repo=name, path_or_fileobj=content) for name, content in files.items())]
    api.create_commit(repo_id, operations, commit_message=job.message)


def remote_files(api, repo_id: str, folder: str) -> list[str]:
    """The files under folder in the repository (its path from the root); none before the first upload there."""
    from huggingface_hub import RepoFile
    from huggingface_hub.errors import HfHubHTTPError

    try:
        return [entry.path for entry in api.list_repo_tree(repo_id, path_in_repo=folder, recursive=True)
                if isinstance(entry, RepoFile)]
    except HfHubHTTPError as error:
        if error.response is not None and error.response.status_code == 404:  # no such folder yet
            return []
        raise


def upload_commands(repo_id: str, folders: dict[str, Path]) -> str:
    """How to upload an Upload's folders by hand, an `hf upload` each (into its folder of the repository)."""
    return " and ".join(f"`hf upload {repo_id} {local}{' ' + folder if folder else ''}`"
                        for folder, local in folders.items())


def trained_upload(config: Config, repo_id: str, trained: Path, step: int, best: Path | None = None,
                   checkpoint: Path | None = None) -> Upload:
    """The trained adapter (or model) at the repository's root with its model card, eval.save_best's in best/, and
    with hub_strategy checkpoint or all_checkpoints the whole checkpoint (a directory of output_dir's) too."""
    folders = {"": trained, **({BEST_FOLDER: best} if best is not None else {}),
               **checkpoint_folder(config, checkpoint)}
    return Upload(folders, f"{trained.name} after step {step}",
                  {"README.md": model_card(config, repo_id, trained, step)})


def checkpoint_folder(config: Config, checkpoint: Path | None) -> dict[str, Path]:
    """The checkpoint's folder in the repository under hub_strategy checkpoint (last-checkpoint/) or all_checkpoints
    (where it sits in output_dir); none under end and every_save, or without a checkpoint."""
    strategy = config.checkpoint.hub_strategy
    if checkpoint is None:
        return {}
    if strategy == "checkpoint":
        return {LAST_CHECKPOINT: checkpoint}
    if strategy == "all_checkpoints":
        return {checkpoint.relative_to(config.output_dir).as_posix(): checkpoint}
    return {}


def model_card(config: Config, repo_id: str, trained: Path, step: int) -> bytes:
    """The repository's README.md: PEFT's metadata (base model, library, its tags; a whole model's own), pykernels'
    and the algorithm's tags (as TRL tags its uploads trl and grpo), how to load it and what trained it, in place
    of the template PEFT leaves unfilled."""
    import yaml

    saved = (trained / "README.md").read_text() if (trained / "README.md").is_file() else ""
    metadata: dict = (yaml.safe_load(saved.split("---")[1]) or {}) if saved.startswith("---") else {}
    adapter = (trained / "adapter_config.json").is_file()
    base = config.model.path if is_hub_id(config.model.path) else None
    metadata.setdefault("library_name", "peft" if adapter else "transformers")
    metadata.setdefault("pipeline_tag", "text-generation")
    tags = list(metadata.get("tags") or [])
    if base is None:  # a local or tiny base: PEFT named it by this machine's path, which means nothing on the Hub
        metadata.pop("base_model", None)
        tags = [tag for tag in tags if not str(tag).startswith("base_model:")]
    else:
        metadata["base_model"] = base
    metadata["tags"] = tags + [tag for tag in ("pykernels", config.algo.name, "qlora" if config.model.qlora else None)
                               if tag and tag not in tags]
    lora, algo, train = config.lora, config.algo, config.train
    what = (f"A LoRA adapter (r {lora.r}, alpha {lora.alpha:g} on {', '.join(lora.targets + lora.expert_targets)})"
            if adapter else "A fully fine-tuned model")
    on = f" for [{base}](https://huggingface.co/{base})" if base else ""
    loader = ("peft", "AutoPeftModelForCausalLM") if adapter else ("transformers", "AutoModelForCausalLM")
    rewards = [function.name or function.path or function.model for function in config.rewards.functions]
    reward_line = ", ".join(rewards) if rewards else "the algorithm's own (EBFT: feature matching)"
    nf4 = " on an NF4 (QLoRA) base" if config.model.qlora else ""
    lines = [f"# {repo_id.split('/')[-1]}", "",
             f"{what}{on}, trained with {algo.name.upper()} ({algo.loss_type} loss) for {step} steps by "
             f"pykernels{nf4}.",
             "", "## Use", "", "```python", f"from {loader[0]} import {loader[1]}", "",
             f'model = {loader[1]}.from_pretrained("{repo_id}")', "```", "", "## Training", "",
             f"- prompts: `{config.data.source}`",
             f"- rewards: {reward_line}",
             f"- {algo.num_generations} completions per prompt, {train.prompts_per_step} prompts per step, learning "
             f"rate {train.lr:g}, beta {algo.beta:g}",
             "- the whole configuration: `config.yaml` in the run's output directory"]
    front = yaml.safe_dump(metadata, sort_keys=False)
    return (f"---\n{front}---\n\n" + "\n".join(lines) + "\n").encode()


class HubUploader:
    """Rank 0's uploads to the run's repository: `push` hands one to the background thread (every_save; staged
    as hard links, so a checkpoint rotated away meanwhile is still whole), `finish` waits for it, uploads the
    final adapter and returns what failed."""

    def __init__(self, repo_id: str, output_dir: Path, each_save: bool) -> None:
        """each_save: every hub_strategy but end, whose one upload is finish's."""
        from huggingface_hub import constants

        self.repo_id = repo_id
        self.url = f"{constants.ENDPOINT.rstrip('/')}/{repo_id}"
        self.output_dir = output_dir
        self.failures: list[str] = []
        self.uploaded = False  # finish's upload (the final adapter) reached the Hub
        self.unsent: Upload | None = None  # finish's upload, when it failed: what to upload by hand
        self.condition = threading.Condition()
        self.waiting: tuple[Upload, list[Path]] | None = None  # staged, and its staging directories
        self.finishing = False
        for left in output_dir.glob(f"{STAGING_PREFIX}*"):  # a crashed run's staged upload: its hard links only
            shutil.rmtree(left, ignore_errors=True)
        self.thread = threading.Thread(target=self._work, name="hub-upload", daemon=True) if each_save else None
        if self.thread is not None:
            self.thread.start()

    @property
    def each_save(self) -> bool:
        """The training loop pushes each checkpoint (to the background thread, which only each_save has)."""
        return self.thread is not None

    def push(self, job: Upload) -> None:
        """Uploaded in the background; one still waiting is folded into this newer one: what both upload (the
        adapter, last-checkpoint/) is the newer's, and what the older alone uploads (all_checkpoints' checkpoint)
        goes with it."""
        staged, directory = stage(job, self.output_dir)
        directories = [directory]
        with self.condition:
            if self.waiting is not None:
                older, older_directories = self.waiting
                staged = Upload({**older.folders, **staged.folders}, staged.message, {**older.files, **staged.files})
                directories = older_directories + directories
            self.waiting = staged, directories
            self.condition.notify()

    def finish(self, job: Upload | None) -> list[str]:
        """Wait for the background upload, then upload `job` (the final adapter); the failures, a line each."""
        if self.thread is not None:
            with self.condition:
                self.finishing = True
                self.condition.notify()
            self.thread.join()
        if job is not None:
            self.uploaded = self._attempt(job)
            self.unsent = None if self.uploaded else job
        return self.failures

    def _work(self) -> None:
        while True:
            with self.condition:
                self.condition.wait_for(lambda: self.waiting is not None or self.finishing)
                if self.waiting is None:
                    return
                (job, directories), self.waiting = self.waiting, None
            self._attempt(job)
            for directory in directories:
                shutil.rmtree(directory, ignore_errors=True)

    def _attempt(self, job: Upload) -> bool:
        try:
            upload(self.repo_id, job)
        except Exception as error:  # noqa: BLE001 - any failure is reported; the run's files are on disk
            self.failures.append(f"{job.message}: {hub_reason(error)}")
            return False
        return True


def stage(job: Upload, output_dir: Path) -> tuple[Upload, Path]:
    """The job's folders hard-linked (copied where links are impossible) into a directory of output_dir's."""
    directory = Path(tempfile.mkdtemp(prefix=STAGING_PREFIX, dir=output_dir))
    folders = {}
    for index, (folder, local) in enumerate(job.folders.items()):
        shutil.copytree(local, directory / str(index), copy_function=link_or_copy)
        folders[folder] = directory / str(index)
    return Upload(folders, job.message, job.files), directory


def link_or_copy(source: str, target: str) -> None:
    try:
        os.link(source, target)
    except OSError:
        shutil.copy2(source, target)
