"""Training under torchrun, the bottom layer every other package may use: who we are and the
collectives the driver issues (`world`), and FSDP2 sharding of the policy (`fsdp`). The rollout
side of torchrun (rank 0 generates, every rank trains its share) is driver/rollouts/distributed_feed.py.

Interface: `world.world()` / `init_world()` / `broadcast` / `scatter` / `reduce_metrics`;
`fsdp.shard_policy`. Depends on metrics only.
"""
