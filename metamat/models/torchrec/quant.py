"""TorchRec quantized inference modules, find: their tables, where each row lands, and what
fbgemm's CPU layout of every inference TBE looks like. Nothing is allocated here.

Modules (built on meta, all their tables' storage meta):

* unsharded ``torchrec.quant.embedding_modules.EmbeddingBagCollection`` /
  ``EmbeddingCollection`` (``quantize_embeddings``, ``quantize_inference_model`` or built
  directly): TorchRec lays a module built on meta out for a GPU (``EmbeddingLocation.DEVICE``,
  ``weights_dev``); on the CPU it is laid out again for the host at register time, as the same
  module built with ``device="cpu"`` is (same row alignment, same offsets);
* sharded ``ShardedQuantEmbeddingBagCollection`` / ``ShardedQuantEmbeddingCollection``
  (``shard_quant_model(..., compute_device="cpu", sharding_device="meta")``, TW/RW/CW): one
  fbgemm ``IntNBitTableBatchedEmbeddingBagsCodegen`` per rank and group, HOST placement.

The TorchRec/fbgemm inference internals read here are declared in :mod:`.upstream` (group
"quant", with the versions they were checked on) and checked when the modules are found. How a
TBE is laid out for the CPU or a GPU at register time: :mod:`.quant_layout`.
"""
from __future__ import annotations

import dataclasses
from typing import Any, Dict, List, Optional, Tuple

import torch
from torch import nn

from ...errors import UnsupportedError
from ...load.quantize import KINDS, padded_row_bytes, unpadded_row_bytes

__all__ = ["QuantTable", "QuantTBE", "quant_modules", "refreshable", "is_quantized", "find_tbes",
           "quant_classes", "weights_of", "has_meta_tables", "quant_mc_collections",
           "quant_feature_processors", "training_names", "ordinary_children"]

@dataclasses.dataclass
class QuantTable:
    """One table block held by one TBE: rows ``[row0, row0 + rows)`` and columns
    ``[col0, col0 + cols)`` of table ``name`` (global ``(num_embeddings, dim)``).

    ``fqn``: the state_dict key of its weight (``<module>.embedding_bags.<name>.weight``),
    which a float checkpoint's table has too. ``kind``: 8/4/2 (INT-N), 16/32 (FP16/FP32).
    ``storage``: the TBE's meta weights tensor; the block's row ``i`` is at byte
    ``offset + i * stride`` of it; ``sb_last``: scale/bias after the data. ``source_rows``:
    the float table's rows when the quantized one is pruned (TorchRec's
    ``num_embeddings_post_pruning``: it keeps the first ``global_shape[0]`` of them)."""

    name: str
    fqn: str
    prefix: str
    global_shape: Tuple[int, int]
    row0: int
    col0: int
    rows: int
    cols: int
    kind: int
    tbe: Any
    index: int
    storage: torch.Tensor
    offset: int
    stride: int
    sb_last: bool
    config: Any = None
    source_rows: Optional[int] = None

    @property
    def source_shape(self) -> Tuple[int, int]:
        """The float table's global shape (a training checkpoint's, an init's)."""
        return (self.source_rows or self.global_shape[0], self.global_shape[1])

    @property
    def data_offset(self) -> int:
        """Byte of a row where the data starts."""
        return 4 if self.kind in (8, 4, 2) and not self.sb_last else 0

    @property
    def data_bytes(self) -> int:
        return self.cols * self.kind // 8

    @property
    def sb_offset(self) -> int:
        """Byte of a row where scale/bias start (INT-N)."""
        return self.data_bytes if self.sb_last else 0

    @property
    def nbytes(self) -> int:
        return self.rows * unpadded_row_bytes(self.kind, self.cols)


@dataclasses.dataclass
class QuantTBE:
    """One inference TBE of a quantized module: its tables and the storage they live in."""

    module: Any
    owner: str  # the quantized module's name
    storage: torch.Tensor  # meta weights tensor (weights_host, or weights_dev on meta)
    tables: List[QuantTable]


def quant_classes():
    from torchrec.distributed.quant_embedding import ShardedQuantEmbeddingCollection
    from torchrec.distributed.quant_embeddingbag import ShardedQuantEmbeddingBagCollection
    from torchrec.quant.embedding_modules import EmbeddingBagCollection as QEBC
    from torchrec.quant.embedding_modules import EmbeddingCollection as QEC

    return QEBC, QEC, ShardedQuantEmbeddingBagCollection, ShardedQuantEmbeddingCollection


def _fp_classes() -> tuple:
    """TorchRec's quantized FeatureProcessedEmbeddingBagCollection and its inference-sharded
    form (subclasses of the quantized EBC and its sharding), or () in a TorchRec without
    them."""
    try:
        from torchrec.distributed.quant_embeddingbag import (
            ShardedQuantFeatureProcessedEmbeddingBagCollection)
        from torchrec.quant.embedding_modules import FeatureProcessedEmbeddingBagCollection
    except ImportError:  # pragma: no cover - other torchrec versions
        return ()
    return (FeatureProcessedEmbeddingBagCollection,
            ShardedQuantFeatureProcessedEmbeddingBagCollection)


def _tbe_of_module(m: nn.Module) -> List[Any]:
    from .upstream import quant_tbes

    return quant_tbes(m)


def is_quantized(m: nn.Module) -> bool:
    """True for TorchRec's quantized collections, sharded or not (this adapter's modules)."""
    return isinstance(m, quant_classes())


def quant_mc_collections(quant: List[Tuple[str, nn.Module]]) -> List[Tuple[str, nn.Module]]:
    """(name, MC collection) of the quantized managed-collision collections among ``quant``
    (``QuantManagedCollisionEmbedding[Bag]Collection``, and TorchRec's inference sharding of
    them): their MC modules (for a sharded one, the global ones: :mod:`.quant_mc`) are plain
    unsharded ones, for the modules adapter."""
    if not quant:
        return []
    from torchrec.quant.embedding_modules import (QuantManagedCollisionEmbeddingBagCollection,
                                                  QuantManagedCollisionEmbeddingCollection)

    from . import upstream

    from .mc_sharding import sharded_quant_mc_classes

    kinds = (QuantManagedCollisionEmbeddingBagCollection,
             QuantManagedCollisionEmbeddingCollection, *sharded_quant_mc_classes())
    return [(f"{name}._managed_collision_collection" if name
             else "_managed_collision_collection",
             upstream.BOUNDARY.check_instance(m)._managed_collision_collection)
            for name, m in quant if isinstance(m, kinds)]


def quant_feature_processors(quant: List[Tuple[str, nn.Module]]
                             ) -> List[Tuple[str, nn.Module, List[str]]]:
    """(name, feature processor, its training names) of the quantized feature-processed
    collections among ``quant``: their position weights are ordinary float parameters, for the
    modules adapter. Training names: the float ``FeatureProcessedEmbeddingBagCollection``
    keeps them in ``_feature_processors``; inference sharding holds one copy a rank
    (``feature_processors_per_rank.<i>``), each loaded from the same tensors."""
    from . import upstream

    unsharded, sharded = _fp_classes() or (None, None)
    out = []
    for name, m in quant:
        head = f"{name}." if name else ""
        if sharded is not None and isinstance(m, sharded):
            per_rank = upstream.BOUNDARY.check_instance(m).feature_processors_per_rank
            out.append((f"{head}feature_processors_per_rank", per_rank,
                        [f"{head}feature_processors_per_rank.{i}." for i in
                         range(len(per_rank))]))
        elif unsharded is not None and isinstance(m, unsharded):
            out.append((f"{head}feature_processor",
                        upstream.BOUNDARY.check_instance(m).feature_processor,
                        [f"{head}feature_processor."]))
    return out


def training_names(quant: List[Tuple[str, nn.Module]]) -> List[Tuple[str, str]]:
    """(prefix of a quantized module's own name, the float training module's prefix for it):
    the position weights of feature-processed collections (``_feature_processors``)."""
    out = []
    for name, _, prefixes in quant_feature_processors(quant):
        head = name.rsplit(".", 1)[0] + "." if "." in name else ""
        out += [(p, f"{head}_feature_processors.") for p in prefixes]
    return out


def ordinary_children(quant: List[Tuple[str, nn.Module]]) -> List[Tuple[str, nn.Module]]:
    """(name, module) of the ordinary modules inside quantized collections, which the modules
    adapter takes: managed-collision collections, feature processors."""
    return quant_mc_collections(quant) + [(n, m) for n, m, _ in
                                          quant_feature_processors(quant)]


def has_meta_tables(m: nn.Module) -> bool:
    """Whether a quantized collection's tables are on meta (else real: a live model)."""
    return any(weights_of(t).is_meta for t in _tbe_of_module(m))


def quant_modules(root: nn.Module, live: bool = False) -> List[Tuple[str, nn.Module]]:
    """(name, module) of every quantized TorchRec module of ``root`` whose tables are on meta,
    and with ``live`` (a checkpoint to load) those whose tables are real too ([] when torchrec
    was never imported: a model without it holds none)."""
    import sys

    if "torchrec" not in sys.modules:
        return []
    from ..modules import named_modules_pruned

    kinds = quant_classes()
    out = []
    for name, m in named_modules_pruned(root, lambda _n, m: isinstance(m, kinds)):
        if isinstance(m, kinds):
            from . import upstream

            upstream.BOUNDARY.require("quant")  # the first use of their internals
            upstream.check_quant([(name, m)])
            if live or has_meta_tables(m):
                out.append((name, m))
    return out


def refreshable(name: str, m: nn.Module) -> bool:
    """Whether a real quantized module is one metamat refreshes from a checkpoint (its TBEs
    and tables of the layouts :func:`find_tbes` takes, a supported TorchRec); else it loads as
    plain tensors, as before the refresh existed."""
    from .compat import check_versions

    try:
        check_versions()
        find_tbes(name, m)
    except UnsupportedError:
        return False
    return True


def weights_of(tbe: Any) -> torch.Tensor:
    """The TBE's weights storage tensor (its placements must agree)."""
    from fbgemm_gpu.split_table_batched_embeddings_ops_common import EmbeddingLocation

    places = set(tbe.weights_physical_placements)
    if places == {EmbeddingLocation.HOST.value}:
        return tbe.weights_host
    if places == {EmbeddingLocation.DEVICE.value}:
        return tbe.weights_dev
    if places in ({EmbeddingLocation.MANAGED.value}, {EmbeddingLocation.MANAGED_CACHING.value}):
        return tbe.weights_uvm
    raise UnsupportedError(
        f"inference TBE with placements {sorted(places)} (mixed): every table of a TBE must "
        "be in one memory (HOST, DEVICE, or unified memory)")


def _check_tbe(tbe: Any, where: str) -> None:
    from fbgemm_gpu.split_table_batched_embeddings_ops_inference import (
        IntNBitTableBatchedEmbeddingBagsCodegen)

    if not isinstance(tbe, IntNBitTableBatchedEmbeddingBagsCodegen):
        raise UnsupportedError(f"{where}: {type(tbe).__name__} (not fbgemm's "
                               "IntNBitTableBatchedEmbeddingBagsCodegen) is not supported")
    if tbe.scale_bias_size_in_bytes != 4:
        raise UnsupportedError(f"{where}: scale/bias of {tbe.scale_bias_size_in_bytes} bytes "
                               "(MTIA layout) is not supported")
    if tbe.index_remappings_array_offsets.numel() or tbe.index_remapping_hash_table_offsets.numel():
        raise UnsupportedError(f"{where}: pruned tables (index remapping) are not supported")
    if not tbe.weight_initialized:
        raise UnsupportedError(f"{where}: the TBE's weights were never laid out")


def _kind_of(ty: Any, table: str, where: str) -> int:
    kind = KINDS.get(getattr(ty, "value", None))
    if kind is None:
        raise UnsupportedError(
            f"{where}: table {table!r} has weight type {ty}; metamat quantizes into "
            "INT8, INT4, INT2, FP16 and FP32 tables (TorchRec 1.8 cannot build FP8/NFP8 ones)")
    return kind


def _tables_attr(m: nn.Module) -> str:
    QEBC, QEC, SQEBC, SQEC = quant_classes()
    return "embeddings" if isinstance(m, (QEC, SQEC)) else "embedding_bags"


def _configs(name: str, m: nn.Module, tbe: Any) -> List[Tuple[Any, int, int, int, int]]:
    """Per table of ``tbe``: (config, row0, col0, global rows, global cols)."""
    from .upstream import quant_groups, quant_tbe_config, quant_tbes

    QEBC, QEC, SQEBC, SQEC = quant_classes()
    if isinstance(m, (SQEBC, SQEC)):
        out = []
        for t in quant_tbe_config(m, tbe).embedding_tables:
            off = t.local_metadata.shard_offsets if t.local_metadata is not None else [0, 0]
            # a pruned table is sharded over its kept rows
            out.append((t, int(off[0]), int(off[1]), _post_pruning(t) or int(t.num_embeddings),
                        int(t.embedding_dim)))
        return out
    tables = quant_groups(m)[quant_tbes(m).index(tbe)]
    return [(t, 0, 0, _post_pruning(t) or int(t.num_embeddings), int(t.embedding_dim))
            for t in tables]


def _post_pruning(config: Any) -> Optional[int]:
    """A pruned table's rows (TorchRec's ``num_embeddings_post_pruning``), else None."""
    rows = getattr(config, "num_embeddings_post_pruning", None)
    return None if rows is None else int(rows)


def find_tbes(name: str, m: nn.Module) -> List[QuantTBE]:
    """The inference TBEs of quantized module ``m`` (named ``name``) and their tables.

    Raises:
        UnsupportedError: a TBE or table layout metamat does not write.
    """
    from fbgemm_gpu.split_table_batched_embeddings_ops_inference import (
        rounded_row_size_in_bytes)

    prefix = f"{name}." if name else ""
    attr = _tables_attr(m)
    out = []
    for j, tbe in enumerate(_tbe_of_module(m)):
        where = f"{name or '<root>'} (TBE {j})"
        _check_tbe(tbe, where)
        storage = weights_of(tbe)
        configs = _configs(name, m, tbe)
        if len(configs) != len(tbe.embedding_specs):
            raise UnsupportedError(f"{where}: {len(tbe.embedding_specs)} tables in the TBE, "
                                   f"{len(configs)} in the module's configs")
        tables = []
        for i, ((tname, rows, cols, ty, _loc), (cfg, r0, c0, grows, gcols)) in enumerate(
                zip(tbe.embedding_specs, configs)):
            if tname != cfg.name or r0 + rows > grows or c0 + cols > gcols:
                raise UnsupportedError(f"{where}: table {tname!r} ({rows}x{cols} at {r0},{c0}) "
                                       f"does not fit its config {cfg.name!r} {grows}x{gcols}")
            kind = _kind_of(ty, tname, where)
            stride = rounded_row_size_in_bytes(cols, ty, tbe.row_alignment,
                                               tbe.scale_bias_size_in_bytes)
            if stride != padded_row_bytes(kind, cols, tbe.row_alignment):
                raise UnsupportedError(f"{where}: table {tname!r}: fbgemm's row of {stride} "
                                       "bytes is not the layout metamat writes")
            offset = int(tbe.weights_physical_offsets[i])
            if offset + rows * stride > storage.numel():
                raise UnsupportedError(f"{where}: table {tname!r} past its TBE's storage")
            tp = f"{prefix}{attr}.{tname}."
            pruned = _post_pruning(cfg) is not None
            tables.append(QuantTable(tname, tp + "weight", tp, (grows, gcols), r0, c0, rows, cols,
                                     kind, tbe, i, storage, offset, stride,
                                     bool(tbe.reverse_qparam), cfg,
                                     int(cfg.num_embeddings) if pruned else None))
        out.append(QuantTBE(tbe, name, storage, tables))
    return out


def weights_bytes(tbe: Any) -> int:
    """Bytes of the TBE's weights storage."""
    return int(weights_of(tbe).numel())


def tbe_storages(tbe: Any) -> Dict[str, torch.Tensor]:
    """The TBE's weights tensors by attribute name."""
    return {k: getattr(tbe, k) for k in ("weights_host", "weights_dev", "weights_uvm")}


def config_of(table: QuantTable) -> Optional[Any]:
    return table.config
