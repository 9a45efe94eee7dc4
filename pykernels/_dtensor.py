"""DTensor (FSDP2, tensor parallel) inputs of the ops, unwrapped explicitly.

Under FSDP2 a module's parameters are plain tensors during its own forward (FSDP all-gathers them in
the pre-forward hook), so the ops normally never see a DTensor. A sharded parameter read outside its
module's forward (e.g. an lm_head weight passed to token_logprobs) is a DTensor; the custom ops have
no DTensor sharding rules, so it is gathered here into the full tensor. DTensor.full_tensor() is
differentiable: the gradient of a trainable sharded weight flows back to its shards.
"""

from __future__ import annotations

try:  # at import, not per call: torch.compile traces the ops' public functions
    from torch.distributed.tensor import DTensor
except ImportError:  # a torch build without torch.distributed has no DTensor either
    DTensor = ()


def full(tensor):
    """tensor itself, or the full (all-gathered, replicated) tensor of a DTensor."""
    return tensor.full_tensor() if isinstance(tensor, DTensor) else tensor
