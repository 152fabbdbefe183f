"""Allocate stage: one real storage per planned storage, and real views of the meta tensors.

Views keep their exact (storage offset, shape, stride) in the new storage, so every alias a
model built on meta (TorchRec's TableBatchedEmbeddingSlice and Shards, views of fbgemm's flat
buffers, FSDP2's padded shards) aliases the new storage the same way. Nothing in the model
changes here: the adapters swap the real tensors in at the register stage.

Large CPU storages come from fresh anonymous memory maps: the kernel hands out zero pages on
first touch (calloc semantics), so storages that must start at zero (optimizer state, gaps)
cost no write pass at all, and pages nobody touches take no memory.

On a CUDA device a storage group says which memory it needs (:data:`MEMORY_KINDS`): device
memory (``torch.empty`` on the GPU), or fbgemm's unified memory for UVM tables (managed or
host-mapped, ``torch.ops.fbgemm.new_unified_tensor`` as fbgemm allocates it). Unified memory
lives on the host: the allocation keeps a CPU alias of it (:meth:`Allocation.host_view`), so
the init engine and the checkpoint reader write those bytes from the host, where they are,
with no copy over PCIe. Plain host memory is a kind too, for what only the host reads and
writes while a GPU model is filled (the shadow of a live table in unified memory). Under
:func:`metamat.emulation.emulated_cuda` every kind is a CPU storage and the kinds are only
recorded (tests of the GPU path on machines without a GPU).
"""
from __future__ import annotations

import ctypes
import math
import mmap
from typing import Dict, Iterable, Optional, Set

import torch
from torch import nn

from .plan import StorageGroup, storage_key

__all__ = ["Allocation", "allocate", "zeroed_cpu_storage", "is_zero_dist", "LAZY_ZERO_MIN_BYTES",
           "DEVICE", "UVM", "UVM_HOST_MAPPED", "HOST", "MEMORY_KINDS", "host_alias",
           "mapped_host_view", "host_tensor_at"]

# Below this a map costs more than the memset it saves (and rounds up to a page).
LAZY_ZERO_MIN_BYTES = 1 << 20

# Memory a storage group asks for (``StorageGroup.memory``). Only CUDA devices tell them apart.
DEVICE = "device"  # the device's own memory (HBM)
UVM = "uvm"  # fbgemm's managed memory (cudaMallocManaged, preferred on the host)
UVM_HOST_MAPPED = "uvm_host_mapped"  # fbgemm's host-mapped memory (cudaHostAlloc, mapped)
HOST = "host"  # plain host memory, pageable (the GPU never reads it)
MEMORY_KINDS = (DEVICE, UVM, UVM_HOST_MAPPED, HOST)


def host_alias(x: torch.Tensor) -> Optional[torch.Tensor]:
    """A CPU tensor viewing the same bytes as CUDA tensor ``x`` when ``x`` lives in fbgemm's
    unified memory (a live model's UVM table), else None."""
    if x.device.type != "cuda":
        return None
    try:
        if not torch.ops.fbgemm.is_uvm_tensor(x):
            return None
    except (AttributeError, RuntimeError):  # no fbgemm: nothing can be unified memory
        return None
    try:
        return torch.ops.fbgemm.uvm_to_cpu(x)
    except RuntimeError:  # host-mapped memory: fbgemm < 1.8's uvm_to_cpu reads managed only
        return mapped_host_view(x)


def mapped_host_view(x: torch.Tensor) -> Optional[torch.Tensor]:
    """A CPU tensor over the host pages that CUDA tensor ``x`` reaches when its storage is
    page-locked host memory mapped for the GPU (fbgemm's host-mapped UVM: malloc +
    cudaHostRegister), else None. The view keeps ``x``'s storage alive."""
    from . import _C

    st = x.untyped_storage()
    addr = _C.host_pointer(st.data_ptr()) if st.nbytes() else 0
    if not addr:
        return None
    return host_tensor_at(addr, st, x)


def host_tensor_at(addr: int, owner: torch.UntypedStorage, like: torch.Tensor) -> torch.Tensor:
    """A CPU tensor over the ``owner.nbytes()`` host bytes at ``addr``, viewed as ``like``
    views ``owner`` (offset, shape, stride); it keeps ``owner`` alive."""
    buf = (ctypes.c_uint8 * owner.nbytes()).from_address(addr)
    buf.owner = owner  # the storage outlives every view of its bytes
    st = torch.frombuffer(buf, dtype=torch.uint8).untyped_storage()
    return torch.empty((0,), dtype=like.dtype).set_(st, like.storage_offset(), like.shape,
                                                    like.stride())


def _unified_storage(nbytes: int, device: torch.device, host_mapped: bool):
    """(storage on ``device``, CPU alias of the same bytes) from fbgemm's UVM allocator."""
    try:
        new_unified = torch.ops.fbgemm.new_unified_tensor
    except (AttributeError, RuntimeError) as e:  # torch.ops lookups raise without the library
        raise RuntimeError("UVM tables need fbgemm-gpu's CUDA build (torch.ops.fbgemm."
                           "new_unified_tensor)") from e
    proto = torch.empty(1, dtype=torch.uint8, device=device)
    t = new_unified(proto, [int(nbytes)], bool(host_mapped))
    alias = host_alias(t)
    if alias is None:
        raise RuntimeError(
            f"no host view of fbgemm's {'host-mapped' if host_mapped else 'managed'} memory on "
            f"{device}: neither torch.ops.fbgemm.uvm_to_cpu nor metamat's CUDA backend "
            "(metamat._C.host_pointer) gives one; rebuild metamat with METAMAT_CUDA=ON")
    return t.untyped_storage(), alias.untyped_storage()


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
        emulated: a CUDA device emulated with CPU storages (:mod:`metamat.emulation`).
        memory: key -> memory kind, for the storages not in device memory (UVM).
        host: key -> a CPU storage aliasing the same bytes, for storages in unified memory.
    """

    def __init__(self, device: torch.device, emulated: bool = False) -> None:
        self.device = device
        self.emulated = emulated
        self.storages: Dict[int, torch.UntypedStorage] = {}
        self.zeroed: Set[int] = set()
        self.nbytes = 0
        self.memory: Dict[int, str] = {}
        self.host: Dict[int, torch.UntypedStorage] = {}
        self._twins: Dict[int, torch.Tensor] = {}
        self._by_ptr: Optional[Dict[int, int]] = None
        self._by_ptr_n = 0  # len(self.storages) when _by_ptr was built

    def has(self, old: torch.Tensor) -> bool:
        """True if ``old``'s storage was allocated here."""
        return storage_key(old) in self.storages

    def view(self, old: torch.Tensor) -> torch.Tensor:
        """A plain real tensor viewing the new storage exactly as ``old`` views its meta one."""
        st = self.storages[storage_key(old)]
        t = torch.empty((0,), dtype=old.dtype, device=st.device)
        t.set_(st, old.storage_offset(), old.shape, old.stride())
        return t

    def full(self, key: int) -> torch.Tensor:
        """The whole new storage ``key`` as a uint8 tensor, on the host for unified memory
        (writes go where the bytes live)."""
        st = self.host.get(key)
        if st is None:
            st = self.storages[key]
        return torch.empty((0,), dtype=torch.uint8, device=st.device).set_(
            st, 0, (st.nbytes(),), (1,))

    def bytes_by_memory(self) -> Dict[str, int]:
        """Bytes allocated per memory kind (kinds with bytes only)."""
        out: Dict[str, int] = {}
        for k, st in self.storages.items():
            kind = self.memory.get(k, DEVICE)
            out[kind] = out.get(kind, 0) + st.nbytes()
        return {k: v for k, v in out.items() if v}

    def memory_of(self, x: torch.Tensor) -> str:
        """The memory kind of real tensor ``x``'s storage (:data:`DEVICE` when not planned
        here)."""
        k = self.key_of(x)
        return self.memory.get(k, DEVICE) if k is not None else DEVICE

    def host_view(self, x: torch.Tensor) -> torch.Tensor:
        """``x``, or for a tensor in unified memory a CPU tensor viewing the same bytes (the
        host writes them in place: no copy over PCIe, no page migration to the GPU)."""
        k = self.key_of(x)
        st = self.host.get(k) if k is not None else None
        if st is None or x.device.type == "cpu":  # not unified, or already the host's view
            return x
        return torch.empty((0,), dtype=x.dtype).set_(st, x.storage_offset(), x.shape, x.stride())

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
            # a host alias of unified memory is the same storage seen from the CPU
            self._by_ptr.update({st.data_ptr(): k for k, st in self.host.items() if st.nbytes()})
            self._by_ptr_n = len(self.storages)
        return self._by_ptr.get(x.untyped_storage().data_ptr())

    def twins(self) -> Dict[int, torch.Tensor]:
        """id(old meta tensor) -> its twin, for every twin made so far."""
        return self._twins


def _check_fits(groups: Iterable[StorageGroup], device: torch.device, emulated: bool) -> None:
    """Raise :class:`~metamat.errors.DeviceMemoryError`, before anything is allocated, when
    the device memory of ``groups`` (every part's: TorchRec tables, dense layers, buffers) is
    more than the GPU has free. (The TorchRec and quantized plans check their own tables
    first, naming the caches that take the memory.)"""
    if device.type != "cuda" and not emulated:
        return
    from .emulation import free_device_memory
    from .errors import DeviceMemoryError

    free = free_device_memory(device, emulated)
    if free is None:
        return
    sizes = {g.key: g.nbytes for g in groups if g.memory == DEVICE}
    need = sum(sizes.values())
    if need > free:
        raise DeviceMemoryError(
            f"the model's tensors need {need:,} bytes ({need / 2**30:.2f} GiB) of device "
            f"memory on {'the emulated GPU' if emulated else device} ({len(sizes)} storages) "
            f"and {free:,} bytes are free; nothing was allocated")


def allocate(groups: Iterable[StorageGroup], device: torch.device, *,
             emulated: bool = False) -> Allocation:
    """Allocate every storage of ``groups`` on ``device``, in the memory each asks for
    (``StorageGroup.memory``: device or unified memory on CUDA); touches no memory.
    Raises :class:`~metamat.errors.DeviceMemoryError` first when the device memory they need
    is more than the GPU has free.

    Large CPU storages (>= :data:`LAZY_ZERO_MIN_BYTES`) are born zero (anonymous maps).
    ``emulated``: ``device`` is the CPU standing in for a CUDA device; every kind of memory
    is a CPU storage, and unified memory is its own host alias.
    """
    groups = list(groups)
    _check_fits(groups, device, emulated)
    alloc = Allocation(device, emulated)
    for g in groups:
        if g.key in alloc.storages:
            continue
        memory = g.memory
        if memory not in MEMORY_KINDS:
            raise ValueError(f"unknown memory kind {memory!r}")
        on_host = device.type == "cpu" or memory == HOST
        if device.type == "cuda" and memory not in (DEVICE, HOST) and g.nbytes:
            alloc.storages[g.key], alloc.host[g.key] = _unified_storage(
                g.nbytes, device, memory == UVM_HOST_MAPPED)
        elif on_host and g.nbytes >= LAZY_ZERO_MIN_BYTES:
            alloc.storages[g.key] = zeroed_cpu_storage(g.nbytes)
            alloc.zeroed.add(g.key)
        else:
            alloc.storages[g.key] = torch.UntypedStorage(
                g.nbytes, device="cpu" if on_host else device)
        if memory != DEVICE:
            alloc.memory[g.key] = memory
            if emulated:
                alloc.host[g.key] = alloc.storages[g.key]
        alloc.nbytes += g.nbytes
    return alloc
