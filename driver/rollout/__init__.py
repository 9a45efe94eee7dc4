"""Generation backends (vLLM in-process or as a server) behind one interface (rollout/base.py)."""

from __future__ import annotations

from driver.config import Config
from driver.rollout.base import Completion, Generator, SyncError


def make_generator(config: Config, model_dir: str) -> Generator:
    if config.rollout.backend == "colocate":
        from driver.rollout.colocate import ColocatedGenerator

        return ColocatedGenerator(config, model_dir)
    from driver.rollout.server import ServerGenerator

    return ServerGenerator(config, model_dir)


__all__ = ["Completion", "Generator", "SyncError", "make_generator"]
