"""TorchRec adapter: the sharded collections of a model, their kernel wrappers and layouts."""
from __future__ import annotations

import os
from typing import Any, Dict, List, Optional, Tuple

import torch
from torch import nn

from ...errors import UnsupportedError

__all__ = ["root_of", "sharded_modules", "wrappers", "named_wrappers", "laid_out_for",
           "table_configs", "uses_torchrec", "pec_aliases", "check_node_groups"]


def root_of(model: nn.Module) -> nn.Module:
    """The module whose ``named_modules`` names match ``model.state_dict()`` keys (a DMP's
    wrapped module, else the model)."""
    from .upstream import is_dmp

    return model.module if is_dmp(model) else model


def uses_torchrec() -> bool:
    # A model can only hold TorchRec modules if torchrec was imported.
    import sys

    return "torchrec" in sys.modules


def sharded_modules(root: nn.Module) -> List[Tuple[str, nn.Module]]:
    if not uses_torchrec():
        return []
    from torchrec.distributed.embedding import ShardedEmbeddingCollection
    from torchrec.distributed.embeddingbag import ShardedEmbeddingBagCollection
    from torchrec.distributed.types import ShardedModule

    from ..modules import named_modules_pruned

    from . import upstream

    tables = (ShardedEmbeddingBagCollection, ShardedEmbeddingCollection)
    out = []
    # not below a table module: its ~1 module per table is never a sharded module
    for name, m in named_modules_pruned(root, lambda _n, m: isinstance(m, tables)):
        if isinstance(m, tables):
            out.append((name, m))
        elif isinstance(m, ShardedModule) and not _is_container(m):
            from .quant import is_quantized  # quantized inference modules: quant_part.py
            if not is_quantized(m) and any(p.is_meta for p in _tensors_of(m)):
                raise UnsupportedError(
                    f"{name or '<root>'}: sharded module type {type(m).__name__} is not supported "
                    "(supported: ShardedEmbeddingBagCollection, ShardedEmbeddingCollection)"
                )
    if out:  # the first use of TorchRec's internals in this call: all of them checked
        upstream.require("train")
        for _, sm in out:
            upstream.BOUNDARY.check_instance(sm)
    return out


def _is_container(m: nn.Module) -> bool:
    """A sharded module whose tables are a ShardedEmbedding[Bag]Collection child (found on its
    own by ``named_modules``) and whose other state is ordinary modules and tensors:

    * TorchRec's ShardedFeatureProcessedEmbeddingBagCollection (position-weighted features);
    * its ShardedPECEmbeddingCollection (prioritized embedding communication): besides the
      tables, per-sharding overlap handlers whose only tensors are a scratch mask, zeroed
      before each use, and a lazily built offset tensor (the graph walk swaps both and
      their device attribute);
    * a sharded managed-collision collection, its parts found on their own
      (``managed_collision``; the quantized one's by the quantized adapter, ``quant_mc``).
    """
    from .mc_sharding import is_mc_collection, is_mc_container, is_quant_mc_collection

    if is_mc_container(m) or is_mc_collection(m) or is_quant_mc_collection(m):
        return True
    return isinstance(m, _plain_containers())


def _plain_containers() -> tuple:
    out = []
    try:
        from torchrec.distributed.fp_embeddingbag import (
            ShardedFeatureProcessedEmbeddingBagCollection)
        out.append(ShardedFeatureProcessedEmbeddingBagCollection)
    except ImportError:  # a TorchRec without feature processors
        pass
    try:
        from torchrec.distributed.pec_embedding import ShardedPECEmbeddingCollection
        out.append(ShardedPECEmbeddingCollection)
    except ImportError:  # torchrec < 1.8
        pass
    return tuple(out)


_PEC_INNER = "_embedding_collection"  # where PECEmbeddingCollection keeps its collection


def pec_aliases(root: nn.Module, sharded: List[Tuple[str, nn.Module]]) -> List[Tuple[str, str]]:
    """(name prefix of a sharded EmbeddingCollection's state, the prefix the same tables have
    with PEC toggled): a PECEmbeddingCollection only wraps its collection, so a checkpoint
    saved with PEC loads into the same model without it, and the other way round."""
    try:
        from torchrec.distributed.embedding import ShardedEmbeddingCollection
        from torchrec.distributed.pec_embedding import ShardedPECEmbeddingCollection
    except ImportError:  # torchrec < 1.8: no PEC
        return []
    out = []
    for name, sm in sharded:
        if not isinstance(sm, ShardedEmbeddingCollection):
            continue
        parent, _, last = name.rpartition(".")
        if last == _PEC_INNER and isinstance(root.get_submodule(parent),
                                             ShardedPECEmbeddingCollection):
            out.append((f"{name}.", f"{parent}." if parent else ""))
        else:
            out.append((f"{name}." if name else "", f"{name}.{_PEC_INNER}." if name
                        else f"{_PEC_INNER}."))
    return out


def _tensors_of(m: nn.Module) -> List[torch.Tensor]:
    try:
        return list(m.parameters()) + list(m.buffers())
    except Exception:  # noqa: BLE001 - some sharded modules refuse; treat as opaque
        return []


def wrappers(sm: nn.Module) -> List[nn.Module]:
    import torchrec.distributed.batched_embedding_kernel as bek
    from torchrec.distributed.batched_embedding_kernel import (
        BatchedDenseEmbedding,
        BatchedDenseEmbeddingBag,
        BatchedFusedEmbedding,
        BatchedFusedEmbeddingBag,
    )

    from .upstream import FULLY_SHARDED_KERNELS, emb_modules, lookups

    supported = (BatchedFusedEmbeddingBag, BatchedDenseEmbeddingBag, BatchedFusedEmbedding,
                 BatchedDenseEmbedding, *(getattr(bek, c) for c in FULLY_SHARDED_KERNELS))
    out = []
    for lookup in lookups(sm):
        for w in emb_modules(lookup):
            if type(w) not in supported:
                raise UnsupportedError(
                    f"compute kernel module {type(w).__name__} is not supported "
                    f"(supported: {', '.join(c.__name__ for c in supported)})"
                )
            out.append(w)
    return out


def laid_out_for(model: nn.Module, sharded: List[Tuple[str, nn.Module]]) -> Optional[torch.device]:
    """The CUDA device a model's TBEs are laid out for (``shard_on_meta(compute_device=
    "cuda")``, or an eager DMP built on a GPU), else None (fbgemm's CPU layout)."""
    from .upstream import kernel_module

    dev = getattr(model, "_metamat_compute_device", None)
    if dev is not None or not sharded:
        return dev
    for _, w in named_wrappers(sharded):
        # fbgemm's TBEs list (rows, dims, location, compute device) per table
        specs = getattr(kernel_module(w), "embedding_specs", None) or []
        if any(len(s) > 3 and getattr(s[3], "name", "") == "CUDA" for s in specs):
            return torch.device("cuda")
    return None


def named_wrappers(sharded: List[Tuple[str, nn.Module]]) -> List[Tuple[str, nn.Module]]:
    """(readable path, kernel wrapper) of every sharded module's lookups."""
    from .upstream import emb_modules, lookups

    out = []
    for name, sm in sharded:
        for i, lookup in enumerate(lookups(sm)):
            for j, w in enumerate(emb_modules(lookup)):
                out.append((f"{name or '<root>'}._lookups[{i}]._emb_modules[{j}]", w))
    return out


def table_configs(sm: nn.Module) -> Dict[str, Any]:
    """Table name -> the user's config (with its ``init_fn``). TorchRec keeps the module's
    configs on the sharded module; the kernels' ShardedEmbeddingTable copies lose init_fn."""
    from . import upstream

    out = {}
    for cfg in upstream.table_configs(sm):
        out.setdefault(cfg.name, cfg)
    if out:
        return out
    for w in wrappers(sm):
        for t in upstream.kernel_config(w).embedding_tables:
            out.setdefault(t.name, t)
    return out


def check_node_groups(sharded: List[Tuple[str, Any]]) -> None:
    """Refuse, before anything is allocated, table-row-wise and grid shardings whose node
    groups (made at register: register.py ``_fix_process_groups``) would have another size
    than the nodes their tables were placed by: on meta TorchRec places them by the local
    world size, while its node groups take the topology group's size (the hosts of
    ``TOPOLOGY_DOMAIN_MULTIPLE`` or ``TORCHREC_RESOLVED_POD_SIZE``), and the two would
    disagree on which rank holds which rows."""
    import torch.distributed as dist
    from torchrec.distributed import comm

    from . import upstream

    topology_size = getattr(comm, "get_topology_group_world_size", None)
    if topology_size is None or not dist.is_initialized() or not any(
            v in os.environ for v in ("TOPOLOGY_DOMAIN_MULTIPLE", "TORCHREC_RESOLVED_POD_SIZE")):
        return  # node groups of the local world size, as the tables were placed
    size = None
    for name, sm in sharded:
        for sh in upstream.shardings(sm):
            groups = upstream.node_groups(sh)
            if groups is None or groups[0] is not None or upstream.is_2d_parallel(sh):
                continue
            if size is None:
                try:
                    size = topology_size(dist.get_world_size())
                except ValueError as e:
                    raise UnsupportedError(f"{name or '<root>'}: TorchRec's node groups: {e}") \
                        from e
            placed = upstream.placed_node_size(sh)
            if size != placed:
                raise UnsupportedError(
                    f"{name or '<root>'}: its table-row-wise or grid tables were placed on "
                    f"nodes of {placed} rank{'s' * (placed != 1)} (the local world size), and "
                    f"TorchRec's node groups would have {size} (TOPOLOGY_DOMAIN_MULTIPLE / "
                    "TORCHREC_RESOLVED_POD_SIZE set): "
                    "metamat cannot build these shardings on meta with topology groups; unset "
                    "those variables, or plan these tables with another sharding type")
