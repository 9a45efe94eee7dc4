"""The policy loss, EBFT, the batch arithmetic, the optimizer and the outputs of an axolotl config,
translated; and the keys that change nothing here."""

from __future__ import annotations

from driver.axolotl.keys import (AXOLOTL_DEFAULTS, EBFT_STRIDED_ONLY, EBFT_STRUCTURED_ONLY, OPTIMIZERS, SCHEDULES,
                                 WITHOUT_EFFECT)
from driver.axolotl.pending import PendingKeys


# TRL's adaptive entropy control, the same names in the algo section.
TRL_ENTROPY_CONTROL = ("use_adaptive_entropy", "entropy_coef_min", "entropy_coef_max", "entropy_coef_delta",
                       "entropy_target")


class TrainingKeys(PendingKeys):
    def policy_loss(self) -> None:
        trl_beta, rl_beta = self.take("trl.beta"), self.take("rl_beta")
        beta = trl_beta if trl_beta is not None else rl_beta
        if beta is not None:
            self.put("algo.beta", beta)
        for key in ("epsilon", "epsilon_high", "loss_type", "importance_sampling_level", "mask_truncated_completions",
                    "off_policy_mask_threshold", "top_entropy_quantile", "entropy_coef", *TRL_ENTROPY_CONTROL):
            value = self.take(f"trl.{key}")
            if value is not None:
                self.put(f"algo.{key}", value)
        self.num_iterations = self.take("trl.num_iterations", 1)
        if self.num_iterations != 1:
            self.put("algo.num_iterations", self.num_iterations)
        scale = self.take("trl.scale_rewards")
        scale = {True: "group", False: "none"}.get(scale, scale) if isinstance(scale, bool) else scale
        if scale is not None and scale != "group":
            if self.method == "ebft":
                self.refuse("trl.scale_rewards", f"{scale}: ebft's advantages here are ebft.advantage_estimator's "
                            "(rloo, group_norm, reinforce)")
            else:
                self.put("algo.scale_rewards", scale)
        self.sync_ref_model()
        if self.take("trl.use_bias_correction_kl", False):
            self.put("algo.use_bias_correction_kl", True)
        asynchronous = self.asynchronous()
        self.importance_sampling(asynchronous)
        # With beta = 0, filtering (ours), skipping or keeping zero-advantage rows is the same update; with
        # a KL term, axolotl's skip (its default) drops their KL as our skip does.
        skip = self.take("trl.skip_zero_advantage_batches", True)
        if beta:
            self.put("algo.zero_advantage", "skip" if skip else "keep")
        self.replay_and_reroll()


    def sync_ref_model(self) -> None:
        """TRL's moving reference: under full fine-tuning (no adapter), as TRL runs it; its ref_model_* keys without
        it change nothing (taken by without_effect)."""
        if not self.take("trl.sync_ref_model", False):
            return
        if self.out.get("model", {}).get("adapter") != "none":
            self.refuse("trl.sync_ref_model", "with an adapter the KL reference is the base with the adapter off "
                        "(TRL refuses sync_ref_model with PEFT too); here it runs under full fine-tuning")
            return
        self.put("algo.sync_ref_model", True)
        for key in ("ref_model_mixup_alpha", "ref_model_sync_steps"):
            value = self.take(f"trl.{key}")
            if value is not None:
                self.put(f"algo.{key}", value)

    def replay_and_reroll(self) -> None:
        size = self.take("trl.replay_buffer_size", 0)
        if size:
            self.put("algo.replay_buffer_size", size)
            self.notes.append("trl.replay_buffer_size: replayed groups older than algo.replay_max_age versions are "
                              "evicted here (axolotl keeps them)")
        if self.take("trl.replay_recompute_logps", True) is not True:
            self.refuse("trl.replay_recompute_logps", "replayed groups' logprobs are always recomputed here")
        fraction, groups = self.take("trl.reroll_start_fraction", 1.0), self.take("trl.reroll_max_groups", 1)
        if fraction < 1:
            self.put("algo.reroll_failed", True)
            self.put("algo.reroll_start_fraction", fraction)
            self.put("algo.reroll_max_groups", groups)
            self.put("algo.reroll_after", 0.0)  # axolotl queues a failed prompt for the next batch it makes
            self.notes.append("trl.reroll_start_fraction: a failed group (every total reward <= 0 here; axolotl: "
                              "every reward exactly 0) comes back from that point of the run on, at most "
                              "reroll_max_groups per step, ahead of fresh prompts (axolotl overwrites fresh ones), "
                              "at most algo.reroll_max_attempts times, from a queue of algo.reroll_queue_size "
                              "(axolotl: no limits)")


    def ebft(self) -> None:
        """The ebft: section; the keys of the other mode are ignored, as axolotl ignores them."""
        renamed = {"use_whitening": "whitening"}
        common = ("feature_layers", "embed_method", "use_whitening", "alignment_coef", "diversity_coef",
                  "advantage_estimator")
        own = (("stride", "context_length", "generate_max_len", "rl_coef", "min_completion_prefix", "ce_coef")
               if self.strided else ("gt_length_multiplier",))
        for key in (*common, *own):
            value = self.take(f"ebft.{key}")
            if value is not None:
                self.put(f"ebft.{renamed.get(key, key)}", value)
        if not self.strided and not self.take("ebft.adaptive_max_tokens", True):
            self.put("ebft.gt_length_multiplier", None)
        if not self.strided and "advantage_estimator" not in self.out.get("ebft", {}):
            # axolotl's structured trainer hands its rewards to TRL's GRPO: (r - mean) / std per group
            self.put("ebft.advantage_estimator", "group_norm")
        if self.take("ebft.mask_thinking_ce", False):
            self.refuse("ebft.mask_thinking_ce", "not here")
        other_mode = EBFT_STRUCTURED_ONLY if self.strided else EBFT_STRIDED_ONLY
        ignored = [f"ebft.{key}" for key in other_mode if self.take(f"ebft.{key}") is not None]
        if ignored:
            self.notes.append(f"{', '.join(ignored)}: ignored, ebft mode {'strided' if self.strided else 'structured'} "
                              "does not use them (nor does axolotl)")

    def batches(self, num_generations: int) -> None:
        """TRL: one optimizer step takes gradient_accumulation_steps micro-batches of micro_batch_size
        completions, all from one generated batch of generation_batch_size (default: their product)
        completions. Here that batch is one train step of prompts_per_step prompts, its optimizer steps
        algo.steps_per_generation, so train.gradient_accumulation_steps stays 1. Strided EBFT: a
        micro-batch is micro_batch_size documents, each with num_generations samples."""
        micro, accumulation = self.take("micro_batch_size", 1), self.take("gradient_accumulation_steps", 1)
        max_steps, epochs = self.take("max_steps"), self.take("num_epochs")
        per_step = micro * accumulation
        if self.strided:
            self.put("train.prompts_per_step", per_step)
            self.put("train.micro_batch_size", micro * num_generations)
            steps_per_generation = 1
        else:
            given = self.take("trl.generation_batch_size")
            generated = given or per_step
            steps_per_generation = max(1, generated // per_step)
            if generated % num_generations:
                source = "trl.generation_batch_size" if given else (f"micro_batch_size x gradient_accumulation_steps "
                                                                     f"= {micro} x {accumulation}")
                self.refuse("trl.generation_batch_size" if given else "micro_batch_size",
                            f"{generated} completions per generated batch ({source}) is not a multiple of "
                            f"trl.num_generations = {num_generations}, as TRL requires")
            elif generated % per_step:
                self.refuse("trl.generation_batch_size", f"{generated} is not a whole number of optimizer steps of "
                            f"micro_batch_size x gradient_accumulation_steps = {per_step} completions")
            self.put("train.prompts_per_step", max(1, generated // num_generations))
            self.put("train.micro_batch_size", micro)
            if steps_per_generation > 1:
                self.put("algo.steps_per_generation", steps_per_generation)
        if accumulation > 1:
            self.notes.append(f"gradient_accumulation_steps {accumulation}: one train step here generates "
                              f"{per_step * steps_per_generation} {'documents' if self.strided else 'completions'} "
                              "and makes the optimizer step(s) axolotl makes of them, so "
                              "train.gradient_accumulation_steps stays 1")
        updates = self.num_iterations * steps_per_generation
        self.max_steps, self.updates_per_step = max_steps, updates
        if max_steps is None and epochs is not None:  # counted in steps once the run has read the data
            self.put("train.epochs", epochs)
        elif max_steps is None:
            self.refuse("max_steps", "missing (nor num_epochs)")
        elif max_steps % updates:
            self.refuse("max_steps", f"{max_steps} optimizer steps are not a whole number of generated batches of "
                        f"{updates} (trl.num_iterations x steps per generated batch)")
        else:
            self.put("train.steps", max_steps // updates)

    def evaluation(self) -> None:
        """val_set_size (prompts held out of the data) evaluated every eval_steps optimizer steps (a fraction of
        max_steps below 1, as transformers reads it); after batches(), whose train step may hold several."""
        size, every, per_epoch = self.take("val_set_size", 0), self.take("eval_steps"), self.take("evals_per_epoch")
        if not size:
            if every is not None or per_epoch is not None:
                self.notes.append("eval_steps / evals_per_epoch: ignored without val_set_size (axolotl then has "
                                  "nothing to evaluate either)")
            return
        if self.method == "ebft":
            self.refuse("val_set_size", "evaluation here scores with reward functions (rl: grpo); ebft has none")
        elif per_epoch is not None:
            self.refuse("evals_per_epoch", "an epoch's length depends on the dataset's size, which translating does "
                        "not read; give eval_steps (optimizer steps between evaluations)")
        elif every is None:
            self.refuse("val_set_size", "without eval_steps axolotl evaluates every epoch, whose length translating "
                        "does not know; add eval_steps (optimizer steps between evaluations)")
        elif self.max_steps is not None:
            steps = round(every * self.max_steps) if 0 < every < 1 else every
            if steps < 1 or steps % self.updates_per_step:
                self.refuse("eval_steps", f"{every}: not a whole number of train steps here, each "
                            f"{self.updates_per_step} optimizer step(s) (trl.num_iterations x steps per generated "
                            "batch)")
            else:
                self.put("eval.steps", steps // self.updates_per_step)
                self.put("eval.val_set_size", size)

    def optimizer(self) -> None:
        lr = self.take("learning_rate")
        try:
            self.put("train.lr", float(lr))
        except (TypeError, ValueError):
            self.refuse("learning_rate", "missing" if lr is None else f"{lr}: not a number")
        optimizer = self.take("optimizer", "adamw_torch_fused")
        if optimizer not in OPTIMIZERS:
            self.refuse("optimizer", f"{optimizer}: {', '.join(OPTIMIZERS)}")
        elif OPTIMIZERS[optimizer] != "adamw_torch_fused":
            self.put("train.optim", OPTIMIZERS[optimizer])
        schedule = self.take("lr_scheduler", AXOLOTL_DEFAULTS["lr_scheduler"])
        if schedule not in SCHEDULES:
            self.refuse("lr_scheduler", f"{schedule}: {', '.join(SCHEDULES)}")
        else:
            self.put("train.schedule", SCHEDULES[schedule])
        self.warmup(schedule)
        for key in ("weight_decay", "max_grad_norm", "adam_beta1", "adam_beta2", "adam_epsilon"):
            value = self.take(key)
            if value is not None:
                self.put(f"train.{key}", value)
        min_lr_ratio = self.take("cosine_min_lr_ratio")
        if min_lr_ratio is not None and schedule != "cosine":
            self.refuse("cosine_min_lr_ratio", f"only with lr_scheduler cosine, not {schedule}")
        elif min_lr_ratio is not None:
            self.put("train.min_lr_rate", min_lr_ratio)
        if self.take("lr_scheduler_kwargs"):
            self.refuse("lr_scheduler_kwargs", "the schedules here take no arguments")
        self.put("train.seed", self.take("seed", AXOLOTL_DEFAULTS["seed"]))

    def warmup(self, schedule: str) -> None:
        """axolotl's warm-up: warmup_steps, else warmup_ratio x max_steps, else 3% of max_steps (at most 100);
        1 becomes 2. transformers' constant schedule has none."""
        steps, ratio, total = self.take("warmup_steps"), self.take("warmup_ratio"), self.max_steps or 0
        if self.max_steps is None and steps is None and schedule != "constant":  # num_epochs: no step count yet
            self.put("train.warmup_ratio", 0.03 if ratio is None else ratio)
            self.notes.append(f"warmup_ratio {0.03 if ratio is None else ratio} (num_epochs): rounded up here, down "
                              "in axolotl" + ("; axolotl's default also caps it at 100 steps" if ratio is None else ""))
            return
        if steps is not None:
            warmup = steps
        elif ratio is not None:
            warmup = max(int(ratio * total), 0)
        else:
            warmup = min(int(0.03 * total), 100)
        if schedule == "constant":
            warmup = 0
        if warmup:
            self.put("train.warmup_steps", 2 if warmup == 1 else warmup)

    def outputs(self) -> None:
        self.put("logging.output_dir", str(self.take("output_dir", AXOLOTL_DEFAULTS["output_dir"])))
        trackers = ["tensorboard"] if self.take("use_tensorboard", False) else []
        project, run_name, use_wandb = self.take("wandb_project"), self.take("wandb_name"), self.take("use_wandb")
        if project or use_wandb:  # axolotl reports to wandb when a project is named
            trackers.append("wandb")
            if project:
                self.put("logging.project", project)
            if run_name:
                self.put("logging.run_name", run_name)
        self.put("logging.report_to", trackers)
        for key in ("wandb_entity", "wandb_run_id", "wandb_watch", "wandb_log_model", "wandb_mode"):
            if self.take(key) is not None:
                self.refuse(key, f"set wandb's environment instead ({key.upper()})")
        every, keep = self.take("save_steps"), self.take("save_total_limit")
        if every is not None and (not isinstance(every, int) or every < 1):
            self.refuse("save_steps", f"{every}: a whole number of steps here")
        elif every is not None:
            self.put("checkpoint.every", every)
        if keep is not None:
            self.put("checkpoint.keep", keep)
        self.hub()
        if self.take("resume_from_checkpoint"):
            self.refuse("resume_from_checkpoint", "axolotl's checkpoints do not load here; resume ours with "
                        "--checkpoint.resume")
        if self.take("auto_resume_from_checkpoints"):  # ours in output_dir: the newest if any, else the run starts
            self.put("checkpoint.resume", "auto")

    def hub(self) -> None:
        """axolotl pushes to the Hub when hub_model_id names a repository (transformers' push_to_hub)."""
        repository, strategy = self.take("hub_model_id"), self.take("hub_strategy")
        private = self.take("hub_private_repo")
        if not repository:
            if strategy is not None or private is not None:
                self.notes.append("hub_strategy, hub_private_repo: ignored without hub_model_id, as in axolotl")
            return
        self.put("checkpoint.push_to_hub", True)
        self.put("checkpoint.hub_model_id", repository)
        if strategy is not None:
            self.put("checkpoint.hub_strategy", strategy)
        if private is not None:
            self.put("checkpoint.hub_private_repo", bool(private))

    def without_effect(self) -> None:
        for key in WITHOUT_EFFECT:
            self.take(key)
        if self.take("tf32", "auto") not in (False, "auto"):
            self.refuse("tf32", "TF32 matmuls are not switched on here")
        if self.take("ddp", False):
            self.refuse("ddp", "one process, or several under torchrun (README: Multi-GPU)")
        if self.take("context_parallel_size", 1) != 1:
            self.refuse("context_parallel_size", "context parallelism is not here")
        for key in [key for key in self.pending if key.startswith("special_tokens.")]:
            self.refuse(key, "changes the tokenizer's special tokens; not here (pad_token only)")

