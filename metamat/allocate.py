"""Allocation helpers shared by the model walkers.

Large CPU storages come from fresh anonymous memory maps: the kernel hands out zero pages on
first touch (calloc semantics), so storages that must start at zero (optimizer state, gaps)
cost no write pass at all, and pages nobody touches take no memory.
"""
from __future__ import annotations

import math
import mmap

import torch

__all__ = ["LAZY_ZERO_MIN_BYTES", "zeroed_cpu_storage", "is_zero_dist"]

# Below this a map costs more than the memset it saves (and rounds up to a page).
LAZY_ZERO_MIN_BYTES = 1 << 20


def zeroed_cpu_storage(nbytes: int) -> torch.UntypedStorage:
    """A CPU storage of ``nbytes`` guaranteed to read as zeros, not yet touched.

    The storage keeps its private anonymous map alive and unmaps it when freed.
    """
    mm = mmap.mmap(-1, max(1, nbytes), flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
    st = torch.frombuffer(mm, dtype=torch.uint8).untyped_storage()
    return st if nbytes == st.nbytes() else _narrow(st, nbytes)


def _narrow(st: torch.UntypedStorage, nbytes: int) -> torch.UntypedStorage:
    # Only for nbytes == 0 (a map needs one byte): an empty storage of the right size.
    return torch.UntypedStorage(nbytes)


def is_zero_dist(dist) -> bool:
    """True for Zeros() / Constant(+0.0): values a zeroed storage already holds."""
    from .spec import Constant

    return isinstance(dist, Constant) and dist.value == 0.0 and math.copysign(1.0, dist.value) > 0
