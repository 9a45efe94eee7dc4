"""PEFT and transformers integrations (fused LoRA, MoE experts) land with their kernel families."""
