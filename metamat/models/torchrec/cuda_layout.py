"""Where each table, optimizer state and cache buffer of an fbgemm TBE laid out for CUDA lives.

``shard_on_meta(compute_device="cuda")`` builds fbgemm ``SplitTableBatchedEmbeddingBagsCodegen``
modules whose tensors are all on meta but whose layout is the CUDA one (see cuda_kernels). This
module re-derives that layout from the TBE's constructor inputs, the way fbgemm does, and
checks it against what the meta TBE holds, so that later stages can

* allocate the storages on the GPU (``weights_dev`` with ``torch.empty``, ``weights_uvm`` with
  fbgemm's own ``torch.ops.fbgemm.new_unified_tensor``, honouring ``uvm_host_mapped``);
* fill every table with one CUDA launch (``fill_items`` -> ``metamat.fill_many_``), each
  block at its global (row, col) so values match metamat's CPU init bit for bit;
* set the metadata and cache buffers to the values fbgemm's constructor gives them.

fbgemm functions replicated (fbgemm_gpu 1.6.0 to 1.9.0,
``split_table_batched_embeddings_ops_training`` unless noted):

* ``construct_split_state``: per table a placement (HOST / DEVICE / MANAGED /
  MANAGED_CACHING) and an offset into the ``{prefix}_host`` / ``_dev`` / ``_uvm`` buffer;
  rowwise optimizer state of a MANAGED table goes to DEVICE;
* ``apply_split_helper``: ``{prefix}_offsets`` / ``{prefix}_placements`` are the per-table
  values indexed by ``feature_table_map`` (int64 / int32);
* ``CacheState.construct`` (``fbgemm_gpu/tbe/cache/cache_config.py``; in older releases the
  function ``construct_cache_state`` of ``split_table_batched_embeddings_ops_common``):
  ``cache_hash_size_cumsum`` and ``cache_index_table_map``;
* ``SplitTableBatchedEmbeddingBagsCodegen._apply_cache_state``: ``lxu_cache_state`` =
  -1 of (cache_sets, DEFAULT_ASSOC) int64, ``lxu_cache_weights`` = zeros of
  (cache_sets * DEFAULT_ASSOC, max_D_cache), ``lxu_state`` = zeros of (cache_sets,
  DEFAULT_ASSOC) for LRU or (total_cache_hash_size + 1,) for LFU, ``cache_miss_counter`` = 0;
  without a cached table the five buffers are int64 ``zeros(1)`` and the cache weights (0, 0);
* ``__init__``: ``D_offsets`` (int32), ``hash_size_cumsum`` and ``rows_per_table`` (int64).
"""
from __future__ import annotations

import dataclasses
from typing import Any, Callable, Dict, List, Mapping, Optional, Sequence, Tuple

import torch

from ...spec import Dist
from .compat import UnsupportedError

__all__ = [
    "Split", "CacheLayout", "TBELayout", "FillItem", "split_state", "cache_state", "tbe_layout",
    "initial_values", "fill_items", "fill_many_items", "allocate_storages", "STORAGE_OF",
    "ENFORCE_HBM_SPLITS",
]

# fbgemm EmbeddingLocation name -> the buffer suffix its rows live in (split_embedding_weights)
STORAGE_OF = {"DEVICE": "dev", "MANAGED": "uvm", "MANAGED_CACHING": "uvm", "HOST": "host"}
# fbgemm optimizers whose state metamat lays out: name -> ((state, rowwise), ...), as fbgemm's
# constructor splits them (momentum2 of the partial-rowwise optimizers is one value per row)
_OPTIMIZERS = {
    "EXACT_SGD": (),
    "EXACT_ROWWISE_ADAGRAD": (("momentum1", True),),
    "EXACT_ADAGRAD": (("momentum1", False),),
    "ADAM": (("momentum1", False), ("momentum2", False)),
    "PARTIAL_ROWWISE_ADAM": (("momentum1", False), ("momentum2", True)),
    "LAMB": (("momentum1", False), ("momentum2", False)),
    "PARTIAL_ROWWISE_LAMB": (("momentum1", False), ("momentum2", True)),
}


@dataclasses.dataclass
class Split:
    """One state's layout (``construct_split_state``): per physical table its location and
    element offset in ``{prefix}_{storage}``, and the three buffer sizes (elements)."""

    prefix: str
    dtype: torch.dtype
    placements: List[str]  # EmbeddingLocation names, per physical table
    offsets: List[int]
    row_elems: List[int]  # elements per row (dims, or 1 for rowwise state)
    rows: List[int]
    dev_size: int = 0
    host_size: int = 0
    uvm_size: int = 0

    def storage(self, t: int) -> str:
        return f"{self.prefix}_{STORAGE_OF[self.placements[t]]}"

    def size(self, storage: str) -> int:
        return {"dev": self.dev_size, "host": self.host_size, "uvm": self.uvm_size}[
            storage.rsplit("_", 1)[1]]


@dataclasses.dataclass
class CacheLayout:
    """The LXU cache (``_apply_cache_state``)."""

    cache_sets: int
    assoc: int
    max_d_cache: int
    dtype: torch.dtype
    algorithm: str  # "LRU" or "LFU"
    total_cache_hash_size: int
    cache_hash_size_cumsum: List[int]
    cache_index_table_map: List[int]


@dataclasses.dataclass
class TBELayout:
    rows: List[int]
    dims: List[int]
    locations: List[str]
    feature_table_map: List[int]
    weights: Split
    states: Dict[str, Split]
    cache: Optional[CacheLayout]
    uvm_host_mapped: bool
    table_names: List[str]
    cache_dtype: torch.dtype = torch.float32  # of lxu_cache_weights (cache_precision)

    def splits(self) -> List[Split]:
        return [self.weights, *self.states.values()]


def _loc_name(loc: Any) -> str:
    if hasattr(loc, "name"):
        return loc.name
    from fbgemm_gpu.split_table_batched_embeddings_ops_common import EmbeddingLocation

    return EmbeddingLocation(int(loc)).name


def split_state(rows: Sequence[int], dims: Sequence[int], locations: Sequence[str], *,
                rowwise: bool, cacheable: bool, placement: Optional[str] = None,
                prefix: str = "weights", dtype: torch.dtype = torch.float32) -> Split:
    """``construct_split_state`` for FP32/FP16/BF16 weights (no INT8 row padding)."""
    s = Split(prefix, dtype, [], [], [], list(rows))
    for n, d, loc in zip(rows, dims, locations):
        if d % 4:
            raise UnsupportedError(f"embedding_dim must be a multiple of 4, got {d}")
        size = n if rowwise else n * d
        loc = placement or loc
        s.row_elems.append(1 if rowwise else d)
        if loc == "HOST":
            s.placements.append("HOST")
            s.offsets.append(s.host_size)
            s.host_size += size
        elif loc == "DEVICE" or rowwise:
            s.placements.append("DEVICE")
            s.offsets.append(s.dev_size)
            s.dev_size += size
        else:
            s.placements.append("MANAGED_CACHING" if cacheable and loc == "MANAGED_CACHING"
                                else "MANAGED")
            s.offsets.append(s.uvm_size)
            s.uvm_size += size
    return s


def cache_state(rows: Sequence[int], locations: Sequence[str], feature_table_map: Sequence[int]
                ) -> Tuple[List[int], List[int], int]:
    """``CacheState.construct``: (cache_hash_size_cumsum [T features + 1], cache_index_table_map
    [total cached rows] -> the last feature of each table, total_cache_hash_size)."""
    cumsum, total = [0], 0
    for n, loc in zip(rows, locations):
        if loc == "MANAGED_CACHING":
            total += n
        cumsum.append(total)
    index_map = [-1] * total
    last_feature = {}
    for f, t in enumerate(feature_table_map):
        last_feature[t] = f
    for t, f in last_feature.items():
        index_map[cumsum[t]:cumsum[t + 1]] = [f] * (cumsum[t + 1] - cumsum[t])
    per_feature = [cumsum[t] if locations[t] == "MANAGED_CACHING" else -1
                   for t in feature_table_map]
    return per_feature + [total], index_map, total


def _name(enum_value: Any) -> str:
    return getattr(enum_value, "name", str(enum_value))


def tbe_layout(emb: torch.nn.Module, table_names: Optional[Sequence[str]] = None) -> TBELayout:
    """The layout of fbgemm TBE ``emb`` (built on meta or real), re-derived as fbgemm does and
    checked against ``emb``'s own lists and buffer shapes.

    Raises:
        UnsupportedError: a precision, optimizer or location metamat does not lay out, or a
            layout that differs from ``emb``'s (an fbgemm whose rules changed).
    """
    cls = type(emb).__name__
    if cls != "SplitTableBatchedEmbeddingBagsCodegen":
        raise UnsupportedError(f"{cls}: only fbgemm's SplitTableBatchedEmbeddingBagsCodegen is "
                               "laid out for CUDA")
    from .upstream import BOUNDARY

    BOUNDARY.check_instance(emb)  # the attributes read below (declared in .upstream)
    specs = list(emb.embedding_specs)
    rows = [int(s[0]) for s in specs]
    dims = [int(s[1]) for s in specs]
    locations = [_loc_name(s[2]) for s in specs]
    devices = {_name(s[3]) for s in specs}
    if devices != {"CUDA"} or any(loc not in ("DEVICE", "MANAGED", "MANAGED_CACHING")
                                  for loc in locations):
        raise UnsupportedError(f"TBE compute devices {sorted(devices)} / locations "
                               f"{sorted(set(locations))}: not a CUDA layout metamat handles")
    precision = _name(emb.weights_precision)
    if precision not in ("FP32", "FP16", "BF16"):
        raise UnsupportedError(f"TBE weights precision {precision} is not supported")
    optimizer = _name(emb.optimizer)
    if optimizer not in _OPTIMIZERS:
        raise UnsupportedError(f"TBE optimizer {optimizer} is not supported "
                               f"(supported: {', '.join(_OPTIMIZERS)})")
    ftm = [int(t) for t in emb.feature_table_map]
    weights = split_state(rows, dims, locations, rowwise=False, cacheable=True,
                          dtype=emb.weights_dev.dtype)
    states: Dict[str, Split] = {}
    for prefix, rowwise in _OPTIMIZERS[optimizer]:
        have = [_loc_name(p) for p in getattr(emb, f"{prefix}_physical_placements")]
        dtype = getattr(emb, f"{prefix}_dev").dtype
        s = split_state(rows, dims, locations, rowwise=rowwise, cacheable=False, prefix=prefix,
                        dtype=dtype)
        if s.placements != have and not rowwise:  # uvm_non_rowwise_momentum=True
            s = split_state(rows, dims, locations, rowwise=rowwise, cacheable=False,
                            placement="MANAGED", prefix=prefix, dtype=dtype)
        states[prefix] = s
    for s in [weights, *states.values()]:
        have_p = [_loc_name(p) for p in getattr(emb, f"{s.prefix}_physical_placements")]
        have_o = [int(o) for o in getattr(emb, f"{s.prefix}_physical_offsets")]
        if have_p != s.placements or have_o != s.offsets:
            raise UnsupportedError(
                f"fbgemm's {s.prefix} layout {list(zip(have_p, have_o))} differs from "
                f"metamat's {list(zip(s.placements, s.offsets))}")
        for st in ("dev", "uvm", "host"):
            buf = getattr(emb, f"{s.prefix}_{st}")
            if buf.numel() != s.size(f"_{st}"):
                raise UnsupportedError(f"fbgemm's {s.prefix}_{st} has {buf.numel()} elements, "
                                       f"metamat's layout {s.size(f'_{st}')}")
    cache = None
    cw = emb.lxu_cache_weights
    if cw.numel():
        from fbgemm_gpu.split_table_batched_embeddings_ops_training import DEFAULT_ASSOC

        cumsum, index_map, total = cache_state(rows, locations, ftm)
        algorithm = _name(emb.cache_algorithm)
        cached_dims = [d for d, loc in zip(dims, locations) if loc == "MANAGED_CACHING"]
        sets = cw.shape[0] // DEFAULT_ASSOC
        cache = CacheLayout(sets, DEFAULT_ASSOC, max(cached_dims), cw.dtype, algorithm, total,
                            cumsum, index_map)
        if tuple(cw.shape) != (sets * DEFAULT_ASSOC, max(cached_dims)) or \
                tuple(emb.cache_index_table_map.shape) != (total,) or \
                tuple(emb.cache_hash_size_cumsum.shape) != (len(ftm) + 1,):
            raise UnsupportedError("fbgemm's LXU cache buffers differ from metamat's layout")
    # table_names: fbgemm's own names, None when its caller gave none
    names_out = list(table_names) if table_names is not None else \
        list(emb.table_names or [f"table-{i}" for i in range(len(rows))])
    return TBELayout(rows, dims, locations, ftm, weights, states, cache,
                     bool(emb.uvm_host_mapped), names_out, cw.dtype)


def initial_values(layout: TBELayout) -> Dict[str, torch.Tensor]:
    """CPU tensors holding what fbgemm's constructor puts in the TBE's metadata and cache
    buffers (module docstring). Table and optimizer storages are not included: the fill
    writes the tables; optimizer state starts at zero (``torch.zeros`` in apply_split_helper).
    """
    ftm = layout.feature_table_map
    out: Dict[str, torch.Tensor] = {}
    from itertools import accumulate

    fdims = [layout.dims[t] for t in ftm]
    out["D_offsets"] = torch.tensor([0, *accumulate(fdims)], dtype=torch.int32)
    hs = [0, *accumulate(layout.rows)]
    out["hash_size_cumsum"] = torch.tensor([hs[t] for t in ftm] + [hs[-1]], dtype=torch.int64)
    out["rows_per_table"] = torch.tensor([layout.rows[t] for t in ftm], dtype=torch.int64)
    from fbgemm_gpu.split_table_batched_embeddings_ops_common import EmbeddingLocation

    for s in layout.splits():
        out[f"{s.prefix}_offsets"] = torch.tensor([s.offsets[t] for t in ftm], dtype=torch.int64)
        out[f"{s.prefix}_placements"] = torch.tensor(
            [EmbeddingLocation[s.placements[t]].value for t in ftm], dtype=torch.int32)
    c = layout.cache
    if c is None:
        for name in ("cache_hash_size_cumsum", "cache_index_table_map", "lxu_cache_state",
                     "lxu_state"):
            out[name] = torch.zeros(1, dtype=torch.int64)
        out["lxu_cache_weights"] = torch.zeros(0, 0, dtype=layout.cache_dtype)
    else:
        out["cache_hash_size_cumsum"] = torch.tensor(c.cache_hash_size_cumsum, dtype=torch.int64)
        out["cache_index_table_map"] = torch.tensor(c.cache_index_table_map, dtype=torch.int32)
        # the cache's own buffers (GiBs for a large cache): one value each, broadcast, so the
        # fill writes them on the device and the host never builds them (support.fill_support)
        out["lxu_cache_state"] = _constant(-1, (c.cache_sets, c.assoc), torch.int64)
        out["lxu_cache_weights"] = _constant(0, (c.cache_sets * c.assoc, c.max_d_cache), c.dtype)
        shape = (c.total_cache_hash_size + 1,) if c.algorithm == "LFU" else (c.cache_sets, c.assoc)
        out["lxu_state"] = _constant(0, shape, torch.int64)
    out["cache_miss_counter"] = torch.zeros(2, dtype=torch.int64)
    return out


def _constant(value: int, shape: Tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
    """A tensor of ``shape`` holding ``value`` everywhere, one element in memory."""
    return torch.tensor(value, dtype=dtype).expand(shape)


@dataclasses.dataclass(frozen=True)
class FillItem:
    """One table block to fill: ``rows`` x ``cols`` elements at element ``offset`` of the TBE
    buffer ``storage`` (e.g. "weights_dev"), the block at global (``row_offset``,
    ``col_offset``) of table ``key``, drawn from ``dist`` with ``seed``."""

    storage: str
    offset: int
    rows: int
    cols: int
    row_offset: int
    col_offset: int
    key: str
    dist: Dist
    seed: int


def fill_items(layout: TBELayout, shard_offsets: Sequence[Tuple[int, int]],
               dist_of: Callable[[str], Dist], seed: int,
               locations: Sequence[str] = ("DEVICE",)) -> List[FillItem]:
    """The fill items of the tables at ``locations`` (default: DEVICE, the ones in
    ``weights_dev``). ``shard_offsets[t]`` is table t's global (row, col) offset (TorchRec:
    ``config.embedding_tables[t].local_metadata.shard_offsets``); ``dist_of(name)`` its
    distribution."""
    w = layout.weights
    out = []
    for t, name in enumerate(layout.table_names):
        if layout.locations[t] not in locations or layout.rows[t] == 0:
            continue
        ro, co = (int(x) for x in shard_offsets[t])
        out.append(FillItem(w.storage(t), w.offsets[t], layout.rows[t], layout.dims[t], ro, co,
                            name, dist_of(name), seed))
    return out


def fill_many_items(items: Sequence[FillItem], storages: Mapping[str, torch.Tensor]
                    ) -> List[Tuple[torch.Tensor, Dist, str, int, int]]:
    """``metamat.fill_many_`` items: (rows x cols view of ``storages[item.storage]`` at
    ``item.offset``, dist, key, global row, global col). All items of one device go in one
    call, so one CUDA launch fills every DEVICE table of a rank (per seed)."""
    out = []
    for it in items:
        flat = storages[it.storage].view(-1)
        if it.offset + it.rows * it.cols > flat.numel():
            raise ValueError(f"{it.key}: block [{it.offset}, +{it.rows * it.cols}) is past the "
                             f"end of {it.storage} ({flat.numel()} elements)")
        view = flat[it.offset:it.offset + it.rows * it.cols].view(it.rows, it.cols)
        out.append((view, it.dist, it.key, it.row_offset, it.col_offset))
    return out


#: The storages fbgemm's ``enforce_hbm`` keeps in device memory: its constructor passes it to
#: these ``_apply_split`` calls only (fbgemm 1.6 to 1.9), so momentum2 and the later optimizer
#: state of a UVM table stay in unified memory.
ENFORCE_HBM_SPLITS = ("weights", "momentum1")


def allocate_storages(layout: TBELayout, device: torch.device, *, enforce_hbm: bool = False
                      ) -> Dict[str, torch.Tensor]:
    """Allocate the TBE's storages on CUDA ``device`` as fbgemm's ``apply_split_helper`` does,
    without writing the tables (the fill does): ``{prefix}_dev`` with ``torch.empty`` (tables)
    or ``torch.zeros`` (optimizer state), ``{prefix}_uvm`` with
    ``torch.ops.fbgemm.new_unified_tensor(proto, [size], is_host_mapped=uvm_host_mapped)``
    (``torch.zeros`` on the device when ``enforce_hbm``), optimizer UVM state zeroed; plus
    every buffer of ``initial_values`` on the device. Needs a GPU and fbgemm-gpu (CUDA)."""
    device = torch.device(device)
    if device.type != "cuda":
        raise ValueError(f"allocate_storages: {device} is not a CUDA device")
    out: Dict[str, torch.Tensor] = {}
    for s in layout.splits():
        table = s.prefix == "weights"
        make = torch.empty if table else torch.zeros
        out[f"{s.prefix}_dev"] = make(s.dev_size, dtype=s.dtype, device=device)
        out[f"{s.prefix}_host"] = torch.empty(0, dtype=s.dtype, device=device)
        if s.uvm_size and enforce_hbm and s.prefix in ENFORCE_HBM_SPLITS:
            out[f"{s.prefix}_uvm"] = make(s.uvm_size, dtype=s.dtype, device=device)
        elif s.uvm_size:
            uvm = torch.ops.fbgemm.new_unified_tensor(
                torch.empty(1, dtype=s.dtype, device=device), [s.uvm_size],
                is_host_mapped=layout.uvm_host_mapped)
            if not table:
                uvm.zero_()
            out[f"{s.prefix}_uvm"] = uvm
        else:
            out[f"{s.prefix}_uvm"] = torch.empty(0, dtype=s.dtype, device=device)
    for name, v in initial_values(layout).items():
        out[name] = v.to(device)
    return out
