"""Episodes in the rollout producer: one sample is one episode, the model's turns and the environment's
messages as one token sequence, generated turn by turn as continuations.

When a sample's turn ends (the engine's "stop"), `EpisodeRunner.turn_ended` steps the sample's
environment on it. If the episode goes on, the environment's messages are rendered with the chat
template and appended to the sample's tokens as an environment span (loss mask 0, sampling logprob 0,
no adapter version), and the sample is marked "partial", so the producer's next round continues it
from its token ids exactly as it continues a partial rollout: nothing is decoded and re-tokenized,
the trainer scores the very tokens the engine saw. The episode ends when the environment says so,
after environment.max_turns model turns, or when its tokens (the environment's included) would pass
rollout.sampling.max_tokens: then it is truncated ("length"), as a single-turn completion is.

The environment's tokens after a model turn come from TRL's construction: the chat template's
rendering of a dummy exchange with and without the messages, the common part cut at its last EOS
(templates end an assistant turn with the EOS token, which the model sampled itself).

Environments are Python objects the checkpoint does not hold: an episode still running when a run
resumes gets a fresh environment, reset on its row and stepped on the turns recorded in the sample,
which restores any environment whose answers depend only on what it was told.
"""

from __future__ import annotations

from driver.config import Config
from driver.data.records import Episode, Group, Sample
from driver.environments.base import Environment, EnvironmentFactory, ModelTurn


class EpisodeRunner:
    def __init__(self, config: Config, tokenizer, factory: EnvironmentFactory, tools: list[dict]) -> None:
        self.tokenizer, self.factory, self.tools = tokenizer, factory, tools
        self.max_turns = config.environment.max_turns
        self.template_kwargs = dict(config.data.chat_template_kwargs)
        self._live: dict[tuple[int, int], Environment] = {}  # (group id, sample index) -> its environment

    def turn_ended(self, group: Group, index: int, max_tokens: int) -> None:
        """Sample `index` of the group finished a generation call: step its environment when its turn is over
        (not when the producer's round budget only paused it) and append the answer, or end the episode."""
        sample = group.samples[index]
        if sample.finish_reason == "partial":
            return
        episode = sample.episode if sample.episode is not None else Episode()
        sample.episode = episode
        environment = self._environment(group, index)
        turn = self._last_turn(sample)
        episode.turns += 1
        if sample.finish_reason == "length":  # the episode's token budget ran out inside the model's turn
            episode.messages.append({"role": "assistant", "content": turn.text})
            return self._close(group, index)
        result = environment.step(turn)
        episode.messages.append(result.assistant or {"role": "assistant", "content": turn.text})
        episode.tool_calls += result.tool_calls
        episode.tool_failures += result.tool_failures
        if result.done or not result.messages:
            episode.done, episode.reward = True, result.reward
            return self._close(group, index)
        if episode.turns >= self.max_turns:
            return self._close(group, index)
        answer = self.environment_tokens(result.messages)
        if len(sample.token_ids) + len(answer) >= max_tokens:  # no room for the answer and another turn
            sample.finish_reason = "length"
            return self._close(group, index)
        start = len(sample.token_ids)
        sample.token_ids = sample.token_ids + answer
        sample.logprobs = sample.logprobs + [0.0] * len(answer)
        episode.environment_spans.append((start, start + len(answer)))
        episode.messages.extend(result.messages)
        sample.finish_reason = "partial"  # the producer continues it: the model's next turn

    def environment_tokens(self, messages: list[dict]) -> list[int]:
        """The token ids the chat template puts after a model turn for the environment's messages, ending
        with the generation prompt of the model's next turn."""
        exchange = [{"role": "user", "content": "dummy"}, {"role": "assistant", "content": ""}]
        if messages[0]["role"] == "tool":  # some templates (GPT-OSS) head a tool result with the call's name
            exchange[1]["tool_calls"] = [{"type": "function", "function": {"name": messages[0].get("name", "tool"),
                                                                           "arguments": {}}}]
        prefix = self._render(exchange, generation_prompt=False)
        full = self._render(exchange + messages, generation_prompt=True)
        eos = self.tokenizer.eos_token_id
        ends = [position for position, token in enumerate(prefix) if token == eos]
        if ends:  # the model's own turn ended at its EOS: what the template adds after it is the environment's
            prefix = prefix[: ends[-1] + 1]
        if full[: len(prefix)] != prefix:
            raise ValueError("the chat template renders a conversation's start differently once messages follow it; "
                             "environment turns cannot be appended token by token with this template")
        return full[len(prefix):]

    def _render(self, messages: list[dict], generation_prompt: bool) -> list[int]:
        return list(self.tokenizer.apply_chat_template(messages, add_generation_prompt=generation_prompt,
                                                       return_dict=True, tools=self.tools or None,
                                                       **self.template_kwargs)["input_ids"])

    def _last_turn(self, sample: Sample) -> ModelTurn:
        spans = sample.episode.environment_spans if sample.episode is not None else []
        start = spans[-1][1] if spans else 0
        ids = sample.token_ids[start:]
        return ModelTurn(text=self.tokenizer.decode(ids, skip_special_tokens=True),
                         raw_text=self.tokenizer.decode(ids, skip_special_tokens=False), token_ids=list(ids),
                         finish_reason=sample.finish_reason)

    def _environment(self, group: Group, index: int) -> Environment:
        key = (group.group_id, index)
        if key not in self._live:
            environment = self.factory()
            environment.reset(group.prompt.columns)
            self._replay(environment, group.samples[index])
            self._live[key] = environment
        return self._live[key]

    def _replay(self, environment: Environment, sample: Sample) -> None:
        """A resumed episode: step a fresh environment on the model turns recorded before this one."""
        episode = sample.episode
        if episode is None or not episode.environment_spans:
            return
        # Model turn k runs from the end of the environment span before it (or 0) to the start of span k.
        turn_starts = [0] + [end for _, end in episode.environment_spans[:-1]]
        for turn_start, (turn_end, _) in zip(turn_starts, episode.environment_spans):
            ids = sample.token_ids[turn_start:turn_end]
            environment.step(ModelTurn(self.tokenizer.decode(ids, skip_special_tokens=True),
                                       self.tokenizer.decode(ids, skip_special_tokens=False), list(ids), "stop"))

    def _close(self, group: Group, index: int) -> None:
        self._live.pop((group.group_id, index), None)

    def forget(self, group_ids: set[int]) -> None:
        """Groups dropped unfinished (stale): their environments go."""
        for key in [key for key in self._live if key[0] in group_ids]:
            del self._live[key]


def episode_stats(groups: list[Group]) -> dict[str, float]:
    """The step's episodes: model turns per episode, TRL's tools/call_frequency (calls per episode) and
    tools/failure_frequency (failed calls per call), the fraction the environment ended (the others hit
    environment.max_turns or the token budget), the environment's tokens per episode and the fraction of NeMo Gym
    episodes cut at a prefix mismatch. {} without episodes."""
    episodes = [sample.episode for group in groups for sample in group.samples if sample.episode is not None]
    if not episodes:
        return {}
    calls = sum(episode.tool_calls for episode in episodes)
    return {
        "episodes/turns_mean": sum(episode.turns for episode in episodes) / len(episodes),
        "episodes/turns_max": float(max(episode.turns for episode in episodes)),
        "episodes/done_fraction": sum(episode.done for episode in episodes) / len(episodes),
        "episodes/environment_tokens_mean": sum(end - start for episode in episodes
                                                for start, end in episode.environment_spans) / len(episodes),
        # NeMo Gym /run episodes cut where a later prompt re-rendered earlier turns (nemo_gym_episode.py)
        "episodes/prefix_mismatch_fraction": sum(episode.prefix_mismatch for episode in episodes) / len(episodes),
        "tools/call_frequency": calls / len(episodes),
        "tools/failure_frequency": sum(episode.tool_failures for episode in episodes) / calls if calls else 0.0,
    }
