"""The TorchRec module types ``shard_on_meta`` refuses, by name and before anything is built.

A refused type is refused only when a sharder for it is among the sharders in use: without
one, TorchRec leaves the module as it is and shards the collections inside it, which metamat
builds. With one, TorchRec would fail deep inside that sharder with a message that names
neither the module nor the cause ("Tensor.item() cannot be called on meta tensors" from a
DistributedDataParallel built around meta parameters, "Found no NVIDIA driver").
"""
from __future__ import annotations

from typing import Any, Dict, Sequence, Tuple

from torch import nn

from ...errors import UnsupportedError
from .mc_sharding import refuse_unsupported_kinds

__all__ = ["refuse_unsupported_modules", "refuse_unsupported_plan"]

_DDP_AT_BUILD = ("its sharded form wraps the interaction module in DistributedDataParallel "
                 "while it is built, which needs real parameters")
_ITEP = ("its sharded form builds the pruning module's lookup buffers, on the GPU by default, "
         "while it is built")
_POOL = "an object pool, not an embedding table"

# (module, class) -> why. Matched along the module's class hierarchy (subclasses too).
REFUSED: Dict[Tuple[str, str], str] = {
    ("torchrec.modules.embedding_tower", "EmbeddingTower"): _DDP_AT_BUILD,
    ("torchrec.modules.embedding_tower", "EmbeddingTowerCollection"): _DDP_AT_BUILD,
    ("torchrec.modules.itep_embedding_modules", "ITEPEmbeddingBagCollection"): _ITEP,
    ("torchrec.modules.itep_embedding_modules", "ITEPEmbeddingCollection"): _ITEP,
    ("torchrec.modules.keyed_jagged_tensor_pool", "KeyedJaggedTensorPool"): _POOL,
    ("torchrec.modules.tensor_pool", "TensorPool"): _POOL,
}
FUSED_EBC = ("torchrec.modules.fused_embedding_modules", "FusedEmbeddingBagCollection")


def _refused_as(m: nn.Module) -> Any:
    for cls in type(m).__mro__:
        why = REFUSED.get((cls.__module__, cls.__qualname__))
        if why is not None:
            return cls.__qualname__, why
    return None


def refuse_unsupported_modules(module: nn.Module, sharders: Sequence[Any]) -> None:
    """Raise ``UnsupportedError`` naming the first module of ``module`` that ``shard_on_meta``
    cannot build: a type of the table above that one of ``sharders`` (those in use) would
    shard; managed-collision modules other than MCH and HashZch. Reads types only."""
    refuse_unsupported_kinds(module)
    kinds = tuple(sh.module_type for sh in sharders)
    for name, m in module.named_modules():
        found = _refused_as(m) if kinds and isinstance(m, kinds) else None
        if found is not None:
            kind, why = found
            raise UnsupportedError(
                f"{name or '<root>'}: TorchRec's {kind} cannot be sharded on meta ({why}); "
                "metamat builds EmbeddingBagCollection, EmbeddingCollection and their "
                "feature-processed, managed-collision, PEC and quantized forms (without a "
                f"sharder for {kind}, the collections inside it are sharded)")


def _is_fused_ebc(m: nn.Module) -> bool:
    return any((c.__module__, c.__qualname__) == FUSED_EBC for c in type(m).__mro__)


def refuse_unsupported_plan(module: nn.Module, plan: Any) -> None:
    """A FusedEmbeddingBagCollection's data-parallel tables: TorchRec wraps their lookup in a
    DistributedDataParallel with the module's optimizer fused into it while it is built, an
    optimizer no state_dict holds, so it could neither be built on meta nor rebuilt later.
    Its table-, row-, column-wise tables are ordinary fused tables and pass."""
    for name, m in module.named_modules():
        if not _is_fused_ebc(m):
            continue
        params = plan.plan.get(name, {}) if plan is not None else {}
        dp = sorted(t for t, ps in params.items() if ps.sharding_type == "data_parallel")
        if dp:
            raise UnsupportedError(
                f"{name or '<root>'}: FusedEmbeddingBagCollection table {dp[0]!r} is planned "
                "data-parallel; TorchRec fuses the module's optimizer into that table's "
                "DistributedDataParallel while it is built, which cannot be done on meta. Plan "
                "it table-, row- or column-wise, or use an EmbeddingBagCollection (with the "
                "optimizer in the sharder's fused_params)")
