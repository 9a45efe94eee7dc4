"""The policy update of one step: the GRPO / DAPO / Dr. GRPO losses with importance-sampling and
off-policy corrections (`losses`), AdamW and the learning-rate schedule (`optim`), and the step
itself (`step`: score the batch on packed sequences, take num_iterations optimizer updates).

Interface: `step.optimize(config, policy, batch, optimizer, scheduler)` returns the step's metrics.
Depends on config, policy, rollouts (the batch, its filtering), distributed.world and metrics.
"""
