"""Prompts and what generation makes of them: dataset files (via `datasets`) and `data.transform`s
(`prompts`; axolotl's EBFT dataset types live in driver/axolotl/transforms.py), the built-in tasks
with their rewards (`toy_tasks`, `gsm8k`), the tiny random models and tokenizer the default config
trains (`tiny_model`), and the groups of samples generated for a prompt, each token tagged with the
adapter version that sampled it (`records`).

Interface: `prompts.PromptSource` serves `prompts.Prompt`s (token ids, text, the row's other columns
for the reward functions) in a seeded order whose position is part of every checkpoint;
`records.Group` / `Sample` / `Span`; `tiny_model.resolve_model_path`. Depends on config and cli only.
"""
