"""Build TorchRec's FUSED CUDA kernels on meta (``shard_on_meta(compute_device="cuda")``).

TorchRec picks fbgemm's embedding locations from the device it is given
(``BatchedFusedEmbeddingBag.__init__``: ``device.type == "cuda"`` -> ``ComputeDevice.CUDA`` and
``compute_kernel_to_embedding_location(table.compute_kernel)``; anything else -> ``HOST`` on
``ComputeDevice.CPU``). A DMP built with ``device=meta`` therefore gets the CPU layout. Here
the DMP is still built with ``device=meta``, but while it is built:

* the fused wrappers' ``__init__`` records the wrapper's ``GroupedEmbeddingConfig``;
* ``SplitTableBatchedEmbeddingBagsCodegen`` as torchrec's kernel module sees it is a function
  that rewrites the ``embedding_specs`` to ``(rows, dims, location of the table's compute
  kernel, ComputeDevice.CUDA)`` and, when a table is ``MANAGED_CACHING`` and no
  ``cache_sets`` was given, passes the number of cache sets fbgemm would compute on the GPU
  (fbgemm otherwise asks ``torch.cuda.get_device_properties``), then builds the real fbgemm
  class with ``device=meta``.

fbgemm (checked: fbgemm-gpu-cpu 1.6.0 to 1.9.0) then lays every table out as on a GPU
(weights_dev / weights_uvm, momentum, LXU cache) with every tensor on meta; the UVM buffer
goes through ``torch.ops.fbgemm.new_unified_tensor`` on a meta prototype, which
``MetaFactories(cuda=True)`` answers with a meta tensor.

Nothing in this module allocates: all checks run before the DMP is constructed.
"""
from __future__ import annotations

import contextlib
import functools
import threading
from typing import Any, Dict, Iterator, List, Optional, Tuple

from .compat import UnsupportedError

__all__ = ["CUDA_KERNELS", "check_cuda_plan", "cache_sets_for", "cuda_fused_kernels",
           "cuda_dense_kernels", "register_meta_flush"]

# TorchRec compute kernel (``EmbeddingComputeKernel.value``) -> fbgemm EmbeddingLocation name,
# as torchrec.distributed.utils.compute_kernel_to_embedding_location maps them.
CUDA_KERNELS = {
    "fused": "DEVICE",
    "fused_uvm": "MANAGED",
    "fused_uvm_caching": "MANAGED_CACHING",
}
# Kernels built as fbgemm's DenseTableBatchedEmbeddingBagsCodegen in device memory (the DENSE
# kernel, and data-parallel tables, whose kernel is DENSE too).
DENSE_KERNELS = ("dense",)


def _kernel_name(kernel: Any) -> str:
    return str(getattr(kernel, "value", kernel))


def check_cuda_plan(plan: Any) -> None:
    """Refuse a ShardingPlan with a table whose compute kernel the CUDA layout does not handle
    (dense, data parallel, key-value/SSD, ...). Raises ``UnsupportedError``; allocates nothing."""
    bad: List[str] = []
    for path, module_plan in plan.plan.items():
        items = module_plan.items() if hasattr(module_plan, "items") else []
        for table, ps in items:
            kernel = _kernel_name(getattr(ps, "compute_kernel", None))
            if kernel not in CUDA_KERNELS and kernel not in DENSE_KERNELS:
                where = f"{path}.{table}" if path else table
                bad.append(f"{where} ({getattr(ps, 'sharding_type', '?')}, kernel {kernel!r})")
    if bad:
        raise UnsupportedError(
            "shard_on_meta with a CUDA compute device handles fbgemm's fused and dense kernels "
            f"(compute kernels {', '.join(sorted(CUDA_KERNELS) + list(DENSE_KERNELS))}); "
            "not supported: " + "; ".join(bad)
        )


def cache_sets_for(rows: List[int], dims: List[int], locations: List[Any],
                   cache_load_factor: float, cache_element_size: int,
                   free_memory: Optional[int] = None) -> int:
    """The ``cache_sets`` fbgemm computes when given ``cache_sets <= 0``
    (``SplitTableBatchedEmbeddingBagsCodegen._apply_cache_state``, fbgemm 1.8.0): enough sets
    of ``DEFAULT_ASSOC`` slots for ``cache_load_factor`` of the cached rows, at least one,
    capped by ``free_memory`` (the GPU's total memory minus what torch reserved and
    ``cache_reserved_memory``) when it is known. 0 when no table is cached."""
    from fbgemm_gpu.split_table_batched_embeddings_ops_training import DEFAULT_ASSOC

    cached = [(r, d) for r, d, loc in zip(rows, dims, locations)
              if getattr(loc, "name", str(loc)) == "MANAGED_CACHING"]
    if not cached:
        return 0
    total = sum(r for r, _ in cached)
    max_d = max(d for _, d in cached)
    sets = (int(total * cache_load_factor) + DEFAULT_ASSOC - 1) // DEFAULT_ASSOC
    sets = 1 if sets == 0 else sets
    if free_memory is not None:
        if cache_element_size * max_d * sets * DEFAULT_ASSOC > free_memory:
            sets = (int(1.0 * free_memory / max_d / cache_element_size) + DEFAULT_ASSOC - 1) \
                // DEFAULT_ASSOC
    return sets


def _cache_element_size(kwargs: Dict[str, Any]) -> int:
    prec = kwargs.get("cache_precision")
    if prec is None:
        prec = kwargs.get("weights_precision")
    name = getattr(prec, "name", str(prec))
    return 2 if name in ("FP16", "NFP8") else 4


_state = threading.local()
_meta_libs: List[Any] = []


def register_meta_flush() -> None:
    """Give ``fbgemm::lxu_cache_flush`` a Meta kernel that does nothing (once per process).

    TorchRec's fused wrappers flush the LXU cache in ``state_dict()`` (also while
    ``ShardedEmbeddingBagCollection`` is built); fbgemm registers no Meta kernel for the flush
    (fbgemm-gpu-cpu 1.8.0), so a CUDA-laid-out TBE on meta could not give its state_dict. A
    cache on meta holds nothing to write back: doing nothing is the flush's meaning there.
    Leaves an existing Meta kernel alone.
    """
    import torch

    if _meta_libs:
        return
    from .. import torch_upstream

    name = "fbgemm::lxu_cache_flush"
    torch_upstream.require("dispatch")
    try:
        if not torch_upstream.has_kernel_for(name, "Meta"):
            lib = torch.library.Library("fbgemm", "IMPL")
            lib.impl("lxu_cache_flush", lambda *args, **kwargs: None, "Meta")
            _meta_libs.append(lib)
        else:
            _meta_libs.append(None)
    except RuntimeError as e:  # no such op: nothing to flush
        _meta_libs.append(e)


def _free_memory(device_index: Optional[int], reserved: float) -> Optional[int]:
    """Free memory as fbgemm computes it for the cache, when a GPU is visible; else None."""
    import torch

    if device_index is None or not torch.cuda.is_available():
        return None
    total = torch.cuda.get_device_properties(device_index).total_memory
    return int(total - torch.cuda.memory_reserved(device_index) - int(reserved))


@contextlib.contextmanager
def cuda_fused_kernels(device_index: Optional[int] = None) -> Iterator[List[Dict[str, Any]]]:
    """While active, TorchRec's fused wrappers build fbgemm TBEs laid out for a CUDA compute
    device (module docstring). Yields a list that receives, per TBE built, a record
    ``{"tables", "locations", "cache_sets", "cache_sets_capped"}``."""
    import torchrec.distributed.batched_embedding_kernel as bek
    from fbgemm_gpu.split_table_batched_embeddings_ops_common import (
        ComputeDevice,
        EmbeddingLocation,
    )

    from . import upstream

    real_tbe = bek.SplitTableBatchedEmbeddingBagsCodegen
    wrappers = ("BatchedFusedEmbeddingBag", "BatchedFusedEmbedding")
    records: List[Dict[str, Any]] = []

    def tbe(*args: Any, **kwargs: Any):
        config = getattr(_state, "config", None)
        if config is None:
            raise UnsupportedError(
                "fbgemm SplitTableBatchedEmbeddingBagsCodegen built outside TorchRec's fused "
                "wrappers while sharding for CUDA (unknown compute kernels)"
            )
        if args:
            specs, args = list(args[0]), args[1:]
        else:
            specs = list(kwargs.pop("embedding_specs"))
        tables = list(config.embedding_tables)
        if len(specs) != len(tables):
            raise UnsupportedError(
                f"fbgemm got {len(specs)} embedding specs for {len(tables)} tables")
        new_specs: List[Tuple[int, int, Any, Any]] = []
        for (rows, dims, _, _), t in zip(specs, tables):
            kernel = _kernel_name(t.compute_kernel)
            loc = CUDA_KERNELS.get(kernel)
            if loc is None:
                raise UnsupportedError(f"table {t.name}: compute kernel {kernel!r} is not "
                                       "supported on a CUDA compute device")
            new_specs.append((rows, dims, EmbeddingLocation[loc], ComputeDevice.CUDA))
        rows = [s[0] for s in new_specs]
        dims = [s[1] for s in new_specs]
        locs = [s[2] for s in new_specs]
        capped = False
        if int(kwargs.get("cache_sets", 0) or 0) <= 0:
            free = _free_memory(device_index, float(kwargs.get("cache_reserved_memory", 0.0)))
            capped = free is not None
            sets = cache_sets_for(rows, dims, locs, float(kwargs.get("cache_load_factor", 0.2)),
                                  _cache_element_size(kwargs), free)
            if sets:
                kwargs["cache_sets"] = sets
        records.append({"tables": [t.name for t in tables], "locations": [l.name for l in locs],
                        "cache_sets": int(kwargs.get("cache_sets", 0) or 0),
                        "cache_sets_capped": capped})
        return real_tbe(new_specs, *args, **kwargs)

    def recording(init):
        @functools.wraps(init)
        def __init__(self, config, *args, **kwargs):
            prev = getattr(_state, "config", None)
            _state.config = config
            try:
                init(self, config, *args, **kwargs)
            finally:
                _state.config = prev
        return __init__

    with contextlib.ExitStack() as stack:
        stack.enter_context(upstream.patch(upstream.BEK, "SplitTableBatchedEmbeddingBagsCodegen",
                                           tbe))
        for name in wrappers:
            init = getattr(bek, name).__dict__["__init__"]
            stack.enter_context(upstream.patch(f"{upstream.BEK}.{name}", "__init__",
                                               recording(init)))
        yield records


@contextlib.contextmanager
def cuda_dense_kernels() -> Iterator[None]:
    """While active, TorchRec's dense TBEs (the DENSE kernel, data-parallel tables) are built
    for a CUDA compute device, on meta.

    TorchRec builds fbgemm's ``DenseTableBatchedEmbeddingBagsCodegen`` with ``use_cpu=False``
    on a GPU host, and fbgemm then allocates it for real on the current GPU. Here it is built
    with ``use_cpu=True`` (its layout, offsets and dims, does not depend on the device; its
    floating tensors go to meta), then its integer metadata moves to meta remembering its
    values, and it becomes a CUDA module: ``use_cpu=False`` and ``current_device`` meta, which
    ``materialize`` sets to the device."""
    import torch
    import torchrec.distributed.batched_embedding_kernel as bek

    from . import upstream
    from .meta_factories import meta_with_value

    real = bek.DenseTableBatchedEmbeddingBagsCodegen

    def dense_for_cuda(*args: Any, **kwargs: Any):
        kwargs["use_cpu"] = True
        if "use_mtia" in kwargs:
            kwargs["use_mtia"] = False
        tbe = real(*args, **kwargs)
        for name, buf in list(tbe._buffers.items()):
            # fbgemm keeps feature_dims on the CPU on every device
            if buf is not None and buf.device.type != "meta" and name != "feature_dims":
                tbe._buffers[name] = meta_with_value(buf)
        tbe.use_cpu = False
        tbe.current_device = torch.device("meta")
        return tbe

    with upstream.patch(upstream.BEK, "DenseTableBatchedEmbeddingBagsCodegen", dense_for_cuda):
        yield
