"""A Hugging Face Hub cache laid out as huggingface_hub writes it (models--org--name/snapshots/<commit>,
refs/<branch> holding the commit), filled with a tiny model's files, for runs that name a Hub model id
without a connection (HF_HUB_OFFLINE=1): the real huggingface_hub resolves it."""

from __future__ import annotations

import shutil
from pathlib import Path

from driver.data.tiny_model import resolve_model_path


def cache_with(cache: Path, repo_id: str, refs: dict[str, str], model: str = "tiny://qwen2") -> dict[str, Path]:
    """refs: branch or tag -> 40-hex commit; each commit's snapshot holds `model`'s files.
    Returns commit -> snapshot directory."""
    repo = cache / f"models--{repo_id.replace('/', '--')}"
    snapshots = {}
    for ref, commit in refs.items():
        snapshot = repo / "snapshots" / commit
        if not snapshot.exists():
            shutil.copytree(resolve_model_path(model), snapshot)
        snapshots[commit] = snapshot
        (repo / "refs").mkdir(parents=True, exist_ok=True)
        (repo / "refs" / ref).write_text(commit)
    return snapshots
