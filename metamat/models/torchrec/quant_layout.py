"""An inference TBE's layout at register time, for the CPU or a GPU, computed by fbgemm itself.

* :func:`host_twin`: the same TBE built by fbgemm's constructor for the CPU without its
  weights: every metadata buffer and layout attribute of the host layout;
* :func:`device_twin`: the same TBE laid out for a GPU (DEVICE placement), built on meta: the
  specs, sizes, placements and offsets of a TBE built on a GPU, for the TBEs TorchRec's quant
  sharding leaves HOST-placed on meta for a GPU plan (:func:`gpu_relayout_refusal` says which
  it can be done for);
* :func:`host_layout`, :func:`device_layout`: a TBE built on meta takes its twin's layout and
  its real weights.
"""
from __future__ import annotations

from typing import Any, Dict, Optional, Sequence, Set, Tuple

import torch
from torch import nn

from ...errors import DeviceMemoryError, UnsupportedError
from .quant import quant_classes, weights_of

__all__ = ["TBE_HOST_ATTRS", "TBE_DEVICE_ATTRS", "DEVICE_KERNELS", "KERNEL_LOCATIONS",
           "CACHE_FILL", "CACHE_MAPS", "host_twin", "device_twin", "inference_cache_sets",
           "cache_values", "is_caching", "in_unified_memory", "tbe_kernel", "cache_bytes",
           "device_bytes", "cache_free_memory", "check_device_memory", "empty_cache",
           "gpu_relayout_refusal", "planned_for_gpu", "host_layout", "device_layout"]

#: Attributes of an inference TBE that differ between one built on meta and the same one
#: built for the CPU (measured: everything else, buffers aside, is equal).
TBE_HOST_ATTRS = ("current_device", "use_cpu", "embedding_specs", "host_size", "dev_size",
                  "uvm_size", "weights_physical_placements", "weights_physical_offsets",
                  "weights_offsets", "weights_placements", "row_alignment")


def _twin(tbe: Any, location: Any, device: torch.device, cache_sets: int = 0) -> Any:
    """The same inference TBE built by fbgemm with every table at ``location``, on
    ``device``, with the same row alignment (and cache settings; ``cache_sets`` for a
    MANAGED_CACHING one); its layout checked against ``tbe``'s."""
    from fbgemm_gpu.split_table_batched_embeddings_ops_common import BoundsCheckMode
    from fbgemm_gpu.split_embedding_configs import SparseType

    specs = [(n, r, d, ty, location) for n, r, d, ty, _ in tbe.embedding_specs]
    kwargs: Dict[str, Any] = dict(
        embedding_specs=specs, feature_table_map=list(tbe.feature_table_map),
        pooling_mode=tbe.pooling_mode, device=device,
        bounds_check_mode=BoundsCheckMode(tbe.bounds_check_mode_int),
        output_dtype=SparseType.from_int(tbe.output_dtype), row_alignment=tbe.row_alignment,
        scale_bias_size_in_bytes=tbe.scale_bias_size_in_bytes,
        reverse_qparam=tbe.reverse_qparam,
        feature_names_per_table=tbe.feature_names_per_table,
        indices_dtype=tbe.indices_dtype,
        uvm_host_mapped=tbe.uvm_host_mapped, enforce_hbm=tbe.enforce_hbm,
        cache_load_factor=tbe.cache_load_factor, cache_sets=cache_sets,
        cache_algorithm=tbe.cache_algorithm, cache_reserved_memory=tbe.cache_reserved_memory,
        cache_assoc=tbe.cache_assoc, gather_uvm_cache_stats=tbe.gather_uvm_cache_stats,
        record_cache_metrics=tbe.record_cache_metrics)
    if tbe.fp8_exponent_bits >= 0:  # -1: not an FP8 table
        kwargs.update(fp8_exponent_bits=tbe.fp8_exponent_bits,
                      fp8_exponent_bias=tbe.fp8_exponent_bias)
    where = "the CPU" if device.type == "cpu" else "a GPU"
    try:
        twin = type(tbe)(**kwargs)
    except Exception as e:  # noqa: BLE001 - fbgemm's own checks
        raise UnsupportedError(f"cannot lay the inference TBE out for {where}: {e}") from e
    twin.initialize_logical_weights_placements_and_offsets()
    if list(twin.weights_physical_offsets) != list(tbe.weights_physical_offsets) or \
            twin.host_size + twin.dev_size + twin.uvm_size != weights_of(tbe).numel():
        raise UnsupportedError(f"the inference TBE's layout for {where} differs from the one "
                               "built on meta")
    return twin


def host_twin(tbe: Any) -> Any:
    """The same inference TBE built for the CPU (HOST placement, same row alignment), without
    its weights: every metadata buffer and layout attribute of the host layout, computed by
    fbgemm itself (a few KiB; the weights are never allocated).

    Raises:
        UnsupportedError: fbgemm refuses the arguments, or the twin's layout differs.
    """
    from fbgemm_gpu.split_table_batched_embeddings_ops_common import EmbeddingLocation

    return _twin(tbe, EmbeddingLocation.HOST, torch.device("cpu"))


def device_twin(tbe: Any, kernel: str = "quant", free_memory: Optional[int] = None) -> Any:
    """The same inference TBE laid out by fbgemm for a GPU, built on meta: its specs, sizes,
    placements and offsets, as fbgemm gives a TBE that TorchRec builds on a GPU for compute
    kernel ``kernel`` (DEVICE placement; MANAGED for ``quant_uvm``, MANAGED_CACHING with its
    cache for ``quant_uvm_caching``: :data:`KERNEL_LOCATIONS`). The buffers it shares with
    the host layout take their values from :func:`host_twin` (they do not depend on the
    placement); the cache's are shaped here (:func:`cache_values` gives their values).

    Args:
        free_memory: the GPU's free bytes as fbgemm counts them for the cache (None:
            unknown, no cap): see :func:`inference_cache_sets`.

    Raises:
        UnsupportedError: fbgemm refuses the arguments, or the twin's layout differs.
    """
    from fbgemm_gpu.split_table_batched_embeddings_ops_common import EmbeddingLocation

    location = getattr(EmbeddingLocation, KERNEL_LOCATIONS[kernel])
    sets = inference_cache_sets(tbe, location, free_memory) \
        if location == EmbeddingLocation.MANAGED_CACHING else 0
    return _twin(tbe, location, torch.device("meta"), cache_sets=sets)


def inference_cache_sets(tbe: Any, location: Any, free_memory: Optional[int]) -> int:
    """The cache sets fbgemm gives an inference TBE whose tables are at ``location``
    (MANAGED_CACHING) when it is built on a GPU (``IntNBitTableBatchedEmbeddingBagsCodegen.
    _apply_cache_state``): the TBE's own ``cache_sets`` when set, else enough sets of
    ``cache_assoc`` slots for ``cache_load_factor`` of the cached rows, capped by
    ``free_memory`` less ``cache_reserved_memory`` when it is known, at least one."""
    from fbgemm_gpu.split_table_batched_embeddings_ops_inference import (
        construct_cache_state, rounded_row_size_in_bytes)

    if tbe.cache_sets > 0:
        return int(tbe.cache_sets)
    if not tbe.cache_load_factor > 0:  # fbgemm asserts it
        raise ValueError(f"an inference TBE with cached tables has cache_load_factor "
                         f"{tbe.cache_load_factor}: it must be > 0, or pass cache_sets")
    specs = [(n, r, d, ty, location) for n, r, d, ty, _ in tbe.embedding_specs]
    state = construct_cache_state([s[1] for s in specs], [s[4] for s in specs],
                                  list(tbe.feature_table_map))
    assoc = int(tbe.cache_assoc)
    max_d = max(rounded_row_size_in_bytes(d, ty, 16, tbe.scale_bias_size_in_bytes)
                for _, _, d, ty, _ in specs)
    sets = (int(state.total_cache_hash_size * tbe.cache_load_factor) + assoc - 1) // assoc
    if free_memory is not None:
        free = free_memory - int(tbe.cache_reserved_memory)
        if free <= 0:  # fbgemm asserts it
            raise DeviceMemoryError(
                f"no GPU memory is left for an inference TBE's cache ({free_memory / 2**30:.3f}"
                f" GiB free after the TBEs before it, cache_reserved_memory "
                f"{float(tbe.cache_reserved_memory) / 2**30:.3f} GiB): pass cache_sets in the "
                "sharder's fused_params; nothing was allocated")
        if sets * assoc * max_d > free:
            sets = (int(1.0 * free / max_d) + assoc - 1) // assoc
    return 1 if sets == 0 else sets


#: The cache buffers of a MANAGED_CACHING inference TBE and the value fbgemm gives each
#: (``_apply_cache_state``): -1 marks an empty cache slot; the two maps come from the specs.
CACHE_FILL = {"lxu_cache_state": -1, "lxu_cache_weights": 0, "lxu_state": 0,
              "lxu_cache_miss_timestamp": 0, "cache_miss_counter": 0, "uvm_cache_stats": 0,
              "local_uvm_cache_stats": 0}
CACHE_MAPS = ("cache_hash_size_cumsum", "cache_index_table_map")


def cache_values(twin: Any) -> Dict[str, torch.Tensor]:
    """The values of the two cache maps of a MANAGED_CACHING twin (:func:`device_twin`), on
    the CPU, as fbgemm computes them from the specs (``construct_cache_state``)."""
    from fbgemm_gpu.split_table_batched_embeddings_ops_inference import construct_cache_state

    state = construct_cache_state([s[1] for s in twin.embedding_specs],
                                  [s[4] for s in twin.embedding_specs],
                                  list(twin.feature_table_map))
    return {"cache_hash_size_cumsum": torch.tensor(state.cache_hash_size_cumsum,
                                                   dtype=torch.int64),
            "cache_index_table_map": torch.tensor(state.cache_index_table_map,
                                                  dtype=torch.int32)}


def is_caching(twin: Optional[Any]) -> bool:
    """The twin (None: no twin) keeps its tables in unified memory behind a cache in device
    memory."""
    return twin is not None and twin.total_cache_hash_size > 0 \
        and twin.lxu_cache_weights.numel() > 0


def in_unified_memory(twin: Optional[Any]) -> bool:
    """The twin (None: no twin) keeps its weights in fbgemm's unified memory (MANAGED,
    MANAGED_CACHING)."""
    return twin is not None and twin.uvm_size > 0


#: Attributes of an inference TBE a GPU layout changes beyond the buffers: taken from
#: :func:`device_twin` for a TBE that TorchRec's quant sharding left HOST-placed on meta.
TBE_DEVICE_ATTRS = ("embedding_specs", "host_size", "dev_size", "uvm_size",
                    "weights_physical_placements", "weights_physical_offsets", "row_alignment",
                    "max_D_cache", "total_cache_hash_size")


#: Compute kernels TorchRec's quant sharding lays out in device memory on a GPU
#: (``compute_kernel_to_embedding_location``: DEVICE, and a plain inference TBE).
DEVICE_KERNELS = ("quant", "dense", "fused")
#: Every compute kernel a quant-sharded TBE can be laid out for on a GPU -> fbgemm's
#: location of its tables (TorchRec's ``compute_kernel_to_embedding_location``).
KERNEL_LOCATIONS = {**{k: "DEVICE" for k in DEVICE_KERNELS}, "quant_uvm": "MANAGED",
                    "quant_uvm_caching": "MANAGED_CACHING"}


def _placements(m: nn.Module) -> Tuple[Set[Tuple[str, Optional[int]]], Set[str]]:
    """((device type, rank) of every table shard, compute kernels) of a quant-sharded
    collection, over all its TBEs (TorchRec groups them by device)."""
    from .upstream import quant_tbe_config, quant_tbes

    places, kernels = set(), set()
    for t in (t for tb in quant_tbes(m) for t in quant_tbe_config(m, tb).embedding_tables):
        p = t.local_metadata.placement if t.local_metadata is not None else None
        places.add((p.device().type, p.rank()) if p is not None else ("unplaced", None))
        kernels.add(getattr(t.compute_kernel, "value", t.compute_kernel))
    return places, kernels


def planned_for_gpu(m: nn.Module) -> bool:
    """A quant-sharded collection whose every shard TorchRec's plan put on a GPU."""
    QEBC, QEC, SQEBC, SQEC = quant_classes()
    return isinstance(m, (SQEBC, SQEC)) and {d for d, _ in _placements(m)[0]} == {"cuda"}


def gpu_relayout_refusal(name: str, m: nn.Module) -> Optional[str]:
    """Whether the HOST-placed TBEs of a quant-sharded collection can be laid out on the GPU
    this call fills: None when TorchRec's plan put the collection there (every table's shard
    on ``cuda`` rank 0, a compute kernel of :data:`KERNEL_LOCATIONS`: device memory, or
    unified memory with or without a cache), else why not."""
    QEBC, QEC, SQEBC, SQEC = quant_classes()
    where = name or "<root>"
    if not isinstance(m, (SQEBC, SQEC)):
        return (f"{where}: its inference TBEs are laid out for the CPU (HOST placement); "
                "materialize it with device='cpu'")
    places, kernels = _placements(m)
    types = sorted({d for d, _ in places})
    if types != ["cuda"]:
        if "cuda" not in types:
            return (f"{where}: sharded for {', '.join(types)} (shard_quant_model("
                    "compute_device='cpu')): materialize it with device='cpu'")
        return (f"{where}: its tables are placed on {', '.join(types)}: metamat lays a "
                "quant-sharded collection out on one GPU only")
    ranks = sorted({r for _, r in places})
    if ranks != [0]:
        return (f"{where}: shards of rank {ranks[-1]}, which TorchRec places on cuda:"
                f"{ranks[-1]} of this process; metamat fills one GPU per call: shard with "
                "shard_quant_model(world_size=1), or materialize with device='cpu'")
    other = sorted(k for k in kernels if k not in KERNEL_LOCATIONS)
    if other:
        return (f"{where}: compute kernel {other[0]!r} (a key-value store) is not supported on "
                "a GPU; metamat fills inference tables of kernels "
                f"{', '.join(KERNEL_LOCATIONS)}")
    return None


def tbe_kernel(m: nn.Module, tbe: Any) -> str:
    """The compute kernel of a quant-sharded TBE's tables (TorchRec groups tables by kernel:
    one per TBE)."""
    from .upstream import quant_tbe_config

    kernels = {getattr(t.compute_kernel, "value", t.compute_kernel)
               for t in quant_tbe_config(m, tbe).embedding_tables}
    if len(kernels) != 1:
        raise UnsupportedError(f"an inference TBE with tables of kernels {sorted(kernels)}")
    return kernels.pop()


def host_layout(tbe: Any, twin: Any, weights: torch.Tensor) -> None:
    """A TBE built on meta laid out for the CPU as its host twin: its attributes and buffers,
    the weights in ``weights_host``."""
    for a in TBE_HOST_ATTRS:
        setattr(tbe, a, getattr(twin, a))
    for name, buf in twin._buffers.items():
        tbe._buffers[name] = buf
    tbe.weights_host = weights
    tbe.weights_dev = twin.weights_dev
    tbe.weights_uvm = twin.weights_uvm


def device_layout(tbe: Any, twin: Any, weights: torch.Tensor, dev: torch.device,
                  relaid: Optional[Any] = None,
                  cache: Optional[Dict[str, torch.Tensor]] = None) -> None:
    """A TBE built on meta laid out for a GPU: ``relaid`` (its :func:`device_twin`, for one
    TorchRec left HOST-placed) gives its specs, sizes, placements and offsets first;
    ``cache``: the real cache buffers of a MANAGED_CACHING one, by name."""
    for a in TBE_DEVICE_ATTRS if relaid is not None else ():
        setattr(tbe, a, getattr(relaid, a))
    _device_layout(tbe, twin, weights, dev)
    for name, buf in (cache or {}).items():  # persistent or not as fbgemm registers them
        tbe._buffers[name] = buf
        if name in relaid._non_persistent_buffers_set:
            tbe._non_persistent_buffers_set.add(name)
        else:
            tbe._non_persistent_buffers_set.discard(name)


def _device_layout(tbe: Any, twin: Any, weights: torch.Tensor, dev: torch.device) -> None:
    """A TBE built on meta for a GPU as fbgemm builds it on ``dev``: the weights in
    ``weights_dev`` (DEVICE placement) or ``weights_uvm`` (unified memory), the metadata the
    host twin computed (the layout is the same: offsets and sizes do not depend on the
    placement), the placements the TBE's."""
    for name, buf in twin._buffers.items():
        tbe._buffers[name] = buf.to(dev)
    tbe.weights_offsets = twin.weights_offsets.to(dev)
    tbe.weights_placements = torch.tensor(
        [tbe.weights_physical_placements[t] for t in tbe.feature_table_map],
        dtype=torch.int32, device=dev)
    tbe.current_device = dev
    tbe.use_cpu = False
    empty = torch.empty(0, dtype=torch.uint8, device=dev)
    tbe.weights_host = torch.zeros(0, dtype=torch.uint8, device=dev)
    if tbe.uvm_size > 0:
        tbe.weights_uvm, tbe.weights_dev = weights, empty
    else:
        tbe.weights_dev, tbe.weights_uvm = weights, empty


def cache_bytes(twin: Any) -> int:
    """Device memory of a caching TBE's cache buffers (0 without a cache)."""
    if not is_caching(twin):
        return 0
    return sum(twin._buffers[n].untyped_storage().nbytes() for n in (*CACHE_FILL, *CACHE_MAPS))


def device_bytes(twin: Any) -> int:
    """Device memory a TBE laid out for a GPU takes: its rows there (DEVICE; ``enforce_hbm``
    keeps its unified-memory rows there too) and its cache buffers."""
    return twin.dev_size + (twin.uvm_size if twin.enforce_hbm else 0) + cache_bytes(twin)


def cache_free_memory(device: torch.device, emulated: bool) -> Optional[int]:
    """The free memory fbgemm sizes an inference TBE's cache by (the GPU's total memory less
    what torch reserved; the emulated device's free memory), or None when unknown."""
    if emulated:
        from ...emulation import free_device_memory

        return free_device_memory(device, True)
    from .cuda_kernels import _free_memory

    index = device.index if device.index is not None else torch.cuda.current_device()
    return _free_memory(index, 0.0)


def check_device_memory(groups: Sequence[Any], caches: Sequence[Tuple[str, Any]],
                        device: torch.device, emulated: bool) -> None:
    """Raise :class:`~metamat.errors.DeviceMemoryError` before anything is allocated when the
    device memory of ``groups`` (storage groups: rows in device memory, caches) is more than
    the GPU has free; ``caches``: (owner, twin) of the caching TBEs, named in the message."""
    from ...allocate import DEVICE
    from ...emulation import free_device_memory
    from ...errors import DeviceMemoryError

    free = free_device_memory(device, emulated)
    need = sum(g.nbytes for g in groups if g.memory == DEVICE)
    if free is None or need <= free:
        return
    detail = "" if not caches else (
        "; of it the caches of unified-memory TBEs take "
        f"{sum(cache_bytes(tw) for _, tw in caches) / 2**30:.3f} GiB ("
        + ", ".join(f"{o}: {tw.lxu_cache_state.shape[0]} sets" for o, tw in caches[:5])
        + (" ..." if len(caches) > 5 else "") + "): lower cache_load_factor or pass "
        "cache_sets in the sharder's fused_params")
    raise DeviceMemoryError(
        f"the quantized tables need {need / 2**30:.3f} GiB of device memory on {device} "
        f"and {free / 2**30:.3f} GiB are free{detail}; nothing was allocated")


def empty_cache(tbe: Any) -> None:
    """Evict every row of a live caching TBE's cache (fbgemm's ``reset_cache_states``) and
    drop the cache locations a prefetch queued for the next lookup (they point at old rows)."""
    tbe.reset_cache_states()
    for _ in range(tbe.lxu_cache_locations_list.size()):
        tbe.lxu_cache_locations_list.pop()
    tbe.timestep_prefetch_size.reset()
