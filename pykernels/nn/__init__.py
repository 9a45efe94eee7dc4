"""Modules built on pykernels ops."""

from pykernels.nn.nf4_experts import NF4ExpertWeight
from pykernels.nn.nf4_linear import NF4Linear, nf4_linear

__all__ = ["NF4ExpertWeight", "NF4Linear", "nf4_linear"]
