"""The translation's working state: axolotl's keys still to translate (flattened to dotted keys), our
config being built, the notes for its reader and the refusals, each with its reason."""

from __future__ import annotations

from typing import Any

from driver.axolotl.keys import NESTED_SECTIONS


class UntranslatableConfig(ValueError):
    """Keys the translation cannot honour, each with why: {key: reason}."""

    def __init__(self, refused: dict[str, str]) -> None:
        self.refused = refused
        lines = "\n".join(f"  {key}: {reason}" for key, reason in refused.items())
        super().__init__(f"this axolotl config cannot be translated (nothing was); remove or change:\n{lines}")


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


class PendingKeys:
    """Each step of the translation takes the keys it handles out of `pending` and puts ours into `out`;
    what is left at the end was not translated and is refused with the rest. The steps live in the
    *_keys.py modules, mixed into driver/axolotl/translator.py's Translator."""

    # Set by the steps that decide them, read by later ones.
    method: str  # grpo | ebft (axolotl's rl:)
    strided: bool  # ebft mode strided: the trainer samples, no vLLM
    backend: str  # our rollout.backend
    num_iterations: int  # trl.num_iterations
    max_steps: int | None  # axolotl's max_steps (optimizer steps)
    updates_per_step: int  # optimizer steps one train step here makes (num_iterations x steps per generation)

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
