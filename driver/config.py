"""The training config: one YAML file, validated by pydantic, every field with help and a default.

`python -m driver.train --help` prints every key below; `--section.key=value` overrides one.
"""

from __future__ import annotations

import math
import re
import warnings
from importlib.util import find_spec
from pathlib import Path
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator, model_validator


def schedule_staleness(depth: int, interval: int) -> int:
    """The largest staleness, in adapter versions, that generation with prefetch depth d and a sync
    every k steps produces by itself: d + k - 1 (driver/rollouts/schedule.py). Here, at the bottom
    of the layering, because it is also max_staleness's default."""
    return depth + interval - 1


CISPO_DEFAULT_EPSILON_MAX = 5.0  # ScaleRL's recommended cap for cispo (arXiv 2510.13786), TRL's docs' advice


DATA_FILE_FORMATS = {".jsonl": "json", ".json": "json", ".parquet": "parquet", ".csv": "csv"}  # -> `datasets` builder
HUB_ID = re.compile(r"^\w[\w.-]*/\w[\w.-]*$")  # org/name, as the Hub spells a repository (model or dataset)


def is_hub_id(path: str) -> bool:
    """`org/name` that is not a local path: a Hugging Face Hub repository id."""
    return bool(HUB_ID.match(path)) and not Path(path).exists()


# SamplingParams the engine sets per request or relies on: generation_kwargs may not override them.
DRIVER_OWNED_SAMPLING_KEYS = {"n", "seed", "logprobs", "prompt_logprobs", "max_tokens", "temperature", "detokenize",
                              "output_kind", "structured_outputs"}
# generate's warpers: with rollout.backend transformers the driver applies them itself, before recording logprobs.
TRANSFORMERS_WARPER_KEYS = {"top_k", "top_p", "min_p", "typical_p", "epsilon_cutoff", "eta_cutoff",
                            "repetition_penalty", "logits_processor"}
STRUCTURED_OUTPUT_KINDS = {"json", "regex", "choice", "grammar", "json_object", "structural_tag"}
FORMER_SYNC_VALUES = {"lora": "adapter", "weights": "merged"}  # rollout.sync -> rollout.weight_sync


class Section(BaseModel):
    model_config = ConfigDict(extra="forbid", validate_assignment=True)

    def off_default(self, keys) -> list[str]:
        """Which of `keys` hold other than their default: settings of a switch that is off are a mistake when
        set, and compared with the defaults, not "was it given", as a run's own config.yaml lists every key."""
        fields = type(self).model_fields
        return [key for key in keys if getattr(self, key) != fields[key].get_default(call_default_factory=True)]


class ModelConfig(Section):
    path: str = Field("tiny://qwen2", description="a Hugging Face Hub model id (org/name: fetched into the Hub's "
                      "cache on first use, HF_HUB_OFFLINE=1 uses the cache), a local model directory, or "
                      "tiny://qwen2 | tiny://qwen2-wide | tiny://llama | tiny://qwen3-moe | tiny://qwen3-moe-wide "
                      "for a tiny random model built locally (no download)")
    revision: str | None = Field(None, description="a Hub model's branch, tag or commit (TRL's model_revision, "
                                 "axolotl's revision_of_model); default: main")
    dtype: Literal["float32", "bfloat16", "float16"] = Field(
        "float32", description="dtype of the trainer's weights and of vLLM's; float16 trains with dynamic loss "
        "scaling (TRL's fp16: GradScaler's schedule, an update that overflows is skipped; driver/update/loss_scale.py)")
    adapter: Literal["lora", "none"] = Field(
        "lora", description="lora: train a LoRA adapter (lora section) on the frozen base; none: full fine-tuning of "
        "every weight (axolotl's adapter key absent, TRL without peft_config), dense models, one process or "
        "torchrun (FSDP2): the reference for beta > 0 and EBFT's feature network are a frozen copy (twice the "
        "weights in memory) and every sync pushes all weights")
    qlora: bool = Field(False, description="train on an NF4-quantized base (pykernels.nn.NF4Linear, MoE experts as "
                        "NF4ExpertWeight on the grouped kernels); vLLM "
                        "serves the bf16 base + adapter and importance sampling absorbs the difference")
    qlora_blocksize: int = Field(64, description="NF4 block size for qlora (power of two, 32..4096)")
    attention: Literal["sdpa", "eager", "flash_attention_2"] = Field(
        "sdpa", description="transformers attention backend of the trainer")
    device: str = Field("auto", description="where the trainer runs: auto (cuda if available, else cpu), cpu, "
                        "cuda, cuda:1, ...")
    gradient_checkpointing: bool = Field(False, description="recompute each decoder layer's activations in the "
                                         "backward instead of keeping them (transformers' non-reentrant "
                                         "checkpointing): less memory, one more forward per layer")
    disable_dropout: bool = Field(False, description="no dropout while training (TRL's disable_dropout): the "
                                  "model's dropout layers, its attention dropout (which TRL's leaves on) and LoRA's, "
                                  "so the training forward scores tokens as the frozen passes do; the saved "
                                  "config.json keeps its values")

    @field_validator("qlora_blocksize")
    @classmethod
    def _power_of_two_blocksize(cls, value: int) -> int:
        if value not in (32, 64, 128, 256, 512, 1024, 2048, 4096):
            raise ValueError("must be a power of two in [32, 4096]")
        return value


class LoraSettings(Section):
    r: int = Field(8, ge=1, description="LoRA rank")
    alpha: float = Field(16.0, gt=0, description="LoRA alpha (scaling = alpha / r, or alpha / sqrt(r) with rslora)")
    dropout: float = Field(0.0, ge=0, lt=1, description="dropout on the LoRA input")
    targets: list[str] = Field(
        ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"],
        description="module names to adapt (PEFT target_modules)")
    expert_targets: list[str] = Field(
        [], description="MoE expert parameters to adapt (PEFT target_parameters), e.g. "
        "['mlp.experts.gate_up_proj', 'mlp.experts.down_proj']")
    rslora: bool = Field(False, description="rank-stabilized scaling alpha / sqrt(r) (Kalajdzievski 2023)")
    init_from: str | None = Field(None, description="start from a trained PEFT LoRA adapter, e.g. an SFT run's (a "
                                  "local directory with adapter_config.json, or a Hub id; axolotl's lora_model_dir): "
                                  "its weights, and its r, alpha, rslora, targets and expert_targets, which this "
                                  "section need not repeat (a value given must agree). The KL reference stays the "
                                  "base without any adapter, as in TRL")


class DataConfig(Section):
    source: str = Field("toy:digits", description="toy:<name> for a built-in toy set (digits, digits-gt, "
                        "digits-chat), reasoning_gym:<task>[?size=500&seed=0&<config field>=...] for a "
                        "reasoning-gym task (docs/rewards.md), a local .jsonl / .json / .parquet / .csv file, a "
                        "local dataset directory, or a Hugging Face Hub dataset id (org/name), read with "
                        "`datasets` (its cache and HF_HUB_OFFLINE apply)")
    name: str | None = Field(None, description="the dataset's configuration (subset), e.g. main for openai/gsm8k")
    split: str = Field("train", description="the split of a dataset directory or Hub dataset")
    revision: str | None = Field(None, description="Hub dataset: a branch, tag or commit")
    prompt_field: str = Field("prompt", description="column holding the prompt (after the transform): text, or a "
                              "list of chat messages {role, content} rendered with the chat template")
    transform: str | None = Field(None, description="dotted path to fn(example: dict) -> dict (or a list of dicts: "
                                  "several rows) applied to every example, e.g. to build the prompt from other "
                                  "columns, or to axolotl's fn(cfg) -> (map_fn, {remove_columns: [...]}); chat "
                                  "data for ebft: driver.ebft.transforms.first_turn | last_turn | all_turns | "
                                  "last_turn_answer_only")
    chat_template: bool = Field(False, description="wrap prompts with the tokenizer's chat template")
    chat_template_kwargs: dict = Field({}, description="extra arguments of the chat template, e.g. "
                                       "{enable_thinking: false} for Qwen3 (TRL's chat_template_kwargs)")
    shuffle: bool = Field(True, description="shuffle the prompts every epoch (seeded)")
    max_prompt_length: int = Field(256, ge=1, description="prompts longer than this many tokens are cut from the left")

    def source_kind(self) -> str:
        """toy | reasoning_gym | file | directory | hub (what driver/data/sources.py loads); ValueError for
        anything else."""
        source = self.source
        if source.startswith("toy:"):
            return "toy"
        if source.startswith("reasoning_gym:"):
            if not source[len("reasoning_gym:"):].partition("?")[0]:
                raise ValueError("reasoning_gym: needs a task, e.g. reasoning_gym:basic_arithmetic")
            return "reasoning_gym"
        path = Path(source)
        if path.is_file():
            if path.suffix not in DATA_FILE_FORMATS:
                raise ValueError(f"{path} must end with one of {', '.join(DATA_FILE_FORMATS)}")
            return "file"
        if path.is_dir():
            return "directory"
        if path.suffix in DATA_FILE_FORMATS:
            raise ValueError(f"dataset file {source} does not exist")
        if HUB_ID.match(source):
            return "hub"
        raise ValueError(f"{source} is not a toy set, an existing dataset file or directory, or a Hub dataset id "
                         "(org/name)")


class RewardFunction(Section):
    path: str | None = Field(None, description="dotted path to fn(prompts, completions, **columns) -> "
                             "list[float | None] (plain or async def)")
    model: str | None = Field(None, description="instead of path: a sequence-classification reward model (local "
                              "directory or Hub id) whose first logit on prompt + completion is the reward, "
                              "scored in batches on the trainer's device (TRL's reward model reward_funcs)")
    kwargs: dict | None = Field(None, description="with path: path names a factory, called once with these "
                                "arguments to make the reward function (TRL's reward_funcs=[factory(...)]), e.g. "
                                "driver.rewards.builtin.get_soft_overlong_punishment with {max_completion_len: 256, "
                                "soft_punish_cache: 64}")
    batch_size: int = Field(16, ge=1, description="model: completions per forward pass")
    weight: float = Field(1.0, description="weight of this reward in the total")
    name: str | None = Field(None, description="name in the logs (default: the function's name, or the model "
                             "directory's name)")

    @model_validator(mode="after")
    def _path_or_model(self) -> RewardFunction:
        if (self.path is None) == (self.model is None):
            raise ValueError("give exactly one of path (a Python function) and model (a reward model)")
        if self.kwargs is not None and self.path is None:
            raise ValueError("kwargs are the arguments of the factory that path names; a reward model takes none")
        return self


class RewardsConfig(Section):
    functions: list[RewardFunction] = Field(
        [RewardFunction(path="driver.data.toy_tasks.digit_fraction")], description="reward functions")
    aggregation: Literal["sum_then_normalize", "normalize_then_sum"] = Field(
        "sum_then_normalize", description="weighted-sum the rewards then normalize per group, or normalize "
        "each reward per group then sum")
    reward_num_workers: int = Field(0, ge=0, description="score groups in this many spawned worker processes, "
                                    "in parallel with generation (0: in the trainer's main thread)")
    reward_timeout: float = Field(120.0, gt=0, description="seconds one group's reward call may take in a worker; "
                                  "a hung or crashed worker is replaced and the group retried once")

    @model_validator(mode="after")
    def _models_in_the_trainer(self) -> RewardsConfig:
        models = [f.model for f in self.functions if f.model is not None]
        if models and self.reward_num_workers:
            raise ValueError(f"reward models ({', '.join(models)}) score on the trainer's device, in its process: set "
                             "reward_num_workers: 0")
        return self


class SamplingConfig(Section):
    temperature: float = Field(1.0, gt=0, description="sampling temperature (also used to score the policy)")
    top_p: float = Field(1.0, gt=0, le=1, description="nucleus sampling")
    top_k: int = Field(-1, description="top-k sampling (-1: off)")
    max_tokens: int = Field(32, ge=1, description="maximum completion length in tokens")
    min_p: float = Field(0.0, ge=0, le=1, description="drop tokens less likely than min_p x the likeliest (0: off)")
    repetition_penalty: float = Field(1.0, gt=0, description="> 1 discourages tokens already in the prompt or the "
                                      "completion, < 1 encourages them (1: off)")
    stop: list[str] = Field([], description="strings that end a completion (the tokens up to and including the "
                            "one that completes the string are kept)")
    structured_outputs: dict | None = Field(
        None, description="constrained decoding, vLLM's StructuredOutputsParams: one of {regex: ...}, {json: "
        "<schema>}, {choice: [...]}, {grammar: <EBNF>} (TRL's vllm_structured_outputs_regex is {regex: ...})")
    generation_kwargs: dict = Field({}, description="more vLLM SamplingParams, passed through and overriding the "
                                    "keys above (e.g. presence_penalty, bad_words, stop_token_ids); not the ones the "
                                    "driver sets itself (n, seed, logprobs, max_tokens, temperature, detokenize)")

    @field_validator("generation_kwargs")
    @classmethod
    def _no_driver_owned_keys(cls, value: dict) -> dict:
        owned = sorted(set(value) & DRIVER_OWNED_SAMPLING_KEYS)
        if owned:
            raise ValueError(f"{', '.join(owned)} cannot be set here: the driver sets them (temperature: "
                             "rollout.sampling.temperature, which the trainer also scores with; max_tokens: "
                             "rollout.sampling.max_tokens)")
        return value

    @field_validator("structured_outputs")
    @classmethod
    def _one_constraint(cls, value: dict | None) -> dict | None:
        if value is None:
            return value
        constraints = sorted(set(value) & STRUCTURED_OUTPUT_KINDS)
        if len(constraints) != 1:
            raise ValueError(f"give exactly one of {', '.join(sorted(STRUCTURED_OUTPUT_KINDS))}, got "
                             f"{', '.join(constraints) or 'none'}")
        return value

    def engine_sampling(self, temperature: float | None = None) -> dict:
        """What vLLM's SamplingParams (and the server's completion request) take from this section, beyond
        n / seed / max_tokens / logprobs, which the engine sets per request; `temperature` replaces the
        section's (an evaluation's)."""
        temperature = self.temperature if temperature is None else temperature
        return {"temperature": temperature, "top_p": self.top_p, "top_k": self.top_k, "min_p": self.min_p,
                "repetition_penalty": self.repetition_penalty, "stop": list(self.stop) or None,
                **self.generation_kwargs}


class RolloutConfig(Section):
    backend: Literal["colocate", "server", "transformers"] = Field(
        "colocate", description="in-process vLLM engine, a vLLM OpenAI server, or transformers' generate on the "
        "trainer's own weights (no vLLM: TRL's use_vllm=False; one process, no async_prefetch)")
    server_url: str | list[str] | None = Field(
        None, description="server backend: URL of a running vLLM server (`python -m driver.vllm_serve cfg.yaml` "
        "starts one), or a list of URLs of data-parallel servers: each request goes to one of them, round-robin, "
        "and every sync loads the adapter into each; empty launches one on 127.0.0.1")
    api_key: str | None = Field(None, description="server backend: API key of the server")
    server_timeout: float = Field(600.0, gt=0, description="seconds to wait for a launched server to be healthy")
    request_timeout: float = Field(1800.0, gt=0, description="server backend: seconds one HTTP request to the server "
                                   "may take (a request carries a whole group's generation) before it is retried")
    max_retries: int = Field(3, ge=0, description="server backend: retries of a request that could not connect, timed "
                             "out or got HTTP 429 / 5xx, before the run stops with an error naming the server")
    retry_backoff: float = Field(1.0, ge=0, description="server backend: seconds before the first retry, doubled "
                                 "before each next one")
    gpu_memory_utilization: float = Field(0.3, gt=0, le=1, description="vLLM memory fraction (on CPU: of one "
                                          "NUMA node's memory)")
    max_model_len: int = Field(512, ge=16, description="vLLM context length")
    tensor_parallel_size: int = Field(1, ge=1, description="vLLM engine: GPUs each model replica is split across "
                                      "(CUDA only)")
    data_parallel_size: int = Field(1, ge=1, description="vLLM engine: model replicas in one server, each "
                                    "tensor_parallel_size GPUs (a launched or driver.vllm_serve server; CUDA only)")
    dtype: Literal["float32", "bfloat16", "float16"] | None = Field(
        None, description="vLLM engine: dtype of the served model (null: model.dtype; another dtype makes the sync "
        "check compare how the probe moves, not its values)")
    quantization: str | None = Field(
        None, description="vLLM engine: quantization of the served base, vLLM's --quantization (e.g. fp8: online "
        "FP8 of the bf16 weights; the accepted names are checked against the installed vLLM when it starts; the "
        "sync check then compares how the probe moves)")
    enforce_eager: bool = Field(False, description="vLLM engine: no CUDA graphs (slower decoding, less memory, "
                                "faster start)")
    enable_prefix_caching: bool | None = Field(None, description="vLLM engine: reuse the KV cache of shared prompt "
                                               "prefixes (null: vLLM's default, on)")
    max_num_seqs: int | None = Field(None, ge=1, description="vLLM engine: sequences in one engine batch at most "
                                     "(null: vLLM's default)")
    seed: int | None = Field(None, description="vLLM engine: its seed (null: train.seed); every request is seeded "
                             "from train.seed in any case")
    enable_sleep_mode: bool = Field(False, description="colocate on CUDA: after each generation vLLM sleeps (level "
                                    "1: weights to CPU memory, KV cache freed) while the trainer trains, and wakes "
                                    "before the next (TRL's vllm_enable_sleep_mode); not with async_prefetch, whose "
                                    "thread generates while the trainer trains")
    sampling: SamplingConfig = Field(default_factory=SamplingConfig, description="sampling parameters")
    weight_sync: Literal["auto", "adapter", "merged"] = Field(
        "auto", description="how vLLM serves the trained LoRA adapter: adapter loads each version as a LoRA adapter "
        "(vLLM's LoRA path at every token); merged writes base + scaling * B @ A into the engine's weights in place "
        "at every sync, always from the trainer's untouched base (TRL's way: no LoRA at generation, one version "
        "served at a time; a server reloads them from a file through /collective_rpc); auto: merged for a colocated "
        "float32 engine (exact there, and ~2x faster on 2 CPU cores) and for MoE on CPU, adapter otherwise "
        "(in bf16 a merged weight loses deltas below its rounding; servers, QLoRA, torchrun, sleep mode). Full "
        "fine-tuning always pushes whole weights")
    sync: Literal["auto", "lora", "weights"] | None = Field(
        None, description="former name of weight_sync (lora = adapter, weights = merged), still read")
    verify_sync: bool = Field(True, description="after every adapter sync, score a probe with vLLM and the "
                              "trainer and fail when vLLM still serves old weights")
    sync_tolerance: float = Field(1e-3, gt=0, description="float32 with a dense base: largest probe logprob "
                                  "difference between vLLM and the trainer at any version; other dtypes and QLoRA "
                                  "compare how the probe moved instead (driver/engine/sync_check.py), and this is "
                                  "the floor of their noise thresholds")
    vllm_sync_interval: int = Field(1, ge=1, description="push the adapter to vLLM every this many optimizer steps "
                                    "(samples are then up to interval - 1 versions older)")
    async_prefetch: bool = Field(False, description="generate the next batches in a background thread while the "
                                 "trainer updates (samples become up to prefetch_depth versions stale; importance "
                                 "sampling against the stored sampling logprobs corrects for it)")
    prefetch_depth: int = Field(1, ge=1, description="async_prefetch: batches generated ahead of the trainer")
    max_staleness: int | None = Field(None, ge=0, description="drop samples older than this many versions when "
                                      "trained on (default: what the schedule itself produces, prefetch_depth + "
                                      "vllm_sync_interval - 1 with async_prefetch, vllm_sync_interval - 1 without; "
                                      "+ 1 with partial rollouts, so a group may be continued once)")
    stale_policy: Literal["drop", "regenerate"] = Field(
        "regenerate", description="a too-stale group is dropped, or its prompt generated again with a newer adapter")
    partial_rollout_tokens: int | None = Field(
        None, ge=1, description="partial rollouts: generate at most this many tokens per sample per round; unfinished "
        "groups are continued from their token ids in later batches (with newer adapters) instead of holding "
        "this one back (null: off)")

    @field_validator("server_url")
    @classmethod
    def _http_urls(cls, value: str | list[str] | None) -> str | list[str] | None:
        urls = [value] if isinstance(value, str) else value or []
        if isinstance(value, list) and not value:
            raise ValueError("an empty list: give one URL or more, or null to launch a server")
        bad = [url for url in urls if not url.startswith(("http://", "https://"))]
        if bad:
            raise ValueError(f"{', '.join(bad)}: URLs start with http:// or https://")
        duplicates = sorted({url for url in urls if urls.count(url) > 1})
        if duplicates:
            raise ValueError(f"{', '.join(duplicates)} given twice: each server once")
        return value

    @model_validator(mode="before")
    @classmethod
    def _former_sync_name(cls, data: Any) -> Any:
        """sync (its former name) decides weight_sync when given; both given and different is an error."""
        if not isinstance(data, dict) or data.get("sync") in (None, "auto"):
            return data
        meant = FORMER_SYNC_VALUES.get(data["sync"])
        if meant is None:
            return data  # the field's own check names the allowed values
        given = data.get("weight_sync", "auto")
        if given not in ("auto", meant):
            raise ValueError(f"sync = {data['sync']} (the former name of weight_sync, = {meant}) and weight_sync = "
                             f"{given} disagree: give weight_sync alone")
        return {**data, "weight_sync": meant}

    def weight_sync_key(self) -> str:
        """'weight_sync = merged', or the former spelling when the config used it (for messages)."""
        return f"sync = {self.sync}" if self.sync not in (None, "auto") else f"weight_sync = {self.weight_sync}"

    @model_validator(mode="after")
    def _check_engine_options(self) -> RolloutConfig:
        """The combinations no engine can run (what this machine's devices allow is checked when the
        engine starts: driver/engine/options.py)."""
        if self.enable_sleep_mode and self.weight_sync == "merged":
            raise ValueError(f"enable_sleep_mode with {self.weight_sync_key()}: the merged weights are written into "
                             "the engine in place, which a sleeping engine cannot take; use weight_sync = adapter")
        if self.weight_sync == "merged" and self.backend == "colocate" and self.tensor_parallel_size > 1:
            raise ValueError(f"{self.weight_sync_key()} with tensor_parallel_size = {self.tensor_parallel_size}: the "
                             "merged weights go by reference into an engine running in this process, one worker; use "
                             "weight_sync = adapter, or backend = server")
        if self.backend == "transformers" and self.weight_sync != "auto":
            raise ValueError(f"{self.weight_sync_key()} with backend = transformers: it samples with the trainer's own "
                             "weights, there is nothing to sync (leave weight_sync at auto)")
        if self.data_parallel_size > 1 and self.backend == "colocate":
            raise ValueError(f"data_parallel_size = {self.data_parallel_size} needs backend = server (one in-process "
                             "engine serves a colocated run; a server runs the replicas)")
        if self.enable_sleep_mode and self.backend != "colocate":
            raise ValueError(f"enable_sleep_mode needs backend = colocate (got {self.backend}): it frees the colocated "
                             "engine's memory for the trainer; a server keeps its own GPUs")
        if self.enable_sleep_mode and self.async_prefetch:
            raise ValueError("enable_sleep_mode with async_prefetch: the prefetch thread generates while the trainer "
                             "trains, so the engine is never idle to sleep; turn one off")
        if self.backend == "transformers":
            engine_only = [key for key, on in (("tensor_parallel_size", self.tensor_parallel_size > 1),
                                               ("data_parallel_size", self.data_parallel_size > 1),
                                               ("quantization", self.quantization is not None)) if on]
            if engine_only:
                raise ValueError(f"{', '.join(engine_only)}: vLLM engine options, not used by backend = transformers")
        return self

    def server_urls(self) -> list[str]:
        """server_url as a list, each without a trailing / or /v1 (the OpenAI client's spelling: every
        path the driver requests starts with /v1)."""
        urls = [self.server_url] if isinstance(self.server_url, str) else self.server_url or []
        return [url.rstrip("/").removesuffix("/v1") for url in urls]


class ImportanceSamplingConfig(Section):
    level: Literal["token", "sequence_product", "none"] = Field(
        "token", description="correct for the gap between vLLM's sampling logprobs and the trainer's: per token, "
        "by the product of the sequence's token ratios on all its tokens (TRL's vllm_importance_sampling_mode "
        "sequence_*, not GSPO's importance_sampling_level), or not at all")
    mode: Literal["truncate", "mask"] = Field("truncate", description="ratios above cap are truncated to cap, or "
                                               "masked (weight 0)")
    cap: float = Field(2.0, gt=0, description="the cap C on importance ratios")
    cap_min: float | None = Field(None, ge=0, description="two-sided: ratios below this are raised to it "
                                  "(truncate) or masked (mask; IcePop) as well (TRL's "
                                  "vllm_importance_sampling_clip_min; null: one-sided)")

    @model_validator(mode="after")
    def _check_range(self) -> ImportanceSamplingConfig:
        if self.cap_min is not None and self.cap_min >= self.cap:
            raise ValueError(f"cap_min = {self.cap_min} must be below cap = {self.cap}")
        return self

    @field_validator("level", mode="before")
    @classmethod
    def _renamed_level(cls, value):
        if value == "sequence":  # renamed: TRL's importance_sampling_level="sequence" is GSPO, another thing
            raise ValueError("'sequence' is now called 'sequence_product' (the product of the token ratios "
                             "vLLM-vs-trainer); TRL's importance_sampling_level='sequence' (GSPO, the geometric "
                             "mean of the policy ratio) is a different method, not supported here")
        return value


def merged_zero_advantage_keys(data: dict) -> dict:
    """algo.filter_zero_advantage and algo.skip_zero_advantage (until 2026-11) were two keys for one idea,
    now algo.zero_advantage: the old keys keep working, with one warning giving the new spelling."""
    old = {"filter_zero_advantage", "skip_zero_advantage"} & data.keys()
    if not old:
        return data
    if "zero_advantage" in data:
        raise ValueError(f"zero_advantage replaces {' and '.join(sorted(old))}: give it alone")
    data = dict(data)
    flags = {key: data.pop(key, True) for key in ("filter_zero_advantage", "skip_zero_advantage")}
    if not all(isinstance(flag, bool) for flag in flags.values()):
        raise ValueError(f"{' and '.join(sorted(old))} must be true or false (now: zero_advantage)")
    data["zero_advantage"] = ("filter" if flags["filter_zero_advantage"]
                              else "skip" if flags["skip_zero_advantage"] else "keep")
    warnings.warn(f"algo.{' / algo.'.join(sorted(old))} is now algo.zero_advantage: {data['zero_advantage']} "
                  "(the old keys will go away)", FutureWarning, stacklevel=2)
    return data


class AlgoConfig(Section):
    name: Literal["grpo", "ebft"] = Field("grpo", description="grpo: verifiable rewards (rewards section); ebft: "
                                          "energy-based fine-tuning, feature matching against each prompt's "
                                          "ground truth (ebft section; arXiv 2603.12248)")
    num_generations: int = Field(8, ge=1, description="completions per prompt (the group; grpo needs >= 2, "
                                 "ebft allows 1 with advantage_estimator reinforce)")
    loss_type: Literal["grpo", "bnpo", "dr_grpo", "dapo", "cispo", "sapo", "luspo", "vespo"] = Field(
        "dapo", description="the clipped surrogate normalized per sequence (grpo), per token in the micro-batch "
        "(bnpo), by batch x max length (dr_grpo), per token in the whole step (dapo), or per sequence times its "
        "length (luspo, with importance_sampling_level sequence); cispo: REINFORCE weighted by the ratio capped at "
        "epsilon_high (MiniMax-M1); sapo: a sigmoid gate instead of the clip; vespo: a gamma weight of the "
        "sequence ratio (as TRL)")
    importance_sampling_level: Literal["token", "sequence"] = Field(
        "token", description="the policy ratio per token, or per sequence as the geometric mean of its token ratios "
        "(GSPO, arXiv 2507.18071); not the engine-vs-trainer correction (algo.importance_sampling)")
    epsilon: float = Field(0.2, ge=0, description="lower clip range of the policy ratio")
    epsilon_high: float | None = Field(None, description="upper clip range (default: epsilon; DAPO uses 0.28); "
                                       "cispo: the cap on the ratio itself (default 5.0, ScaleRL's)")
    delta: float | None = Field(None, gt=1, description="two-sided clipping: the unclipped ratio is also capped "
                                "at delta, so negative-advantage tokens cannot push it without bound (INTELLECT-2; "
                                "use > 1 + epsilon_high; null: off)")
    sapo_temperature_pos: float = Field(1.0, gt=0, description="sapo: gate temperature of positive advantages")
    sapo_temperature_neg: float = Field(1.05, gt=0, description="sapo: gate temperature of other advantages")
    vespo_k_pos: float = Field(2.0, description="vespo: power k of the gamma weight, non-negative advantages")
    vespo_lambda_pos: float = Field(3.0, gt=0, description="vespo: decay lambda, non-negative advantages")
    vespo_k_neg: float = Field(3.0, description="vespo: power k of the gamma weight, negative advantages")
    vespo_lambda_neg: float = Field(2.0, gt=0, description="vespo: decay lambda, negative advantages")
    beta: float = Field(0.0, ge=0, description="KL coefficient against the base model (adapter disabled)")
    kl_estimator: Literal["k1", "k2", "k3"] = Field(
        "k3", description="per-token KL(policy || base) estimator (Schulman 2020): k1 = log(p/ref), k2 = "
        "log(p/ref)^2 / 2, k3 = ref/p - log(ref/p) - 1 (TRL's)")
    use_bias_correction_kl: bool = Field(False, description="multiply each token's KL term by its policy ratio "
                                         "pi / pi_old (the token's, or GSPO's sequence ratio), unclipped and with its "
                                         "gradient: the importance-corrected KL estimate of DeepSeek-V3.2 (TRL's "
                                         "use_bias_correction_kl)")
    kl_in_reward: bool = Field(False, description="apply beta as a KL penalty in the reward instead of a loss term "
                               "(verl's use_kl_in_reward): each completion's reward minus beta x the sum over its "
                               "tokens of kl_estimator(policy || base), before advantages")
    mask_truncated_completions: bool = Field(
        False, description="completions cut at max_tokens (no end of sequence) carry no loss (DAPO); their rewards "
        "still count in their group's advantages")
    top_entropy_quantile: float = Field(
        1.0, ge=0, le=1, description="train the policy term only on the tokens whose entropy is in this top "
        "quantile of the micro-batch's tokens (per rank; Beyond the 80/20 rule recommends 0.2; 1: all)")
    entropy_coef: float = Field(0.0, ge=0, description="entropy bonus: the loss minus entropy_coef x the mean "
                                "token entropy (the kept tokens' with top_entropy_quantile); with "
                                "use_adaptive_entropy, the coefficient it starts from")
    sync_ref_model: bool = Field(False, description="TR-DPO's moving reference (TRL's sync_ref_model): every "
                                 "ref_model_sync_steps optimizer updates the KL reference becomes "
                                 "ref_model_mixup_alpha x the policy + (1 - alpha) x itself; full fine-tuning with "
                                 "beta > 0 (with an adapter the reference is the base with the adapter off, and TRL "
                                 "refuses it too)")
    ref_model_mixup_alpha: float = Field(0.6, ge=0, le=1, description="sync_ref_model: the policy's share of the "
                                         "new reference")
    ref_model_sync_steps: int = Field(512, ge=1, description="sync_ref_model: optimizer updates between syncs")
    use_adaptive_entropy: bool = Field(False, description="Skywork-OR1's entropy control (TRL's): after each "
                                       "optimizer update the coefficient moves by entropy_coef_delta, up while the "
                                       "update's mean token entropy is at or below entropy_target, down otherwise, "
                                       "within [entropy_coef_min, entropy_coef_max]; the bonus applies only while "
                                       "the last update's entropy was at or below the target")
    entropy_coef_min: float = Field(0.0, ge=0, description="use_adaptive_entropy: the coefficient's lower bound")
    entropy_coef_max: float = Field(1.0, ge=0, description="use_adaptive_entropy: the coefficient's upper bound")
    entropy_coef_delta: float = Field(0.005, ge=0, description="use_adaptive_entropy: the step of the coefficient "
                                      "per optimizer update")
    entropy_target: float = Field(0.2, ge=0, description="use_adaptive_entropy: the mean token entropy (nats) "
                                  "below which the bonus applies and grows")
    advantage_estimator: Literal["grpo", "rloo", "reinforce_plus_plus", "reinforce_plus_plus_baseline"] = Field(
        "grpo", description="grpo: the group mean subtracted, scaled by scale_rewards; rloo: r minus the mean of the "
        "group's other rewards; reinforce_plus_plus: rewards whitened over the batch's tokens, no group baseline; "
        "reinforce_plus_plus_baseline: the group mean subtracted, then whitened over the batch's tokens (as verl)")
    num_iterations: int = Field(1, ge=1, description="optimizer passes over each rollout batch (mu)")
    steps_per_generation: int = Field(
        1, ge=1, description="optimizer steps per generated batch, each on its own part of it (TRL's; the parts "
        "are runs of whole micro-batches, as even as they divide, each normalized alone; old logprobs from before "
        "the first); a train step then makes steps_per_generation x num_iterations optimizer updates")
    scale_rewards: Literal["group", "batch", "none"] = Field(
        "group", description="divide advantages by the reward std of the group, of the batch, or not (Dr. GRPO); "
        "ignored by rewards.aggregation normalize_then_sum (GDPO), which divides each function by its group std "
        "and the sum by its batch std, as TRL")
    importance_sampling: ImportanceSamplingConfig = Field(default_factory=ImportanceSamplingConfig,
                                                          description="sampling-vs-trainer correction")
    off_policy_mask_threshold: float | None = Field(
        None, description="drop the policy term of sequences with negative advantage whose mean KL(sampling || "
        "current policy) exceeds this (DeepSeek-V3.2 off-policy sequence masking; their KL term stays)")
    zero_advantage: Literal["filter", "skip", "keep"] = Field(
        "filter", description="completions with exactly zero advantage (groups of equal rewards) carry no policy "
        "gradient: filter removes them before the update (the loss keeps the unfiltered step's normalization, so "
        "the update is unchanged, only cheaper); skip keeps them but skips micro-batches whose advantages are all "
        "zero (single process only); keep trains on every completion. With beta > 0 the KL term acts on every "
        "completion: keep")
    replay_buffer_size: int = Field(0, ge=0, description="keep up to this many high-signal groups (sum |A| x reward "
                                    "std) and use them to refill the groups filtered for zero advantage (0: off)")
    replay_max_age: int = Field(4, ge=0, description="replayed groups are at most this many versions old")
    replay_sampling: Literal["best", "proportional"] = Field(
        "best", description="which buffered groups refill a step: best = the highest scores, which leave the buffer "
        "(a group trains at most twice); proportional = axolotl's draw with probability proportional to the score, "
        "the drawn groups staying in the buffer (replayed at several steps until max_age or eviction)")
    reroll_failed: bool = Field(False, description="groups that failed entirely (every total reward <= "
                                "reroll_threshold) come back later in training, when the policy may solve them")
    reroll_threshold: float = Field(0.0, description="a group failed entirely when every reward is <= this")
    reroll_after: float = Field(0.1, ge=0, le=1, description="re-roll a failed group after this fraction of "
                                "train.steps (at least prefetch_depth + 1 steps)")
    reroll_start_fraction: float = Field(0.0, ge=0, le=1, description="no failed prompt comes back before this "
                                         "fraction of train.steps (axolotl's reroll_start_fraction; 0: any time)")
    reroll_max_groups: int | None = Field(None, ge=1, description="re-rolled prompts per step at most (axolotl's "
                                          "reroll_max_groups; null: up to the step's prompts)")
    reroll_max_attempts: int = Field(2, ge=1, description="times one prompt is rolled at most")
    reroll_queue_size: int = Field(256, ge=1, description="failed prompts waiting at most")
    dynamic_sampling: bool = Field(
        False, description="DAPO's dynamic sampling (arXiv 2503.14476; verl's algorithm.filter_groups): a step trains "
        "only on groups with signal (rewards not all equal, before any kl_in_reward penalty) and generates more "
        "prompts until it has its prompts_per_step x gradient_accumulation_steps of them; dropped groups' prompts are "
        "consumed. Unlike zero_advantage it changes the update: normalization and any KL or entropy term see only "
        "the kept groups. grpo, without rollout.async_prefetch")
    dynamic_sampling_max_rounds: int = Field(
        3, ge=1, description="dynamic_sampling: extra generation rounds per step at most (verl's max_num_gen_batches "
        "- 1); when they run out the step trains on what it has (dynamic_sampling/filled_fraction < 1), the empty "
        "places refilled from the replay buffer when replay_buffer_size > 0")

    @model_validator(mode="before")
    @classmethod
    def _old_zero_advantage_keys(cls, data):
        return merged_zero_advantage_keys(data) if isinstance(data, dict) else data

    @model_validator(mode="after")
    def _check_loss(self) -> AlgoConfig:
        if self.loss_type == "luspo" and self.importance_sampling_level != "sequence":
            raise ValueError("loss_type luspo scales GSPO's sequence term by the sequence's length: set "
                             "importance_sampling_level: sequence")
        if self.loss_type == "vespo" and self.importance_sampling_level != "token":
            raise ValueError("loss_type vespo builds its own sequence weight from the token ratios: set "
                             "importance_sampling_level: token")
        if self.kl_in_reward and self.beta <= 0:
            raise ValueError("kl_in_reward moves beta from the loss to the reward: set beta > 0")
        if self.kl_in_reward and self.name != "grpo":
            raise ValueError("kl_in_reward applies to grpo (ebft's reward is feature matching)")
        if self.use_bias_correction_kl and self.loss_beta <= 0:
            raise ValueError("use_bias_correction_kl corrects the loss's KL term, which "
                             + ("kl_in_reward moves into the reward" if self.kl_in_reward else "beta = 0 leaves out")
                             + ": set beta > 0 (without kl_in_reward), or remove it")
        if self.advantage_estimator != "grpo" and "scale_rewards" in self.model_fields_set:
            raise ValueError(f"scale_rewards applies to advantage_estimator grpo only ({self.advantage_estimator} "
                             "has its own scaling); remove it")
        self._check_adaptive_entropy()
        return self

    def _check_adaptive_entropy(self) -> None:
        keys = ("entropy_coef_min", "entropy_coef_max", "entropy_coef_delta", "entropy_target")
        if not self.use_adaptive_entropy:
            given = self.off_default(keys)  # a controller tuned but left off
            if given:
                raise ValueError(f"{given[0]} is set but use_adaptive_entropy is false: set it true (or remove "
                                 f"{given[0]})")
        elif self.entropy_coef_min > self.entropy_coef_max:
            raise ValueError(f"entropy_coef_min = {self.entropy_coef_min} is above entropy_coef_max = "
                             f"{self.entropy_coef_max}")

    @model_validator(mode="after")
    def _check_replay(self) -> AlgoConfig:
        """Replayed groups fill the places zero-advantage filtering (or dynamic sampling) left empty: with
        nothing filtered the buffer would only take memory. A warning, not an error: the run is valid."""
        filters = self.zero_advantage == "filter" and not self.acts_on_every_completion
        if self.replay_buffer_size and not (filters or self.dynamic_sampling):
            why = ("a KL or entropy term acts on every completion, so none is filtered" if self.acts_on_every_completion
                   else f"zero_advantage = {self.zero_advantage} filters nothing")
            warnings.warn(f"algo.replay_buffer_size = {self.replay_buffer_size} replays nothing: {why} (replayed "
                          "groups take the places of filtered ones; or set dynamic_sampling)", UserWarning,
                          stacklevel=2)
        return self

    def check_dynamic_sampling(self, rollout: RolloutConfig) -> None:
        """What dynamic_sampling cannot work with (called by Config: it reads the rollout section)."""
        if self.dynamic_sampling and self.name != "grpo":
            raise ValueError("algo.dynamic_sampling applies to grpo (verifiable rewards; ebft's feature-matching "
                             "rewards are continuous)")
        if self.dynamic_sampling and rollout.async_prefetch:
            raise ValueError("algo.dynamic_sampling generates a step's extra rounds in the trainer's thread after "
                             "scoring, which the prefetch thread's jobs would race: turn off rollout.async_prefetch")

    @property
    def clip_high(self) -> float:
        """epsilon_high as the loss uses it: its default is epsilon, and cispo's is ScaleRL's cap 5.0."""
        if self.epsilon_high is not None:
            return self.epsilon_high
        return CISPO_DEFAULT_EPSILON_MAX if self.loss_type == "cispo" else self.epsilon

    @property
    def loss_beta(self) -> float:
        """The KL term's coefficient in the loss: beta, unless kl_in_reward moved it into the reward."""
        return 0.0 if self.kl_in_reward else self.beta

    @property
    def acts_on_every_completion(self) -> bool:
        """A loss term reaches completions of zero advantage (the KL, the entropy bonus): filtering or
        skipping them would change the update."""
        return self.loss_beta > 0 or self.entropy_coef > 0 or self.use_adaptive_entropy


class EbftConfig(Section):
    mode: Literal["structured", "strided"] = Field(
        "structured", description="structured: vLLM samples whole completions of each prompt (like grpo); strided: no "
        "vLLM, the trainer regenerates blocks of generate_max_len tokens at anchors every stride tokens of the "
        "prompt + ground-truth document, all blocks in one forward pass, sampled at rollout.sampling.temperature "
        "(0.6 when not given, axolotl's ebft.temperature)")
    ground_truth_field: str | None = Field(
        "ground_truth", description="column holding the reference completion; strided with null: the prompt column "
        "is the whole document")
    feature_layers: list[float] = Field([0.25, 0.5, 0.75], description="depths (fractions in (0, 1]) of the hidden "
                                        "states used as features: layer clamp(floor(f * num_layers), 1, num_layers)")
    embed_method: Literal["last_token", "mean_pooling", "completion_mean", "concat"] = Field(
        "last_token", description="one vector per completion (strided: per block): its last token; the mean over "
        "prompt + completion (strided: the block); the mean over the completion (strided: the block); or its tokens "
        "at 25/50/75 percent of its length, concatenated and divided by sqrt(3)")
    whitening: bool = Field(False, description="whiten each group's features with W = (gen^T gen)^(+1/2) from the "
                            "generated samples, applied to both sides (the diversity term is then 0 unless samples "
                            "nearly repeat)")
    whiten_tol: float = Field(1e-5, gt=0, description="singular values below whiten_tol * the largest are cut")
    alignment_coef: float = Field(1.0, ge=0, description="weight of 2 * cos(phi_j, phi_gt)")
    diversity_coef: float = Field(1.0, ge=0, description="weight of 2 / (n - 1) * sum_k phi_j . phi_k (set to 0 "
                                  "when algo.num_generations = 1)")
    advantage_estimator: Literal["rloo", "group_norm", "reinforce"] = Field(
        "rloo", description="rloo: leave-one-out baseline with the diversity recomputed without the sample; "
        "group_norm: (r - mean) / std per group; reinforce: the reward itself (what algo.num_generations = 1 "
        "falls back to, with a warning)")
    gt_length_multiplier: float | None = Field(
        1.5, ge=0.1, description="structured: each group's max_tokens = floor(its ground truth's tokens x this), "
        "at most rollout.sampling.max_tokens and at least min_max_tokens (axolotl's adaptive_max_tokens, per "
        "prompt rather than per batch; null: always rollout.sampling.max_tokens)")
    min_max_tokens: int = Field(64, ge=1, description="structured: floor of the adaptive max_tokens (capped at "
                                "rollout.sampling.max_tokens)")
    stride: int = Field(8, ge=1, description="strided: tokens between anchors")
    context_length: int = Field(8, ge=1, description="strided: the first anchor; block b sees the whole document "
                                "before its anchor context_length + b * stride")
    generate_max_len: int = Field(8, ge=1, description="strided: tokens generated per block")
    min_completion_prefix: int = Field(0, ge=0, description="strided with a ground truth: the first anchor is at "
                                       "least this many tokens into the ground truth")
    max_document_length: int = Field(256, ge=2, description="strided: documents (prompt + ground truth) are cut to "
                                     "this many tokens")
    rl_coef: float = Field(1.0, ge=0, description="weight of the policy-gradient loss (structured: of the whole "
                           "GRPO loss, its KL and entropy terms included)")
    ce_coef: float = Field(0.0, ge=0, description="weight of the cross-entropy loss on the ground truth (strided "
                           "without one: on the whole document): per document the mean NLL of its ground-truth tokens, "
                           "each given the tokens before it, at temperature 1, averaged over the step's documents. "
                           "structured: the documents are the prompts + ground truths, in the completions' forward; a "
                           "group that zero_advantage: filter removes adds no cross-entropy (the mean still counts its "
                           "document)")
    kv_cache: bool = Field(True, description="strided: generate with a KV cache (false: recompute the row each "
                           "step, the reference implementation)")
    attention: Literal["auto", "flex", "dense"] = Field(
        "auto", description="strided: the block-parallel mask of the feature and training forwards, as a "
        "flex_attention BlockMask (block-sparse; CUDA only, FlexAttention has no backward on CPU) or a dense "
        "[L, L] mask (SDPA / eager); auto = flex on CUDA. Generation always uses the dense mask")

    @field_validator("feature_layers")
    @classmethod
    def _fractions_of_depth(cls, value: list[float]) -> list[float]:
        if not value or any(not 0 < f <= 1 for f in value):
            raise ValueError("must be a non-empty list of fractions in (0, 1]")
        return value


class KernelOpsConfig(Section):
    nf4: Literal["auto", "ours", "torch"] | None = Field(None, description="NF4 dequantize of QLoRA bases "
                                                         "(null: train.kernels)")
    lora: Literal["auto", "ours", "torch"] | None = Field(None, description="LoRA linear: fused kernel, or "
                                                          "torch = PEFT's F.linear + eager LoRA (null: train.kernels)")
    moe: Literal["auto", "ours", "torch"] | None = Field(None, description="MoE experts: grouped kernels, or torch "
                                                         "= transformers' experts (null: train.kernels)")
    logprobs: Literal["auto", "ours", "torch"] | None = Field(None, description="token logprobs: fused lm_head "
                                                              "kernel, or chunked torch (null: train.kernels)")


class TrainConfig(Section):
    steps: int = Field(60, ge=1, description="optimizer steps")
    epochs: float | None = Field(None, gt=0, description="passes over the prompts (TRL's num_train_epochs, axolotl's "
                                 "num_epochs), which then decide steps: ceil(epochs x prompts / (prompts_per_step x "
                                 "gradient_accumulation_steps)), counted once the data is read (held-out eval prompts "
                                 "left out) and written to the run's config.yaml")
    prompts_per_step: int = Field(8, ge=1, description="prompts sampled per step (each gets num_generations)")
    micro_batch_size: int = Field(16, ge=1, description="completions per forward/backward "
                                  "(ebft strided: documents x num_generations, at least one document)")
    gradient_accumulation_steps: int = Field(1, ge=1, description="rollout batches per optimizer step")
    lr: float = Field(5e-3, gt=0, description="AdamW learning rate")
    optim: Literal["adamw_torch", "adamw_torch_fused", "adamw_8bit", "paged_adamw_8bit"] = Field(
        "adamw_torch_fused", description="transformers' names: torch's AdamW (foreach), its fused kernel (the "
        "default, as transformers'), or bitsandbytes' 8-bit AdamW (paged: its states may page out to CPU memory; "
        "tensors under 4096 elements keep 32-bit states, as bitsandbytes' min_8bit_size)")
    master_weights: bool = Field(True, description="the optimizer steps fp32 copies of 16-bit trainable weights "
                                 "(full fine-tuning in bfloat16 / float16; adapters are fp32 already) and writes them "
                                 "back rounded: stepped in bf16, an update below a weight's rounding step is lost, so "
                                 "at GRPO's usual learning rates most weights would never move. Micro-batches' "
                                 "gradients sum in fp32 on the copies, and are clipped there. Costs 4 bytes a weight, "
                                 "2 for the fp32 gradient and fp32 optimizer states; false: pure 16-bit AdamW, as "
                                 "TRL's single-GPU full fine-tuning of a bf16 model (docs/memory.md)")
    weight_decay: float = Field(0.0, ge=0, description="AdamW weight decay (biases and norm weights take none, as in "
                                "transformers' Trainer)")
    adam_beta1: float = Field(0.9, ge=0, lt=1, description="AdamW's beta1 (TRL's adam_beta1)")
    adam_beta2: float = Field(0.999, ge=0, lt=1, description="AdamW's beta2 (TRL's adam_beta2)")
    adam_epsilon: float = Field(1e-8, gt=0, description="AdamW's epsilon (TRL's adam_epsilon)")
    schedule: Literal["constant", "linear", "cosine"] = Field("constant", description="learning-rate schedule")
    min_lr_rate: float = Field(0.0, ge=0, lt=1, description="cosine: the fraction of lr the schedule ends at "
                               "(transformers' cosine_with_min_lr with lr_scheduler_kwargs min_lr_rate, axolotl's "
                               "cosine_min_lr_ratio)")
    warmup_steps: int = Field(0, ge=0, description="linear warm-up steps (optimizer updates)")
    warmup_ratio: float = Field(0.0, ge=0, lt=1, description="warm-up as a fraction of the run's optimizer updates, "
                                "rounded up (TRL's warmup_ratio; with train.epochs, of the steps they make); "
                                "warmup_steps above 0 wins, as in transformers")
    max_grad_norm: float | None = Field(1.0, description="gradient clipping norm (null: off)")
    seed: int = Field(0, description="seed for data order, sampling and initialization")
    kernels: Literal["auto", "reference", "ours", "torch"] = Field(
        "auto", description="every pykernels op (fused LoRA, NF4, logprobs, grouped MoE experts): auto (on CUDA, "
        "checked against torch and timed once per shape bucket, the faster correct one kept; ours on CPU), ours, "
        "or torch / reference (PEFT, transformers' experts and the pure-torch references); "
        "docs/kernels-dispatch.md. PYKERNELS_KERNELS in the environment overrides it")
    kernel_ops: KernelOpsConfig = Field(default_factory=KernelOpsConfig,
                                        description="per-op overrides of train.kernels")

    @field_validator("optim")
    @classmethod
    def _bitsandbytes_installed(cls, value: str) -> str:
        if value.endswith("8bit") and find_spec("bitsandbytes") is None:
            raise ValueError(f"{value} needs bitsandbytes (pip install bitsandbytes); or use adamw_torch_fused")
        return value

    @model_validator(mode="after")
    def _min_lr_with_cosine(self) -> TrainConfig:
        if self.min_lr_rate and self.schedule != "cosine":
            raise ValueError(f"min_lr_rate = {self.min_lr_rate} is for schedule cosine, not {self.schedule}: set "
                             "schedule: cosine (or remove min_lr_rate)")
        return self

    def steps_for_epochs(self, prompts: int) -> int:
        """The steps train.epochs makes over `prompts` prompts (at least one)."""
        per_step = self.prompts_per_step * self.gradient_accumulation_steps
        return max(1, math.ceil(self.epochs * prompts / per_step - 1e-9))  # 1e-9: 0.1 x 30 / 3 is 1.0000000000000002

    def kernel_modes(self) -> dict[str, str]:
        """op -> auto | ours | torch, as pykernels.backend.set_kernels takes them."""
        default = "torch" if self.kernels == "reference" else self.kernels
        return {op: getattr(self.kernel_ops, op) or default for op in KernelOpsConfig.model_fields}


class LoggingConfig(Section):
    output_dir: str = Field("outputs/run", description="where metrics, checkpoints, plots and the resolved config go")
    progress: bool = Field(True, description="rich progress bar on the terminal")
    quiet: bool = Field(True, description="send what vLLM and the libraries print (engine logs, warnings, "
                        "reward functions' prints) to output_dir/run.log; the terminal keeps the progress bar, "
                        "the driver's messages and errors")
    report_to: list[Literal["tensorboard", "wandb", "mlflow"]] = Field(
        ["tensorboard"], description="where metrics and the completions tables go besides metrics.jsonl and "
        "completions.jsonl: TensorBoard (output_dir/tensorboard), Weights & Biases (pip install wandb; WANDB_MODE="
        "offline works), MLflow (pip install mlflow-skinny; MLFLOW_TRACKING_URI, default output_dir/mlruns)")
    project: str = Field("pykernels", description="wandb project / MLflow experiment")
    run_name: str | None = Field(None, description="wandb / MLflow run name (default: output_dir's name)")
    plots: bool = Field(True, description="write PNG plots of the main curves at the end")
    log_completions: int = Field(2, ge=0, description="sample completions printed every log_completions_every steps")
    log_completions_every: int = Field(10, ge=1, description="steps between printed sample completions and "
                                       "between completions tables (every completion of the step: prompt, "
                                       "completion, rewards, advantage) in completions.jsonl and the trackers")

    @model_validator(mode="before")
    @classmethod
    def _old_tensorboard_key(cls, data):
        """logging.tensorboard (until 2026-11) is now an entry of report_to."""
        if not isinstance(data, dict) or "tensorboard" not in data:
            return data
        data = dict(data)
        enabled = data.pop("tensorboard")
        if "report_to" in data:
            raise ValueError("report_to replaces tensorboard: give it alone")
        if not isinstance(enabled, bool):
            raise ValueError("tensorboard must be true or false (now: report_to)")
        data["report_to"] = ["tensorboard"] if enabled else []
        warnings.warn(f"logging.tensorboard is now logging.report_to: {data['report_to']} (the old key will go "
                      "away)", FutureWarning, stacklevel=2)
        return data

    @field_validator("report_to")
    @classmethod
    def _trackers_installed(cls, value: list[str]) -> list[str]:
        packages = {"wandb": ("wandb", "wandb"), "mlflow": ("mlflow", "mlflow-skinny")}
        missing = [f"{name} (pip install {packages[name][1]})" for name in value
                   if name in packages and find_spec(packages[name][0]) is None]
        if missing:
            raise ValueError(f"not installed: {', '.join(missing)}")
        return list(dict.fromkeys(value))

    @model_validator(mode="after")
    def _tensorboard_installed(self) -> LoggingConfig:
        # A model check: report_to's default names TensorBoard, and a field's default is never validated.
        if self.tensorboard and find_spec("tensorboard") is None:
            raise ValueError("logging.report_to has tensorboard (its default), which is not installed: pip install "
                             "tensorboard, or set logging.report_to: [] (metrics.jsonl is written either way)")
        return self

    @property
    def tensorboard(self) -> bool:
        return "tensorboard" in self.report_to


class CheckpointConfig(Section):
    every: int = Field(0, ge=0, description="save a checkpoint every N steps (0: only at the end)")
    resume: str | None = Field(None, description="checkpoint directory to resume from, 'latest' (output_dir's "
                               "newest), or 'auto' (its newest if there is one, else start: a command a requeued "
                               "job can rerun, axolotl's auto_resume_from_checkpoints)")
    keep: int = Field(2, ge=1, description="checkpoints kept on disk")
    push_to_hub: bool = Field(False, description="upload the trained adapter (the model under full fine-tuning) "
                              "to a Hugging Face Hub repository, created at the start if missing (TRL's "
                              "push_to_hub); needs a token that can write: `hf auth login` or HF_TOKEN")
    hub_model_id: str | None = Field(None, description="with push_to_hub: the repository, user/name or org/name "
                                     "(a bare name: the token's user); null: output_dir's name, as TRL")
    hub_strategy: Literal["end", "every_save", "checkpoint", "all_checkpoints"] = Field(
        "end", description="with push_to_hub: end uploads the final adapter (and eval.save_best's to best/) when "
        "the run ends; every_save also uploads each checkpoint's as it is saved, in the background; checkpoint "
        "also the whole checkpoint to last-checkpoint/ (what a resume on another machine needs), all_checkpoints "
        "each one to checkpoints/step-NNNNNN/ (TRL's names)")
    hub_private_repo: bool | None = Field(None, description="with push_to_hub: create the repository private "
                                          "(null: the Hub's default for the account)")


class EvalSetConfig(Section):
    """One of eval.sets: a dataset read as eval.source is."""

    source: str = Field(description="a dataset in any form data.source takes")
    name: str | None = Field(None, description="its configuration (subset), e.g. main for openai/gsm8k")
    split: str = Field("test", description="the split of a dataset directory or Hub dataset")
    revision: str | None = Field(None, description="on the Hub: a branch, tag or commit")


EVAL_SET_LABEL = re.compile(r"[A-Za-z0-9_.-]+")


def eval_prefix(label: str) -> str:
    """Where an evaluation set's metrics go: eval/ for the one set, eval_<label>/ for each of eval.sets (TRL's
    eval_<name>_ prefix of a dict eval_dataset's metrics, with our slash)."""
    return f"eval_{label}/" if label else "eval/"


class EvalConfig(Section):
    """Evaluation on prompts the run does not train on: the step's adapter samples each, the reward functions score
    them, and eval/<TRL's metric names> go to metrics.jsonl and the trackers (eval/reward, eval/rewards/<name>/mean,
    eval/completions/mean_length, ...), every completion to eval_completions.jsonl. The same prompts and sampling
    seeds every time, so evaluations differ by the adapter alone."""

    steps: int = Field(0, ge=0, description="evaluate every this many optimizer steps (TRL's eval_steps with "
                       "eval_strategy: steps; axolotl's eval_steps); 0: only on_start")
    on_start: bool = Field(False, description="evaluate once before the first step (TRL's eval_on_start): the "
                           "baseline later evaluations compare with")
    only: bool = Field(False, description="evaluate once and stop, training nothing (TRL's trainer.evaluate()): "
                       "the adapter of lora.init_from or of checkpoint.resume, else the base model")
    source: str | None = Field(None, description="the prompts evaluated (TRL's eval_dataset): a dataset in any form "
                               "data.source takes, read with data's prompt_field, transform and chat template, in file "
                               "order; null: val_set_size prompts held out of data.source")
    name: str | None = Field(None, description="source's configuration (subset), e.g. main for openai/gsm8k")
    split: str = Field("test", description="the split of a dataset directory or Hub dataset given as source")
    revision: str | None = Field(None, description="source on the Hub: a branch, tag or commit")
    sets: dict[str, EvalSetConfig] = Field(default_factory=dict, description="named evaluation sets instead of "
                                           "source (TRL's eval_dataset as a dict), each {source, name, split, "
                                           "revision}, evaluated in turn: metrics under eval_<set>/ "
                                           "(eval_<set>/reward, ...), completions tagged with set in "
                                           "eval_completions.jsonl; best_metric then names a set: <set>/reward")
    val_set_size: float = Field(0, ge=0, description="without source: prompts of data.source held out of training "
                                "for evaluation (axolotl's val_set_size), a fraction below 1 or a count; which ones "
                                "is fixed by train.seed")
    max_prompts: int | None = Field(None, ge=1, description="evaluate the first this many eval prompts (null: all)")
    num_generations: int | None = Field(None, ge=1, description="completions per eval prompt (TRL's "
                                        "num_generations_eval; null: algo.num_generations, 1 with temperature 0): "
                                        "eval/reward is their mean, pass@1 averaged over them")
    save_best: bool = Field(False, description="keep the adapter of the best evaluation so far in output_dir/best "
                            "(a PEFT adapter directory, with best.json: its step and metric), TRL's "
                            "load_best_model_at_end")
    best_metric: str = Field("reward", description="with save_best: the eval/ metric that decides (TRL's "
                             "metric_for_best_model), e.g. reward or rewards/<function>/mean")
    greater_is_better: bool = Field(True, description="with save_best: whether a larger best_metric is better")
    temperature: float | None = Field(None, ge=0, description="the evaluations' sampling temperature (null: "
                                      "rollout.sampling.temperature, with its other settings; 0: greedy decoding, "
                                      "one completion per prompt)")

    @property
    def enabled(self) -> bool:
        return self.steps > 0 or self.on_start or self.only

    def generations(self, training: int) -> int:
        """Completions per eval prompt, given algo.num_generations."""
        if self.num_generations is not None:
            return self.num_generations
        return 1 if self.temperature == 0 else training

    def data(self, data: DataConfig, label: str = "") -> DataConfig:
        """The data section reading source (or eval.sets' `label`) instead (same columns, transform, chat template),
        unshuffled."""
        origin = self.sets[label] if label else self
        return data.model_copy(update={"source": origin.source, "name": origin.name, "split": origin.split,
                                       "revision": origin.revision, "shuffle": False})

    def labels(self) -> list[str]:
        """The evaluation sets' labels: eval.sets' names, or "" for the one set (source or val_set_size)."""
        return list(self.sets) or [""]

    def best_key(self) -> str:
        """The metrics key best_metric names (eval/reward; with sets, <set>/reward is eval_<set>/reward)."""
        if not self.sets:
            return eval_prefix("") + self.best_metric
        label, _, metric = self.best_metric.partition("/")
        return eval_prefix(label) + metric

    def held_out(self, rows: int) -> int:
        """How many of data.source's `rows` prompts val_set_size holds out (0 with a source of its own)."""
        if self.source is not None or not self.val_set_size:
            return 0
        return round(self.val_set_size * rows) if self.val_set_size < 1 else int(self.val_set_size)


class NemoGymAgentConfig(Section):
    """environment.name = nemo_gym_agent: each episode is one POST /run to a NeMo Gym agent server (its model server
    calling this run's vLLM server), reached at agent_url, found through a running ng_run's head server, or started
    by the run (resources_server)."""

    agent_url: str | None = Field(None, description="a running agent server (http://host:port) whose model server "
                                  "calls this run's vLLM server (rollout.server_url)")
    head_server_url: str | None = Field(None, description="a running ng_run's head server (http://host:port; axolotl's "
                                        "nemo_gym_head_port): the agent named agent_name is looked up in its config")
    agent_name: str | None = Field(None, description="with head_server_url: the agent server's name in the ng_run "
                                   "config (e.g. example_single_tool_call_simple_agent)")
    resources_server: str | None = Field(None, description="the run starts ng_run (NeMo Gym's venv, 127.0.0.1) with "
                                         "this resources server of the nemo-gym package (e.g. "
                                         "example_single_tool_call), policy_model (vllm_model on this run's vLLM "
                                         "server) and simple_agent (max_steps = environment.max_turns)")
    resources_server_options: dict[str, Any] = Field(default_factory=dict, description="with resources_server: its "
                                                     "config fields, over the package's")
    venv: str = Field(".nemo-gym/venv", description="with resources_server: NeMo Gym's venv (`make nemo-gym`)")
    timeout: float = Field(600.0, gt=0, description="seconds one /run (a whole episode) may take before it is "
                           "retried (axolotl's nemo_gym_run_timeout)")
    retries: int = Field(3, ge=0, description="more tries of a /run the agent did not answer (refused, timed out, "
                         "HTTP 429 / 5xx), waiting retry_backoff * 2**k seconds before the k-th")
    retry_backoff: float = Field(1.0, ge=0, description="seconds before the first retry, doubled before each next one")
    max_concurrency: int = Field(16, ge=1, description="/run calls in flight at once")

    def source_keys(self) -> list[str]:
        """Which of the three ways to reach an agent the config gives."""
        return [key for key in ("agent_url", "head_server_url", "resources_server") if getattr(self, key)]


class EnvironmentConfig(Section):
    """Multi-turn episodes (driver/environments): after each model turn the environment answers (tool results,
    a user turn) or ends the episode; the sample is the whole episode, only the model's tokens train."""

    name: str | None = Field(None, description="null: one completion per sample (single turn, rewards as "
                             "configured); tools: the model calls the Python functions in `tools`; conversation: "
                             "the user turns of a data column (user_turns_field) follow each model turn; "
                             "nemo_gym_agent: a NeMo Gym agent server's /run plays each episode (nemo_gym); or the "
                             "dotted path of a factory kwargs -> Environment (docs/environments.md)")
    tools: list[str] = Field(default_factory=list, description="name: tools: dotted paths of Python functions the "
                             "model may call (typed arguments and a docstring: their JSON schemas go in the prompt)")
    tool_parser: str = Field("hermes", description="vLLM's tool-call parser that reads the calls from a model turn "
                             "(hermes: <tool_call>{json}</tool_call>, as Qwen2.5/3; see vLLM's --tool-call-parser)")
    max_turns: int = Field(8, ge=1, description="model turns per episode at most (then it ends as it is); the "
                           "episode's tokens, the environment's included, are capped by rollout.sampling.max_tokens")
    user_turns_field: str = Field("user_turns", description="name: conversation: the data column holding the "
                                  "later user messages (a list of strings) of each row")
    kwargs: dict[str, Any] = Field(default_factory=dict, description="keyword arguments of a custom factory")
    nemo_gym: NemoGymAgentConfig = Field(default_factory=NemoGymAgentConfig, description="name: nemo_gym_agent: "
                                         "the NeMo Gym agent server whose /run plays each episode")


class Config(Section):
    model: ModelConfig = Field(default_factory=ModelConfig, description="the policy model")
    lora: LoraSettings = Field(default_factory=LoraSettings, description="the adapter")
    data: DataConfig = Field(default_factory=DataConfig, description="prompts")
    rewards: RewardsConfig = Field(default_factory=RewardsConfig, description="rewards")
    rollout: RolloutConfig = Field(default_factory=RolloutConfig, description="generation with vLLM")
    algo: AlgoConfig = Field(default_factory=AlgoConfig, description="the RL algorithm")
    ebft: EbftConfig = Field(default_factory=EbftConfig, description="energy-based fine-tuning (algo.name: ebft)")
    environment: EnvironmentConfig = Field(default_factory=EnvironmentConfig, description="multi-turn episodes: "
                                           "the model's turns alternate with an environment's (tools, users)")
    train: TrainConfig = Field(default_factory=TrainConfig, description="optimization")
    logging: LoggingConfig = Field(default_factory=LoggingConfig, description="outputs")
    checkpoint: CheckpointConfig = Field(default_factory=CheckpointConfig, description="checkpoints")
    eval: EvalConfig = Field(default_factory=EvalConfig, description="evaluation on held-out prompts")

    @model_validator(mode="after")
    def _check_consistency(self) -> Config:
        if (self.algo.epsilon_high is not None and self.algo.loss_type != "cispo"
                and self.algo.epsilon_high < self.algo.epsilon):
            raise ValueError("algo.epsilon_high must be >= algo.epsilon")
        rollout = self.rollout
        staleness = schedule_staleness(self.prefetch_depth, rollout.vllm_sync_interval)
        if rollout.max_staleness is not None and rollout.max_staleness < staleness:
            raise ValueError(f"rollout.max_staleness = {rollout.max_staleness} would drop every batch: with "
                             f"prefetch_depth = {self.prefetch_depth} and vllm_sync_interval = "
                             f"{rollout.vllm_sync_interval} samples are {staleness} versions old "
                             "when trained on; raise it or lower those")
        if rollout.sampling.structured_outputs is not None and self.algo.importance_sampling.level != "none":
            warnings.warn("rollout.sampling.structured_outputs with algo.importance_sampling: vLLM's sampling logprobs "
                          "are of the grammar-constrained distribution and the trainer's are not, so the importance "
                          "weights measure the grammar (a forced token: ratio p / 1), not the engine gap; set "
                          "algo.importance_sampling.level: none (TRL does not correct under guided decoding either)",
                          stacklevel=2)
        if rollout.partial_rollout_tokens is not None and rollout.sampling.structured_outputs is not None:
            raise ValueError("rollout.partial_rollout_tokens cannot go with rollout.sampling.structured_outputs: a "
                             "continued completion is a new request, whose grammar would start again from its "
                             "beginning in the middle of the completion")
        if rollout.partial_rollout_tokens is not None and rollout.partial_rollout_tokens >= rollout.sampling.max_tokens:
            raise ValueError(f"rollout.partial_rollout_tokens = {rollout.partial_rollout_tokens} must be below "
                             f"rollout.sampling.max_tokens = {rollout.sampling.max_tokens} (or null for off)")
        if rollout.backend == "transformers":
            self._check_transformers_backend()
        if self.algo.kl_in_reward and self.rewards.aggregation != "sum_then_normalize":
            raise ValueError("algo.kl_in_reward needs rewards.aggregation = sum_then_normalize (the penalty is added "
                             "to the weighted sum of the rewards)")
        if self.algo.advantage_estimator != "grpo" and self.rewards.aggregation != "sum_then_normalize":
            raise ValueError(f"algo.advantage_estimator = {self.algo.advantage_estimator} needs rewards.aggregation = "
                             "sum_then_normalize (normalize_then_sum is GDPO, an estimator of its own)")
        if self.algo.name == "grpo" and self.algo.num_generations < 2:
            raise ValueError(f"algo.num_generations = {self.algo.num_generations}: grpo compares completions within "
                             "a group and needs at least 2")
        if self.algo.name == "ebft":
            self._check_ebft()
        if self.environment.name is not None:
            self._check_environment()
        self.algo.check_dynamic_sampling(self.rollout)
        self._check_steps_per_generation()
        self._check_eval()
        self._check_hub()
        self._check_sync_ref_model()
        if self.model.adapter == "none":
            self._check_full_finetuning()
        elif self.model.qlora and self.rollout.weight_sync == "merged":
            raise ValueError(f"rollout.{self.rollout.weight_sync_key()} with model.qlora: the trainer's base is NF4, "
                             "and merging would write dequantize(NF4) + scaling * B @ A into the engine as dense "
                             "weights, which the driver does not do; use rollout.weight_sync = adapter (the engine "
                             "serves the NF4 round trip of the base with the adapter: the trainer's function)")
        return self

    def _check_environment(self) -> None:
        environment = self.environment
        if self.algo.name != "grpo":
            raise ValueError(f"environment.name = {environment.name}: environments train with algo.name = grpo (ebft's "
                             "multi-turn rollouts come from the data: driver.ebft.transforms.first_turn)")
        if environment.name == "tools" and not environment.tools:
            raise ValueError("environment.name = tools needs environment.tools: the dotted paths of the Python "
                             "functions the model may call")
        if environment.tools and environment.name != "tools":
            raise ValueError(f"environment.tools is set but environment.name = {environment.name}: tools are called "
                             "by the tools environment only")
        if environment.name == "nemo_gym_agent":
            self._check_nemo_gym_agent()
        elif environment.nemo_gym.model_fields_set:
            raise ValueError(f"environment.nemo_gym is set but environment.name = {environment.name}: it configures "
                             "the nemo_gym_agent environment only")

    def _check_nemo_gym_agent(self) -> None:
        """The agent's model server calls our vLLM server by the base model's name, at any time during a /run: it
        needs a server (rollout.backend) holding one set of weights, the current version's, under that name."""
        agent, rollout = self.environment.nemo_gym, self.rollout
        sources = agent.source_keys()
        if len(sources) != 1:
            raise ValueError("environment.name = nemo_gym_agent needs exactly one of environment.nemo_gym.agent_url, "
                             "head_server_url (with agent_name) or resources_server (the run starts ng_run), got "
                             f"{', '.join(sources) or 'none'}")
        if agent.head_server_url and not agent.agent_name:
            raise ValueError("environment.nemo_gym.head_server_url needs environment.nemo_gym.agent_name: the agent "
                             "server's name in that ng_run's config")
        if rollout.backend != "server":
            raise ValueError(f"environment.name = nemo_gym_agent with rollout.backend = {rollout.backend}: NeMo Gym's "
                             "model server calls the policy over HTTP; use rollout.backend = server")
        if self.model.adapter != "none" and rollout.weight_sync != "merged":
            raise ValueError(f"environment.name = nemo_gym_agent with model.adapter = {self.model.adapter} and "
                             f"rollout.weight_sync = {rollout.weight_sync}: the agent's model server names one model, "
                             "the base, so the server must serve the trained weights under it, one version at a time: "
                             "use rollout.weight_sync = merged, or model.adapter = none (full fine-tuning); LoRA "
                             "adapters are served under names of their own")
        if rollout.partial_rollout_tokens is not None:
            raise ValueError("environment.name = nemo_gym_agent with rollout.partial_rollout_tokens: a /run plays a "
                             "whole episode, it cannot be paused and continued")

    def _check_eval(self) -> None:
        evaluation = self.eval
        if not evaluation.enabled:
            given = evaluation.off_default(EvalConfig.model_fields)
            if given:  # a config that names eval prompts but never evaluates them has a mistake in it
                raise ValueError(f"eval.{given[0]} is set but eval.steps = 0 and eval.on_start and eval.only are "
                                 "false: nothing would be evaluated; set eval.steps (or remove the eval section)")
            return
        if sum((evaluation.source is not None, bool(evaluation.val_set_size), bool(evaluation.sets))) != 1:
            raise ValueError("eval needs its prompts from exactly one of eval.source (a dataset, e.g. its test split), "
                             "eval.sets (named datasets) and eval.val_set_size (prompts held out of data.source)")
        bad = [label for label in evaluation.sets if not EVAL_SET_LABEL.fullmatch(label)]
        if bad:
            raise ValueError(f"eval.sets: {bad[0]!r} is no set name: letters, digits, _ . - only (it names metrics: "
                             f"eval_<set>/reward)")
        if evaluation.sets and evaluation.save_best and evaluation.best_metric.partition("/")[0] not in evaluation.sets:
            raise ValueError(f"eval.best_metric = {evaluation.best_metric}: with eval.sets it names one of them, "
                             f"<set>/<metric> (e.g. {next(iter(evaluation.sets))}/reward)")
        if evaluation.val_set_size >= 1 and evaluation.val_set_size != int(evaluation.val_set_size):
            raise ValueError(f"eval.val_set_size = {evaluation.val_set_size}: a fraction below 1 or a whole count")
        if evaluation.save_best and evaluation.only:
            raise ValueError("eval.save_best with eval.only: nothing is trained, so there is no better adapter to keep")
        if evaluation.temperature == 0 and evaluation.generations(self.algo.num_generations) > 1:
            raise ValueError(f"eval.temperature = 0 decodes greedily: eval.num_generations = "
                             f"{evaluation.num_generations} completions of a prompt would all be the same; set it "
                             "to 1 (or leave it out)")
        if self.algo.name != "grpo":
            raise ValueError(f"eval with algo.name = {self.algo.name}: evaluation scores with the reward functions "
                             "(algo.name: grpo); EBFT's feature-matching reward has none")
        interval = self.rollout.vllm_sync_interval
        if evaluation.steps % interval:
            raise ValueError(f"eval.steps = {evaluation.steps} must be a multiple of rollout.vllm_sync_interval = "
                             f"{interval}: the engine serves the adapter of those steps only")

    def _check_hub(self) -> None:
        checkpoint = self.checkpoint
        if not checkpoint.push_to_hub:
            given = checkpoint.off_default(("hub_model_id", "hub_strategy", "hub_private_repo"))
            if given:
                raise ValueError(f"checkpoint.{given[0]} is set but checkpoint.push_to_hub is false: nothing would be "
                                 "uploaded; set push_to_hub: true (or remove it)")
        elif self.eval.only:
            raise ValueError("checkpoint.push_to_hub with eval.only: nothing is trained, so there is nothing to upload")

    def _check_sync_ref_model(self) -> None:
        algo = self.algo
        if not algo.sync_ref_model:
            given = algo.off_default(("ref_model_mixup_alpha", "ref_model_sync_steps"))
            if given:
                raise ValueError(f"algo.{given[0]} is set but algo.sync_ref_model is false: set it true (or remove "
                                 f"algo.{given[0]})")
            return
        if self.model.adapter != "none":
            raise ValueError("algo.sync_ref_model moves a reference model of its own, which full fine-tuning keeps "
                             "(model.adapter: none); with an adapter the reference is the base with the adapter off "
                             "(TRL refuses sync_ref_model with PEFT for the same reason)")
        if algo.name != "grpo" or algo.loss_beta <= 0:
            raise ValueError("algo.sync_ref_model moves the reference of the loss's KL term: it needs algo.name = grpo "
                             "and beta > 0 without kl_in_reward (whose reference is scored while the policy trains)")

    def _check_full_finetuning(self) -> None:
        conflicts = [key for key, on in (("model.qlora", self.model.qlora),
                                          ("lora.init_from", self.lora.init_from is not None),
                                          (f"rollout.{self.rollout.weight_sync_key()}",
                                           self.rollout.weight_sync == "adapter")) if on]
        if conflicts:
            raise ValueError(f"model.adapter = none (full fine-tuning) cannot go with {', '.join(conflicts)}: QLoRA "
                             "trains an adapter on a frozen NF4 base, an adapter to start from needs an adapter to "
                             "train, and the engine must receive whole weights (rollout.weight_sync: auto or merged)")
        if self.model.dtype == "float16" and not self.train.master_weights:
            raise ValueError("model.dtype = float16 with train.master_weights = false under full fine-tuning: the "
                             "loss-scaled gradients would be unscaled in float16, where the small ones vanish (why "
                             "TRL's GradScaler refuses float16 gradients), and AdamW's eps (1e-8) is 0 in float16; "
                             "keep train.master_weights: true, or use bfloat16")

    def _check_steps_per_generation(self) -> None:
        steps, train = self.algo.steps_per_generation, self.train
        rows = train.prompts_per_step * train.gradient_accumulation_steps * self.algo.num_generations
        micro_batches = -(-rows // train.micro_batch_size)
        if steps > micro_batches:
            raise ValueError(f"algo.steps_per_generation = {steps}, but a generated batch of {rows} completions makes "
                             f"{micro_batches} micro-batch(es) of train.micro_batch_size = {train.micro_batch_size}: "
                             "each optimizer step needs at least one; lower one of them")
        if steps > 1 and self.algo.name == "ebft" and self.ebft.mode == "strided":
            raise ValueError("algo.steps_per_generation > 1 is not supported by ebft.mode = strided (its update trains "
                             "one block batch per step)")

    def _check_ebft(self) -> None:
        ebft, algo = self.ebft, self.algo
        if algo.num_generations == 1 and (ebft.advantage_estimator != "reinforce" or ebft.diversity_coef > 0):
            # axolotl's fallback for one sample per prompt, written into the config so that the resolved
            # config says what runs: no other sample to be a baseline or to be diverse from.
            warnings.warn(f"algo.num_generations = 1 with ebft: advantage_estimator {ebft.advantage_estimator} -> "
                          f"reinforce, diversity_coef {ebft.diversity_coef} -> 0 (one sample per prompt has no "
                          "baseline and no other sample to differ from)", UserWarning, stacklevel=2)
            ebft.advantage_estimator, ebft.diversity_coef = "reinforce", 0.0
        if ebft.mode == "strided" and "temperature" not in self.rollout.sampling.model_fields_set:
            self.rollout.sampling.temperature = 0.6  # axolotl's ebft.temperature: strided's default, not grpo's
        # Compared with the default, not "was it given": a run's own config.yaml lists the default functions.
        if self.rewards.functions != RewardsConfig().functions:
            raise ValueError("rewards.functions are not used with algo.name = ebft (the reward is feature matching "
                             "against the ground truth); remove them, or use algo.name = grpo")
        if self.rewards.reward_num_workers:
            raise ValueError("rewards.reward_num_workers must be 0 with algo.name = ebft: its reward is computed by "
                             "the trainer's model, in the trainer's thread")
        if algo.reroll_failed:
            raise ValueError("algo.reroll_failed does not apply to ebft: feature-matching rewards have no failure "
                             "threshold")
        if algo.advantage_estimator != "grpo":
            raise ValueError("algo.advantage_estimator does not apply to ebft: set ebft.advantage_estimator")
        if ebft.mode == "strided":
            unsupported = [key for key, on in (("rollout.async_prefetch", self.rollout.async_prefetch),
                                               ("rollout.partial_rollout_tokens",
                                                self.rollout.partial_rollout_tokens is not None),
                                               ("algo.replay_buffer_size", algo.replay_buffer_size > 0),
                                               ("algo.beta", algo.beta > 0),
                                               ("algo.entropy_coef", algo.entropy_coef > 0),
                                               ("algo.use_adaptive_entropy", algo.use_adaptive_entropy),
                                               ("algo.top_entropy_quantile", algo.top_entropy_quantile < 1),
                                               ("algo.mask_truncated_completions",
                                                algo.mask_truncated_completions),
                                               *self._engine_only_sampling()) if on]
            if unsupported:
                raise ValueError(f"{', '.join(unsupported)}: not supported by ebft.mode = strided (the trainer "
                                 "generates its own fixed-length blocks, no vLLM, no KL or entropy term); turn "
                                 "them off")
            if self.model.attention == "flash_attention_2":
                raise ValueError("model.attention = flash_attention_2 cannot take the block-parallel mask of "
                                 "ebft.mode = strided; use sdpa or eager")

    def _check_transformers_backend(self) -> None:
        rollout = self.rollout
        unsupported = [key for key, on in (
            ("rollout.async_prefetch", rollout.async_prefetch),
            ("rollout.vllm_sync_interval > 1", rollout.vllm_sync_interval > 1),
            ("rollout.sampling.structured_outputs", rollout.sampling.structured_outputs is not None)) if on]
        if unsupported:
            raise ValueError(f"{', '.join(unsupported)}: not supported by rollout.backend = transformers (it samples "
                             "with the weights being trained, every step, without a grammar engine)")
        warpers = sorted(set(rollout.sampling.generation_kwargs) & TRANSFORMERS_WARPER_KEYS)
        if warpers:
            raise ValueError(f"rollout.sampling.generation_kwargs: {', '.join(warpers)} must be set in "
                             "rollout.sampling itself with rollout.backend = transformers (the sampling logprobs are "
                             "recorded after them)")

    def _engine_only_sampling(self) -> list[tuple[str, bool]]:
        """Sampling knobs only vLLM implements (ebft strided samples in the trainer: temperature, top_p, top_k)."""
        sampling = self.rollout.sampling
        return [("rollout.sampling.min_p", sampling.min_p > 0),
                ("rollout.sampling.repetition_penalty", sampling.repetition_penalty != 1),
                ("rollout.sampling.stop", bool(sampling.stop)),
                ("rollout.sampling.structured_outputs", sampling.structured_outputs is not None),
                ("rollout.sampling.generation_kwargs", bool(sampling.generation_kwargs))]

    @property
    def optimizer_updates(self) -> int:
        """Optimizer updates in the whole run (what the learning-rate schedule spans)."""
        return self.train.steps * self.algo.num_iterations * self.algo.steps_per_generation

    @property
    def prefetch_depth(self) -> int:
        """Jobs generated ahead of the trainer: 0 for the synchronous loop."""
        return self.rollout.prefetch_depth if self.rollout.async_prefetch else 0

    @property
    def max_staleness(self) -> int:
        if self.rollout.max_staleness is not None:
            return self.rollout.max_staleness
        # Partial rollouts: a group may be continued once, in the next batch, by a newer version.
        return (schedule_staleness(self.prefetch_depth, self.rollout.vllm_sync_interval)
                + (self.rollout.partial_rollout_tokens is not None))

    @property
    def output_dir(self) -> Path:
        return Path(self.logging.output_dir)
