"""axolotl configs translated into ours: `python -m driver.train axolotl.yml` (recognized by its keys,
or forced with `--from axolotl`) prints the translation, then trains with it.

An axolotl GRPO (`rl: grpo | gdpo`) or EBFT (`rl: ebft`) config becomes one of ours key by key
(docs/axolotl-differences.md#config-translation has the table). Where axolotl leaves a key out, the
default it would use (its own, or that of TRL 1.8, which it pins) is written out wherever it differs
from ours, so the translated run is the one axolotl would make. Every key is mapped, accepted because
it changes nothing here, or refused; the refusals come back together, each with its reason, and then
nothing is translated.

By job: `keys` (the tables: markers, axolotl's defaults, renames, keys without effect, known
refusals), `pending` (the keys still to translate, what was made of the others, the refusals),
`model_keys` / `rollout_keys` / `training_keys` (the translation, section by section),
`translator` (the steps in order), `transforms` (axolotl's EBFT dataset types as data.transforms).

Interface: `translate(data) -> Translation` (our config as a dict, and notes for its reader),
`translation_yaml(translation, source)`, `is_axolotl_config(data)`, `AXOLOTL_MARKERS`,
`UntranslatableConfig` (every refused key with its reason). Depends on config only.
"""

from __future__ import annotations

from driver.axolotl.keys import AXOLOTL_MARKERS, BUILTIN_DATASET_TYPES
from driver.axolotl.pending import UntranslatableConfig
from driver.axolotl.translator import Translation, is_axolotl_config, translate, translation_yaml

__all__ = ["AXOLOTL_MARKERS", "BUILTIN_DATASET_TYPES", "Translation", "UntranslatableConfig", "is_axolotl_config",
           "translate", "translation_yaml"]
