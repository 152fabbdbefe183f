"""metamat: materialize meta-device recommendation models fast.

Fused, plan-invariant init (every element a pure function of seed, table name, global row and
column) and rank-local checkpoint loading, with a torch-free C++/CUDA core.
"""
from .spec import Constant, Dist, Normal, TruncatedNormal, Uniform, Zeros
from .fill_init import fill_, fill_many_
from ._ext import ExtensionNotBuiltError

__version__ = "0.1.0"

__all__ = [
    "Dist", "Uniform", "Normal", "TruncatedNormal", "Constant", "Zeros",
    "fill_", "fill_many_", "ExtensionNotBuiltError",
]
