"""Every batch source the loop takes batches from has the BatchSource interface (driver/rollouts/source.py)."""

import pytest

from driver.ebft.strided import StridedSource
from driver.rollouts.distributed_feed import FollowerFeed, LeaderFeed
from driver.rollouts.feed import Rollouts
from driver.rollouts.source import BatchSource


@pytest.mark.parametrize("source", [Rollouts, LeaderFeed, FollowerFeed, StridedSource])
def test_every_source_implements_the_interface(source):
    assert issubclass(source, BatchSource), f"{source.__name__} lacks part of BatchSource"


def test_a_class_without_push_is_no_source():
    class NoPush:
        def next_batch(self, step, abandon=None): ...
        def state_dict(self): ...
        def close(self): ...

    assert not issubclass(NoPush, BatchSource)
