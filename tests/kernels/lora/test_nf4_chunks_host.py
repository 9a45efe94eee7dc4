"""How many rows of an NF4 weight the CUDA LoRA op dequantizes per GEMM (csrc/lora/nf4_chunks.h), on
the host: 16 MiB, grown until the forward GEMM of one chunk fills the GPU, or capped by
PYKERNELS_NF4_CHUNK_MIB."""

import math
import random

import pytest

from pykernels import _C

H = _C.host_logic
H100_SMS = 132
MIB = 1 << 20


def tiles(m: int, rows: int) -> int:
    """128 x 256 tiles of the forward GEMM y[:, rows] = x W[rows]^T for m tokens."""
    return math.ceil(m / 128) * math.ceil(rows / 256)


def test_the_measured_qlora_forward_takes_the_whole_weight_at_1024_tokens():
    # 4096 -> 14336 at T 1024: 16 MiB chunks were 2048 rows, 64 tiles on 132 SMs, seven in a row
    assert H.lora_nf4_chunk_rows(14336, 4096, 1024, 2, H100_SMS) == 14336
    assert H.lora_nf4_chunk_rows(14336, 4096, 1024, 2, H100_SMS, "16") == 2048
    # at T 8192 a 16 MiB chunk already holds 8 x 64 tiles: the chunks stay as they were
    assert H.lora_nf4_chunk_rows(14336, 4096, 8192, 2, H100_SMS) == 2048


@pytest.mark.parametrize("seed", range(4))
def test_default_chunks_fill_the_gpu_within_their_memory(seed):
    rng = random.Random(seed)
    for _ in range(500):
        n, k = rng.randint(1, 60000), rng.randint(1, 30000)
        m, size, sms = rng.randint(1, 70000), rng.choice([2, 4]), rng.choice([0, 1, 78, 114, 132])
        rows = H.lora_nf4_chunk_rows(n, k, m, size, sms)
        assert 1 <= rows <= n
        assert rows == n or rows % 8 == 0
        fit = max(8, 16 * MIB // (k * size) // 8 * 8)
        filling = math.ceil(4 * sms / math.ceil(m / 128)) * 256 if sms else 0
        assert rows == n or rows <= max(fit, filling), "more memory than 16 MiB or four waves need"
        if sms:  # the chunks split n evenly, so each is at least half of four waves
            assert rows == n or tiles(m, rows) >= 2 * sms, (n, k, m, size, sms, rows)
        else:
            assert rows == min(n, fit) or math.ceil(n / rows) == math.ceil(n / fit), "no device: 16 MiB chunks"


@pytest.mark.parametrize(("setting", "cap"), [("1", MIB), ("16", 16 * MIB), ("300", 300 * MIB)])
def test_a_cap_bounds_every_chunk(setting, cap):
    rng = random.Random(cap)
    for _ in range(300):
        n, k, m, size = rng.randint(1, 60000), rng.randint(1, 30000), rng.randint(1, 70000), rng.choice([2, 4])
        rows = H.lora_nf4_chunk_rows(n, k, m, size, H100_SMS, setting)
        assert rows == n or rows % 8 == 0
        assert rows * k * size <= cap or rows == min(n, 8), "over the cap"
        fit = max(8, cap // (k * size) // 8 * 8)
        assert math.ceil(n / rows) == math.ceil(n / min(n, fit)), "more chunks than the cap needs"


def test_degenerate_shapes():
    assert H.lora_nf4_chunk_rows(0, 4096, 16, 2, H100_SMS) == 0
    assert H.lora_nf4_chunk_rows(7, 0, 16, 2, H100_SMS) == 7
    assert H.lora_nf4_chunk_rows(5, 4096, 0, 2, H100_SMS) == 5
    assert H.lora_nf4_chunk_rows(100_000, 1 << 24, 16, 4, H100_SMS, "1") == 8  # one row over the cap: 8 rows


@pytest.mark.parametrize("setting", ["0", "-1", "1.5", "16MiB", "abc", "99999999999", "1048577"])
def test_bad_cap_is_named(setting):
    with pytest.raises(ValueError, match=r"PYKERNELS_NF4_CHUNK_MIB must be a whole number of MiB from 1 to 1048576"):
        H.lora_nf4_chunk_rows(4096, 4096, 16, 2, H100_SMS, setting)


@pytest.mark.parametrize("setting", ["", "auto"])
def test_empty_or_auto_is_the_default(setting):
    assert H.lora_nf4_chunk_rows(14336, 4096, 1024, 2, H100_SMS, setting) == 14336
