"""Allocate stage: one real storage per planned storage, and real views of the meta tensors.

Views keep their exact (storage offset, shape, stride) in the new storage, so every alias a
model built on meta (TorchRec's TableBatchedEmbeddingSlice and Shards, views of fbgemm's flat
buffers, FSDP2's padded shards) aliases the new storage the same way. Nothing in the model
changes here: the adapters swap the real tensors in at the register stage.

Large CPU storages come from fresh anonymous memory maps: the kernel hands out zero pages on
first touch (calloc semantics), so storages that must start at zero (optimizer state, gaps)
cost no write pass at all, and pages nobody touches take no memory.
"""
from __future__ import annotations

import math
import mmap
from typing import Dict, Iterable, Optional, Set

import torch
from torch import nn

from .plan import StorageGroup, storage_key

__all__ = ["Allocation", "allocate", "zeroed_cpu_storage", "is_zero_dist", "LAZY_ZERO_MIN_BYTES"]

# Below this a map costs more than the memset it saves (and rounds up to a page).
LAZY_ZERO_MIN_BYTES = 1 << 20


def zeroed_cpu_storage(nbytes: int) -> torch.UntypedStorage:
    """A CPU storage of ``nbytes`` guaranteed to read as zeros, not yet touched.

    The storage keeps its private anonymous map alive and unmaps it when freed.
    """
    if nbytes == 0:
        return torch.UntypedStorage(0)
    mm = mmap.mmap(-1, nbytes, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
    return torch.frombuffer(mm, dtype=torch.uint8).untyped_storage()


def is_zero_dist(dist) -> bool:
    """True for Zeros() / Constant(+0.0): values a zeroed storage already holds."""
    from .spec import Constant

    return isinstance(dist, Constant) and dist.value == 0.0 and math.copysign(1.0, dist.value) > 0


class Allocation:
    """The real storages of a plan, and real twins of the meta tensors viewing them.

    Attributes:
        device: where everything was allocated.
        storages: meta storage key -> new storage.
        zeroed: keys of the storages born zero.
        nbytes: bytes allocated.
    """

    def __init__(self, device: torch.device) -> None:
        self.device = device
        self.storages: Dict[int, torch.UntypedStorage] = {}
        self.zeroed: Set[int] = set()
        self.nbytes = 0
        self._twins: Dict[int, torch.Tensor] = {}
        self._by_ptr: Optional[Dict[int, int]] = None
        self._by_ptr_n = 0  # len(self.storages) when _by_ptr was built

    def has(self, old: torch.Tensor) -> bool:
        """True if ``old``'s storage was allocated here."""
        return storage_key(old) in self.storages

    def view(self, old: torch.Tensor) -> torch.Tensor:
        """A plain real tensor viewing the new storage exactly as ``old`` views its meta one."""
        st = self.storages[storage_key(old)]
        t = torch.empty((0,), dtype=old.dtype, device=self.device)
        t.set_(st, old.storage_offset(), old.shape, old.stride())
        return t

    def full(self, key: int) -> torch.Tensor:
        """The whole new storage ``key`` as a uint8 tensor."""
        st = self.storages[key]
        return torch.empty((0,), dtype=torch.uint8, device=self.device).set_(
            st, 0, (st.nbytes(),), (1,))

    def twin(self, old: torch.Tensor, view: Optional[torch.Tensor] = None) -> torch.Tensor:
        """The real tensor object that replaces ``old`` (same class, same requires_grad),
        created once: every caller asking for the twin of one tensor gets the same object.

        ``view``: ``self.view(old)`` if the caller made it already. A Parameter twin is made
        from it (``_make_subclass`` detaches: the caller's view stays a separate plain
        tensor); other twins are made from a view of their own."""
        new = self._twins.get(id(old))
        if new is None:
            cls = type(old)
            if cls is torch.Tensor:
                v = self.view(old)
                new = v.requires_grad_(True) if old.requires_grad else v
            elif issubclass(cls, nn.Parameter):
                new = torch.Tensor._make_subclass(
                    cls, view if view is not None else self.view(old), old.requires_grad)
            else:
                new = self.view(old).as_subclass(cls)
            self._twins[id(old)] = new
        return new

    def adopt(self, x: torch.Tensor) -> None:
        """Count ``x``'s storage (new memory an adapter made itself, e.g. a real tensor moved
        to the device) as part of this allocation, so :meth:`key_of` knows it."""
        st = x.untyped_storage()
        key = -len(self.storages) - 1
        self.storages[key] = st
        self.nbytes += st.nbytes()

    def key_of(self, x: torch.Tensor) -> Optional[int]:
        """The plan key of the new storage that real tensor ``x`` views, else None."""
        # rebuilt when storages were added (adopt); empty storages are left out of the map, so
        # compare against the count it was built from, not its own length
        if self._by_ptr is None or self._by_ptr_n != len(self.storages):
            self._by_ptr = {st.data_ptr(): k for k, st in self.storages.items() if st.nbytes()}
            self._by_ptr_n = len(self.storages)
        return self._by_ptr.get(x.untyped_storage().data_ptr())

    def twins(self) -> Dict[int, torch.Tensor]:
        """id(old meta tensor) -> its twin, for every twin made so far."""
        return self._twins


def allocate(groups: Iterable[StorageGroup], device: torch.device) -> Allocation:
    """Allocate every storage of ``groups`` on ``device``; touches no memory.

    Large CPU storages (>= :data:`LAZY_ZERO_MIN_BYTES`) are born zero (anonymous maps).
    """
    alloc = Allocation(device)
    for g in groups:
        if g.key in alloc.storages:
            continue
        if device.type == "cpu" and g.nbytes >= LAZY_ZERO_MIN_BYTES:
            alloc.storages[g.key] = zeroed_cpu_storage(g.nbytes)
            alloc.zeroed.add(g.key)
        else:
            alloc.storages[g.key] = torch.UntypedStorage(g.nbytes, device=device)
        alloc.nbytes += g.nbytes
    return alloc
