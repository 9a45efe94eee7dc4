"""Who samples and how, in an axolotl config: trl.use_vllm / vllm_mode, the vllm: section (the engine
`axolotl vllm-serve` starts, or the colocated one), trl's sampling keys, the async trainer's keys and the
vLLM-vs-trainer importance sampling, translated."""

from __future__ import annotations

from driver.axolotl.keys import AXOLOTL_DEFAULTS, DTYPES, IMPORTANCE_SAMPLING_MODES
from driver.axolotl.pending import PendingKeys
from driver.config import RolloutConfig

# The vllm: section's engine options that are ours under the same name (rollout.*), with our defaults.
ENGINE_OPTIONS = {key: RolloutConfig.model_fields[key].default
                  for key in ("tensor_parallel_size", "data_parallel_size", "enforce_eager", "enable_prefix_caching")}


class RolloutKeys(PendingKeys):
    def generation(self) -> int:
        """Who samples (trl.use_vllm, trl.vllm_mode), with what (the vllm: section) and how (trl's
        sampling keys); returns num_generations."""
        use_vllm = self.take("trl.use_vllm", False)
        mode = self.take("trl.vllm_mode", "server")  # axolotl's validation picks server when use_vllm has no mode
        # The trainer reaches trl.vllm_server_host:port; `axolotl vllm-serve` listens on vllm.host:port.
        trl_host, trl_port = self.take("trl.vllm_server_host"), self.take("trl.vllm_server_port")
        serve_host, serve_port = self.take("vllm.host"), self.take("vllm.port")
        host = trl_host or serve_host or AXOLOTL_DEFAULTS["vllm_host"]
        port = trl_port or serve_port or AXOLOTL_DEFAULTS["vllm_port"]
        timeout = self.take("trl.vllm_server_timeout")
        backend = "transformers" if not use_vllm else mode
        if backend not in ("transformers", "colocate", "server"):
            self.refuse("trl.vllm_mode", f"{mode}: server or colocate")
            backend = "server"
        self.backend = backend
        self.put("rollout.backend", backend)
        if backend == "server":
            self.put("rollout.server_url", f"http://{host}:{port}")
            if timeout is not None:
                self.put("rollout.server_timeout", float(timeout))
        self.sleep_mode(backend)
        max_tokens = self.take("trl.max_completion_length")
        if max_tokens is None:
            if self.method == "grpo":
                self.refuse("trl.max_completion_length", "missing: axolotl hands TRL none, and completions then "
                            "run to the end of vLLM's context; give the length")
            max_tokens = AXOLOTL_DEFAULTS["max_completion_length"]  # what axolotl's ebft leaves to TRL
        self.vllm_engine(backend, max_tokens)
        self.sampling(max_tokens)
        num_generations = self.take("trl.num_generations", 8)  # TRL's default, and ours
        self.put("algo.num_generations", num_generations)
        return num_generations

    def sleep_mode(self, backend: str) -> None:
        """TRL frees the colocated engine's memory while the trainer trains; its server mode ignores the key."""
        if not self.take("trl.vllm_enable_sleep_mode", False):
            return
        if backend == "colocate" and self.pending.get("trl.async_prefetch"):
            self.refuse("trl.vllm_enable_sleep_mode", "with trl.async_prefetch the engine generates while the "
                        "trainer trains and is never idle to sleep; turn one off")
        elif backend == "colocate":
            self.put("rollout.enable_sleep_mode", True)
        else:
            self.notes.append(f"trl.vllm_enable_sleep_mode: ignored with rollout.backend {backend} (as TRL does: "
                              "only a colocated engine sleeps)")

    def vllm_engine(self, backend: str, max_tokens: int) -> None:
        """The vllm: section (what `axolotl vllm-serve` starts, or the colocated engine) and the lengths: the
        engine options go to the rollout section, which configures both the colocated engine and
        `python -m driver.vllm_serve`."""
        memory, model_len = self.take("vllm.gpu_memory_utilization"), self.take("vllm.max_model_len")
        dtype, serve_module = self.take("vllm.dtype", "auto"), self.take("vllm.serve_module")
        sequence_len, max_prompt_len = self.take("sequence_len", AXOLOTL_DEFAULTS["sequence_len"]), self.take(
            "max_prompt_len")
        if dtype != "auto" and str(dtype) not in DTYPES:
            self.refuse("vllm.dtype", f"{dtype}: auto, {', '.join(DTYPES)}")
        elif dtype != "auto" and DTYPES[str(dtype)] != self.out["model"]["dtype"]:
            self.put("rollout.dtype", DTYPES[str(dtype)])
        if serve_module not in (None, "axolotl.scripts.vllm_serve_lora"):
            self.refuse("vllm.serve_module", f"{serve_module}: vLLM's own OpenAI server serves the adapters here")
        for key in ("enable_reasoning", "reasoning_parser", "worker_extension_cls"):
            if self.take(f"vllm.{key}") is not None:
                self.refuse(f"vllm.{key}", "not here: completions come back as the model wrote them")
        # TRL 1.8 cuts no prompt; the longest prompt a full completion still fits behind is the bound here.
        model_len = model_len or sequence_len + max_tokens
        prompt_len = max_prompt_len or model_len - max_tokens
        if prompt_len < 1:
            self.refuse("vllm.max_model_len", f"{model_len} leaves no room for a prompt before "
                        f"trl.max_completion_length = {max_tokens} tokens")
        else:
            self.put("data.max_prompt_length", prompt_len)
        self.put("rollout.max_model_len", model_len)
        if backend == "transformers":
            self.ignore_section("vllm", "trl.use_vllm is false: the trainer samples, without vLLM")
            return
        self.put("rollout.gpu_memory_utilization", memory or AXOLOTL_DEFAULTS["vllm_gpu_memory_utilization"])
        for key, default in ENGINE_OPTIONS.items():
            value = self.take(f"vllm.{key}")
            if key == "data_parallel_size" and backend == "colocate" and value not in (None, 1):
                self.refuse(f"vllm.{key}", f"{value}: the colocated engine is one in-process engine; use "
                            "trl.vllm_mode: server for data-parallel replicas")
            elif value is not None and value != default:
                self.put(f"rollout.{key}", value)
        if backend == "server":
            self.notes.append(self.server_command())

    def server_command(self) -> str:
        """How to start what `axolotl vllm-serve config.yaml` started (rollout.server_url)."""
        address = self.out["rollout"]["server_url"].removeprefix("http://")
        dev_mode = ("; with VLLM_SERVER_DEV_MODE=1, as full fine-tuning reloads the weights through /collective_rpc"
                    if self.out["model"].get("adapter") == "none" else "")
        return ("rollout.backend server: start vLLM first, on its own GPU(s), as `axolotl vllm-serve` did:\n"
                "  CUDA_VISIBLE_DEVICES=0 python -m driver.vllm_serve <this file>\n"
                f"(vLLM's OpenAI server for model.path with the vllm: section's options, on {address}{dev_mode}), "
                "then train on another GPU (CUDA_VISIBLE_DEVICES=1); model.path must be a local directory here")

    def sampling(self, max_tokens: int) -> None:
        self.put("rollout.sampling.max_tokens", max_tokens)
        for key in ("temperature", "top_p", "min_p", "repetition_penalty", "generation_kwargs"):
            value = self.take(f"trl.{key}")
            if value is not None:
                self.put(f"rollout.sampling.{key}", value)
        top_k = self.take("trl.top_k")
        if top_k is not None:
            self.put("rollout.sampling.top_k", -1 if top_k == 0 else top_k)  # TRL's 0 is our -1: off
        regex = self.take("trl.vllm_guided_decoding_regex")
        if regex is not None:
            self.put("rollout.sampling.structured_outputs", {"regex": regex})
        template_kwargs = self.take("trl.chat_template_kwargs")
        if template_kwargs is not None:
            self.put("data.chat_template_kwargs", template_kwargs)
        shown = self.take("trl.num_completions_to_print")
        if shown is not None:
            self.put("logging.log_completions", shown)


    def asynchronous(self) -> bool:
        """axolotl's async trainer runs with async_prefetch or use_data_producer (which other defaults follow)."""
        prefetch = self.take("trl.async_prefetch", False)
        if prefetch:
            self.put("rollout.async_prefetch", True)
        for key in ("prefetch_depth", "vllm_sync_interval"):
            value = self.take(f"trl.{key}")
            if value is not None:
                self.put(f"rollout.{key}", value)
        return bool(prefetch or self.pending.get("trl.use_data_producer"))

    def importance_sampling(self, asynchronous: bool) -> None:
        """vLLM's sampling logprobs against the trainer's: axolotl's async trainer defaults to token_truncate,
        its synchronous one (TRL 1.8's GRPOConfig) to sequence_mask; both cap at 3. The async trainer also
        floors the ratios at 1 / cap (two-sided: our cap_min); in its mask modes it masks above the cap and
        then clamps at the floor, which lifts the masked tokens back to 1 / cap (a bug): ours masks both
        tails. TRL 1.6+ names the cap vllm_importance_sampling_clip_max, with a clip_min."""
        correction = self.take("trl.vllm_importance_sampling_correction", True)
        mode = self.take("trl.vllm_importance_sampling_mode", "token_truncate" if asynchronous else "sequence_mask")
        cap = self.take("trl.vllm_importance_sampling_cap", None)
        clip_max = self.take("trl.vllm_importance_sampling_clip_max", None)
        if cap is not None and clip_max is not None and cap != clip_max:
            self.refuse("trl.vllm_importance_sampling_clip_max", f"{clip_max} against vllm_importance_sampling_cap "
                        f"{cap}: the same cap under TRL's two names; give one")
        if cap is None:
            cap = clip_max if clip_max is not None else AXOLOTL_DEFAULTS["importance_sampling_cap"]
        floor = self.take("trl.vllm_importance_sampling_clip_min", 1 / cap if asynchronous else None)
        if self.backend == "transformers":
            return  # sampled by the trainer's own weights: no correction in TRL, ratios of 1 here
        if not correction:
            self.put("algo.importance_sampling.level", "none")
        elif mode not in IMPORTANCE_SAMPLING_MODES:
            self.refuse("trl.vllm_importance_sampling_mode", f"{mode}: {', '.join(IMPORTANCE_SAMPLING_MODES)}")
        else:
            level, how = IMPORTANCE_SAMPLING_MODES[mode]
            self.put("algo.importance_sampling", {"level": level, "mode": how, "cap": cap,
                                                  **({"cap_min": floor} if floor else {})})
            if asynchronous and how == "mask":
                self.notes.append(f"importance sampling: ratios above {cap:g} and below {floor:g} get weight 0 here; "
                                  "axolotl's async trainer masks above the cap, then its floor clamp lifts those "
                                  "tokens back to 1 / cap (a bug, not copied)")


    def strided_sampling(self) -> int:
        """ebft strided: the trainer samples its blocks, with ebft:'s own temperature and top_p."""
        num_generations = self.take("ebft.n_samples_per_prompt", AXOLOTL_DEFAULTS["strided_samples"])
        self.put("algo.num_generations", num_generations)
        self.put("rollout.sampling.temperature", self.take("ebft.temperature", AXOLOTL_DEFAULTS["strided_temperature"]))
        top_p = self.take("ebft.top_p")
        if top_p is not None:
            self.put("rollout.sampling.top_p", top_p)
        # axolotl's strided transforms cut documents to sequence_len tokens.
        sequence_len = self.take("sequence_len", AXOLOTL_DEFAULTS["sequence_len"])
        self.put("ebft.max_document_length", sequence_len)
        self.put("data.max_prompt_length", sequence_len)
        self.take("max_prompt_len"), self.take("rl_beta")  # axolotl's strided trainer reads neither
        self.ignore_section("vllm", "ebft mode strided samples in the trainer, without vLLM")
        self.num_iterations = 1
        return num_generations

