"""A sequence-classification reward model as a reward function (TRL's reward-model `reward_funcs`): the
first logit of the model on prompt + completion is the reward. Text prompts are concatenated with their
completion; conversations are rendered with the reward model's own chat template (prompt messages +
the assistant's completion), as TRL does. Scored without gradients, in batches of `batch_size`
right-padded sequences, on the trainer's device."""

from __future__ import annotations

import os
from pathlib import Path

import torch

from driver.data.conversation import as_assistant_message


def trainer_device(name: str) -> torch.device:
    """model.device as the trainer resolves it (driver/policy/model.resolve_device): auto = cuda if
    available; under torchrun cuda means this rank's GPU (LOCAL_RANK)."""
    if name == "auto":
        name = "cuda" if torch.cuda.is_available() else "cpu"
    if name == "cuda" and "LOCAL_RANK" in os.environ:
        return torch.device("cuda", int(os.environ["LOCAL_RANK"]))
    return torch.device(name)


class SequenceClassifierReward:
    def __init__(self, model_path: str, device: str = "auto", batch_size: int = 16) -> None:
        from transformers import AutoModelForSequenceClassification, AutoTokenizer

        self.__name__ = Path(model_path.rstrip("/")).name  # the name in the logs, as a function's
        self.batch_size, self.device = batch_size, trainer_device(device)
        self.tokenizer = AutoTokenizer.from_pretrained(model_path, padding_side="right")
        if self.tokenizer.pad_token is None:
            self.tokenizer.pad_token = self.tokenizer.eos_token
        self.model = AutoModelForSequenceClassification.from_pretrained(model_path).to(self.device).eval()
        # The classifier reads each row's last real token, found through the pad id.
        self.model.config.pad_token_id = self.tokenizer.pad_token_id

    def texts(self, prompts: list, completions: list) -> list[str]:
        texts = []
        for prompt, completion in zip(prompts, completions):
            if isinstance(prompt, str):
                texts.append(prompt + completion)
                continue
            if self.tokenizer.chat_template is None:
                raise ValueError(f"reward model {self.__name__}: the prompts are conversations, but its tokenizer "
                                 "has no chat template to render them with")
            messages = list(prompt) + (completion if isinstance(completion, list) else as_assistant_message(completion))
            texts.append(self.tokenizer.apply_chat_template(messages, tokenize=False))
        return texts

    @torch.no_grad()
    def __call__(self, prompts: list, completions: list, **columns) -> list[float]:
        texts = self.texts(prompts, completions)
        rewards = []
        for start in range(0, len(texts), self.batch_size):
            inputs = self.tokenizer(texts[start:start + self.batch_size], return_tensors="pt", padding=True,
                                    add_special_tokens=False).to(self.device)
            rewards += self.model(**inputs).logits[:, 0].float().tolist()
        return rewards
