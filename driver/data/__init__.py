"""Prompts and what generation makes of them: dataset files (via `datasets`) and `data.transform`s
(`prompts`; axolotl's EBFT dataset types live in driver/axolotl/transforms.py), the built-in tasks
with their rewards (`toy_tasks`, `gsm8k`), the tiny random models and tokenizer the default config
trains (`tiny_model`), where a model.path's weights come from (`model_source`: tiny://, a local directory
or a Hugging Face Hub id; also lora.init_from's adapter, whose settings `adapter_settings` adopts), where a
trained adapter goes on the Hub (`hub_upload`: checkpoint.push_to_hub), which
prompts train and which are evaluated (`eval_prompts`), and the groups of samples generated for a prompt,
each token tagged with the adapter version that sampled it (`records`), with the training progress their
rewards see (`trainer_state`, TRL's).

Interface: `prompts.PromptSource` serves `prompts.Prompt`s (token ids, text, the row's other columns
for the reward functions) in a seeded order whose position is part of every checkpoint;
`eval_prompts.training_and_eval_prompts`; `records.Group` / `Sample` / `Span`; `model_source.model_directory`,
`adapter_directory`; `adapter_settings.adopt_adapter_settings`; `hub_upload.create_repository`,
`HubUploader`. Depends on config and cli only.
"""
