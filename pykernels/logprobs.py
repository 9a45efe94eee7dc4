"""Per-token logprobs and entropy with the lm_head fused in, on packed sequences.

    >>> lp = pykernels.logprobs.token_logprobs(hidden, lm_head.weight, targets, temperature=0.7)

Until the fused CPU/CUDA kernels land (issue [4/8]) these are the pure-torch references
(pykernels.reference.logprobs), chunked so the full [N, V] logits never exist at once.
"""

from pykernels.reference.logprobs import IGNORE_INDEX, packed_targets, token_logprobs

__all__ = ["IGNORE_INDEX", "packed_targets", "token_logprobs"]
