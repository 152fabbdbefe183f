"""The plan: plain data saying which block of which global tensor each local tensor holds,
which storages must exist and how every byte gets its value.

Planning allocates nothing. The model adapters (:mod:`metamat.models`) produce
:class:`Target` s (checkpointable blocks) and :class:`StorageGroup` s (meta storages to
allocate); the fill stages (:mod:`metamat.init`, :mod:`metamat.load`) consume them.
"""
from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any, List, Optional, Tuple

import torch

from .spec import Dist

__all__ = ["Target", "StorageGroup", "block_nbytes", "storage_key"]


@dataclass
class Target:
    """One local block of one global tensor.

    Attributes:
        fqn: the model's name for the global tensor (``state_dict()`` key, or the fused
            optimizer's ``state.<param>.<name>`` path): the checkpoint key.
        key: RNG key of the tensor (a TorchRec table's name, else the fqn).
        global_shape: shape of the whole tensor (0-, 1- or 2-D; N-D tensors are planned as
            row blocks of their ``(rows, cols)`` view, :mod:`metamat.blocks`).
        offsets: offset of this block inside the global tensor, one per dim.
        local_shape: shape of this block.
        dtype: dtype of the destination.
        dist: the fused distribution that initialises it when it is not loaded (None: a
            callable, a value or the owning module decides).
        tensor: the destination: a meta view until the allocate stage binds the real one
            (a 1-D or 2-D view with unit inner stride, ``local_shape`` elements); a real tensor
            for blocks that already exist (loaded into a shadow copy, or in place).
        init_fn: a callable applied to ``tensor`` instead of the fused engine.
        aliases: other names of the same tensor (tied parameters); a checkpoint may hold it
            under any of them.
        optimizer: fused-optimizer state (its checkpoint keys have their own prefixes and it
            is optional in a checkpoint).
        persistent: it belongs in a checkpoint (non-persistent buffers do not).
        shadowed: loaded through a shadow copy even with ``inplace=True``: state checked
            after the read (managed-collision remapping state), which a failed check must leave
            as it was.
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
    aliases: Tuple[str, ...] = ()
    optimizer: bool = False
    persistent: bool = True
    shadowed: bool = False

    @property
    def nbytes(self) -> int:
        return block_nbytes(self.local_shape, self.dtype)

    @property
    def names(self) -> Tuple[str, ...]:
        """Every name of the tensor, canonical first."""
        return (self.fqn,) + tuple(self.aliases)


@dataclass
class StorageGroup:
    """One storage the allocate stage creates, and how its bytes get their values.

    Attributes:
        key: identity of the meta storage it replaces (:func:`storage_key`).
        nbytes: bytes to allocate.
        kind: ``"targets"`` (targets cover it; bytes no target covers are zeroed),
            ``"values"`` (``value`` is its whole content: metadata with known values),
            ``"zeros"`` (nobody else writes it).
        value: the content for ``"values"``.
        where: a readable path to one tensor viewing it, for messages (empty: the adapter
            finds one when a message needs it; a path costs microseconds, a TBE has ~50
            storages).
        memory: the memory it needs on a CUDA device (:data:`metamat.allocate.MEMORY_KINDS`:
            ``"device"``, or fbgemm's unified memory ``"uvm"`` / ``"uvm_host_mapped"``).
    """

    key: int
    nbytes: int
    kind: str = "zeros"
    value: Optional[torch.Tensor] = field(default=None, repr=False)
    where: str = ""
    tensors: List[Any] = field(default_factory=list, repr=False)
    memory: str = "device"


def storage_key(t: torch.Tensor) -> int:
    """Identity of a tensor's storage (works on meta)."""
    return t.untyped_storage()._cdata


def block_nbytes(shape: Tuple[int, ...], dtype: torch.dtype) -> int:
    """Bytes of a dense block of ``shape`` and ``dtype``."""
    return math.prod(shape) * dtype.itemsize
