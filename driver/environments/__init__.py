"""Environments: multi-turn episodes in which the model's turns alternate with an environment's answers
(tool results, user turns), the reward coming from reward functions or from the environment itself.

Interface: `base.Environment` (reset on a data row, step on each model turn -> `base.StepResult`), made
per episode by the factory the config names (`factory.make_factory`; built-ins `tools.ToolEnvironment`
and `conversation.ConversationEnvironment`); `episodes.EpisodeRunner`, which the rollout producer calls
when a sample's turn ends and which keeps the token bookkeeping (environment tokens carry no loss);
`rewards.environment_reward`, the reward function that passes the environment's reward on;
`nemo_gym_episode.episode_from_run`, a NeMo Gym agent's /run answer as one sample (played by
driver/rollouts/agent_runs.py). Depends on
config, cli and data only; the rollouts and the trainer use it.
"""
