"""Per-token logprobs and entropy with the lm_head fused in, on packed sequences.

    >>> targets = pykernels.logprobs.packed_targets(input_ids_flat, cu_seqlens)
    >>> lp = pykernels.logprobs.token_logprobs(hidden, lm_head.weight, targets, temperature=0.7)

The [N, V] logits never exist, forward or backward (see csrc/logprobs/). The pure-torch statement
of the same ops is pykernels.reference.logprobs; pykernels.backend.set_kernels("reference")
switches to it.
"""

from pykernels.ops.logprobs import IGNORE_INDEX, token_logprobs
from pykernels.reference.logprobs import packed_targets

__all__ = ["IGNORE_INDEX", "packed_targets", "token_logprobs"]
