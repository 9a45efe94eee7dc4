"""The model, the adapter, the dataset and the reward functions of an axolotl config, translated."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from driver.axolotl.keys import ATTENTION, AXOLOTL_DEFAULTS, BUILTIN_DATASET_TYPES, DTYPES
from driver.axolotl.pending import PendingKeys
from driver.config import DATA_FILE_FORMATS, LoraSettings


class ModelKeys(PendingKeys):
    def model(self) -> None:
        base_model = self.take("base_model")
        if base_model is None:
            self.refuse("base_model", "missing")
        else:
            self.put("model.path", str(base_model))
        revision = self.take("revision_of_model")
        if revision is not None:
            self.put("model.revision", str(revision))
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
            if four_bit:
                self.refuse("load_in_4bit", "a 4-bit base trains an adapter: adapter: qlora")
        elif adapter not in ("lora", "qlora"):
            self.refuse("adapter", f"{adapter}: lora, qlora, or none (full fine-tuning)")
        if adapter == "qlora" or (adapter == "lora" and four_bit):
            self.put("model.qlora", True)
        if self.take("peft_use_dora"):
            self.refuse("peft_use_dora", "DoRA is not here")
        init_from = self.take("lora_model_dir")
        if init_from is not None and adapter is None:
            self.refuse("lora_model_dir", "an adapter to start from needs adapter: lora or qlora")
        elif init_from is not None:
            self.start_from_adapter(str(init_from))
            return
        for key, ours in (("lora_r", "r"), ("lora_alpha", "alpha"), ("lora_dropout", "dropout"),
                          ("peft_use_rslora", "rslora")):
            value = self.take(key)
            if value is not None:
                self.put(f"lora.{ours}", value)
        if adapter is not None and "alpha" not in self.out.get("lora", {}):
            self.put("lora.alpha", AXOLOTL_DEFAULTS["lora_alpha"])  # PEFT's default, which axolotl keeps
        self.lora_targets(adapter is not None)

    def start_from_adapter(self, path: str) -> None:
        """lora_model_dir: axolotl loads it with PeftModel.from_pretrained, whose saved settings replace lora_r,
        lora_alpha, lora_dropout and the targets; here lora.init_from takes the same from it."""
        self.put("lora.init_from", path)
        ignored = [key for key in ("lora_r", "lora_alpha", "lora_dropout", "peft_use_rslora", "lora_target_modules",
                                   "lora_target_linear", "lora_target_parameters") if self.take(key) is not None]
        if ignored:
            self.notes.append(f"{', '.join(ignored)}: the adapter's own settings apply (lora_model_dir), as in axolotl")

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

