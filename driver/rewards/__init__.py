"""Rewards and advantages: the reward functions named in the config (`functions`: TRL's signature,
called per group), the worker pool that scores groups off the trainer's thread (`pool`, `worker`,
`group_scorer`), and the advantages computed from them (`advantages`: weighted sum, then centred and
scaled within each prompt's group).

Interface: `scorer.Scorer`, what scores a step's groups whatever the algorithm: `submit_group`,
`wait(group_ids)` -> a `pool.RewardResult` per group, `advantages(groups)`; `group_scorer.GroupScorer`
is GRPO's (EBFT's is driver/ebft/structured.py's FeatureScorer); `functions.RewardFunction`, what a
config's reward function is (TRL's signature); `builtin`, the task-independent rewards that come with the
driver (DAPO's soft overlong punishment). Depends on config, cli and data.
"""
