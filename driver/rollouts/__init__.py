"""Rollouts: what feeds the trainer one `batch.RolloutBatch` per step.

Generation jobs (`producer`: one per optimizer step, groups of samples tagged with the adapter
version that sampled them), run ahead by a background thread (`prefetch`) as far as the staleness
schedule allows (`schedule`), with partial rollouts, re-rolls of failed prompts (`reroll`) and a
replay buffer of high-signal groups (`replay`); `assemble` turns a job's scored groups into the
step's batch, zero-advantage rows filtered out (`filtering`), or only groups with signal kept and
more generated until the step is full (`dynamic_sampling`, DAPO). NeMo Gym agent episodes are played whole
by an agent server's /run instead of the engine's rounds (`agent_runs`). Under torchrun rank 0 runs all of
it and every rank trains its share (`distributed_feed`, `shard_batch`). `evaluation` samples and scores the eval
section's prompts with the adapter of a step, between jobs.

Interface: `source.BatchSource` (typed Protocol): `next_batch(step)`, `push(step)` (the engine serves
the new adapter), `evaluate(step)`, `state_dict()`, `close()`; implemented by `feed.Rollouts` and
`distributed_feed.LeaderFeed` / `FollowerFeed` (the same per rank), and by EBFT's strided source.
Depends on data, engine, rewards, policy and distributed.world.
"""
