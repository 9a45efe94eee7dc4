"""Per-token logprobs and entropy with the lm_head fused in, on packed sequences.

    >>> targets = pykernels.logprobs.packed_targets(input_ids_flat, cu_seqlens)
    >>> lp = pykernels.logprobs.token_logprobs(hidden, lm_head.weight, targets, temperature=0.7)

The [N, V] logits never exist, forward or backward (see csrc/logprobs/). The pure-torch statement
of the same ops is pykernels.reference.logprobs (chunked torch logprobs); token_logprobs is
dispatched between the two (pykernels/dispatch.py, pykernels.backend.set_kernels).
"""

from pykernels import dispatch
from pykernels.ops import logprobs as _ops
from pykernels.ops.logprobs import IGNORE_INDEX
from pykernels.packed_sequences import packed_targets


def _bucket(hidden, weight, targets, temperature=1.0, ignore_index=IGNORE_INDEX, return_entropy=False,
            entropy_grad=True):
    tokens = dispatch.token_bucket(hidden.shape[0])
    entropy = " entropy" if return_entropy else ""
    return hidden.device, hidden.dtype, f"tokens<={tokens} hidden={hidden.shape[1]} vocab={weight.shape[0]}{entropy}"


token_logprobs = dispatch.dispatched("logprobs", _ops.token_logprobs, _bucket)

__all__ = ["IGNORE_INDEX", "packed_targets", "token_logprobs"]
