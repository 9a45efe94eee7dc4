"""The training config: one YAML file, validated by pydantic, every field with help and a default.

`python -m driver.train --help` prints every key below; `--section.key=value` overrides one.
"""

from __future__ import annotations

from pathlib import Path
from typing import Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator, model_validator


class Section(BaseModel):
    model_config = ConfigDict(extra="forbid", validate_assignment=True)


class ModelConfig(Section):
    path: str = Field("tiny://qwen2", description="Hugging Face model directory, or tiny://qwen2 | tiny://llama | "
                      "tiny://qwen3-moe for a tiny random model built locally (no download)")
    dtype: Literal["float32", "bfloat16", "float16"] = Field(
        "float32", description="dtype of the trainer's weights and of vLLM's")
    qlora: bool = Field(False, description="train on an NF4-quantized base (pykernels.nn.NF4Linear, MoE experts as "
                        "NF4ExpertWeight on the grouped kernels); vLLM "
                        "serves the bf16 base + adapter and importance sampling absorbs the difference")
    qlora_blocksize: int = Field(64, description="NF4 block size for qlora (power of two, 32..4096)")
    attention: Literal["sdpa", "eager", "flash_attention_2"] = Field(
        "sdpa", description="transformers attention backend of the trainer")
    device: str = Field("auto", description="where the trainer runs: auto (cuda if available, else cpu), cpu, "
                        "cuda, cuda:1, ...")

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


class DataConfig(Section):
    source: str = Field("toy:digits", description="toy:<name> for a built-in toy set, or a local "
                        ".jsonl / .json / .parquet / .csv file read with `datasets`")
    prompt_field: str = Field("prompt", description="column holding the prompt text (after the transform)")
    transform: str | None = Field(None, description="dotted path to fn(example: dict) -> dict applied to "
                                  "every example, e.g. to build the prompt from other columns")
    chat_template: bool = Field(False, description="wrap prompts with the tokenizer's chat template")
    shuffle: bool = Field(True, description="shuffle the prompts every epoch (seeded)")
    max_prompt_length: int = Field(256, ge=1, description="prompts longer than this many tokens are cut from the left")


class RewardFunction(Section):
    path: str = Field(description="dotted path to fn(prompts, completions, **columns) -> list[float | None]")
    weight: float = Field(1.0, description="weight of this reward in the total")
    name: str | None = Field(None, description="name in the logs (default: the function's name)")


class RewardsConfig(Section):
    functions: list[RewardFunction] = Field(
        [RewardFunction(path="driver.toy_tasks.digit_fraction")], description="reward functions")
    aggregation: Literal["sum_then_normalize", "normalize_then_sum"] = Field(
        "sum_then_normalize", description="weighted-sum the rewards then normalize per group, or normalize "
        "each reward per group then sum")
    reward_num_workers: int = Field(0, ge=0, description="score groups in this many spawned worker processes, "
                                    "in parallel with generation (0: in the trainer's main thread)")
    reward_timeout: float = Field(120.0, gt=0, description="seconds one group's reward call may take in a worker; "
                                  "a hung or crashed worker is replaced and the group retried once")


class SamplingConfig(Section):
    temperature: float = Field(1.0, gt=0, description="sampling temperature (also used to score the policy)")
    top_p: float = Field(1.0, gt=0, le=1, description="nucleus sampling")
    top_k: int = Field(-1, description="top-k sampling (-1: off)")
    max_tokens: int = Field(32, ge=1, description="maximum completion length in tokens")


class RolloutConfig(Section):
    backend: Literal["colocate", "server"] = Field("colocate", description="in-process vLLM engine, or a vLLM "
                                                    "OpenAI server")
    server_url: str | None = Field(None, description="server backend: URL of a running vLLM server; empty "
                                   "launches one on 127.0.0.1")
    api_key: str | None = Field(None, description="server backend: API key of the server")
    server_timeout: float = Field(600.0, gt=0, description="seconds to wait for a launched server to be healthy")
    gpu_memory_utilization: float = Field(0.3, gt=0, le=1, description="vLLM memory fraction (on CPU: of one "
                                          "NUMA node's memory)")
    max_model_len: int = Field(512, ge=16, description="vLLM context length")
    sampling: SamplingConfig = Field(default_factory=SamplingConfig, description="sampling parameters")
    sync: Literal["auto", "lora", "weights"] = Field(
        "auto", description="how vLLM gets new weights: load each adapter version (lora), or merge it and "
        "overwrite the engine's weights in place (weights; colocate only); auto = weights for MoE on CPU")
    verify_sync: bool = Field(True, description="after every adapter sync, score a probe with vLLM and the "
                              "trainer and fail when vLLM still serves old weights")
    sync_tolerance: float = Field(1e-3, gt=0, description="largest probe logprob difference accepted as in sync")
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


class ImportanceSamplingConfig(Section):
    level: Literal["token", "sequence", "none"] = Field(
        "token", description="correct for the gap between vLLM's sampling logprobs and the trainer's: per token, "
        "per sequence, or not at all")
    mode: Literal["truncate", "mask"] = Field("truncate", description="ratios above cap are truncated to cap, or "
                                               "masked (weight 0)")
    cap: float = Field(2.0, gt=0, description="the cap C on importance ratios")


class AlgoConfig(Section):
    name: Literal["grpo"] = Field("grpo", description="algorithm (ebft lands with issue [7/8])")
    num_generations: int = Field(8, ge=2, description="completions per prompt (the group)")
    loss_type: Literal["grpo", "bnpo", "dr_grpo", "dapo"] = Field(
        "dapo", description="loss normalization: per sequence (grpo), per token in the micro-batch (bnpo), by "
        "batch x max length (dr_grpo), per token in the whole step (dapo)")
    epsilon: float = Field(0.2, ge=0, description="lower clip range of the policy ratio")
    epsilon_high: float | None = Field(None, description="upper clip range (default: epsilon; DAPO uses 0.28)")
    beta: float = Field(0.0, ge=0, description="KL (k3) coefficient against the base model (adapter disabled)")
    num_iterations: int = Field(1, ge=1, description="optimizer passes over each rollout batch (mu)")
    scale_rewards: Literal["group", "batch", "none"] = Field(
        "group", description="divide advantages by the reward std of the group, of the batch, or not (Dr. GRPO)")
    importance_sampling: ImportanceSamplingConfig = Field(default_factory=ImportanceSamplingConfig,
                                                          description="sampling-vs-trainer correction")
    off_policy_mask_threshold: float | None = Field(
        None, description="drop sequences with negative advantage whose mean KL(sampling || policy) exceeds this")
    skip_zero_advantage: bool = Field(True, description="skip the policy loss of micro-batches whose advantages "
                                      "are all zero (kept connected to the graph; not skipped when beta > 0)")
    filter_zero_advantage: bool = Field(True, description="remove completions with zero advantage (groups of equal "
                                        "rewards) before the update; the loss keeps the unfiltered step's "
                                        "normalization, so the update is unchanged (only applied when beta = 0)")
    replay_buffer_size: int = Field(0, ge=0, description="keep up to this many high-signal groups (sum |A| x reward "
                                    "std) and use them to refill the groups filtered for zero advantage (0: off)")
    replay_max_age: int = Field(4, ge=0, description="replayed groups are at most this many versions old")
    reroll_failed: bool = Field(False, description="groups that failed entirely (every total reward <= "
                                "reroll_threshold) come back later in training, when the policy may solve them")
    reroll_threshold: float = Field(0.0, description="a group failed entirely when every reward is <= this")
    reroll_after: float = Field(0.1, gt=0, le=1, description="re-roll a failed group after this fraction of "
                                "train.steps (at least prefetch_depth + 1 steps)")
    reroll_max_attempts: int = Field(2, ge=1, description="times one prompt is rolled at most")
    reroll_queue_size: int = Field(256, ge=1, description="failed prompts waiting at most")


class TrainConfig(Section):
    steps: int = Field(60, ge=1, description="optimizer steps")
    prompts_per_step: int = Field(8, ge=1, description="prompts sampled per step (each gets num_generations)")
    micro_batch_size: int = Field(16, ge=1, description="completions per forward/backward")
    gradient_accumulation_steps: int = Field(1, ge=1, description="rollout batches per optimizer step")
    lr: float = Field(5e-3, gt=0, description="AdamW learning rate")
    weight_decay: float = Field(0.0, ge=0, description="AdamW weight decay")
    schedule: Literal["constant", "linear", "cosine"] = Field("constant", description="learning-rate schedule")
    warmup_steps: int = Field(0, ge=0, description="linear warm-up steps")
    max_grad_norm: float | None = Field(1.0, description="gradient clipping norm (null: off)")
    seed: int = Field(0, description="seed for data order, sampling and initialization")
    kernels: Literal["auto", "reference"] = Field("auto", description="pykernels ops where they exist (fused "
                                                 "LoRA, NF4, logprobs, grouped MoE experts), or PEFT, transformers' "
                                                 "experts and the pure-torch references")


class LoggingConfig(Section):
    output_dir: str = Field("outputs/run", description="where metrics, checkpoints, plots and the resolved config go")
    progress: bool = Field(True, description="rich progress bar on the terminal")
    tensorboard: bool = Field(True, description="write TensorBoard events to output_dir/tensorboard")
    plots: bool = Field(True, description="write PNG plots of the main curves at the end")
    log_completions: int = Field(2, ge=0, description="sample completions printed every log_completions_every steps")
    log_completions_every: int = Field(10, ge=1, description="steps between printed sample completions")


class CheckpointConfig(Section):
    every: int = Field(0, ge=0, description="save a checkpoint every N steps (0: only at the end)")
    resume: str | None = Field(None, description="checkpoint directory to resume from, or 'latest'")
    keep: int = Field(2, ge=1, description="checkpoints kept on disk")


class Config(Section):
    model: ModelConfig = Field(default_factory=ModelConfig, description="the policy model")
    lora: LoraSettings = Field(default_factory=LoraSettings, description="the adapter")
    data: DataConfig = Field(default_factory=DataConfig, description="prompts")
    rewards: RewardsConfig = Field(default_factory=RewardsConfig, description="rewards")
    rollout: RolloutConfig = Field(default_factory=RolloutConfig, description="generation with vLLM")
    algo: AlgoConfig = Field(default_factory=AlgoConfig, description="the RL algorithm")
    train: TrainConfig = Field(default_factory=TrainConfig, description="optimization")
    logging: LoggingConfig = Field(default_factory=LoggingConfig, description="outputs")
    checkpoint: CheckpointConfig = Field(default_factory=CheckpointConfig, description="checkpoints")

    @model_validator(mode="after")
    def _check_consistency(self) -> Config:
        if self.algo.epsilon_high is not None and self.algo.epsilon_high < self.algo.epsilon:
            raise ValueError("algo.epsilon_high must be >= algo.epsilon")
        rollout = self.rollout
        if rollout.max_staleness is not None and rollout.max_staleness < self.schedule_staleness:
            raise ValueError(f"rollout.max_staleness = {rollout.max_staleness} would drop every batch: with "
                             f"prefetch_depth = {self.prefetch_depth} and vllm_sync_interval = "
                             f"{rollout.vllm_sync_interval} samples are {self.schedule_staleness} versions old "
                             "when trained on; raise it or lower those")
        if rollout.partial_rollout_tokens is not None and rollout.partial_rollout_tokens >= rollout.sampling.max_tokens:
            raise ValueError(f"rollout.partial_rollout_tokens = {rollout.partial_rollout_tokens} must be below "
                             f"rollout.sampling.max_tokens = {rollout.sampling.max_tokens} (or null for off)")
        return self

    @property
    def prefetch_depth(self) -> int:
        """Jobs generated ahead of the trainer: 0 for the synchronous loop."""
        return self.rollout.prefetch_depth if self.rollout.async_prefetch else 0

    @property
    def schedule_staleness(self) -> int:
        return self.prefetch_depth + self.rollout.vllm_sync_interval - 1

    @property
    def max_staleness(self) -> int:
        if self.rollout.max_staleness is not None:
            return self.rollout.max_staleness
        # Partial rollouts: a group may be continued once, in the next batch, by a newer version.
        return self.schedule_staleness + (self.rollout.partial_rollout_tokens is not None)

    @property
    def output_dir(self) -> Path:
        return Path(self.logging.output_dir)
