"""The CPU kernels' bf16 GEMM (csrc/common/cpu_gemm_bf16.h), which the logprobs and MoE ops run, on
each of its paths against an fp64 product of the same bf16 values. On AMX the tiles take K in steps of
32 over all of C, a last row tile or partial last panel through a copy that must leave C's other
elements alone, and AVX-512 the rest of K, so the shapes put M, N and K on both sides of the tiles'
edges (16 rows, 32 columns, 32 of K), K past their 1024-element cache block and M past their 256-row one."""

import numpy as np
import pytest
import torch

from pykernels import _C

SHAPES = [  # (m, n, k)
    (1, 1, 1),
    (16, 32, 32),  # exactly one tile block, one panel, one K step
    (15, 31, 31),  # just below each: all on AVX-512
    (15, 31, 64),  # a partial row tile and a partial panel only
    (17, 33, 33),  # one past each: partial tiles beside whole ones, one element of K on AVX-512
    (48, 64, 96),
    (33, 95, 257),  # odd K: AVX-512's last element
    (40, 64, 1024 + 64 + 1),  # one whole K block, a partial one, the odd element
    (130, 70, 600),
    (7, 200, 1000),  # fewer rows than a tile
    (300, 40, 4096 + 33),  # two row blocks (256 rows) by five K blocks, the last partial
]


def bf16_bits(t: torch.Tensor) -> np.ndarray:
    return t.bfloat16().view(torch.int16).numpy().view(np.uint16)


def run(m, n, k, accumulate, seed, prepacked=False):
    g = torch.Generator().manual_seed(seed)
    a = torch.randn(m, k, generator=g).bfloat16()
    b_t = torch.randn(n, k, generator=g).bfloat16()
    ld = n + 5  # columns past n must stay as they were
    c = torch.randn(m, ld, generator=g).numpy()
    before = c.copy()
    _C.host_logic.cpu_gemm_bf16(bf16_bits(a), bf16_bits(b_t), c, accumulate, prepacked=prepacked)
    a64, b64 = a.double().numpy(), b_t.double().numpy()
    exact = a64 @ b64.T + (before[:, :n] if accumulate else 0.0)
    # fp32 sums of exact bf16 products: within k roundings of the sum of magnitudes
    bound = (k + 1) * 2.0**-24 * (np.abs(a64) @ np.abs(b64).T + np.abs(before[:, :n]))
    return c, before, exact, bound


@pytest.mark.parametrize("prepacked", [False, True], ids=["a_packed_here", "a_prepacked"])
@pytest.mark.parametrize("accumulate", [False, True], ids=["overwrite", "accumulate"])
def test_matches_fp64_at_every_edge(gemm_cpu_isa, accumulate, prepacked):
    """prepacked: A handed to the GEMM as gemm::prepack_a laid it out (the MoE ops pack a slot chunk once
    for all of its column blocks), every cache block of it found where the tiles look."""
    if gemm_cpu_isa == "scalar":
        pytest.skip("the GEMM is AVX-512 BF16 code: scalar kernels take other paths")
    for i, (m, n, k) in enumerate(SHAPES):
        try:
            c, before, exact, bound = run(m, n, k, accumulate, seed=i, prepacked=prepacked)
        except ValueError as e:
            pytest.skip(str(e))  # no AVX-512 BF16
        err = np.abs(c[:, :n] - exact)
        assert (err <= bound).all(), (m, n, k, float((err / bound).max()))
        np.testing.assert_array_equal(c[:, n:], before[:, n:], err_msg=f"columns past n written at {(m, n, k)}")


def test_rejects_mismatched_shapes():
    with pytest.raises(ValueError, match="shapes must be a \\[m, k\\], b_t \\[n, k\\], c \\[m, >= n\\]"):
        _C.host_logic.cpu_gemm_bf16(np.zeros((2, 3), np.uint16), np.zeros((4, 5), np.uint16),
                                    np.zeros((2, 4), np.float32), False)
