"""The plan: plain data saying which block of which global tensor each local tensor holds.

Planning allocates nothing. A ``Target`` is produced by the model walkers (TorchRec, DTensor,
plain modules) and consumed by the fill stages (init engine, checkpoint loader).
"""
from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Optional, Tuple

import torch

from .spec import Dist

__all__ = ["Target", "block_nbytes"]


@dataclass
class Target:
    """One local block of one global tensor.

    Attributes:
        fqn: the model's ``state_dict()`` key for the global tensor (checkpoint key).
        key: RNG key of the table (its name); the init engine hashes it.
        global_shape: shape of the unsharded tensor (1-D or 2-D).
        offsets: offset of this block inside the global tensor, one per dim.
        local_shape: shape of this block.
        dtype: dtype of the destination.
        dist: how to initialise it when it is not loaded (None: a custom callable or
            module-driven init decides, see ``init_fn``).
        tensor: the real destination (set by the allocate stage); a 1-D or 2-D view with
            unit inner stride, ``local_shape`` elements.
        init_fn: optional callable applied to ``tensor`` instead of the fused engine.
    """

    fqn: str
    key: str
    global_shape: Tuple[int, ...]
    offsets: Tuple[int, ...]
    local_shape: Tuple[int, ...]
    dtype: torch.dtype
    dist: Optional[Dist] = None
    tensor: Optional[torch.Tensor] = field(default=None, repr=False)
    init_fn: Optional[object] = field(default=None, repr=False)

    @property
    def nbytes(self) -> int:
        return block_nbytes(self.local_shape, self.dtype)


def block_nbytes(shape: Tuple[int, ...], dtype: torch.dtype) -> int:
    """Bytes of a dense block of ``shape`` and ``dtype``."""
    return math.prod(shape) * torch.empty((), dtype=dtype).element_size()
