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

from typing import Any, Dict, Optional, Set, Tuple

import torch
from torch import nn

from ...errors import UnsupportedError
from .quant import quant_classes, weights_of

__all__ = ["TBE_HOST_ATTRS", "TBE_DEVICE_ATTRS", "DEVICE_KERNELS", "host_twin", "device_twin",
           "gpu_relayout_refusal", "planned_for_gpu", "host_layout", "device_layout"]

#: Attributes of an inference TBE that differ between one built on meta and the same one
#: built for the CPU (measured: everything else, buffers aside, is equal).
TBE_HOST_ATTRS = ("current_device", "use_cpu", "embedding_specs", "host_size", "dev_size",
                  "uvm_size", "weights_physical_placements", "weights_physical_offsets",
                  "weights_offsets", "weights_placements", "row_alignment")


def _twin(tbe: Any, location: Any, device: torch.device) -> Any:
    """The same inference TBE built by fbgemm with every table at ``location``, on
    ``device``, with the same row alignment; its layout checked against ``tbe``'s."""
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
        uvm_host_mapped=tbe.uvm_host_mapped)
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
            twin.host_size + twin.dev_size != weights_of(tbe).numel():
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


def device_twin(tbe: Any) -> Any:
    """The same inference TBE laid out by fbgemm for a GPU (DEVICE placement, same row
    alignment), built on meta: its specs, sizes, placements and offsets, as fbgemm gives a
    TBE built on a GPU (its buffers' values come from :func:`host_twin`: they do not depend
    on the placement).

    Raises:
        UnsupportedError: fbgemm refuses the arguments, or the twin's layout differs.
    """
    from fbgemm_gpu.split_table_batched_embeddings_ops_common import EmbeddingLocation

    return _twin(tbe, EmbeddingLocation.DEVICE, torch.device("meta"))


#: Attributes of an inference TBE a GPU layout changes beyond the buffers: taken from
#: :func:`device_twin` for a TBE that TorchRec's quant sharding left HOST-placed on meta.
TBE_DEVICE_ATTRS = ("embedding_specs", "host_size", "dev_size", "uvm_size",
                    "weights_physical_placements", "weights_physical_offsets", "row_alignment")


#: Compute kernels TorchRec's quant sharding lays out in device memory on a GPU
#: (``compute_kernel_to_embedding_location``: DEVICE, and a plain inference TBE).
DEVICE_KERNELS = ("quant", "dense", "fused")


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
    on ``cuda`` rank 0, a compute kernel TorchRec keeps in device memory: the DEVICE placement
    TorchRec gives it when sharding on a GPU), else why not."""
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
    other = sorted(k for k in kernels if k not in DEVICE_KERNELS)
    if other:
        return (f"{where}: compute kernel {other[0]!r} keeps its tables outside device memory "
                "(unified memory or a key-value store): not supported on a GPU; metamat fills "
                f"inference tables in device memory (kernels {', '.join(DEVICE_KERNELS)})")
    return None


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
                  relaid: Optional[Any] = None) -> None:
    """A TBE built on meta laid out for a GPU: ``relaid`` (its :func:`device_twin`, for one
    TorchRec left HOST-placed) gives its specs, sizes, placements and offsets first."""
    for a in TBE_DEVICE_ATTRS if relaid is not None else ():
        setattr(tbe, a, getattr(relaid, a))
    _device_layout(tbe, twin, weights, dev)


def _device_layout(tbe: Any, twin: Any, weights: torch.Tensor, dev: torch.device) -> None:
    """A TBE built on meta for a GPU (DEVICE placement) as fbgemm builds it on ``dev``: the
    weights in ``weights_dev``, the metadata the host twin computed (the layout is the same:
    offsets and sizes do not depend on the placement), placements DEVICE."""
    for name, buf in twin._buffers.items():
        tbe._buffers[name] = buf.to(dev)
    tbe.weights_offsets = twin.weights_offsets.to(dev)
    tbe.weights_placements = torch.tensor(
        [tbe.weights_physical_placements[t] for t in tbe.feature_table_map],
        dtype=torch.int32, device=dev)
    tbe.current_device = dev
    tbe.use_cpu = False
    tbe.weights_dev = weights
    tbe.weights_host = torch.zeros(0, dtype=torch.uint8, device=dev)
    tbe.weights_uvm = torch.empty(0, dtype=torch.uint8, device=dev)
