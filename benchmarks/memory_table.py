"""Peak memory of the policy update under each training option, on the tiny models: docs/memory.md's table.

    .venv/bin/python -m benchmarks.memory_table                                  # ~2.5 minutes on 2 cores
    .venv/bin/python -m benchmarks.memory_table --models tiny://qwen3-moe-wide   # ~1.5 minutes

A script, not part of the gated suite. Each (model, option) runs in a process of its own, as a
training run would: the config built as the CLI builds it (the model's example YAML plus the
option's `--key=value` overrides), train.kernels applied and the policy loaded as driver/train.py
does, then driver.update.step.optimize UPDATES times on a synthetic rollout batch of the config's
size (train.prompts_per_step x algo.num_generations rows, PROMPT_TOKENS-token prompts, completions
of rollout.sampling.max_tokens tokens: the longest a step can see). No vLLM: the trainer's memory.

- model, trainable: bytes of the loaded policy's tensors (NF4 weights included), of the adapter's.
- update peak: the peak above what was in use before the first update, over every update (the
  optimizer's states, created at the first one, included). CUDA: torch.cuda.max_memory_allocated.
  CPU: the process's peak resident set (VmHWM, reset through /proc/self/clear_refs): torch does not
  count CPU allocations, so the resident set is the honest number. It also holds allocator slack and
  thread stacks; allocations of 1 MiB or more are fresh mmaps here
  (benchmarks.conftest.pin_fresh_allocations), so freed buffers leave it.
"""

from __future__ import annotations

import argparse
import gc
import multiprocessing
import os
import platform
import sys
import time
from concurrent.futures import ProcessPoolExecutor
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
PROMPT_TOKENS = 32
UPDATES = 2  # the first creates the optimizer's states; the second is a steady-state step
PRELOAD = ["torch", "transformers", "peft", "pykernels", "benchmarks.conftest", "driver.cli", "driver.policy.model",
           "driver.update.step"]
MODELS = {  # model -> (the example config it trains with, overrides)
    "tiny://qwen2": ("examples/tiny-grpo.yaml", ""),
    "tiny://qwen2-wide": ("examples/tiny-grpo.yaml", "--model.path=tiny://qwen2-wide"),
    "tiny://qwen3-moe": ("examples/tiny-moe-grpo.yaml", ""),
    "tiny://qwen3-moe-wide": ("examples/tiny-moe-grpo.yaml", "--model.path=tiny://qwen3-moe-wide"),
}
DEFAULT_MODELS = ["tiny://qwen2", "tiny://qwen2-wide", "tiny://qwen3-moe"]  # the wide MoE: 1.5 minutes more
DENSE, MOE = ("tiny://qwen2", "tiny://qwen2-wide"), ("tiny://qwen3-moe", "tiny://qwen3-moe-wide")
WIDE = ("tiny://qwen2-wide",)  # the tiny models' adapters hold 0.1-0.3 MiB: no optimizer state to compare
# One line per option: its overrides of the example config ("": the example as it is) and the models it
# applies to.
OPTIONS = [
    ("", DENSE + MOE),
    ("--model.gradient_checkpointing=true", DENSE + MOE),
    ("--model.qlora=true", DENSE + MOE),
    ("--train.optim=adamw_torch", WIDE),
    ("--train.optim=adamw_8bit", WIDE),
    ("--train.optim=paged_adamw_8bit", WIDE),
    ("--train.kernel_ops.lora=torch", DENSE + MOE),
    ("--train.kernel_ops.moe=torch", MOE),
    ("--train.kernels=reference", DENSE + MOE),
    ("--train.micro_batch_size=8", DENSE),
    ("--train.micro_batch_size=64", DENSE),
    ("--model.adapter=none", DENSE),  # full fine-tuning: every weight trains
    ("--model.adapter=none --algo.beta=0.04", DENSE),  # ... and a frozen copy of the base for the KL
    ("--model.adapter=none --train.optim=adamw_8bit", WIDE),
]


def synthetic_batch(config, vocab_size: int):
    """A full step's rollout batch: every completion max_tokens long, advantages of both signs (no
    micro-batch is skipped), a uniform sampler's logprobs (values change no tensor's size)."""
    import torch

    from driver.rollouts.batch import RolloutBatch

    rows = config.train.prompts_per_step * config.algo.num_generations
    length = config.rollout.sampling.max_tokens
    generator = torch.Generator().manual_seed(0)
    prompts = torch.randint(0, vocab_size, (rows, PROMPT_TOKENS), generator=generator).tolist()
    completions = torch.randint(0, vocab_size, (rows, length), generator=generator).tolist()
    sampling_logprobs = torch.full((rows, length), -float(torch.log(torch.tensor(vocab_size))))
    advantages = torch.where(torch.arange(rows) % 2 == 0, 1.0, -1.0)
    return RolloutBatch(prompts, completions, sampling_logprobs, torch.ones(rows, length), advantages)


def tensors_of(model) -> list:
    """Every tensor the model holds: parameters, buffers, and the NF4 weights of QLoRA's NF4Linear
    layers (an NF4Weight, neither a parameter nor a buffer)."""
    import dataclasses

    import torch

    from pykernels.nf4 import NF4Weight

    tensors = [*model.parameters(), *model.buffers()]
    for module in model.modules():
        weight = getattr(module, "weight", None)
        if isinstance(weight, NF4Weight):
            tensors += [value for value in (getattr(weight, f.name) for f in dataclasses.fields(weight))
                        if isinstance(value, torch.Tensor)]
    return tensors


def storage_bytes(tensors: list) -> int:
    """Bytes of the distinct storages behind `tensors` (a tied or shared weight counts once)."""
    storages = {tensor.untyped_storage().data_ptr(): tensor.untyped_storage().nbytes() for tensor in tensors}
    return sum(storages.values())


def measure(argv: list[str]) -> dict:
    """One (model, option) in this process: {model_bytes, trainable_bytes, update_bytes, seconds_per_update}."""
    import torch
    import transformers

    from benchmarks.conftest import peak_extra_memory, pin_fresh_allocations

    pin_fresh_allocations()
    transformers.utils.logging.disable_progress_bar()

    import pykernels
    from driver.cli import config_from_argv
    from driver.policy.model import kernel_modes, load_policy, resolve_device
    from driver.update.optim import build_optimizer, build_scheduler
    from driver.update.step import optimize

    config = config_from_argv(argv)
    torch.manual_seed(config.train.seed)
    pykernels.backend.set_kernels(**kernel_modes(config))
    device = resolve_device(config.model.device)
    policy = load_policy(config)
    tensors = tensors_of(policy.model)
    if policy.frozen_reference is not None:  # full fine-tuning with a KL term: the base's frozen copy
        tensors += tensors_of(policy.frozen_reference)
    with torch.no_grad():  # fault in weights that loaded as a memory map of the file: before, not during, the update
        for tensor in tensors:
            tensor.sum()
    optimizer = build_optimizer(policy.trainable_parameters(), config.train)
    scheduler = build_scheduler(optimizer, config.train, UPDATES)
    batch = synthetic_batch(config, len(policy.tokenizer))
    gc.collect()
    started = time.perf_counter()
    update_bytes = peak_extra_memory(
        lambda: [optimize(config, policy, batch, optimizer, scheduler) for _ in range(UPDATES)], device)
    return {"model_bytes": storage_bytes(tensors), "trainable_bytes": storage_bytes(policy.trainable_parameters()),
            "update_bytes": update_bytes, "seconds_per_update": (time.perf_counter() - started) / UPDATES}


def measure_case(model: str, option: str, threads: int) -> dict:
    """measure() of one case, in a pool worker process of its own; a failure becomes {"error": message}."""
    import torch

    torch.set_num_threads(threads)
    config, model_overrides = MODELS[model]
    try:
        return measure([str(ROOT / config), *model_overrides.split(), *option.split()])
    except Exception as error:  # one failing option (e.g. a missing package) is one row of the table
        return {"error": f"{type(error).__name__}: {' '.join(str(error).split())[:200]}"}


def mib(value: int | None) -> str:
    return "n/a" if value is None else f"{value / 2**20:.1f}"


def table(models: list[str], jobs: int) -> str:
    """The markdown table, its cases run `jobs` at a time (each on cpu_count / jobs threads)."""
    cases = [(model, option) for model in models for option, applies_to in OPTIONS if model in applies_to]
    threads = max(1, (os.cpu_count() or 1) // jobs)
    # Each case in a process of its own, forked from a server that imported the libraries and ran
    # nothing: fresh memory and peak for every case without paying torch's import each time.
    context = multiprocessing.get_context("forkserver")
    context.set_forkserver_preload(PRELOAD)
    with ProcessPoolExecutor(jobs, mp_context=context, max_tasks_per_child=1) as pool:
        futures = [pool.submit(measure_case, model, option, threads) for model, option in cases]
        results = []
        for index, ((model, option), future) in enumerate(zip(cases, futures)):
            results.append(future.result())
            print(f"[{index + 1}/{len(cases)}] {model} {option or '(the example config)'}", file=sys.stderr, flush=True)
    lines = ["| model | option | model (MiB) | trainable (MiB) | update peak (MiB) | vs. the example config | "
             "s / update |", "|---|---|---:|---:|---:|---:|---:|"]
    baselines = {model: result["update_bytes"] for (model, option), result in zip(cases, results)
                 if not option and "error" not in result}
    for (model, option), result in zip(cases, results):
        label = f"`{option}`" if option else "the example config"
        if "error" in result:
            lines.append(f"| `{model}` | {label} | failed: {result['error']} | | | | |")
            continue
        peak, baseline = result["update_bytes"], baselines.get(model)
        ratio = f"{peak / baseline:.2f}x" if peak is not None and baseline else ""
        lines.append(f"| `{model}` | {label} | {mib(result['model_bytes'])} | {mib(result['trainable_bytes'])} | "
                     f"{mib(peak)} | {ratio} | {result['seconds_per_update']:.1f} |")
    return "\n".join(lines)


def machine() -> str:
    import torch

    if torch.cuda.is_available():
        return f"{torch.cuda.get_device_name()}, torch {torch.__version__}"
    try:
        with open("/proc/cpuinfo") as cpuinfo:
            cpu = next(line.split(":", 1)[1].strip() for line in cpuinfo if line.startswith("model name"))
    except (OSError, StopIteration):
        cpu = platform.machine()
    return f"{cpu}, {os.cpu_count()} cores, no GPU, torch {torch.__version__}"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--models", nargs="+", choices=list(MODELS), default=DEFAULT_MODELS)
    parser.add_argument("--jobs", type=int, default=2, help="cases measured at once (memory is per process)")
    args = parser.parse_args()
    started = time.perf_counter()
    print(table(args.models, args.jobs))
    print(f"\n{machine()}; {UPDATES} updates per case, prompts of {PROMPT_TOKENS} tokens; "
          f"{time.perf_counter() - started:.0f} s in all")


if __name__ == "__main__":
    main()
