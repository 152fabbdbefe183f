"""A CUDA device emulated on the CPU, so the GPU path of ``materialize`` runs where no GPU is.

Inside ``with emulated_cuda():``, ``materialize(model, device="cuda")`` (or with no device) runs
the CUDA path with CPU tensors standing where the GPU's memory goes:

* planning is the CUDA one: fbgemm's CUDA layout, its metadata and cache buffers, the check of
  the device memory the model needs against ``free_memory``;
* every storage is allocated in the memory kind it asks for (device, UVM, host-mapped UVM),
  each a CPU storage, the kind recorded (``Report.memory``, ``Allocation.memory``);
* device-memory tables are filled by the CUDA kernel's host emulation
  (:func:`metamat.init.fill_many_emulated_`: the launch's segment table, block search and
  per-thread work); UVM tables by the CPU engine through their host alias, as on a GPU;
* checkpoint bytes for device memory go through the staging pipeline's host sink (the CUDA
  sink's chunking, ring reuse and ordering, with memcpy for the copies); UVM bytes are read in
  place, as on a GPU;
* the LXU cache of UVM-caching tables is reset after a load into a live model, and fbgemm's
  ``lxu_cache_flush`` gets a CPU reference (every valid cache slot written back to its row, as
  the CUDA kernel does), so a test sees what a stale cache would write over loaded rows;
* registration is the same, with the CPU as the device.

What only a GPU shows (the tests marked ``cuda``): UVM allocation by fbgemm, kernel writes,
copies and stream order, TorchRec's forward, backward and optimizer step.
"""
from __future__ import annotations

import contextlib
import contextvars
import dataclasses
from typing import Iterator, Optional, Tuple

import torch

__all__ = ["emulated_cuda", "active", "resolve", "free_device_memory"]


@dataclasses.dataclass(frozen=True)
class Emulation:
    """The emulated device: ``free_memory`` bytes free (None: no limit)."""

    free_memory: Optional[int] = None


_CURRENT: contextvars.ContextVar[Optional[Emulation]] = contextvars.ContextVar(
    "metamat_emulated_cuda", default=None)


@contextlib.contextmanager
def emulated_cuda(free_memory: Optional[int] = None) -> Iterator[Emulation]:
    """Emulate a CUDA device on the CPU while active (module docstring).

    Args:
        free_memory: bytes the emulated GPU has free (the device-memory check of
            ``materialize``); None: unlimited.

    Yields:
        The :class:`Emulation` in effect.

    Example:
        >>> from metamat.emulation import emulated_cuda
        >>> with emulated_cuda(free_memory=1 << 30):
        ...     pass  # metamat.materialize(model, device="cuda") runs the GPU path on the CPU
    """
    register_cpu_cache_flush()
    token = _CURRENT.set(Emulation(free_memory))
    try:
        yield _CURRENT.get()
    finally:
        _CURRENT.reset(token)


def active() -> Optional[Emulation]:
    """The emulation in effect in this context, or None.

    Returns:
        The active :class:`Emulation`, or None outside :func:`emulated_cuda`.
    """
    return _CURRENT.get()


def resolve(device: torch.device) -> Tuple[torch.device, bool]:
    """Where tensors aimed at ``device`` go: a CUDA device is the CPU while emulating.

    Args:
        device: the device asked for.

    Returns:
        ``(device tensors go to, whether it is emulated)``.
    """
    if device.type == "cuda" and active() is not None:
        return torch.device("cpu"), True
    return device, False


def free_device_memory(device: torch.device, emulated: bool) -> Optional[int]:
    """Bytes free on ``device`` for new allocations (what torch's caching allocator holds
    unused counts as free).

    Args:
        device: a CUDA device (any other device: None).
        emulated: whether ``device`` is the emulated one (:func:`resolve`).

    Returns:
        The free bytes, or None when unknown (emulation without a limit, or the CPU).
    """
    if emulated:
        em = active()
        return None if em is None else em.free_memory
    if device.type != "cuda":
        return None
    free, _total = torch.cuda.mem_get_info(device)
    return int(free + torch.cuda.memory_reserved(device) - torch.cuda.memory_allocated(device))


_flush_libs: list = []


def _cache_flush_reference(uvm_weights, cache_hash_size_cumsum, cache_index_table_map,
                           weights_offsets, D_offsets, total_D, lxu_cache_state,
                           lxu_cache_weights, stochastic_rounding) -> None:
    """fbgemm's ``lxu_cache_flush`` on the host: every slot whose state names a cached row
    writes its cache row back to that row of the table (fbgemm's cache is write-back with no
    dirty bits: every valid slot is written). Rounding to fp16/bf16 is to nearest."""
    state = lxu_cache_state.reshape(-1)
    slots = torch.nonzero(state >= 0).reshape(-1)
    flat = uvm_weights.reshape(-1)
    for slot in slots.tolist():
        idx = int(state[slot])
        t = int(cache_index_table_map[idx])
        row = idx - int(cache_hash_size_cumsum[t])
        d = int(D_offsets[t + 1] - D_offsets[t])
        start = int(weights_offsets[t]) + row * d
        flat[start:start + d] = lxu_cache_weights[slot, :d].to(flat.dtype)


def register_cpu_cache_flush() -> None:
    """Give ``fbgemm::lxu_cache_flush`` the CPU reference above (once per process; only when
    fbgemm is loaded and has no CPU kernel of its own: fbgemm-gpu-cpu has none)."""
    if _flush_libs:
        return
    name = "fbgemm::lxu_cache_flush"
    try:
        if not torch._C._dispatch_has_kernel_for_dispatch_key(name, "CPU"):
            lib = torch.library.Library("fbgemm", "IMPL")
            lib.impl("lxu_cache_flush", _cache_flush_reference, "CPU")
            _flush_libs.append(lib)
        else:
            _flush_libs.append(None)
    except RuntimeError:  # fbgemm not loaded: there is no cache to flush
        pass
