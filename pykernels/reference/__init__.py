"""Pure-torch references: the readable math, the test oracles and the benchmark baselines."""
