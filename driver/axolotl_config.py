"""axolotl configs translated into ours: `python -m driver.train axolotl.yml` (recognized by its keys,
or forced with `--from axolotl`) prints the translation, then trains with it.

An axolotl GRPO (`rl: grpo | gdpo`) or EBFT (`rl: ebft`) config becomes one of ours key by key
(docs/axolotl-differences.md#config-translation has the table). Where axolotl leaves a key out, the
default it would use (its own, or that of TRL 1.8, which it pins) is written out wherever it differs
from ours, so the translated run is the one axolotl would make. Every key is mapped, accepted because
it changes nothing here, or refused; the refusals come back together, each with its reason, and then
nothing is translated.
"""

from __future__ import annotations

import math
from pathlib import Path
from typing import Any, NamedTuple

import yaml

from driver.config import DATA_FILE_FORMATS, Config, LoraSettings

OUR_SECTIONS = frozenset(Config.model_fields) - {"ebft"}  # ebft: is a section of both
# Top-level keys of axolotl's that none of our configs has: one of them, and none of OUR_SECTIONS,
# makes a file an axolotl config.
AXOLOTL_MARKERS = frozenset({"base_model", "rl", "trl", "datasets", "vllm", "adapter", "lora_r", "micro_batch_size",
                             "gradient_accumulation_steps", "learning_rate", "sequence_len", "max_steps"})
NESTED_SECTIONS = ("trl", "vllm", "ebft", "special_tokens", "gradient_checkpointing_kwargs")

# Defaults axolotl (or the TRL and transformers it pins) applies to a key left out, where ours differs.
AXOLOTL_DEFAULTS = dict(seed=42, output_dir="./model-out", lr_scheduler="cosine", sequence_len=512, lora_alpha=8,
                        max_completion_length=256, colocate_gpu_memory_utilization=0.9, vllm_host="0.0.0.0",
                        vllm_port=8000, importance_sampling_cap=3.0, strided_samples=4, strided_temperature=0.6)
# TRL's importance-sampling modes -> (algo.importance_sampling.level, .mode).
IMPORTANCE_SAMPLING_MODES = {"token_truncate": ("token", "truncate"), "token_mask": ("token", "mask"),
                             "sequence_truncate": ("sequence_product", "truncate"),
                             "sequence_mask": ("sequence_product", "mask")}
OPTIMIZERS = {"adamw_torch": "adamw_torch", "adamw_torch_fused": "adamw_torch_fused", "adamw_bnb_8bit": "adamw_8bit",
              "adamw_8bit": "adamw_8bit", "paged_adamw_8bit": "paged_adamw_8bit"}
SCHEDULES = {"cosine": "cosine", "linear": "linear", "constant_with_warmup": "constant", "constant": "constant"}
ATTENTION = {"flash_attention_2": "flash_attention_2", "sdpa": "sdpa", "eager": "eager"}
DTYPES = {"bfloat16": "bfloat16", "bf16": "bfloat16", "float16": "float16", "fp16": "float16", "half": "float16",
          "float32": "float32", "fp32": "float32", "float": "float32"}
# ebft: keys one mode reads and the other ignores (axolotl's EBFTStrategy).
EBFT_STRIDED_ONLY = ("stride", "context_length", "generate_max_len", "n_samples_per_prompt", "temperature", "top_p",
                     "rl_coef", "min_completion_prefix", "ce_coef")
EBFT_STRUCTURED_ONLY = ("adaptive_max_tokens", "gt_length_multiplier")
# Reasons for refusing keys axolotl configs often carry.
KNOWN_REFUSALS = {
    "deepspeed": "DeepSpeed is not here: one process, or torchrun + FSDP2 (README: Multi-GPU)",
    "fsdp": "axolotl's FSDP settings do not apply: torchrun shards with FSDP2 by itself (README: Multi-GPU)",
    "fsdp_config": "axolotl's FSDP settings do not apply: torchrun shards with FSDP2 by itself (README: Multi-GPU)",
    "fsdp_version": "axolotl's FSDP settings do not apply: torchrun shards with FSDP2 by itself (README: Multi-GPU)",
    "plugins": "axolotl plugins do not run here",
    "fp8": "FP8 training is not here",
    "sample_packing": "an SFT setting; completions are always packed here",
}
TRANSFORMS = "driver.data.axolotl_transforms"
EBFT_TRANSFORMS = "driver.ebft.transforms"
# axolotl's EBFT prompt strategies (axolotl.prompt_strategies.ebft) -> (our data.transform, or None with why not).
BUILTIN_DATASET_TYPES = {
    "ebft_opencode.transform": (f"{TRANSFORMS}.ebft_opencode", None),
    "ebft_strided_structured.transform": (f"{TRANSFORMS}.ebft_strided_structured", None),
    "ebft_pretrain.transform": (f"{TRANSFORMS}.ebft_pretrain", None),
    "ebft_chat_multiturn.transform_last_turn": (f"{EBFT_TRANSFORMS}.last_turn", None),
    "ebft_chat_multiturn.transform_all_turns": (f"{EBFT_TRANSFORMS}.all_turns", None),
    "ebft_reasoning.transform": (f"{EBFT_TRANSFORMS}.last_turn", None),
    "ebft_reasoning.transform_answer_only": (f"{EBFT_TRANSFORMS}.last_turn_answer_only", None),
    "ebft_chat_multiturn.transform": (f"{EBFT_TRANSFORMS}.first_turn", None),  # later turns rolled out
    "ebft_strided_chat.transform": (None, "anchors in every assistant turn of the chat; here a row has one ground "
                                    "truth: driver.ebft.transforms.last_turn or all_turns"),
    "ebft_reasoning.transform_split_thinking": (None, "needs the chat template's reasoning_content; not here"),
    "ebft_reasoning.transform_strided": (None, "masks thinking tokens out of the CE loss; not here"),
}
# Keys that change nothing in a run of ours, whatever their value: key -> why.
WITHOUT_EFFECT = {
    "strict": "axolotl's own schema strictness",
    "debug": "axolotl's dataset preview",
    "skip_prepare_dataset": "no dataset preparation cache here",
    "dataset_prepared_path": "no dataset cache here",
    "dataset_processes": "rows are transformed in the trainer",
    "logging_steps": "every step is logged here",
    "torch_compile": "speed only: our kernels replace compilation",
    "batch_flattening": "sequences are always packed",
    "special_tokens.pad_token": "sequences are packed, never padded",
    "gradient_checkpointing_kwargs.use_reentrant": "the same gradients either way",
    "vllm.device": "vLLM's device",
    "trl.use_data_producer": "the rollout loop is always a producer",
    "trl.vllm_lora_sync": "how the adapter reaches vLLM, not what it serves",
    "trl.streaming_partial_batch": "groups are scored as they finish anyway",
    "trl.streaming_min_groups": "groups are scored as they finish anyway",
    "trl.log_completions": "completions are always logged (completions.jsonl)",
    "trl.use_liger_loss": "the same loss; the logprobs are fused here",
    "trl.ref_model_mixup_alpha": "only with sync_ref_model",
    "trl.ref_model_sync_steps": "only with sync_ref_model",
}


class Translation(NamedTuple):
    config: dict  # ours, sections in Config's order, only the keys the axolotl config decides
    notes: list[str]  # what a reader of the translation should know, printed as comments above it


class UntranslatableConfig(ValueError):
    """Keys the translation cannot honour, each with why: {key: reason}."""

    def __init__(self, refused: dict[str, str]) -> None:
        self.refused = refused
        lines = "\n".join(f"  {key}: {reason}" for key, reason in refused.items())
        super().__init__(f"this axolotl config cannot be translated (nothing was); remove or change:\n{lines}")


def is_axolotl_config(data: dict) -> bool:
    """axolotl's top-level keys and none of our sections (ours always have some: a file of `ebft:` alone is ours)."""
    return bool(data.keys() & AXOLOTL_MARKERS) and not data.keys() & OUR_SECTIONS


def translate(data: dict) -> Translation:
    """Our config (a plain dict, for Config.model_validate) for an axolotl one; UntranslatableConfig
    names every key it cannot honour."""
    return _Translator(data).run()


def translation_yaml(translation: Translation, source: str) -> str:
    """The translation as a YAML file a user can keep and run as it is."""
    header = [f"# {source}, an axolotl config, translated by `python -m driver.train` (docs/axolotl-differences.md)",
              *(f"# {line}" for note in translation.notes for line in note.splitlines())]
    return "\n".join(header) + "\n" + yaml.safe_dump(translation.config, sort_keys=False)


def flatten(data: dict) -> dict[str, Any]:
    """{"trl.temperature": 0.7, "datasets[0].path": ...}: the nested sections and dataset entries by
    dotted key; null values are left out (axolotl's schema reads them as absent)."""
    flat: dict[str, Any] = {}
    for key, value in data.items():
        if key in NESTED_SECTIONS and isinstance(value, dict):
            flat.update({f"{key}.{sub}": sub_value for sub, sub_value in value.items() if sub_value is not None})
        elif key == "datasets" and isinstance(value, list) and all(isinstance(entry, dict) for entry in value):
            for index, entry in enumerate(value):
                flat.update({f"datasets[{index}].{sub}": v for sub, v in entry.items() if v is not None})
            flat["datasets"] = len(value)
        elif value is not None:
            flat[str(key)] = value
    return flat


def power_of_two_at_least(value: int, floor: int) -> int:
    return 2 ** math.ceil(math.log2(max(value, floor)))


class _Translator:
    """One pass over an axolotl config: each step takes the keys it handles out of `pending`; what is
    left at the end was not translated and is refused with the rest."""

    def __init__(self, data: dict) -> None:
        self.pending = flatten(data)
        self.out: dict[str, Any] = {}
        self.refused: dict[str, str] = {}
        self.notes: list[str] = []

    def take(self, key: str, default: Any = None) -> Any:
        return self.pending.pop(key, default)

    def put(self, dotted_key: str, value: Any) -> None:
        node = self.out
        *sections, leaf = dotted_key.split(".")
        for section in sections:
            node = node.setdefault(section, {})
        node[leaf] = value

    def refuse(self, key: str, reason: str) -> None:
        self.refused.setdefault(key, reason)

    def run(self) -> Translation:
        self.method = self.rl_method()
        self.strided = self.method == "ebft" and self.ebft_mode() == "strided"
        self.model()
        self.adapter()
        self.dataset()
        self.rewards()
        if self.strided:
            num_generations = self.strided_sampling()
            self.ignore_section("trl", "ebft mode strided samples in the trainer (axolotl ignores trl: there too)")
        else:
            num_generations = self.generation()
            self.policy_loss()
        if self.method == "ebft":
            self.ebft()
        elif self.drop_section("ebft"):
            self.refuse("ebft", f"only with rl: ebft (rl is {self.method})")
        self.batches(num_generations)
        self.optimizer()
        self.outputs()
        self.without_effect()
        for key in self.pending:
            self.refuse(key, KNOWN_REFUSALS.get(key.split(".")[0], "not translated: no equivalent here, or not an "
                                                "axolotl key"))
        if self.refused:
            raise UntranslatableConfig(self.refused)
        return Translation({section: self.out[section] for section in Config.model_fields if section in self.out},
                           self.notes)

    def rl_method(self) -> str:
        rl = self.take("rl")
        if rl in ("grpo", "gdpo"):
            if rl == "gdpo":  # axolotl: GRPO with GDPO's aggregation unless trl: says otherwise
                self.put("rewards.aggregation", "normalize_then_sum")
            return "grpo"
        if rl == "ebft":
            self.put("algo.name", "ebft")
            return "ebft"
        self.refuse("rl", "missing: axolotl without rl: is supervised fine-tuning; this driver trains grpo "
                    "and ebft" if rl is None else f"{rl}: this driver trains grpo (gdpo) and ebft")
        return "grpo"  # the rest is still checked, so that one message names every key

    def ebft_mode(self) -> str:
        mode = self.take("ebft.mode", "structured")
        if mode not in ("structured", "strided"):
            self.refuse("ebft.mode", f"{mode}: structured or strided")
        if mode == "strided":
            self.put("ebft.mode", mode)
        return mode

    def model(self) -> None:
        base_model = self.take("base_model")
        if base_model is None:
            self.refuse("base_model", "missing")
        else:
            self.put("model.path", str(base_model))
        dtype = self.dtype()
        self.put("model.dtype", dtype)
        torch_dtype = self.take("torch_dtype")
        if torch_dtype is not None and DTYPES.get(str(torch_dtype)) != dtype:
            self.refuse("torch_dtype", f"{torch_dtype} disagrees with bf16 / fp16 ({dtype}); here one dtype "
                        "serves the weights and the compute: model.dtype")
        for key, default in (("tokenizer_type", "AutoTokenizer"), ("model_type", "AutoModelForCausalLM"),
                             ("base_model_config", base_model), ("tokenizer_config", base_model)):
            value = self.take(key, default)
            if value != default:
                self.refuse(key, f"{value}: the model and its tokenizer load from base_model "
                            f"({default} only)")
        if self.take("trust_remote_code", False):
            self.refuse("trust_remote_code", "models with their own code are not loaded here")
        self.attention()
        checkpointing = self.take("gradient_checkpointing", False)
        if checkpointing is True:
            self.put("model.gradient_checkpointing", True)
        elif checkpointing is not False:
            self.refuse("gradient_checkpointing", f"{checkpointing}: activation offloading is not here (true or "
                        "false)")
        device_map = self.take("device_map")
        if device_map is not None:
            device = device_map.get("") if isinstance(device_map, dict) and len(device_map) == 1 else None
            if not isinstance(device, int):
                self.refuse("device_map", f"{device_map}: the model is not split across devices here; "
                            "{'': <gpu>} only (model.device)")
            elif device:
                self.put("model.device", f"cuda:{device}")

    def dtype(self) -> str:
        bf16, fp16 = self.take("bf16", "auto"), self.take("fp16", False)
        if bf16 not in (True, False, "auto", "full"):
            self.refuse("bf16", f"{bf16}: true, false or auto")
        if fp16 and bf16 is not True:
            return "float16"
        return "bfloat16" if bf16 in (True, "auto", "full") else "float32"

    def attention(self) -> None:
        """strided EBFT: axolotl replaces the backend by flex attention (or eager) for the block-parallel
        mask, as ebft.attention auto does here; other runs take the backend the keys name."""
        named = self.take("attn_implementation")
        flags = {"flash_attention_2": self.take("flash_attention"), "sdpa": self.take("sdp_attention"),
                 "flex_attention": self.take("flex_attention")}
        wanted = {named} if named is not None else set()
        wanted |= {backend for backend, on in flags.items() if on}
        if self.strided:
            return
        if len(wanted) > 1:
            self.refuse("attn_implementation", f"{' and '.join(sorted(wanted))} asked for at once")
        elif wanted and next(iter(wanted)) not in ATTENTION:
            self.refuse("attn_implementation", f"{next(iter(wanted))}: model.attention takes "
                        f"{', '.join(ATTENTION)}")
        elif wanted:
            self.put("model.attention", ATTENTION[next(iter(wanted))])

    def adapter(self) -> None:
        adapter = self.take("adapter")
        four_bit, eight_bit = self.take("load_in_4bit", False), self.take("load_in_8bit", False)
        if eight_bit:
            self.refuse("load_in_8bit", "8-bit bases are not here: adapter: qlora (NF4)")
        if adapter is None:
            self.put("model.adapter", "none")
            if self.method == "ebft":
                self.refuse("adapter", "missing (full fine-tuning): EBFT here reads its features from the base "
                            "with the adapter disabled; use adapter: lora")
            if four_bit:
                self.refuse("load_in_4bit", "a 4-bit base trains an adapter: adapter: qlora")
        elif adapter not in ("lora", "qlora"):
            self.refuse("adapter", f"{adapter}: lora, qlora, or none (full fine-tuning)")
        if adapter == "qlora" or (adapter == "lora" and four_bit):
            self.put("model.qlora", True)
        for key, ours in (("lora_r", "r"), ("lora_alpha", "alpha"), ("lora_dropout", "dropout"),
                          ("peft_use_rslora", "rslora")):
            value = self.take(key)
            if value is not None:
                self.put(f"lora.{ours}", value)
        if adapter is not None and "alpha" not in self.out.get("lora", {}):
            self.put("lora.alpha", AXOLOTL_DEFAULTS["lora_alpha"])  # PEFT's default, which axolotl keeps
        if self.take("peft_use_dora"):
            self.refuse("peft_use_dora", "DoRA is not here")
        self.lora_targets(adapter is not None)

    def lora_targets(self, has_adapter: bool) -> None:
        modules, linear = self.take("lora_target_modules"), self.take("lora_target_linear", False)
        parameters = self.take("lora_target_parameters")
        for key, value in (("lora_target_modules", modules), ("lora_target_parameters", parameters)):
            if isinstance(value, str):
                self.refuse(key, "a regular expression (PEFT's string form); here the list of module names: "
                            "the regex's per-layer selection has no equivalent")
        targets = list(modules) if isinstance(modules, list) else []
        if linear:
            # axolotl: every nn.Linear but the output head. For Llama / Qwen / Mistral-style dense models
            # these are the seven projections; other architectures name theirs differently.
            targets += [name for name in LoraSettings.model_fields["targets"].default if name not in targets]
            self.notes.append("lora_target_linear: lora.targets are the seven projections of Llama / Qwen / "
                              "Mistral-style models; other architectures: list their linear layers")
        if targets:
            self.put("lora.targets", targets)
        elif has_adapter:
            self.refuse("lora_target_modules", "missing (nor lora_target_linear): PEFT's per-architecture "
                        "default would apply; name the modules")
        if isinstance(parameters, list):
            self.put("lora.expert_targets", parameters)

    def dataset(self) -> None:
        count = self.take("datasets", 0)
        if count != 1:
            self.refuse("datasets", "missing" if count == 0 else "not a list of mappings" if not isinstance(
                count, int) else f"{count} datasets: one here (mix them into one file or Hub dataset)")
            return
        path = self.take("datasets[0].path")
        if path is None:
            self.refuse("datasets[0].path", "missing")
            return
        self.put("data.source", str(path))
        split = self.take("datasets[0].split", "train")
        if Path(str(path)).suffix in DATA_FILE_FORMATS and split != "train":
            self.refuse("datasets[0].split", f"{split}: a data file is read whole here (split only selects "
                        "from a Hub dataset or a directory)")
        elif split != "train":
            self.put("data.split", split)
        for key in ("name", "revision"):
            value = self.take(f"datasets[0].{key}")
            if value is not None:
                self.put(f"data.{key}", value)
        self.dataset_type(self.take("datasets[0].type"))
        template = self.take("chat_template", "tokenizer_default")
        if template != "tokenizer_default":
            self.refuse("chat_template", f"{template}: a template of axolotl's own; here conversations are "
                        "rendered with the tokenizer's template (tokenizer_default): remove the key when the "
                        "model's tokenizer has the template you want")

    def dataset_type(self, kind: Any) -> None:
        if kind is None:
            return  # the rows already hold the prompt column, as axolotl expects without a type
        if not isinstance(kind, str):
            self.refuse("datasets[0].type", "a mapping of fields (axolotl's user_defined): write a transform "
                        "function and name it by its dotted path")
            return
        builtin = self.method == "ebft" and kind in BUILTIN_DATASET_TYPES  # axolotl looks them up under rl: ebft
        transform, why_not = BUILTIN_DATASET_TYPES[kind] if builtin else (kind, None)
        if why_not is not None:
            self.refuse("datasets[0].type", f"{kind} {why_not}")
        elif "." not in transform:
            self.refuse("datasets[0].type", f"{kind}: one of axolotl's prompt strategies; here data.transform is "
                        "the dotted path of a function (module.function), axolotl's fn(cfg) -> (map_fn, "
                        "{remove_columns}) included")
        elif kind == "ebft_pretrain.transform" and not self.strided:
            self.refuse("datasets[0].type", f"{kind}: documents without a ground truth, for ebft mode strided")
        else:
            self.put("data.transform", transform)
            if kind == "ebft_pretrain.transform":
                self.put("ebft.ground_truth_field", None)  # the prompt column is the whole document

    def rewards(self) -> None:
        functions, weights = self.take("trl.reward_funcs"), self.take("trl.reward_weights")
        workers, aggregation = self.take("trl.reward_num_workers"), self.take("trl.multi_objective_aggregation")
        for key in ("trl.rollout_func", "trl.reward_processing_classes"):
            if self.take(key) is not None:
                self.refuse(key, "not here: rewards.functions score single-turn completions")
        if self.method == "ebft":  # the reward is feature matching; axolotl's ebft runs no reward workers either
            for key, value in (("trl.reward_funcs", functions), ("trl.reward_weights", weights)):
                if value:
                    self.refuse(key, "ebft's reward is feature matching against the ground truth: no reward functions")
            return
        if not functions or not isinstance(functions, list):
            self.refuse("trl.reward_funcs", "missing: grpo needs a list of reward functions (dotted paths or reward "
                        "models)")
            return
        if weights is not None and (not isinstance(weights, list) or len(weights) != len(functions)):
            self.refuse("trl.reward_weights", f"{weights}: one weight per reward function ({len(functions)})")
            weights = None
        entries = []
        for index, name in enumerate(map(str, functions)):
            # TRL's rule: what does not import is a reward model; a dotted path has no "/", a model id has one.
            entry = {"model": name} if "/" in name or Path(name).is_dir() else {"path": name}
            if weights is not None:
                entry["weight"] = float(weights[index])
            entries.append(entry)
        self.put("rewards.functions", entries)
        if workers is not None:
            # axolotl runs the rewards in-process for 0 and 1 (its default) and in N processes for N >= 2;
            # here 0 is in-process and N >= 1 is N worker processes.
            self.put("rewards.reward_num_workers", workers if workers >= 2 else 0)
        if aggregation is not None:
            self.put("rewards.aggregation", aggregation)

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
        if self.take("trl.vllm_enable_sleep_mode", False):
            self.refuse("trl.vllm_enable_sleep_mode", "the colocated engine keeps its memory here: lower "
                        "vllm.gpu_memory_utilization instead")
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

    def vllm_engine(self, backend: str, max_tokens: int) -> None:
        """The vllm: section (what `axolotl vllm-serve` starts, or the colocated engine) and the lengths."""
        memory, model_len = self.take("vllm.gpu_memory_utilization"), self.take("vllm.max_model_len")
        parallel = {key: self.take(f"vllm.{key}") for key in ("tensor_parallel_size", "data_parallel_size")}
        speed = {key: self.take(f"vllm.{key}") for key in ("enforce_eager", "enable_prefix_caching")}
        dtype, serve_module = self.take("vllm.dtype", "auto"), self.take("vllm.serve_module")
        sequence_len, max_prompt_len = self.take("sequence_len", AXOLOTL_DEFAULTS["sequence_len"]), self.take(
            "max_prompt_len")
        if dtype != "auto" and DTYPES.get(str(dtype)) != self.out["model"]["dtype"]:
            self.refuse("vllm.dtype", f"{dtype}: vLLM serves the trainer's dtype here ({self.out['model']['dtype']})")
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
        if backend == "colocate":
            self.put("rollout.gpu_memory_utilization", memory or AXOLOTL_DEFAULTS["colocate_gpu_memory_utilization"])
            for key, size in parallel.items():
                if size not in (None, 1):
                    self.refuse(f"vllm.{key}", f"{size}: the colocated engine is one process on the trainer's GPU; "
                                "use trl.vllm_mode: server for a parallel vLLM")
        elif backend == "server":
            self.notes.append(self.server_command(memory, model_len, parallel, speed))

    def server_command(self, memory, model_len: int, parallel: dict, speed: dict) -> str:
        """What `axolotl vllm-serve config.yaml` started, as vLLM's own OpenAI server (rollout.server_url)."""
        full = self.out["model"].get("adapter") == "none"
        rank = power_of_two_at_least(int(self.out.get("lora", {}).get("r", LoraSettings.model_fields["r"].default)), 8)
        flags = [f"--model {self.out['model'].get('path', '<base_model>')}",
                 *([] if full else [f"--enable-lora --max-lora-rank {rank} --max-loras 2"]),
                 "--logprobs-mode processed_logprobs", f"--dtype {self.out['model']['dtype']}",
                 f"--max-model-len {model_len}", f"--gpu-memory-utilization {memory or 0.9}",
                 *(f"--{key.replace('_', '-')} {size}" for key, size in parallel.items() if size is not None),
                 *(f"--{key.replace('_', '-')}" for key, on in speed.items() if on)]
        url = self.out["rollout"]["server_url"]
        host, port = url.removeprefix("http://").rsplit(":", 1)
        env = "VLLM_SERVER_DEV_MODE=1" if full else "VLLM_ALLOW_RUNTIME_LORA_UPDATING=1"
        return ("rollout.backend server: start vLLM first, on its own GPU(s), as `axolotl vllm-serve` did:\n"
                f"  CUDA_VISIBLE_DEVICES=0 {env} python -m vllm.entrypoints.openai.api_server \\\n"
                f"    {' '.join(flags)} --host {host} --port {port}\n"
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

    def policy_loss(self) -> None:
        trl_beta, rl_beta = self.take("trl.beta"), self.take("rl_beta")
        beta = trl_beta if trl_beta is not None else rl_beta
        if beta is not None:
            self.put("algo.beta", beta)
        for key in ("epsilon", "epsilon_high", "loss_type", "importance_sampling_level", "mask_truncated_completions",
                    "off_policy_mask_threshold"):
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
        for key, what in (("sync_ref_model", "a reference model synced to the policy"),
                          ("use_bias_correction_kl", "the importance-corrected KL")):
            if self.take(f"trl.{key}", False):
                self.refuse(f"trl.{key}", f"{what} is not here yet")
        asynchronous = self.asynchronous()
        self.importance_sampling(asynchronous)
        # With beta = 0, filtering (ours), skipping or keeping zero-advantage rows is the same update; with
        # a KL term, axolotl's skip (its default) drops their KL as our skip does.
        skip = self.take("trl.skip_zero_advantage_batches", True)
        if beta:
            self.put("algo.zero_advantage", "skip" if skip else "keep")
        self.replay_and_reroll()

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
        self.max_steps = max_steps
        if max_steps is None:
            self.refuse("max_steps", "missing" + (f" (num_epochs {epochs}: how many steps an epoch makes depends "
                                                  "on the dataset's size, which translating does not read)"
                                                  if epochs is not None else ""))
        elif max_steps % updates:
            self.refuse("max_steps", f"{max_steps} optimizer steps are not a whole number of generated batches of "
                        f"{updates} (trl.num_iterations x steps per generated batch)")
        else:
            self.put("train.steps", max_steps // updates)

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
        for key in ("weight_decay", "max_grad_norm"):
            value = self.take(key)
            if value is not None:
                self.put(f"train.{key}", value)
        if self.take("lr_scheduler_kwargs"):
            self.refuse("lr_scheduler_kwargs", "the schedules here take no arguments")
        self.put("train.seed", self.take("seed", AXOLOTL_DEFAULTS["seed"]))

    def warmup(self, schedule: str) -> None:
        """axolotl's warm-up: warmup_steps, else warmup_ratio x max_steps, else 3% of max_steps (at most 100);
        1 becomes 2. transformers' constant schedule has none."""
        steps, ratio, total = self.take("warmup_steps"), self.take("warmup_ratio"), self.max_steps or 0
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
        for key in ("resume_from_checkpoint", "auto_resume_from_checkpoints"):
            if self.take(key):
                self.refuse(key, "axolotl's checkpoints do not load here; resume ours with --checkpoint.resume")

    def without_effect(self) -> None:
        for key in WITHOUT_EFFECT:
            self.take(key)
        if self.take("val_set_size", 0):
            self.refuse("val_set_size", "no evaluation split here")
        if self.take("tf32", "auto") not in (False, "auto"):
            self.refuse("tf32", "TF32 matmuls are not switched on here")
        if self.take("ddp", False):
            self.refuse("ddp", "one process, or several under torchrun (README: Multi-GPU)")
        if self.take("context_parallel_size", 1) != 1:
            self.refuse("context_parallel_size", "context parallelism is not here")
        for key in [key for key in self.pending if key.startswith("special_tokens.")]:
            self.refuse(key, "changes the tokenizer's special tokens; not here (pad_token only)")

    def drop_section(self, section: str) -> list[str]:
        """Takes every key of the section; returns them."""
        keys = [key for key in self.pending if key.startswith(section + ".")]
        for key in keys:
            del self.pending[key]
        return keys

    def ignore_section(self, section: str, why: str) -> None:
        ignored = self.drop_section(section)
        if ignored:
            self.notes.append(f"{', '.join(ignored)}: ignored, {why}")
