"""Public op functions with their fake implementations, one module per kernel family."""
