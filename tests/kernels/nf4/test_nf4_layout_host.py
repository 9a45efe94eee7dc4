"""nf4/nf4_layout.h's block arithmetic on the host (pykernels._C.host_logic): the dequantize kernel
finds each 8 values' block and nested block by a shift when the blocksize is a power of two (every
bitsandbytes blocksize), by a division otherwise; both must give i // d."""

import pytest

from pykernels import _C

H = _C.host_logic
INDICES = [0, 1, 7, 63, 64, 65, 255, 256, 4095, 4096, 2**31 - 1, 2**31, 2**33 + 5, 151936 * 4096 - 1]


@pytest.mark.parametrize("d", [1, 32, 64, 256, 4096])
def test_power_of_two_divisors_shift(d):
    for i in INDICES:
        assert H.nf4_divide(i, d) == (i // d, d.bit_length() - 1), (i, d)


@pytest.mark.parametrize("d", [3, 96, 100, 4095])
def test_other_divisors_divide(d):
    for i in INDICES:
        assert H.nf4_divide(i, d) == (i // d, -1), (i, d)
