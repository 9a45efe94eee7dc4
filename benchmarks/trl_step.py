"""One GRPO + LoRA step, ours against TRL's GRPOTrainer with vLLM colocated, on CPU.

    .venv/bin/pip install trl==1.16.0                          # for this script only: not a dependency
    .venv/bin/python -m benchmarks.trl_step                     # tiny default, ~6 minutes on 2 cores
    .venv/bin/python -m benchmarks.trl_step --shape qwen2.5-1.5b --layers 2 --steps 6 --warmup 2

A script, not part of the gated suite: whole training runs (vLLM included) are timed, each in its own
process, one after the other and interleaved over --rounds (the machine's load drifts), and the table
gives per run the median over every round's steps after the warm-up of each phase:

- ours (`python -m driver.train examples/tiny-grpo.yaml`), once per rollout.weight_sync (adapter: vLLM's
  LoRA path; merged: base + adapter merged into the in-process engine): time/generation,
  time/sync, time/update (old logprobs, the loss passes, the optimizer) and the rest of time/step
  (rewards, advantages, batch assembly);
- TRL (`GRPOTrainer`, use_vllm=True, vllm_mode="colocate", LoRA through peft_config) with the same
  model, prompts (toy:digits), reward, group size, completion length, temperature, learning rate, loss
  (dapo) and micro-batching (per_device_train_batch_size = train.micro_batch_size, the gradient
  accumulation steps making one generated batch per optimizer step): its sync_weights (merge_adapter,
  the load into vLLM, unmerge_adapter; on CPU vLLM's reload_weights in place of its load_weights, which
  fails there: trl_worker says why), its vLLM generate, the rest of _generate_and_score_completions
  (rewards, the old-logprob pass of its importance-sampling correction) and the training micro-steps
  with the optimizer step. Its engine gets the driver's dtype (TRL passes none, and vLLM on CPU would
  serve the float32 model in bfloat16).

`--shape qwen2.5-1.5b` builds a random model with Qwen2.5-1.5B's layer shapes (hidden 1536, MLP 8960,
12 heads, 2 KV heads; the tiny tokenizer's 384-token vocabulary, untied embeddings) and `--layers` of
its 28 layers: what fits a few minutes per run on 2 cores. The last column is the largest |sampling -
trainer| logprob gap of the run (an engine that stops following the trainer shows there).
"""

from __future__ import annotations

import argparse
import functools
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
EXAMPLE = ROOT / "examples" / "tiny-grpo.yaml"
QUIET = ["--logging.progress=false", "--logging.log_completions=0", "--logging.plots=false",
         "--logging.report_to=[]", "--checkpoint.every=0"]
RUNS = ("ours-adapter", "ours-merged", "trl")
PHASES = ("step", "generation", "sync", "update", "rest")
# Qwen2.5-1.5B's config.json, less its vocabulary (151936) and depth (28 layers).
QWEN25_15B = dict(hidden_size=1536, intermediate_size=8960, num_attention_heads=12, num_key_value_heads=2,
                  rope_theta=1000000.0, rms_norm_eps=1e-6, max_position_embeddings=1024, tie_word_embeddings=False)


def shaped_model(shape: str, layers: int) -> str:
    """A random model directory of `shape`'s layers (built once into the pykernels cache)."""
    if shape.startswith("tiny://"):
        from driver.data.tiny_model import resolve_model_path

        return resolve_model_path(shape)
    import torch
    import transformers

    from driver.data.tiny_model import build_tokenizer, cache_root

    target = cache_root() / "bench-models" / f"{shape}-{layers}layers"
    if (target / "config.json").exists():
        return str(target)
    tokenizer = build_tokenizer()
    config = transformers.Qwen2Config(vocab_size=len(tokenizer), num_hidden_layers=layers,
                                      bos_token_id=tokenizer.bos_token_id, eos_token_id=tokenizer.eos_token_id,
                                      pad_token_id=tokenizer.pad_token_id, **QWEN25_15B)
    torch.manual_seed(0)
    model = transformers.Qwen2ForCausalLM(config).to(torch.float32)
    model.save_pretrained(target, safe_serialization=True)
    tokenizer.save_pretrained(target)
    return str(target)


def ours(run: str, model: str, steps: int, output_dir: Path) -> list[dict]:
    mode = run.removeprefix("ours-")
    command = [sys.executable, "-m", "driver.train", str(EXAMPLE), f"--train.steps={steps}", f"--model.path={model}",
               f"--rollout.weight_sync={mode}", f"--logging.output_dir={output_dir}", *QUIET]
    subprocess.run(command, cwd=ROOT, check=True, capture_output=True, text=True)
    rows = [json.loads(line) for line in (output_dir / "metrics.jsonl").read_text().splitlines()]
    return [{"step": row["time/step"], "generation": row["time/generation"], "sync": row.get("time/sync", 0.0),
             "update": row["time/update"],
             "rest": row["time/step"] - row["time/generation"] - row.get("time/sync", 0.0) - row["time/update"],
             "gap": row.get("sampling/sampling_logp_difference/max")} for row in rows]


def trl(model: str, steps: int, output_dir: Path) -> list[dict]:
    out = output_dir / "trl_steps.jsonl"
    command = [sys.executable, "-m", "benchmarks.trl_step", "--trl-worker", "--model", model, "--steps", str(steps),
               "--out", str(out)]
    result = subprocess.run(command, cwd=ROOT, capture_output=True, text=True)
    if result.returncode != 0:
        raise RuntimeError(f"TRL's run failed:\n{result.stderr[-4000:]}")
    return [json.loads(line) for line in out.read_text().splitlines()]


def trl_worker(model: str, steps: int, out: Path) -> None:
    """TRL's GRPOTrainer on the tiny default's settings; one JSON line of phase times per optimizer step."""
    os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")  # as the driver (driver/engine/colocate.py)
    os.environ.setdefault("VLLM_LOGGING_LEVEL", "WARNING")
    from datasets import Dataset
    from peft import LoraConfig
    from transformers import TrainerCallback
    from trl import GRPOConfig, GRPOTrainer

    from driver.cli import load_config
    from driver.data.toy_tasks import digit_fraction, toy_dataset

    config = load_config(EXAMPLE, {"model.path": model})
    import trl.generation.vllm_generation as trl_vllm

    # TRL passes no dtype and vLLM on CPU serves a float32 checkpoint in bfloat16: the driver's dtype instead.
    trl_vllm.LLM = functools.partial(trl_vllm.LLM, dtype=config.model.dtype)
    train, algo, sampling = config.train, config.algo, config.rollout.sampling
    rows = train.prompts_per_step * algo.num_generations
    args = GRPOConfig(
        output_dir=str(out.parent / "trl"), use_cpu=True, bf16=False, report_to="none", save_strategy="no",
        logging_steps=1, max_steps=steps, seed=train.seed, learning_rate=train.lr,
        per_device_train_batch_size=train.micro_batch_size, gradient_accumulation_steps=rows // train.micro_batch_size,
        num_generations=algo.num_generations, max_completion_length=sampling.max_tokens,
        temperature=sampling.temperature, loss_type=algo.loss_type, beta=algo.beta,
        use_vllm=True, vllm_mode="colocate", vllm_gpu_memory_utilization=config.rollout.gpu_memory_utilization,
        vllm_max_model_length=config.rollout.max_model_len, dataloader_num_workers=0)
    lora = LoraConfig(r=config.lora.r, lora_alpha=config.lora.alpha, lora_dropout=config.lora.dropout,
                      target_modules=list(config.lora.targets), task_type="CAUSAL_LM")
    trainer = GRPOTrainer(model=model, reward_funcs=[digit_fraction], args=args, peft_config=lora,
                          train_dataset=Dataset.from_list(toy_dataset("digits")))
    spent = {"generation": 0.0, "sync": 0.0, "prepare": 0.0}
    vllm = trainer.vllm_generation

    def sync_weights() -> None:
        """TRL's sync_weights with its one call that fails on CPU replaced: `model.load_weights` on the live
        vLLM model raises there ('Parameter' object has no attribute 'weight_loader': vLLM on CPU has moved
        the linear weights into oneDNN handles), so the same (name, merged tensor) stream, TRL's own
        merge_adapter / unmerge_adapter around it, goes through vLLM's in-place reload_weights instead (the
        call our colocated merged engine makes, driver/engine/weight_sync.py)."""
        worker = vllm.llm.llm_engine.model_executor.driver_worker.worker
        worker.reload_weights(weights_iterator=vllm._iter_named_params(), is_checkpoint_format=True)
        vllm.llm.reset_prefix_cache()

    vllm.sync_weights = sync_weights

    def timed(owner, name: str, phase: str) -> None:
        original = getattr(owner, name)

        def wrapper(*args, **kwargs):
            started = time.perf_counter()
            try:
                return original(*args, **kwargs)
            finally:
                spent[phase] += time.perf_counter() - started

        setattr(owner, name, wrapper)

    timed(trainer.vllm_generation, "sync_weights", "sync")
    timed(trainer.vllm_generation, "generate", "generation")
    timed(trainer, "_generate_and_score_completions", "prepare")

    started = [0.0]

    def step_begins(*_, **__) -> None:
        spent.update(generation=0.0, sync=0.0, prepare=0.0)
        started[0] = time.perf_counter()

    def step_ends(*_, **__) -> None:
        step = time.perf_counter() - started[0]
        with out.open("a") as log:
            log.write(json.dumps({"step": step, "generation": spent["generation"], "sync": spent["sync"],
                                  "update": step - spent["prepare"],
                                  "rest": spent["prepare"] - spent["generation"] - spent["sync"]}) + "\n")

    # The trainer's callback handler calls the hooks by name.
    trainer.add_callback(type("StepTimes", (TrainerCallback,), {"on_step_begin": step_begins,
                                                                "on_step_end": step_ends}))
    trainer.train()
    gaps = [entry["sampling/sampling_logp_difference/max"] for entry in trainer.state.log_history
            if "sampling/sampling_logp_difference/max" in entry]
    times = [json.loads(line) for line in out.read_text().splitlines()]
    out.write_text("".join(json.dumps({**row, "gap": gap}) + "\n" for row, gap in zip(times, gaps + [None] * steps)))


def median(rows: list[dict], key: str) -> float:
    return statistics.median(row[key] for row in rows)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--shape", default="tiny://qwen2", help="tiny://<name>, or qwen2.5-1.5b (with --layers)")
    parser.add_argument("--layers", type=int, default=2, help="qwen2.5-1.5b: layers built (of its 28)")
    parser.add_argument("--steps", type=int, default=16)
    parser.add_argument("--warmup", type=int, default=4, help="first steps left out of the medians")
    parser.add_argument("--rounds", type=int, default=2, help="each run this many times, interleaved")
    parser.add_argument("--runs", default=",".join(RUNS), help=f"a subset of {', '.join(RUNS)}")
    parser.add_argument("--trl-worker", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--model", help=argparse.SUPPRESS)
    parser.add_argument("--out", type=Path, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.trl_worker:
        trl_worker(args.model, args.steps, args.out)
        return
    model = shaped_model(args.shape, args.layers)
    runs = args.runs.split(",")
    steps: dict[str, list[dict]] = {run: [] for run in runs}
    rounds: dict[str, list[float]] = {run: [] for run in runs}  # each round's median s/step
    for round_index in range(args.rounds):
        for run in runs:
            with tempfile.TemporaryDirectory() as output_dir:
                rows = (trl(model, args.steps, Path(output_dir)) if run == "trl"
                        else ours(run, model, args.steps, Path(output_dir) / "run"))
            kept = rows[args.warmup:]
            steps[run] += kept
            rounds[run].append(median(kept, "step"))
            print(f"round {round_index + 1} {run:13} " + " ".join(f"{phase} {median(kept, phase):.3f}"
                                                                for phase in PHASES), flush=True)
    label = args.shape if args.shape.startswith("tiny://") else f"{args.shape} ({args.layers} layers)"
    print(f"\n{label}: median s/step over steps {args.warmup + 1}..{args.steps} of {args.rounds} round(s)")
    print("(vs TRL: TRL's median s/step over ours; per round: the median of the rounds' ratios, each round's "
          "runs back to back)")
    print("| run | " + " | ".join(PHASES) + " | vs TRL | vs TRL per round | max IS gap |")
    print("|---|" + "---:|" * (len(PHASES) + 3))
    reference = median(steps["trl"], "step") if "trl" in steps else None
    for run, rows in steps.items():
        gaps = [row["gap"] for row in rows if row.get("gap") is not None]
        speedup = f"{reference / median(rows, 'step'):.2f}x" if reference else "-"
        per_round = (f"{statistics.median(t / o for t, o in zip(rounds['trl'], rounds[run])):.2f}x" if reference
                     else "-")
        gap = f"{max(gaps):.2g}" if gaps else "-"
        print(f"| {run} | " + " | ".join(f"{median(rows, phase):.3f}" for phase in PHASES)
              + f" | {speedup} | {per_round} | {gap} |")


if __name__ == "__main__":
    main()
