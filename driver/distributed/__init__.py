"""Training under torchrun, the bottom layer every other package may use: who we are and the
collectives the driver issues (`world`), FSDP2 sharding of the policy and its optimizer's checkpoints (`fsdp`),
and optimizer state saved before the no-decay param group, resumable into it in one process or under torchrun
(`no_decay_group`). The rollout side of torchrun (rank 0 generates, every rank trains its share) is
driver/rollouts/distributed_feed.py.

Interface: `world.world()` / `init_world()` / `broadcast` / `scatter` / `reduce_metrics`;
`fsdp.shard_policy`; `no_decay_group.split_saved_group`. Depends on metrics only.
"""
