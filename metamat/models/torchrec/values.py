"""Values of TorchRec's own integer metadata that DMP(device=meta) leaves without data.

``shard_on_meta`` records these as it builds the model (``_metamat_value``); for a DMP built
directly on meta we recompute the few TorchRec creates in its constructors (torchrec 1.8).
"""
from __future__ import annotations

from typing import Dict, Iterator, List, Optional, Tuple

import torch
from torch import nn

__all__ = ["torchrec_known_values"]


def _permute_indices(sm: nn.Module) -> Optional[List[int]]:
    # Mirrors ShardedEmbeddingBagCollection._create_output_dist (torchrec 1.8).
    shardings = getattr(sm, "_embedding_shardings", None)
    names = getattr(sm, "_uncombined_embedding_names", None)
    if shardings is None or names is None:
        return None
    metas = []
    for sharding in shardings:
        metas.extend(sharding.embedding_shard_metadata())
    offsets = [m.shard_offsets[1] if m is not None else 0 for m in metas]
    order: Dict[str, int] = {}
    for i, name in enumerate(names):
        order.setdefault(name, i)
    return sorted(range(len(names)), key=lambda i: (order[names[i]], offsets[i]))


_PERMUTE_TENSORS = ("_offset_dim_list", "_permute", "_inv_permute", "_inv_offset_dim_list")


def _unknown(t: object) -> bool:
    """A meta tensor whose value shard_on_meta did not record (those win over ours anyway)."""
    from .meta_factories import recorded_value

    return isinstance(t, torch.Tensor) and t.is_meta and recorded_value(t) is None


def torchrec_known_values(sm: nn.Module) -> Iterator[Tuple[torch.Tensor, torch.Tensor]]:
    """Yield (meta tensor, CPU tensor with its value) for known TorchRec metadata of ``sm``
    that has no recorded value (a DMP built on meta by TorchRec itself)."""
    dpk = getattr(sm, "_dim_per_key", None)
    if _unknown(dpk):
        yield dpk, torch.tensor(sm._embedding_dims, dtype=dpk.dtype)
    op = getattr(sm, "_permute_op", None)
    # the permutation costs ~2 µs per table to recompute: only when a part of it is unknown
    if op is not None and isinstance(getattr(op, "_permute", None), torch.Tensor) \
            and any(_unknown(getattr(op, name, None)) for name in _PERMUTE_TENSORS):
        perm = _permute_indices(sm)
        if perm is not None:
            from fbgemm_gpu.permute_pooled_embedding_modules import PermutePooledEmbeddings

            fresh = PermutePooledEmbeddings(sm._uncombined_embedding_dims, perm, torch.device("cpu"))
            for name in _PERMUTE_TENSORS:
                yield getattr(op, name), getattr(fresh, name)
    fo = getattr(sm, "_features_order", None)
    fot = sm._buffers.get("_features_order_tensor") if hasattr(sm, "_buffers") else None
    if _unknown(fot) and fo is not None:
        yield fot, torch.tensor(fo, dtype=fot.dtype)
