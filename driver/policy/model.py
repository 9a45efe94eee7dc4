"""The policy: a transformers causal LM with a PEFT LoRA adapter, optionally on an NF4 base (QLoRA),
or the causal LM itself under full fine-tuning (model.adapter: none).

With an adapter, the reference model for the KL term (and EBFT's feature network) is the same network with the
adapter disabled, so no second copy of the weights exists; under full fine-tuning it is a frozen copy of the base,
made only when a KL term or EBFT needs it (axolotl's EBFT keeps the same deepcopy).
"""

from __future__ import annotations

import contextlib
import copy
import json
from dataclasses import dataclass
from pathlib import Path

import torch
from torch import nn

from driver.config import Config, LoraSettings, is_hub_id
from driver.data.model_source import adapter_directory, model_directory
from driver.distributed.world import world
from driver.policy.logprobs import causal_lm_of

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
# Layers never quantized for QLoRA: the output head and MoE routers stay in full precision, as in
# bitsandbytes' defaults (a 4-bit router changes which experts tokens go to).
UNQUANTIZED_SUFFIXES = ("lm_head", ".gate", ".router")


@dataclass
class Policy:
    model: nn.Module  # peft.PeftModel, or the causal LM itself under full fine-tuning
    tokenizer: object
    model_dir: str  # local directory of the base model (what vLLM loads)
    kernels: str = "pure torch (train.kernels: reference)"  # what runs on pykernels' kernels, for the log
    frozen_reference: nn.Module | None = None  # full fine-tuning with a KL term or EBFT: the base, frozen
    reference_moves: bool = False  # algo.sync_ref_model: the reference mixes in the policy (checkpoints keep it)
    # model.dtype: what the model computes in and is saved and served in (under torchrun with master weights its
    # shards are fp32: driver/distributed/fsdp.py)
    dtype: torch.dtype | None = None

    @property
    def has_adapter(self) -> bool:
        return hasattr(self.model, "disable_adapter")

    @property
    def causal_lm(self) -> nn.Module:
        return causal_lm_of(self.model)

    @property
    def device(self) -> torch.device:
        return self.causal_lm.get_output_embeddings().weight.device

    @property
    def trained_name(self) -> str:
        """What save_trained writes, as a directory name: the adapter, or the whole model."""
        return "adapter" if self.has_adapter else "model"

    def trainable_parameters(self) -> list[nn.Parameter]:
        """Under torchrun, FSDP's shards: a unit a forward without backward left gathered (the root's under full
        fine-tuning) is resharded first, or its gathered weights would be listed in place of the shards."""
        reshard_if_sharded(self.model)
        return [p for p in self.model.parameters() if p.requires_grad]

    @contextlib.contextmanager
    def reference(self):
        """Context giving the frozen base to score with (use what it yields): the model with its adapter disabled,
        or the frozen copy under full fine-tuning."""
        if self.has_adapter:
            with self.model.disable_adapter():
                yield self.model
            return
        if self.frozen_reference is None:
            raise ValueError("full fine-tuning keeps a reference copy only when a KL term (algo.beta > 0) or EBFT's "
                             "features need it")
        yield self.frozen_reference

    @torch.no_grad()
    def mix_into_reference(self, alpha: float) -> None:
        """algo.sync_ref_model (TR-DPO, TRL's sync_target_model): the reference becomes alpha x the policy +
        (1 - alpha) x itself, weight by weight (under torchrun shard by shard: both are sharded alike)."""
        reshard_if_sharded(self.model, self.frozen_reference)  # the shards, not the weights a forward gathered
        trained = dict(self.model.named_parameters())
        for name, weight in self.frozen_reference.named_parameters():
            weight.lerp_(trained[name].to(weight.dtype), alpha)

    def save_reference(self, path: Path) -> None:
        """algo.sync_ref_model's moved reference, as safetensors. Under torchrun every rank calls it (the shards are
        gathered) and rank 0 writes it."""
        from safetensors.torch import save_file, save_model

        if not world().distributed:
            save_model(self.frozen_reference, str(path))
            return
        from driver.distributed.fsdp import full_model_state

        state = full_model_state(self.frozen_reference)
        if world().is_main:  # copies: a tied weight's two names share one tensor, which save_file refuses
            save_file({name: tensor.clone() for name, tensor in state.items()}, str(path))

    def load_reference(self, path: Path) -> None:
        from safetensors.torch import load_file, load_model

        if not world().distributed:
            load_model(self.frozen_reference, str(path))
            return
        from driver.distributed.fsdp import load_full_model_state

        load_full_model_state(self.frozen_reference, load_file(path))

    def save_trained(self, directory: Path | None) -> Path | None:
        """The adapter in PEFT format (adapter_config.json + adapter_model.safetensors), loadable by PEFT
        and vLLM, or under full fine-tuning the whole model (config.json + safetensors, what vLLM and
        transformers load). Under torchrun every rank calls it (the sharded adapter, or weights, are gathered)
        and rank 0 writes it; directory None: the gather only (the ranks joining rank 0's)."""
        if not self.has_adapter:
            if not world().distributed:
                self.model.save_pretrained(directory, safe_serialization=True)
            else:
                state = self.gathered_weights()
                if not world().is_main or directory is None:
                    return directory
                self.model.save_pretrained(directory, safe_serialization=True, state_dict=state)
                # save_pretrained wrote the dtype of the model's parameters (fp32 master shards), not of the weights
                self.model.config.dtype = self.dtype
                self.model.config.save_pretrained(directory)
            self.tokenizer.save_pretrained(directory)  # a directory vllm serve and transformers load as it is
            return directory
        # PEFT's save_embedding_layers="auto" asks the Hub for the base's config.json at every save when the
        # adapter names its base by Hub id (to see whether the vocabulary grew: it never does here), a request
        # per sync that hangs where the Hub is unreachable; embeddings LoRA targets are saved as "auto" would.
        targets = self.model.peft_config["default"].target_modules or ()
        embeddings = any(name in targets for name in ("embed_tokens", "lm_head"))
        if not world().distributed:
            self.model.save_pretrained(directory, safe_serialization=True, save_embedding_layers=embeddings)
            return directory
        from driver.distributed.fsdp import full_adapter_state

        state = full_adapter_state(self.model)
        if world().is_main:
            self.model.save_pretrained(directory, safe_serialization=True, state_dict=state,
                                       save_embedding_layers=embeddings)
        return directory

    def gathered_weights(self) -> dict[str, torch.Tensor]:
        """Full fine-tuning under torchrun: every rank calls it (the shards are gathered); rank 0 gets every weight
        whole on the CPU, in model.dtype (fp32 master shards rounded as the forward rounds them: what is saved and
        served), the others {}."""
        from driver.distributed.fsdp import full_model_state

        # A tied weight (the lm_head that is the embeddings) once, under its first name, as save_pretrained
        # writes it; the state dict names it twice.
        first = {name for name, _ in self.model.named_parameters()}
        again = {name for name, _ in self.model.named_parameters(remove_duplicate=False)} - first
        return {name: tensor.to(self.dtype) if tensor.is_floating_point() else tensor
                for name, tensor in full_model_state(self.model).items() if name not in again}

    def load_trained(self, directory: Path) -> None:
        """Load what save_trained wrote (a checkpoint's weights) into the model."""
        from safetensors.torch import load_file

        if self.has_adapter:
            check_same_adapter_settings(directory, self.model.peft_config["default"])
            load_adapter_weights(self.model, directory, str(directory))
            return
        state = {}
        for shard in sorted(directory.glob("*.safetensors")):
            state.update(load_file(shard))
        names = dict(self.model.named_parameters())
        if world().distributed:  # each rank keeps its shards of what it read
            from driver.distributed.fsdp import load_full_model_state

            known = set(self.model.state_dict())
            unexpected = [name for name in state if name not in known]
            load_full_model_state(self.model, {name: state[name] for name in state if name in known})
            missing = [name for name in known if name not in state]
        else:
            missing, unexpected = self.model.load_state_dict(state, strict=False)
        # save_pretrained leaves out a weight tied to another (the output head tied to the embeddings).
        loaded = {id(param) for name, param in names.items() if name in state}
        untied = [name for name in missing if id(self.model.get_parameter(name)) not in loaded]
        if unexpected or untied:
            raise ValueError(f"{directory}: the saved model does not match this one (unexpected: {unexpected[:3]}, "
                             f"missing: {untied[:3]})")


def reshard_if_sharded(*models: nn.Module) -> None:
    """Under torchrun: each model's FSDP units back to their shards (driver/distributed/fsdp.py reshard)."""
    if world().distributed:
        from driver.distributed.fsdp import reshard

        for model in models:
            reshard(model)


def load_adapter_weights(model: nn.Module, directory: Path, source: str) -> None:
    """Every LoRA weight of the saved adapter into the PEFT model; a ValueError naming what does not fit (a weight
    this model lacks, a shape of another model, or an adapted module the file has no weights for)."""
    from peft import set_peft_model_state_dict
    from safetensors.torch import load_file

    state = load_file(directory / "adapter_model.safetensors")
    try:
        result = set_peft_model_state_dict(model, state)
    except RuntimeError as error:  # load_state_dict's size mismatch: an adapter of another model
        raise ValueError(f"{source}: its weights do not fit this model: {str(error).splitlines()[-1].strip()}") \
            from error
    unexpected = list(getattr(result, "unexpected_keys", []))
    missing = [key for key in getattr(result, "missing_keys", []) if ".lora_" in key]
    if unexpected or missing:
        raise ValueError(f"{source}: the adapter does not match this model's LoRA layers "
                         f"(weights it has that the model lacks: {unexpected[:3]}; without weights: {missing[:3]})")


def check_lora_targets(model: nn.Module, model_path: str, targets: list[str], expert_targets: list[str]) -> None:
    """ConfigError naming each LoRA target the model has nothing for: PEFT fails only when no target module
    matches (with a traceback), and ignores an expert parameter or a misspelt module beside matching ones."""
    from driver.cli import ConfigError

    def matches(name: str, target: str) -> bool:  # PEFT's rule: the whole name, or its last dotted parts
        return name == target or name.endswith("." + target)

    modules = [name for name, _ in model.named_modules()]
    parameters = [name for name, _ in model.named_parameters()]
    for key, wanted, names in (("lora.targets", targets, modules), ("lora.expert_targets", expert_targets, parameters)):
        missing = [target for target in wanted if not any(matches(name, target) for name in names)]
        if missing:
            linear = sorted({name.rsplit(".", 1)[-1] for name, module in model.named_modules()
                             if isinstance(module, nn.Linear)})
            experts = sorted({name.split(".layers.", 1)[-1].split(".", 1)[-1] for name in parameters
                              if ".experts." in name})
            has = (f"its linear modules: {', '.join(linear)}" if key == "lora.targets" else
                   f"its expert parameters: {', '.join(experts)}" if experts else "it has no MoE experts")
            raise ConfigError(f"{key}: {', '.join(missing)} {'matches' if len(missing) == 1 else 'match'} nothing in "
                              f"{model_path} ({has})")


# What shapes or scales the adapter: a checkpoint resumed under other values would not load (r), or would
# load and silently train another update (alpha and rslora change the scaling).
ADAPTER_SETTINGS = {"r": "lora.r", "lora_alpha": "lora.alpha", "use_rslora": "lora.rslora"}


def check_same_adapter_settings(directory: Path, ours) -> None:
    """ValueError naming the key when the adapter saved in `directory` was trained with other LoRA settings."""
    config_file = directory / "adapter_config.json"
    if not config_file.is_file():
        return
    saved = json.loads(config_file.read_text())
    for field, key in ADAPTER_SETTINGS.items():
        if field in saved and saved[field] != getattr(ours, field):
            raise ValueError(f"{directory} was trained with {key} = {saved[field]}, this run has "
                             f"{key} = {getattr(ours, field)}: resume with the settings it was trained with")


def kernel_modes(config: Config) -> dict[str, str]:
    """op -> auto | ours | torch: train.kernels and train.kernel_ops, then PYKERNELS_KERNELS on top
    (the environment is the quick switch for one run, e.g. to rule a kernel out)."""
    import pykernels.backend

    return config.train.kernel_modes() | pykernels.backend.environment_modes()


def load_policy(config: Config) -> Policy:
    from peft import LoraConfig, get_peft_model

    from driver.cli import ConfigError
    from transformers import AutoModelForCausalLM, AutoTokenizer

    model_dir = model_directory(config.model.path, config.model.revision)
    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    if tokenizer.pad_token is None:
        tokenizer.pad_token = tokenizer.eos_token
    with seeded(config.train.seed):
        model = AutoModelForCausalLM.from_pretrained(
            model_dir, dtype=DTYPES[config.model.dtype], attn_implementation=config.model.attention)
        check_output_head(model, config.model.path)
        model.config.use_cache = False
        if config.model.adapter == "none":
            return full_policy(config, model, tokenizer, model_dir)
        # The default targets (axolotl's lora_target_linear too) mean "the usual projections, those the model
        # has": an MoE model's fused experts have no gate_proj. A list of one's own must match, name by name.
        named = config.lora.targets if config.lora.targets != LoraSettings.model_fields["targets"].default else []
        check_lora_targets(model, config.model.path, named, config.lora.expert_targets)
        if config.model.qlora:
            quantize_linears(model, config.model.qlora_blocksize)
        lora = LoraConfig(
            r=config.lora.r, lora_alpha=config.lora.alpha, lora_dropout=config.lora.dropout,
            target_modules=list(config.lora.targets) or None,
            target_parameters=list(config.lora.expert_targets) or None,
            use_rslora=config.lora.rslora, bias="none", task_type="CAUSAL_LM")
        model = get_peft_model(model, lora)
        if config.lora.init_from is not None:  # its settings are the section's (driver/data/adapter_settings.py)
            try:
                load_adapter_weights(model, Path(adapter_directory(config.lora.init_from)), config.lora.init_from)
            except ValueError as error:
                raise ConfigError(f"lora.init_from: {error}") from None
        if is_hub_id(config.model.path):  # the adapter names its base as the Hub does, not by this machine's cache
            model.peft_config["default"].base_model_name_or_path = config.model.path
            model.peft_config["default"].revision = config.model.revision
        if config.model.qlora:
            from pykernels.integrations.transformers import quantize_moe_experts

            # After get_peft_model: PEFT reads the expert parameters' shapes when it wraps them.
            quantize_moe_experts(model, config.model.qlora_blocksize)
    return Policy(model=model, tokenizer=tokenizer, model_dir=model_dir,
                  kernels=prepare_for_training(config, model))


def disable_dropout(model: nn.Module) -> None:
    """model.disable_dropout: every nn.Dropout (LoRA's included) at p = 0, and every float a module keeps under a
    dropout name (attention modules read self.attention_dropout in training: an nn.Dropout search misses it); the
    model's config is left as it is, so a saved model keeps its own values."""
    for module in model.modules():
        if isinstance(module, nn.Dropout):
            module.p = 0.0
        for name, value in list(vars(module).items()):
            if "dropout" in name.lower() and isinstance(value, float):
                setattr(module, name, 0.0)


def full_policy(config: Config, model: nn.Module, tokenizer, model_dir: str) -> Policy:
    """Full fine-tuning: every weight trains; a KL term scores against a frozen copy of the base, and EBFT reads its
    features from it, made before anything trains (and before a resumed checkpoint's weights are loaded)."""
    from driver.cli import ConfigError

    if is_moe(model.config):
        raise ConfigError(f"model.adapter = none (full fine-tuning) supports dense models; {config.model.path} is a "
                          "mixture of experts: train it with LoRA (lora.expert_targets for the experts)")
    reference = None
    if config.algo.beta > 0 or config.algo.name == "ebft":
        reference = copy.deepcopy(model).requires_grad_(False).eval()
        if not world().distributed:  # under torchrun FSDP moves it, as the policy (prepare_for_training)
            reference.to(resolve_device(config.model.device))
    kernels = prepare_for_training(config, model)
    return Policy(model=model, tokenizer=tokenizer, model_dir=model_dir, kernels=kernels, frozen_reference=reference,
                  reference_moves=config.algo.sync_ref_model, dtype=DTYPES[config.model.dtype])


def is_moe(model_config) -> bool:
    return any(getattr(model_config, key, None) for key in ("num_local_experts", "num_experts", "n_routed_experts"))


def prepare_for_training(config: Config, model: nn.Module) -> str:
    """model.disable_dropout, pykernels' modules in place of PEFT's and transformers' (per train.kernels),
    gradient checkpointing, then the move to the device; returns what runs on pykernels' kernels, for the log."""
    if config.model.disable_dropout:
        disable_dropout(model)
    kernels = Policy.kernels
    modes = kernel_modes(config)
    if modes["lora"] != "torch" or modes["moe"] != "torch":  # torch: PEFT's and transformers' own modules
        from pykernels.integrations.peft import apply_fused_lora
        from pykernels.integrations.transformers import apply_moe_kernels

        fused = apply_fused_lora(model) if modes["lora"] != "torch" else 0  # fused LoRA (dense and NF4 bases)
        grouped = apply_moe_kernels(model) if modes["moe"] != "torch" else 0  # grouped experts; 0 if dense
        parts = [f"fused LoRA on {fused} layers"] if fused else []
        parts += [f"grouped MoE kernels on {grouped} experts modules"] if grouped else []
        kernels = ", ".join(parts) or "no LoRA or MoE layers to fuse (full fine-tuning of a dense model)"
    if config.model.gradient_checkpointing:
        # Non-reentrant: the inputs need not require grad (the base is frozen, only the adapter trains).
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    # Loaded (and NF4-quantized) on the CPU, then moved: a large model never has to fit on the GPU
    # in 16-bit before quantization. Full fine-tuning under torchrun stays on the CPU: FSDP moves each unit to
    # this rank's device as it shards it (driver/distributed/fsdp.py), so no GPU holds the whole model.
    if not (world().distributed and config.model.adapter == "none"):
        model.to(resolve_device(config.model.device))
    return kernels


# transformers config attributes by which a model changes its logits around the output head, with the
# value that changes nothing: the fused logprobs op (pykernels.logprobs.token_logprobs) computes
# log_softmax(final hidden state @ lm_head.weight^T / temperature) and applies none of them.
LOGIT_TRANSFORMS = {
    "final_logit_softcapping": None,  # Gemma 2/3/4: cap * tanh(logits / cap)
    "logit_scale": 1.0,  # Cohere: logits * scale
    "logits_scaling": 1.0,  # Granite: logits / scaling
    "lm_head_multiplier": 1.0,  # Falcon-H1: logits * multiplier
    "output_multiplier": 1.0,  # logits * multiplier before the softcap
    "logits_mup_width_multiplier": 1.0,  # hidden / multiplier before the head
}


def check_output_head(causal_lm: nn.Module, model_path: str) -> None:
    """ConfigError for a model whose logits are not hidden @ lm_head.weight^T (a bias on the head, a
    logit soft-cap or scale): the trainer would score another distribution than the model's (and
    vLLM's), and the importance weights would silently absorb the difference."""
    from driver.cli import ConfigError

    configs = [causal_lm.config]
    text_config = causal_lm.config.get_text_config(decoder=True)
    if text_config is not causal_lm.config:
        configs.append(text_config)
    found = [f"{name} = {getattr(config, name)}" for config in configs for name, neutral in LOGIT_TRANSFORMS.items()
             if getattr(config, name, None) is not None and getattr(config, name) != neutral]
    head = causal_lm.get_output_embeddings()
    if getattr(head, "bias", None) is not None:
        found.append(f"a bias on the output head ({type(head).__name__} with bias of shape {tuple(head.bias.shape)})")
    if found:
        raise ConfigError(f"model.path = {model_path}: {'; '.join(found)}. The trainer scores tokens with "
                          "log_softmax(hidden @ lm_head.weight^T / temperature) (pykernels' fused logprobs), which "
                          "ignores this, so it would train on other logprobs than the model's: such models are not "
                          "supported")


def resolve_device(name: str) -> torch.device:
    """auto: cuda if available, else cpu. Under torchrun, "auto" and "cuda" mean this rank's GPU."""
    from driver.distributed.world import world

    if name == "auto":
        name = "cuda" if torch.cuda.is_available() else "cpu"
    if name == "cuda" and world().distributed:
        return torch.device("cuda", world().local_rank)
    return torch.device(name)


def quantize_linears(model: nn.Module, blocksize: int) -> int:
    """Replace every nn.Linear except the head and routers by an NF4Linear (double-quantized). MoE
    experts (3-D parameters, not nn.Linear) are quantized in load_policy once PEFT has wrapped them."""
    from pykernels.nn import NF4Linear

    replaced = 0
    for name, module in list(model.named_modules()):
        if type(module) is not nn.Linear or name.endswith(UNQUANTIZED_SUFFIXES):
            continue
        parent_name, _, child = name.rpartition(".")
        parent = model.get_submodule(parent_name) if parent_name else model
        setattr(parent, child, NF4Linear.from_linear(module, blocksize=blocksize, double_quant=True))
        replaced += 1
    return replaced


@contextlib.contextmanager
def evaluating(model: nn.Module):
    """Eval mode (dropout off) inside the block; the model's training mode restored after."""
    was_training = model.training
    model.eval()
    try:
        yield model
    finally:
        model.train(was_training)


@contextlib.contextmanager
def seeded(seed: int):
    """Seed torch's global generator inside the block (LoRA init), restoring it after."""
    state = torch.random.get_rng_state()
    torch.manual_seed(seed)
    try:
        yield
    finally:
        torch.random.set_rng_state(state)
