"""Checkpoints written before the driver became packages pickled prompts and sample groups under
their old modules (driver.data, driver.rollout.records): they still load, to the same objects."""

import pickle

import pytest
import torch

from driver.checkpoint import load_state
from driver.data.prompts import Prompt
from driver.data.records import Group, Sample, Span


def old_names(data: bytes) -> bytes:
    """A protocol-0 pickle as the previous layout wrote it: the classes under their old modules."""
    data = data.replace(b"cdriver.data.records\n", b"cdriver.rollout.records\n")
    return data.replace(b"cdriver.data.prompts\n", b"cdriver.data\n")


def test_a_checkpoint_naming_the_old_modules_resumes(tmp_path):
    prompt = Prompt(index=3, text="count", token_ids=[1, 2], columns={"answer": "7"})
    group = Group(group_id=5, prompt=prompt, samples=[Sample(token_ids=[4], logprobs=[-0.5], finish_reason="partial",
                                                            spans=[Span(0, 1, 2)])])
    state = {"producer": {"in_flight": [group], "front": [(prompt, 1)]}}
    path = tmp_path / "trainer_state.pt"
    torch.save(state, path, pickle_protocol=0, _use_new_zipfile_serialization=False)
    raw = path.read_bytes()
    assert b"cdriver.rollout.records\n" in old_names(raw)
    path.write_bytes(old_names(raw))
    loaded = load_state(path)
    assert loaded["producer"]["in_flight"][0] == group
    assert loaded["producer"]["front"][0] == (prompt, 1)
    assert isinstance(loaded["producer"]["in_flight"][0].prompt, Prompt)


def test_the_old_names_are_gone():
    """The shim is needed: the old modules do not exist any more."""
    for module in ("driver.rollout.records", "driver.data"):
        with pytest.raises((ModuleNotFoundError, AttributeError)):
            pickle.loads(b"c" + module.encode() + b"\nGroup\n.")
