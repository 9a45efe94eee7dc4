"""EBFT (energy-based fine-tuning, https://arxiv.org/abs/2603.12248): features, rewards, advantages."""
