"""Values of TorchRec's own integer metadata that DMP(device=meta) leaves without data.

``shard_on_meta`` records these as it builds the model (``_metamat_value``); for a DMP built
directly on meta we recompute the few TorchRec creates in its constructors (checked on torchrec
1.6.1 to 1.9.2; the names read: :mod:`.upstream`).
"""
from __future__ import annotations

from typing import Dict, Iterator, List, Optional, Set, Tuple

import torch
from torch import nn

from ...plan import storage_key
from . import upstream
from .meta_factories import recorded_value
from .sharded import wrappers

__all__ = ["torchrec_known_values", "known_values", "put_value", "value_unknown",
           "own_tensors"]


def _permute_indices(md: "upstream.CollectionMetadata") -> Optional[List[int]]:
    # Mirrors ShardedEmbeddingBagCollection._create_output_dist (torchrec 1.6.1 to 1.9.2).
    names = md.uncombined_names()
    metas = []
    for sharding in upstream.shardings(md.sm):
        metas.extend(sharding.embedding_shard_metadata())
    offsets = [m.shard_offsets[1] if m is not None else 0 for m in metas]
    order: Dict[str, int] = {}
    for i, name in enumerate(names):
        order.setdefault(name, i)
    return sorted(range(len(names)), key=lambda i: (order[names[i]], offsets[i]))


_PERMUTE_TENSORS = upstream.PERMUTE_TENSORS  # fbgemm PermutePooledEmbeddings' tensors


def _unknown(t: object) -> bool:
    """A meta tensor whose value shard_on_meta did not record (those win over ours anyway)."""
    from .meta_factories import recorded_value

    return isinstance(t, torch.Tensor) and t.is_meta and recorded_value(t) is None


def torchrec_known_values(sm: nn.Module) -> Iterator[Tuple[torch.Tensor, torch.Tensor]]:
    """Yield (meta tensor, CPU tensor with its value) for known TorchRec metadata of ``sm``
    that has no recorded value (a DMP built on meta by TorchRec itself)."""
    md = upstream.CollectionMetadata(sm)
    dpk = md.dim_per_key()  # None: an EmbeddingCollection has none (nor a permutation)
    if _unknown(dpk):
        yield dpk, torch.tensor(md.embedding_dims(), dtype=dpk.dtype)
    op = md.permute_op()
    # the permutation costs ~2 µs per table to recompute: only when a part of it is unknown
    if op is not None and isinstance(upstream.permute_tensor(op, "_permute"), torch.Tensor) \
            and any(_unknown(upstream.permute_tensor(op, name)) for name in _PERMUTE_TENSORS):
        perm = _permute_indices(md)
        from fbgemm_gpu.permute_pooled_embedding_modules import PermutePooledEmbeddings

        fresh = PermutePooledEmbeddings(md.uncombined_dims(), perm, torch.device("cpu"))
        for name in _PERMUTE_TENSORS:
            yield upstream.permute_tensor(op, name), upstream.permute_tensor(fresh, name)
    fot = md.features_order_tensor()  # optional: registered at the first forward
    if _unknown(fot):
        yield fot, torch.tensor(md.features_order(), dtype=fot.dtype)


def put_value(values: Dict[int, torch.Tensor], old: torch.Tensor, new: torch.Tensor) -> None:
    """Record ``new`` as the content of ``old``'s storage when ``old`` is the whole storage.
    Values stay where they are (the CPU, mostly): the fill copies them into the new storage,
    so planning allocates nothing on a GPU."""
    if not old.is_meta or old.numel() == 0:
        return
    if old.storage_offset() != 0 or not old.is_contiguous() or \
            old.untyped_storage().nbytes() != old.numel() * old.element_size():
        return  # a view into a bigger storage: not plain metadata
    values[storage_key(old)] = new


def known_values(meta: List[torch.Tensor], sharded: List[Tuple[str, nn.Module]],
                  device: torch.device, skip: Set[int] = frozenset()) -> Dict[int, torch.Tensor]:
    """storage key -> real tensor with the storage's content, for metadata we can produce.
    ``meta``: the meta tensors whose recorded values count; only a contiguous tensor at
    offset 0 of its storage can give one (the caller may pass just those). ``skip``: ids of
    wrappers whose TBE metadata the caller gives (the CUDA layout's)."""
    from .tbe import rebuild_tbe_metadata

    values: Dict[int, torch.Tensor] = {}

    def put(old: torch.Tensor, new: torch.Tensor) -> None:
        put_value(values, old, new)

    for _, sm in sharded:
        for w in wrappers(sm):
            if id(w) in skip:
                continue
            own = own_tensors(upstream.kernel_module(w))
            if not any(value_unknown(t) for t in own.values()):
                continue  # shard_on_meta recorded every value (~9 µs per table saved)
            for name, new in rebuild_tbe_metadata(w, device).items():
                put(own[name], new)
        for old, new in torchrec_known_values(sm):
            put(old, new)
    for t in meta:
        v = recorded_value(t)
        if v is not None:
            put(t, v)
    return values


def value_unknown(t: torch.Tensor) -> bool:
    """A non-empty integer meta tensor with no recorded value: TBE metadata (offsets,
    placements, counters) only fbgemm's constructor can tell. Floating ones are tables,
    optimizer state or zeros; they need no rebuild."""
    return t.is_meta and t.numel() > 0 and not t.is_floating_point() \
        and recorded_value(t) is None


def own_tensors(m: nn.Module) -> Dict[str, torch.Tensor]:
    out = {k: v for k, v in m.__dict__.items() if isinstance(v, torch.Tensor)}
    out.update({k: v for k, v in m._parameters.items() if v is not None})
    out.update({k: v for k, v in m._buffers.items() if v is not None})
    return out
