"""TorchRec adapter, plan for a CUDA layout: the values and the memory of every TBE storage.

A DMP from ``shard_on_meta(compute_device="cuda")`` holds fbgemm TBEs laid out for CUDA, all
on meta (:mod:`.cuda_kernels`). For each of them this module

* re-derives the layout (:func:`.cuda_layout.tbe_layout`: a layout that differs from fbgemm's
  raises before anything is allocated) and gives every metadata and cache buffer the value
  fbgemm's constructor gives it (:func:`.cuda_layout.initial_values`: offsets, placements,
  ``lxu_cache_state`` = -1, cache weights and counters at zero, ...), cross-checked against the
  values recorded while the model was sharded;
* says which storages live in fbgemm's unified memory (``weights_uvm``, the UVM optimizer
  state: managed, or host-mapped when the TBE was built with ``uvm_host_mapped``), less the
  rows and momentum1 of a TBE built with ``enforce_hbm`` (as fbgemm: ENFORCE_HBM_SPLITS);
  everything else is device memory;
* checks the device memory the model needs against what the GPU has free, before anything is
  allocated, naming the LXU caches (whose ``cache_sets`` fbgemm would have capped).
"""
from __future__ import annotations

import dataclasses
from typing import Callable, Dict, List, Optional, Sequence, Tuple

import torch
from torch import nn

from ...allocate import DEVICE, UVM, UVM_HOST_MAPPED
from ...errors import DeviceMemoryError
from ...plan import StorageGroup, storage_key
from .compat import UnsupportedError
from .cuda_layout import ENFORCE_HBM_SPLITS, TBELayout, initial_values, tbe_layout
from .meta_factories import recorded_value
from .upstream import kernel_config, kernel_module

__all__ = ["CudaTBE", "cuda_tbes", "plan_cuda_storages", "check_device_memory"]


@dataclasses.dataclass
class CudaTBE:
    """One fused wrapper whose fbgemm TBE is laid out for CUDA."""

    path: str  # readable: "<sharded module>.<lookup>.<wrapper>"
    wrapper: nn.Module
    layout: TBELayout
    enforce_hbm: bool

    @property
    def emb(self) -> nn.Module:
        return kernel_module(self.wrapper)

    @property
    def cache_bytes(self) -> int:
        c = self.layout.cache
        return 0 if c is None else c.cache_sets * c.assoc * c.max_d_cache * c.dtype.itemsize


def cuda_tbes(wrappers: Sequence[Tuple[str, nn.Module]]) -> List[CudaTBE]:
    """The fused wrappers among ``(path, wrapper)`` whose TBE is laid out for CUDA, with
    their layouts (raises ``UnsupportedError`` for a layout metamat does not handle)."""
    out = []
    for path, w in wrappers:
        emb = kernel_module(w)
        if type(emb).__name__ != "SplitTableBatchedEmbeddingBagsCodegen":
            continue
        config = kernel_config(w)
        names = [t.name for t in config.embedding_tables]
        hbm = bool((getattr(config, "fused_params", None) or {}).get("enforce_hbm", False))
        out.append(CudaTBE(path, w, tbe_layout(emb, names), hbm))
    return out


def plan_cuda_storages(tbes: Sequence[CudaTBE], storages: Dict[int, StorageGroup],
                       put: Callable[[torch.Tensor, torch.Tensor], None]) -> None:
    """Give every metadata/cache buffer of ``tbes`` its value (``put(meta tensor, value)``)
    and mark the storages in unified memory (``StorageGroup.memory``).

    Raises:
        UnsupportedError: a value fbgemm recorded while sharding differs from the layout's.
    """
    for tbe in tbes:
        emb = tbe.emb
        for name, value in initial_values(tbe.layout).items():
            t = getattr(emb, name, None)
            if not isinstance(t, torch.Tensor) or not t.is_meta:
                continue
            rec = recorded_value(t)
            if rec is not None and (rec.shape != value.shape or not torch.equal(
                    rec.to(value.dtype), value)):
                raise UnsupportedError(
                    f"{tbe.path}: fbgemm built {name} = {rec.tolist()[:8]} but metamat's "
                    f"CUDA layout gives {value.tolist()[:8]} (an fbgemm whose rules changed)")
            if t.shape != value.shape or t.dtype != value.dtype:
                raise UnsupportedError(
                    f"{tbe.path}: fbgemm's {name} is {tuple(t.shape)}/{t.dtype}, metamat's "
                    f"CUDA layout {tuple(value.shape)}/{value.dtype}")
            put(t, value)
        kind = UVM_HOST_MAPPED if tbe.layout.uvm_host_mapped else UVM
        for split in tbe.layout.splits():
            if tbe.enforce_hbm and split.prefix in ENFORCE_HBM_SPLITS:
                continue  # fbgemm keeps these in device memory
            uvm = getattr(emb, f"{split.prefix}_uvm")
            if uvm.is_meta and uvm.numel():
                g = storages.get(storage_key(uvm))
                if g is not None:
                    g.memory = kind


def _gib(n: int) -> str:
    return f"{n / 2**30:.2f} GiB"


def check_device_memory(storages: Sequence[StorageGroup], tbes: Sequence[CudaTBE],
                        device: torch.device, free: Optional[int]) -> None:
    """Raise :class:`DeviceMemoryError` when the device memory of ``storages`` exceeds
    ``free`` bytes (None: unknown, no check). Allocates nothing."""
    if free is None:
        return
    need = sum(g.nbytes for g in storages if g.memory == DEVICE)
    if need <= free:
        return
    cached = [t for t in tbes if t.cache_bytes]
    caches = sum(t.cache_bytes for t in cached)
    detail = ""
    if cached:
        detail = (f"; of it {_gib(caches)} are LXU caches of UVM-caching tables ("
                  + ", ".join(f"{t.path}: cache_sets={t.layout.cache.cache_sets}, "
                              f"{_gib(t.cache_bytes)}" for t in cached[:5])
                  + (" ..." if len(cached) > 5 else "")
                  + "): lower cache_load_factor or pass cache_sets in the sharder's "
                  "fused_params")
    raise DeviceMemoryError(
        f"the TorchRec tables need {_gib(need)} of device memory on {device} and "
        f"{_gib(free)} are free{detail}; nothing was allocated")
