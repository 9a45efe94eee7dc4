"""Modules built on pykernels ops."""

from pykernels.nn.nf4_linear import NF4Linear, nf4_linear

__all__ = ["NF4Linear", "nf4_linear"]
