"""Prompts and what generation makes of them: dataset files (via `datasets`) and `data.transform`s
(`prompts`; axolotl's EBFT dataset types live in driver/axolotl/transforms.py), the built-in tasks
with their rewards (`toy_tasks`, `gsm8k`), the tiny random models and tokenizer the default config
trains (`tiny_model`), where a model.path's weights come from (`model_source`: tiny://, a local directory
or a Hugging Face Hub id), and the groups of samples generated for a prompt, each token tagged with the
adapter version that sampled it (`records`).

Interface: `prompts.PromptSource` serves `prompts.Prompt`s (token ids, text, the row's other columns
for the reward functions) in a seeded order whose position is part of every checkpoint;
`records.Group` / `Sample` / `Span`; `model_source.model_directory`. Depends on config and cli only.
"""
