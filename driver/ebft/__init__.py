"""EBFT (energy-based fine-tuning, https://arxiv.org/abs/2603.12248): rewards by feature matching
against a ground truth instead of reward functions. Features are the frozen base network's hidden
states (`features`); rewards and advantages come from matching each prompt's samples against its
ground truth (`rewards`, `advantages`). Structured mode samples whole completions with the engine,
as GRPO does (`structured`); strided mode samples blocks in the trainer itself (`strided*`).

Interface: `structured.FeatureScorer`, a driver/rewards/scorer.py Scorer (registered as the ebft
algorithm in driver/algorithms.py); `strided.StridedSource` (the rollouts interface) and
`strided_update.optimize_strided` for strided mode; `transforms` for chat datasets. Depends on the
shared packages, never the reverse.
"""
