"""Sharding a step's batch over torchrun ranks: the shards partition the rows by whole micro-batches,
carry the whole step's counts, and the sum of the ranks' gradients is the single-process gradient
(FSDP sums what the ranks compute: it averages, and the update multiplies by the world size), for
every loss type, filtered or not. The ranks are simulated in one process, one policy copy each."""

import copy

import pytest
import torch

from driver.config import Config
from driver.rollouts.filtering import check_counts, check_every_row_kept, filter_zero_advantage, step_counts
from driver.rollouts.shard_batch import shard_batch
from driver.update.optim import build_optimizer, build_scheduler
from driver.update.step import optimize
from tests.driver.rollouts.test_driver_filtering import LOSS_TYPES, make_base_policy, make_batch

ADVANTAGES = [0.0, 0.0, 0.9, -0.9, 0.0, 0.0, 1.3, 0.0, 0.4, -0.2, 0.0]  # 11 rows: uneven shards


@pytest.fixture(name="base_policy", scope="module")
def fixture_base_policy():
    """The policy of tests/driver/rollouts/test_driver_filtering.py's base_policy fixture."""
    return make_base_policy()


def test_shards_partition_the_rows_by_whole_micro_batches_and_keep_the_step_counts(base_policy):
    batch = make_batch(base_policy, ADVANTAGES, rows=11)
    counts = step_counts(batch, 3)  # micro-batches of rows [0:3) [3:6) [6:9) [9:11)
    shards = [shard_batch(batch, rank, 3, 3) for rank in range(3)]
    assert [s.completion_ids for s in shards] == [batch.completion_ids[0:3] + batch.completion_ids[9:11],
                                                  batch.completion_ids[3:6], batch.completion_ids[6:9]]
    for rank, shard in enumerate(shards):
        check_counts(shard)
        assert shard.counts.num_sequences == 11 and shard.counts.num_tokens == counts.num_tokens
        assert shard.counts.micro_batch_tokens == counts.micro_batch_tokens
        assert shard.counts.micro_batch_rows == [n if k % 3 == rank else 0
                                                 for k, n in enumerate(counts.micro_batch_rows)]
        assert shard.mask.shape[1] == max(len(c) for c in shard.completion_ids)
    torch.testing.assert_close(torch.cat([shards[0].advantages[:3], shards[1].advantages, shards[2].advantages,
                                          shards[0].advantages[3:]]), batch.advantages)
    with pytest.raises(ValueError, match="rank must lie in"):
        shard_batch(batch, 3, 3, 3)


def gradients(policy, batch, config):
    """The gradient optimize() computes for this batch (left on the parameters after the step)."""
    policy = copy.deepcopy(policy)
    optimizer = build_optimizer(policy.trainable_parameters(), config.train)
    optimize(config, policy, batch, optimizer, build_scheduler(optimizer, config.train, 10))
    return {n: p.grad.clone() for n, p in policy.model.named_parameters() if p.requires_grad}


@pytest.mark.parametrize("loss_type", LOSS_TYPES)
@pytest.mark.parametrize("world_size, micro_batch_size, filtered", [(2, 2, False), (3, 2, True), (2, 3, True)])
def test_the_ranks_gradients_sum_to_the_single_process_gradient(base_policy, loss_type, world_size,
                                                                micro_batch_size, filtered):
    config = Config.model_validate({"lora": {"r": 4}, "algo": {"loss_type": loss_type, "zero_advantage": "keep"},
                                    "train": {"micro_batch_size": micro_batch_size, "max_grad_norm": None}})
    batch = make_batch(base_policy, ADVANTAGES, rows=11)
    if filtered:
        batch, _ = filter_zero_advantage(batch, micro_batch_size, every_row=False)
    expected = gradients(base_policy, batch, config)
    total = None
    for rank in range(world_size):
        grads = gradients(base_policy, shard_batch(batch, rank, world_size, micro_batch_size), config)
        total = grads if total is None else {n: total[n] + g for n, g in grads.items()}
    for name, grad in expected.items():
        torch.testing.assert_close(total[name], grad, atol=1e-6, rtol=1e-4, msg=name)


def test_a_kl_term_s_check_on_filtering_reads_the_whole_batch_not_a_shard(base_policy):
    """A KL or entropy term acts on every row: filtering may drop only rows without loss tokens, which the check
    reads from the step's token count against the batch's. A rank's shard holds only its share of the tokens,
    so under torchrun rank 0 checks the whole batch before sharding it (driver/rollouts/distributed_feed.py) and
    the ranks' updates do not (tests/driver/distributed/test_driver_distributed_full_finetuning.py: beta > 0)."""
    batch = make_batch(base_policy, ADVANTAGES, rows=11)
    kept, _ = filter_zero_advantage(batch, 2, every_row=True)
    check_every_row_kept(kept, every_row=True)
    dropped, _ = filter_zero_advantage(batch, 2, every_row=False)
    check_every_row_kept(dropped, every_row=False)
    with pytest.raises(ValueError, match=r"zero-advantage filtered \(5 of 11 rows kept\) but the loss has a KL"):
        check_every_row_kept(dropped, every_row=True)
    with pytest.raises(ValueError, match="zero-advantage filtered"):  # what each rank's check used to see
        check_every_row_kept(shard_batch(kept, 0, 2, 2), every_row=True)
