"""The one door to TorchRec's and fbgemm's internals (torch's: :mod:`..torch_upstream`).

Every private name of TorchRec and fbgemm that metamat reads, calls or replaces is declared
here once, as data (:data:`DECLARED`), with the versions it was checked on, and read through
this module's functions; every replacement metamat makes while it builds a model goes through
:func:`patch` (a declared patch site, put back on every exit path). How the checks work:
:mod:`metamat.models.boundary`. In short:

* ``require("train")`` / ``require("quant")``: every module- and class-level name of the group
  (classes, methods, patch sites) exists and is of its kind. It runs at the group's first use
  in a call (:func:`metamat.shard_on_meta`, finding the sharded or quantized modules of a
  model), before anything is allocated;
* instance attributes (``_lookups``, ``_emb_modules``, fbgemm's buffers, ...) are checked on
  the first instance of each class the adapter finds (:func:`check_sharded`,
  :func:`check_quant`, :func:`check_dmp`), while it plans, also before anything is allocated
  (some of them are read only after the allocation, when the tensors are registered);
* an accessor never answers a default for a missing name: it raises
  :class:`~metamat.errors.UnsupportedError` naming it. The few names that may be absent on a
  checked version are declared ``optional`` with what their absence means.

Checked versions (``checked``): torchrec 1.6.1 (with fbgemm-gpu-cpu 1.6.0 and torch 2.11, the
GPU box's stack), 1.7.0 (fbgemm 1.7.0, torch 2.12.1), 1.8.0 (fbgemm 1.8.0, torch 2.13.0: the
pinned CPU stack) and 1.9.2 (fbgemm 1.9.0, torch 2.14.1): every name present, of its kind, on
instances built by ``scripts/check_upstream.py``. :func:`metamat.models.torchrec.compat.
check_versions` still refuses other minor versions first.

Importing this module imports neither torchrec nor fbgemm.
"""
from __future__ import annotations

import sys
from typing import Any, Iterable, List, Optional, Tuple

from torch import nn

from ..boundary import Boundary, Private, apply_patch, patch as _patch
from .compat import check_versions

__all__ = ["BOUNDARY", "DECLARED", "REGISTRATIONS", "TORCHREC", "FBGEMM", "require", "patch",
           "site", "check_sharded", "check_quant", "check_dmp", "is_dmp", "lookups", "emb_modules",
           "kernel_module", "kernel_config", "kernel_pg", "table_configs", "shardings",
           "output_dists", "node_groups", "set_node_groups", "sharding_pg", "is_2d_parallel",
           "wrapped_shards",
           "PERMUTE_TENSORS", "TBE_CACHE_STATE"]

#: Versions every declaration below was checked on (module docstring).
TORCHREC = ("1.6.1", "1.7.0", "1.8.0", "1.9.2")
FBGEMM = ("1.6.0", "1.7.0", "1.8.0", "1.9.0")


def _versions() -> str:
    out = []
    for name in ("torchrec", "fbgemm_gpu"):
        mod = sys.modules.get(name)
        out.append(f"{name} {getattr(mod, '__version__', 'unknown') if mod else 'not imported'}")
    return ", ".join(out)


BOUNDARY = Boundary("torchrec/fbgemm_gpu", _versions)

# -- owners ---------------------------------------------------------------------------------
BEK = "torchrec.distributed.batched_embedding_kernel"
EBC_MOD = "torchrec.distributed.embeddingbag"
EC_MOD = "torchrec.distributed.embedding"
SEBC = f"{EBC_MOD}.ShardedEmbeddingBagCollection"
SEC = f"{EC_MOD}.ShardedEmbeddingCollection"
DMP = "torchrec.distributed.model_parallel.DistributedModelParallel"
SHARDS_WRAPPER = "torchrec.distributed.shards_wrapper.LocalShardsWrapper"
POOLED_LOOKUP = "torchrec.distributed.embedding_lookup.GroupedPooledEmbeddingsLookup"
SEQ_LOOKUP = "torchrec.distributed.embedding_lookup.GroupedEmbeddingsLookup"
BASE_BAG = f"{BEK}.BaseBatchedEmbeddingBag"
BASE_EMB = f"{BEK}.BaseBatchedEmbedding"
#: the fused kernel wrappers of DMPCollection's FULLY_SHARDED strategy (subclasses of the
#: fused ones, same storage)
FULLY_SHARDED_KERNELS = ("ShardedBatchedFusedEmbeddingBag", "ShardedBatchedFusedEmbedding")
TWRW_MODULE = "torchrec.distributed.sharding.twrw_sharding"
GRID_MODULE = "torchrec.distributed.sharding.grid_sharding"
TWRW = f"{TWRW_MODULE}.BaseTwRwEmbeddingSharding"
GRID = f"{GRID_MODULE}.BaseGridEmbeddingSharding"
PERMUTE = "fbgemm_gpu.permute_pooled_embedding_modules.PermutePooledEmbeddings"
TRAINING = "fbgemm_gpu.split_table_batched_embeddings_ops_training"
TRAIN_TBE = f"{TRAINING}.SplitTableBatchedEmbeddingBagsCodegen"
DENSE_TBE = f"{TRAINING}.DenseTableBatchedEmbeddingBagsCodegen"
QEBC = "torchrec.quant.embedding_modules.EmbeddingBagCollection"
QEC = "torchrec.quant.embedding_modules.EmbeddingCollection"
QMCEBC = "torchrec.quant.embedding_modules.QuantManagedCollisionEmbeddingBagCollection"
QMCEC = "torchrec.quant.embedding_modules.QuantManagedCollisionEmbeddingCollection"
SQEBC = "torchrec.distributed.quant_embeddingbag.ShardedQuantEmbeddingBagCollection"
SQEC = "torchrec.distributed.quant_embedding.ShardedQuantEmbeddingCollection"
INFERENCE = "fbgemm_gpu.split_table_batched_embeddings_ops_inference"
INFER_TBE = f"{INFERENCE}.IntNBitTableBatchedEmbeddingBagsCodegen"
FBGEMM_OPS = "torch.ops.fbgemm"
SMCC = "torchrec.distributed.mc_modules.ShardedManagedCollisionCollection"
SQMCC = "torchrec.distributed.mc_modules.ShardedQuantManagedCollisionCollection"
SQMCEBC = ("torchrec.distributed.quant_embeddingbag."
           "ShardedQuantManagedCollisionEmbeddingBagCollection")
SQMCEC = "torchrec.distributed.quant_embedding.ShardedQuantManagedCollisionEmbeddingCollection"
QFPEBC = "torchrec.quant.embedding_modules.FeatureProcessedEmbeddingBagCollection"
SQFPEBC = ("torchrec.distributed.quant_embeddingbag."
           "ShardedQuantFeatureProcessedEmbeddingBagCollection")
MCC = "torchrec.modules.mc_modules.ManagedCollisionCollection"
MCH = "torchrec.modules.mc_modules.MCHManagedCollisionModule"
HZCH = "torchrec.modules.hash_mc_modules.HashZchManagedCollisionModule"
HZCH_EVICT = "torchrec.modules.hash_mc_evictions.HashZchEvictionModule"


def _tr(owner: str, name: str, kind: str, why: str, group: str = "train", **kw) -> Private:
    return Private(owner, name, kind, TORCHREC, why, group, **kw)


def _fb(owner: str, name: str, kind: str, why: str, group: str = "train", **kw) -> Private:
    return Private(owner, name, kind, FBGEMM, why, group, library="fbgemm_gpu", **kw)


#: fbgemm PermutePooledEmbeddings' tensors (the output permutation of a sharded EBC), which a
#: DMP built on meta by TorchRec itself leaves without values (values.py recomputes them).
PERMUTE_TENSORS = ("_offset_dim_list", "_permute", "_inv_permute", "_inv_offset_dim_list")
#: fbgemm's prefetch state that ``_apply_cache_state`` resets (part.reset_cache).
TBE_CACHE_STATE = ("timesteps_prefetched", "lxu_cache_locations_list",
                   "lxu_cache_locations_empty", "lxu_cache_locations")
#: What fbgemm's training TBE constructor computes with an op whose meta kernel answers a
#: placeholder (``get_infos_metadata``: -1, -1): how the backward packs (table, batch) into one
#: index. Left at -1, the CUDA backward of a TBE of several features decodes every gradient
#: as table 0's (register.py sets them).
TBE_BATCH_INFO = ("info_B_num_bits", "info_B_mask")
#: fbgemm training TBE attributes the CUDA layout reads (cuda_layout.tbe_layout, cuda_plan).
_TBE_LAYOUT_ATTRS = ("embedding_specs", "weights_precision", "optimizer", "feature_table_map",
                     "weights_dev", "weights_uvm", "weights_host",
                     "weights_physical_placements", "weights_physical_offsets",
                     "lxu_cache_weights", "cache_algorithm", "cache_index_table_map",
                     "cache_hash_size_cumsum", "table_names", "uvm_host_mapped")
#: fbgemm inference TBE attributes metamat reads (quant.py: the layout check, the host twin)
#: or replaces (quant_part.py: the CPU layout at register time).
_INFER_ATTRS = ("embedding_specs", "feature_table_map", "pooling_mode", "bounds_check_mode_int",
                "output_dtype", "row_alignment", "scale_bias_size_in_bytes", "reverse_qparam",
                "feature_names_per_table", "indices_dtype", "uvm_host_mapped",
                "fp8_exponent_bits", "fp8_exponent_bias", "weight_initialized",
                "index_remappings_array_offsets", "index_remapping_hash_table_offsets",
                "weights_host", "weights_dev", "weights_uvm", "weights_offsets",
                "weights_placements", "weights_physical_placements", "weights_physical_offsets",
                "current_device", "use_cpu", "host_size", "dev_size", "uvm_size")

DECLARED: Tuple[Private, ...] = (
    # -- sharded collections (sharded.py, values.py, register.py, relayout.py, fastnames.py) --
    _tr(SEBC, "_lookups", "attr", "its kernels' lookups (tables, TBEs)"),
    _tr(SEBC, "_embedding_shardings", "attr", "its shardings: output permutation, TWRW groups"),
    _tr(SEBC, "_output_dists", "attr", "output dists rebuilt with TWRW's node groups"),
    _tr(SEBC, "_embedding_bag_configs", "attr", "the user's table configs (init_fn), relayout"),
    _tr(SEBC, "_is_weighted", "attr", "relayout builds the unsharded collection again"),
    _tr(SEBC, "_uncombined_embedding_names", "attr", "recomputes _permute_op's permutation"),
    _tr(SEBC, "_uncombined_embedding_dims", "attr", "recomputes _permute_op's permutation"),
    _tr(SEBC, "_embedding_dims", "attr", "the value of _dim_per_key"),
    _tr(SEBC, "_dim_per_key", "attr", "meta tensor whose value values.py recomputes"),
    _tr(SEBC, "_permute_op", "attr", "fbgemm PermutePooledEmbeddings whose tensors values.py "
        "recomputes"),
    _tr(SEBC, "_features_order", "attr", "the value of _features_order_tensor"),
    _tr(SEBC, "_features_order_tensor", "attr", "meta buffer whose value values.py recomputes",
        optional="a buffer TorchRec registers at the first forward (_create_input_dist): "
        "absent, there is nothing to compute"),
    _tr(SEBC, "_create_output_dist", "method", "what sets _permute_op and _dim_per_key "
        "(values.py mirrors its permutation)"),
    _tr(SEBC, "_table_names", "attr", "fastnames: a set-backed list while sharding",
        patched=True),
    _tr(SEC, "_lookups", "attr", "its kernels' lookups (tables, TBEs)"),
    _tr(SEC, "_sharding_type_to_sharding", "attr", "its shardings: TWRW groups"),
    _tr(SEC, "_output_dists", "attr", "output dists rebuilt with TWRW's node groups"),
    _tr(SEC, "_embedding_configs", "attr", "the user's table configs (init_fn), relayout"),
    _tr(SEC, "_need_indices", "attr", "relayout builds the unsharded collection again"),
    _tr(SEC, "_features_order", "attr", "the value of _features_order_tensor"),
    _tr(SEC, "_features_order_tensor", "attr", "meta buffer whose value values.py recomputes",
        optional="a buffer TorchRec registers at the first forward: absent, nothing to compute"),
    _tr(SEC, "_table_names", "attr", "fastnames: a set-backed list while sharding",
        patched=True),
    _tr(EBC_MOD, "DistributedDataParallel", "class", "MetaDDP while sharding on meta",
        patched=True),
    _tr(EC_MOD, "DistributedDataParallel", "class", "MetaDDP while sharding on meta",
        patched=True),
    # -- shardings (register.py: the node groups TWRW/grid sharding skip on meta) ---------------
    _tr(TWRW, "_pg", "attr", "the backend of the node groups"),
    _tr(TWRW, "_intra_pg", "attr", "None on meta: created at register (under 2D: built)"),
    _tr(TWRW, "_cross_pg", "attr", "None on meta: created at register (under 2D: built)"),
    _tr(TWRW, "_is_2D_parallel", "attr", "2D: its node groups exist from the build on"),
    _tr(TWRW, "_local_size", "attr", "the ranks per node its tables were placed by"),
    _tr(GRID, "_pg", "attr", "the backend of the node groups"),
    _tr(GRID, "_intra_pg", "attr", "None on meta: created at register (under 2D: built)"),
    _tr(GRID, "_cross_pg", "attr", "None on meta: created at register (under 2D: built)"),
    _tr(GRID, "_is_2D_parallel", "attr", "2D: its node groups exist from the build on"),
    _tr(GRID, "_local_size", "attr", "the ranks per node its tables were placed by"),
    # -- lookups and kernel wrappers (sharded.py, tbe.py, cuda_plan.py) --------------------------
    _tr(POOLED_LOOKUP, "_emb_modules", "attr", "the kernel wrappers of an EBC's lookup"),
    _tr(SEQ_LOOKUP, "_emb_modules", "attr", "the kernel wrappers of an EC's lookup"),
    _tr(BASE_BAG, "_emb_module", "attr", "the fbgemm TBE"),
    _tr(BASE_BAG, "_config", "attr", "its GroupedEmbeddingConfig (tables, fused_params)"),
    _tr(BASE_BAG, "_pg", "attr", "tbe.py runs the constructor again with it"),
    _tr(BASE_EMB, "_emb_module", "attr", "the fbgemm TBE"),
    _tr(BASE_EMB, "_config", "attr", "its GroupedEmbeddingConfig (tables, fused_params)"),
    _tr(BASE_EMB, "_pg", "attr", "tbe.py runs the constructor again with it"),
    # -- the kernel module's names metamat replaces while sharding ------------------------------
    _tr(BEK, "SplitTableBatchedEmbeddingBagsCodegen", "class", "cuda_kernels: CUDA layout on "
        "meta; tbe.py: stopped to capture its arguments", patched=True),
    _tr(BEK, "DenseTableBatchedEmbeddingBagsCodegen", "class", "host_kernels/cuda_kernels: "
        "use_cpu; tbe.py: stopped to capture its arguments", patched=True),
    _tr(f"{BEK}.BatchedFusedEmbeddingBag", "__init__", "own_method", "cuda_kernels records "
        "the wrapper's config", patched=True),
    _tr(f"{BEK}.BatchedFusedEmbedding", "__init__", "own_method", "cuda_kernels records the "
        "wrapper's config", patched=True),
    _tr(f"{BEK}.EmbeddingFusedOptimizer", "__init__", "own_method", "fastbuild: each table's "
        "own entries only", patched=True),
    _tr(BEK, "dataclass", "function", "fastbuild: one ShardParams class", patched=True),
    _tr(BEK, "copy", "object", "fastbuild: a direct copy of ShardedTensorMetadata",
        patched=True),
    # -- DistributedModelParallel (sharded.py, relayout.py) -------------------------------------
    _tr(DMP, "_dmp_wrapped_module", "attr", "relayout puts the rebuilt collection there"),
    _tr(DMP, "_plan", "attr", "relayout shards again with the DMP's plan"),
    _tr(DMP, "_sharder_map", "attr", "relayout shards again with the DMP's sharders"),
    _tr(DMP, "_env", "attr", "relayout shards again in the DMP's env"),
    _tr(DMP, "_optim", "attr", "relayout rebuilds the combined optimizer"),
    _tr(DMP, "_init_optim", "method", "relayout rebuilds the combined optimizer"),
    # -- DMPCollection, 2D parallel (two_dim.py) ------------------------------------------------
    _tr(DMP, "__init__", "own_method", "two_dim: DMPCollection's DMP part shards on meta",
        patched=True),
    _tr("torchrec.distributed.model_parallel", "DeviceMesh", "class", "two_dim: a gloo-only "
        "process group's 2D mesh is a CPU mesh (the emulated GPU)", patched=True),
    *[_tr(f"{BEK}.{c}", n, "attr", why) for c in FULLY_SHARDED_KERNELS for n, why in (
        ("_unsharded_param", "FULLY_SHARDED: the whole weights (a view the graph swaps)"),
        ("_async_stream", "FULLY_SHARDED: made at registration on the tables' GPU"),
        ("weights_sharded", "FULLY_SHARDED: reduce-scattered weights refuse a load"),
        ("_rs_awaitable", "FULLY_SHARDED: a pending reduce-scatter refuses a load"))],
    *[_tr(mod, "intra_and_cross_node_pg_2D", "function", "two_dim: the node groups of a "
          "2D-parallel TWRW/grid sharding are created while it is built, as on GPUs",
          patched=True) for mod in (TWRW_MODULE, GRID_MODULE)],
    *[_tr(SHARDS_WRAPPER, n, "method", "two_dim: the local tensor of a 2D-parallel table's "
          "DTensor holds the rank's shards (none, one or several) and their offsets")
      for n in ("local_shards", "local_offsets")],
    # -- fbgemm ------------------------------------------------------------------------------
    *[_fb(PERMUTE, n, "attr", "meta tensor whose value values.py recomputes")
      for n in PERMUTE_TENSORS],
    *[_fb(TRAIN_TBE, n, "attr", "the CUDA layout (cuda_layout.py) re-derives and checks it")
      for n in _TBE_LAYOUT_ATTRS],
    *[_fb(TRAIN_TBE, n, "attr", "reset after a load into a live model (part.reset_cache)")
      for n in TBE_CACHE_STATE],
    *[_fb(TRAIN_TBE, n, "attr", "register: meta's placeholder replaced (fix_batch_info)")
      for n in TBE_BATCH_INFO],
    _fb(FBGEMM_OPS, "get_infos_metadata", "object", "register: a meta-built TBE's batch info"),
    _fb(TRAIN_TBE, "_apply_cache_state", "method", "cuda_layout mirrors its cache layout; "
        "part.reset_cache its prefetch state"),
    _fb(TRAIN_TBE, "reset_cache_states", "method", "part.reset_cache"),
    _fb(TRAIN_TBE, "flush", "method", "LXU caches written back before a load"),
    _fb(TRAIN_TBE, "get_optimizer_state", "method", "fastbuild asks whether a TBE keeps state"),
    _fb(TRAINING, "DEFAULT_ASSOC", "object", "the LXU cache's associativity"),
    _fb(DENSE_TBE, "use_cpu", "attr", "cuda_kernels: a dense TBE built on the host for CUDA"),
    _fb(DENSE_TBE, "current_device", "attr", "cuda_kernels: meta until materialize"),
    *[_fb(FBGEMM_OPS, n, "object", "MetaFactories(cuda=True): UVM factories answered on meta",
          patched=True, optional="fbgemm registers its ops when its library loads; without "
          "one, nothing calls it")
      for n in ("new_unified_tensor", "new_managed_tensor", "new_host_mapped_tensor",
                "new_managed_tensor_meta")],
    # -- managed collision (managed_collision.py) ----------------------------------------------
    _tr(SMCC, "_create_managed_collision_modules", "own_method", "managed_collision: the zch "
        "sizes gathered on a real device while sharding on meta", patched=True),
    _tr(SMCC, "_managed_collision_modules", "attr", "managed_collision: each table's MC module"),
    _tr(SMCC, "_device", "attr", "managed_collision: meta while sharding on meta; the zch-size "
        "exchange runs on a real device meanwhile"),
    _tr(SMCC, "_env", "attr", "managed_collision: the process group of the zch-size exchange"),
    _tr(MCC, "_managed_collision_modules", "attr", "managed_collision: the MC modules rebuilt "
        "on meta while sharding"),
    _tr(MCH, "_output_global_offset", "attr", "managed_collision: this rank's first row"),
    _tr(MCH, "_zch_size", "attr", "managed_collision: this rank's rows"),
    *[_tr(MCH, n, "attr", "managed_collision.finish_mc_modules: meta when built on meta, "
          "the real device or a real placeholder once real")
      for n in ("_device", "_evicted_emb_indices", "_mch_sorted_raw_ids")],
    _tr(MCH, "validate_state", "method", "managed_collision: TorchRec's load hook, run after a "
        "load"),
    _tr(HZCH, "_buckets", "attr", "managed_collision: the bucket count a checkpoint must have"),
    _tr(HZCH, "rebuild_with_output_id_range", "method", "mc_sharding: rebuilt on meta while "
        "sharding"),
    *[_tr(HZCH, n, "attr", "managed_collision.finish_mc_modules: the metrics logger TorchRec "
          "skips on meta, built once real") for n in (
              "_scalar_logger", "_tb_logging_frequency", "_name", "_is_inference", "_device",
              "_eviction_module", "_zch_size", "_start_bucket", "_end_bucket",
              "_disable_fallback", "_output_global_offset_tensor")],
    *[_tr(HZCH, n, "attr", "managed_collision: each slot's id and eviction time, -1 when "
          "empty") for n in ("_hash_zch_identities", "_hash_zch_metadata")],
    _tr(HZCH, "get_reserved_slots_per_bucket", "method", "managed_collision.finish_mc_modules"),
    _tr("torchrec.modules.hash_mc_metrics", "ScalarLogger", "class",
        "managed_collision.finish_mc_modules: the logger TorchRec's constructor builds"),
    _tr(HZCH_EVICT, "_device", "attr", "managed_collision.finish_mc_modules: meta when built "
        "on meta"),
    # -- quantized inference modules (quant.py, quant_part.py) ----------------------------------
    _tr(SQEBC, "_tbes_configs", "attr", "its inference TBEs and their configs", "quant"),
    _tr(SQEC, "_tbes_configs", "attr", "its inference TBEs and their configs", "quant"),
    _tr(QEBC, "_emb_modules", "attr", "its inference TBEs", "quant"),
    _tr(QEBC, "_key_to_tables", "attr", "the tables of each TBE", "quant"),
    _tr(QEBC, "_table_name_to_quantized_weights", "attr", "meta copies dropped at register",
        "quant"),
    *[_tr(cls, "_managed_collision_collection", "attr", "quant.quant_mc_collections: the "
          "MC state, the modules adapter's", "quant")
      for cls in (QMCEBC, QMCEC, SQMCEBC, SQMCEC)],
    _tr(SQMCC, "_managed_collision_modules", "attr", "quant.quant_mc_collections: the global "
        "MC modules, the modules adapter's", "quant"),
    _tr(QFPEBC, "feature_processor", "attr", "quant.quant_feature_processors: the position "
        "weights, the modules adapter's", "quant"),
    _tr(SQFPEBC, "feature_processors_per_rank", "attr", "quant.quant_feature_processors: "
        "each rank's copy of the position weights, the modules adapter's", "quant"),
    *[_tr(SQMCC, n, "attr", "quant_mc.rank_mc_modules: each rank's MC modules and rows",
          "quant") for n in ("_managed_collision_modules_per_rank", "_shard_metadata_per_rank")],
    _tr(QEC, "_emb_modules", "attr", "its inference TBEs", "quant"),
    _tr(QEC, "_key_to_tables", "attr", "the tables of each TBE", "quant"),
    _tr(QEC, "_table_name_to_quantized_weights", "attr", "meta copies dropped at register",
        "quant"),
    *[_fb(INFER_TBE, n, "attr", "quant.py reads it; quant_part.py lays the TBE out for the "
          "CPU", "quant") for n in _INFER_ATTRS],
    _fb(INFER_TBE, "initialize_logical_weights_placements_and_offsets", "method",
        "quant_layout.host_twin", "quant"),
    _fb(INFERENCE, "rounded_row_size_in_bytes", "function", "quant.find_tbes: fbgemm's row "
        "size", "quant"),
)
BOUNDARY.declare(*DECLARED)

#: Kernels metamat registers for fbgemm ops and never removes (not patches: nothing is
#: replaced, an existing kernel is left alone): (op, dispatch key, by whom and why).
REGISTRATIONS = (
    ("fbgemm::lxu_cache_flush", "Meta", "cuda_kernels.register_meta_flush: a CUDA-laid-out "
     "TBE on meta gives its state_dict (TorchRec flushes the cache first); a cache on meta "
     "holds nothing to write back"),
    ("fbgemm::lxu_cache_flush", "CPU", "emulation.register_cpu_cache_flush: the emulated "
     "GPU's caches are written back as fbgemm's CUDA kernel does"),
)


def site(owner: str, name: str) -> Private:
    """The declared patch site ``owner.name``."""
    return BOUNDARY.get_declared(owner, name)


def patch(owner: str, name: str, new: Any, **kw: Any):
    """Context manager: declared patch site ``owner.name`` is ``new`` while active
    (:func:`metamat.models.boundary.patch`)."""
    return _patch(site(owner, name), new, **kw)


def apply(owner: str, name: str, new: Any, **kw: Any):
    """Replace declared patch site ``owner.name``; the caller undoes the returned Patch."""
    return apply_patch(site(owner, name), new, **kw)


def require(group: str = "train") -> None:
    """The supported torchrec/fbgemm versions, then every module/class-level name of ``group``
    ("train": sharded training collections and sharding on meta, with the torch internals
    that path uses; "quant": quantized inference modules). Raises UnsupportedError naming
    what is missing; allocates nothing."""
    check_versions()
    BOUNDARY.require(group)
    if group == "train":
        from .. import torch_upstream

        for torch_group in ("module", "sharded_tensor", "factories"):
            torch_upstream.require(torch_group)


# -- accessors: sharded training collections ------------------------------------------------

def _read(obj: Any, owner: str, name: str) -> Any:
    return BOUNDARY.read(obj, owner, name)


def _is_sebc(sm: nn.Module) -> bool:
    mod = sys.modules.get(EBC_MOD)
    return mod is not None and isinstance(sm, mod.ShardedEmbeddingBagCollection)


def _owner_of(sm: nn.Module) -> str:
    return SEBC if _is_sebc(sm) else SEC


def is_dmp(model: Any) -> bool:
    """``model`` is a TorchRec DistributedModelParallel (whose ``module`` is the model)."""
    mod = sys.modules.get("torchrec.distributed.model_parallel")
    return mod is not None and isinstance(model, mod.DistributedModelParallel)


def lookups(sm: nn.Module) -> List[nn.Module]:
    """A sharded collection's lookups (each may be wrapped in DDP: :func:`emb_modules`)."""
    return list(_read(sm, _owner_of(sm), "_lookups"))


def _unwrap(m: Any) -> Any:
    import torch

    while isinstance(m, torch.nn.parallel.DistributedDataParallel):
        m = m.module
    return m


def emb_modules(lookup: nn.Module) -> List[nn.Module]:
    """The kernel wrappers (BatchedFusedEmbeddingBag, ...) of a lookup (DDP unwrapped)."""
    lookup = _unwrap(lookup)
    mod = sys.modules.get("torchrec.distributed.embedding_lookup")
    owner = SEQ_LOOKUP if mod is not None and isinstance(lookup, mod.GroupedEmbeddingsLookup) \
        else POOLED_LOOKUP
    return list(_read(lookup, owner, "_emb_modules"))


def _wrapper_owner(w: nn.Module) -> str:
    bek = sys.modules.get(BEK)
    return BASE_EMB if bek is not None and isinstance(w, bek.BaseBatchedEmbedding) else BASE_BAG


def kernel_module(w: nn.Module) -> nn.Module:
    """The fbgemm TBE of a kernel wrapper."""
    return _read(w, _wrapper_owner(w), "_emb_module")


def weights_scattered(w: nn.Module) -> bool:
    """A FULLY_SHARDED kernel wrapper whose weights a training forward reduce-scattered (or is
    reduce-scattering), until its backward gathers them back; False for other wrappers."""
    name = type(w).__name__
    if name not in FULLY_SHARDED_KERNELS:
        return False
    owner = f"{BEK}.{name}"
    return bool(_read(w, owner, "weights_sharded")) or \
        _read(w, owner, "_rs_awaitable") is not None


def fully_sharded_stream(w: nn.Module) -> Any:
    """A FULLY_SHARDED kernel wrapper's CUDA stream (None for other wrappers)."""
    name = type(w).__name__
    return _read(w, f"{BEK}.{name}", "_async_stream") if name in FULLY_SHARDED_KERNELS \
        else None


def set_fully_sharded_stream(wrapper: nn.Module, stream: Any) -> None:
    """Give a FULLY_SHARDED kernel wrapper its CUDA stream (register.py)."""
    if type(wrapper).__name__ not in FULLY_SHARDED_KERNELS:
        raise TypeError(f"{type(wrapper).__name__} has no stream of its own")
    wrapper._async_stream = stream


def fix_batch_info(emb: nn.Module) -> None:
    """Give fbgemm training TBE ``emb``, built on meta, the batch-index bits its constructor
    computes on a real device (:data:`TBE_BATCH_INFO`). Other modules (the dense TBE
    recomputes them in its backward), and TBEs built on a real device, are left alone."""
    import torch

    mod = sys.modules.get(TRAINING)
    if mod is None or not isinstance(emb, mod.SplitTableBatchedEmbeddingBagsCodegen):
        return
    if _read(emb, TRAIN_TBE, "info_B_num_bits") != -1:
        return
    features = len(_read(emb, TRAIN_TBE, "feature_table_map"))
    infos = _read(torch.ops.fbgemm, FBGEMM_OPS, "get_infos_metadata")
    bits, mask = infos(torch.empty(0, dtype=torch.int32), 1, features)  # its CPU kernel
    emb.info_B_num_bits, emb.info_B_mask = int(bits), int(mask)


def kernel_config(w: nn.Module) -> Any:
    """A kernel wrapper's GroupedEmbeddingConfig."""
    return _read(w, _wrapper_owner(w), "_config")


def kernel_pg(w: nn.Module) -> Any:
    """A kernel wrapper's process group."""
    return _read(w, _wrapper_owner(w), "_pg")


def table_configs(sm: nn.Module) -> List[Any]:
    """The user's table configs of a sharded collection (with their ``init_fn``)."""
    if _is_sebc(sm):
        return list(_read(sm, SEBC, "_embedding_bag_configs") or [])
    return list(_read(sm, SEC, "_embedding_configs") or [])


def is_weighted(sm: nn.Module) -> bool:
    return bool(_read(sm, SEBC, "_is_weighted"))


def need_indices(sm: nn.Module) -> bool:
    return bool(_read(sm, SEC, "_need_indices"))


def shardings(sm: nn.Module) -> List[Any]:
    """A sharded collection's EmbeddingSharding objects, in its lookups' order."""
    if _is_sebc(sm):
        return list(_read(sm, SEBC, "_embedding_shardings"))
    return list(_read(sm, SEC, "_sharding_type_to_sharding").values())


def output_dists(sm: nn.Module) -> List[Any]:
    """The collection's own list of output dists (register.py replaces entries)."""
    return _read(sm, _owner_of(sm), "_output_dists")


def _node_group_owner(sh: Any) -> Optional[str]:
    for owner in (TWRW, GRID):
        mod, _, cls = owner.rpartition(".")
        m = sys.modules.get(mod)
        if m is not None and isinstance(sh, getattr(m, cls)):
            return owner
    return None


def node_groups(sh: Any) -> Optional[Tuple[Any, Any]]:
    """(intra-node, cross-node) process groups of a TWRW or grid sharding (None on meta until
    register creates them); None for other shardings, which have none."""
    owner = _node_group_owner(sh)
    if owner is None:
        return None
    return _read(sh, owner, "_intra_pg"), _read(sh, owner, "_cross_pg")


def set_node_groups(sh: Any, intra: Any, cross: Any) -> None:
    """Give a TWRW or grid sharding its node groups (register.py)."""
    if node_groups(sh) is None:
        raise TypeError(f"{type(sh).__name__} has no node groups")
    sh._intra_pg, sh._cross_pg = intra, cross


def sharding_pg(sh: Any) -> Any:
    return _read(sh, _node_group_owner(sh) or TWRW, "_pg")


def placed_node_size(sh: Any) -> int:
    """The ranks per node a TWRW or grid sharding placed its tables by (on meta, without node
    groups: the local world size)."""
    return int(_read(sh, _node_group_owner(sh) or TWRW, "_local_size"))


def is_2d_parallel(sh: Any) -> bool:
    return bool(_read(sh, _node_group_owner(sh) or TWRW, "_is_2D_parallel"))


class CollectionMetadata:
    """The integer metadata of a ShardedEmbeddingBagCollection that a DMP built on meta by
    TorchRec leaves without values, and what it is computed from (values.py)."""

    def __init__(self, sm: nn.Module) -> None:
        self.sm = sm
        self.sebc = _is_sebc(sm)

    def dim_per_key(self) -> Any:
        return _read(self.sm, SEBC, "_dim_per_key") if self.sebc else None

    def embedding_dims(self) -> List[int]:
        return list(_read(self.sm, SEBC, "_embedding_dims"))

    def permute_op(self) -> Any:
        return _read(self.sm, SEBC, "_permute_op") if self.sebc else None

    def uncombined_names(self) -> List[str]:
        return list(_read(self.sm, SEBC, "_uncombined_embedding_names"))

    def uncombined_dims(self) -> List[int]:
        return list(_read(self.sm, SEBC, "_uncombined_embedding_dims"))

    def features_order(self) -> List[int]:
        return _read(self.sm, _owner_of(self.sm), "_features_order")

    def features_order_tensor(self) -> Any:
        """The ``_features_order_tensor`` buffer, or None (optional: see its declaration)."""
        return self.sm._buffers.get("_features_order_tensor")


def permute_tensor(op: Any, name: str) -> Any:
    """One of :data:`PERMUTE_TENSORS` of fbgemm's PermutePooledEmbeddings ``op``."""
    return _read(op, PERMUTE, name)


# -- accessors: DistributedModelParallel ----------------------------------------------------

def dmp_internals_missing(model: Any) -> List[str]:
    """Declared DMP internals ``model`` lacks (relayout needs them all)."""
    return [n for n in ("_plan", "_sharder_map", "_env", "_init_optim", "_optim")
            if not hasattr(model, n)]


def dmp_plan(model: Any) -> Any:
    return _read(model, DMP, "_plan")


def dmp_sharder_map(model: Any) -> Any:
    return _read(model, DMP, "_sharder_map")


def dmp_env(model: Any) -> Any:
    return _read(model, DMP, "_env")


def dmp_optim(model: Any) -> Any:
    return _read(model, DMP, "_optim")


def set_dmp_optim(model: Any, optim: Any) -> None:
    _read(model, DMP, "_optim")
    model._optim = optim


def dmp_init_optim(model: Any, module: nn.Module) -> Any:
    """DMP's ``_init_optim(module)``: the combined optimizer over ``module``'s."""
    return _read(model, DMP, "_init_optim")(module)


def wrapped_shards(local: Any) -> Optional[List[Tuple[Any, Tuple[int, ...]]]]:
    """(shard, global offsets) of each shard in ``local`` when it is TorchRec's
    ``LocalShardsWrapper`` (the local tensor of a 2D-parallel table's DTensor: none, one or
    several shards per rank), else None."""
    mod = sys.modules.get("torchrec.distributed.shards_wrapper")
    cls = getattr(mod, "LocalShardsWrapper", None) if mod is not None else None
    if cls is None or not isinstance(local, cls):
        return None
    shards = _read(local, SHARDS_WRAPPER, "local_shards")()
    offsets = _read(local, SHARDS_WRAPPER, "local_offsets")()
    return [(t, tuple(int(x) for x in o)) for t, o in zip(shards, offsets)]


def dmp_wrapped(model: Any) -> nn.Module:
    return _read(model, DMP, "_dmp_wrapped_module")


WRAPPED = "_dmp_wrapped_module"  # where relayout puts the rebuilt root collection


# -- accessors: quantized modules -------------------------------------------------------------

def _quant_owner(m: nn.Module) -> str:
    for owner in (SQEBC, SQEC, QEBC, QEC):
        mod, _, cls = owner.rpartition(".")
        if isinstance(m, getattr(sys.modules[mod], cls)):
            return owner
    raise TypeError(f"{type(m).__name__} is not a quantized TorchRec collection")


def quant_tbes(m: nn.Module) -> List[Any]:
    """The inference TBEs of a quantized collection (sharded: the keys of ``_tbes_configs``)."""
    owner = _quant_owner(m)
    if owner in (SQEBC, SQEC):
        return list(_read(m, owner, "_tbes_configs"))
    return list(_read(m, owner, "_emb_modules"))


def quant_tbe_config(m: nn.Module, tbe: Any) -> Any:
    """The GroupedEmbeddingConfig of ``tbe`` in sharded quantized collection ``m``."""
    return _read(m, _quant_owner(m), "_tbes_configs")[tbe]


def quant_groups(m: nn.Module) -> List[Any]:
    """The table lists of an unsharded quantized collection, one per TBE, in TBE order."""
    return list(_read(m, _quant_owner(m), "_key_to_tables").values())


def quantized_weights(m: nn.Module) -> Any:
    """The meta copies an unsharded quantized collection kept (None for sharded ones, which
    have none)."""
    owner = _quant_owner(m)
    if owner in (SQEBC, SQEC):
        return None
    return _read(m, owner, "_table_name_to_quantized_weights")


def drop_quantized_weights(m: nn.Module) -> None:
    if quantized_weights(m):
        m._table_name_to_quantized_weights = None


# -- instance checks (before allocation) ------------------------------------------------------

def check_sharded(sharded: Iterable[Tuple[str, nn.Module]]) -> None:
    """Check the declared instance attributes of every TorchRec/fbgemm object of the sharded
    collections that the adapter reads: the collections, their shardings, lookups, kernel
    wrappers, TBEs and output permutation (UnsupportedError naming what is missing)."""
    check = BOUNDARY.check_instance
    for _, sm in sharded:
        check(sm)
        for sh in shardings(sm):
            check(sh)
        for lookup in lookups(sm):
            check(_unwrap(lookup))
            for w in emb_modules(lookup):
                check(w)
                check(kernel_module(w))
        if _is_sebc(sm):
            op = CollectionMetadata(sm).permute_op()
            if op is not None:
                check(op)


def check_dmp(model: Any) -> None:
    if is_dmp(model):
        BOUNDARY.check_instance(model)


def check_quant(modules: Iterable[Tuple[str, nn.Module]]) -> None:
    """Check the declared instance attributes of quantized collections and their TBEs."""
    check = BOUNDARY.check_instance
    for _, m in modules:
        check(m)
        for tbe in quant_tbes(m):
            check(tbe)
