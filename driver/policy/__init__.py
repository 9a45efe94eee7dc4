"""The policy being trained: the transformers causal LM with its PEFT LoRA adapter, optionally on an
NF4 base (QLoRA), with the pykernels switch (`model`), and the per-token logprobs of completions on
packed sequences through the fused lm_head kernel (`logprobs`).

Interface: `model.load_policy(config) -> Policy`, `model.evaluating(module)`;
`logprobs.pack(...)` and `logprobs.completion_logprobs(model, packed, temperature)`. Depends on config and
data (the model path) only.
"""
