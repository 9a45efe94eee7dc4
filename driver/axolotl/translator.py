"""One axolotl config translated into ours: the steps of ModelKeys, RolloutKeys and TrainingKeys in
order, then every key left over refused (with the rest)."""

from __future__ import annotations

from typing import NamedTuple

import yaml

from driver.axolotl.keys import AXOLOTL_MARKERS, KNOWN_REFUSALS
from driver.axolotl.model_keys import ModelKeys
from driver.axolotl.pending import UntranslatableConfig
from driver.axolotl.rollout_keys import RolloutKeys
from driver.axolotl.training_keys import TrainingKeys
from driver.config import Config

OUR_SECTIONS = frozenset(Config.model_fields) - {"ebft"}  # ebft: is a section of both


class Translation(NamedTuple):
    config: dict  # ours, sections in Config's order, only the keys the axolotl config decides
    notes: list[str]  # what a reader of the translation should know, printed as comments above it


def is_axolotl_config(data: dict) -> bool:
    """axolotl's top-level keys and none of our sections (ours always have some: a file of `ebft:` alone is ours)."""
    return bool(data.keys() & AXOLOTL_MARKERS) and not data.keys() & OUR_SECTIONS


def translate(data: dict) -> Translation:
    """Our config (a plain dict, for Config.model_validate) for an axolotl one; UntranslatableConfig
    names every key it cannot honour."""
    return Translator(data).run()


def translation_yaml(translation: Translation, source: str) -> str:
    """The translation as a YAML file a user can keep and run as it is."""
    header = [f"# {source}, an axolotl config, translated by `python -m driver.train` (docs/axolotl-differences.md)",
              *(f"# {line}" for note in translation.notes for line in note.splitlines())]
    return "\n".join(header) + "\n" + yaml.safe_dump(translation.config, sort_keys=False)


class Translator(ModelKeys, RolloutKeys, TrainingKeys):
    """One pass over an axolotl config (PendingKeys: what is taken, put, noted and refused)."""

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
        self.evaluation()
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

