"""TorchRec's managed-collision collections, sharded on meta (:mod:`.managed_collision` says
what they hold and how they are materialized).

TorchRec's sharder gathers every rank's zch size into tensors on the DMP's device and reads
them back (``.tolist()``), which fails on meta. While ``shard_on_meta`` builds the model
(:func:`mc_sharding_on_meta`), that exchange runs on a device the process group can carry (the
CPU for gloo, the GPU for NCCL); the rebuilt MC modules stay on meta. Kinds other than MCH and
HashZch (exactly those classes) are refused before anything is built
(:func:`refuse_unsupported_kinds`).
"""
from __future__ import annotations

import contextlib
import functools
from typing import Any, Iterator, Optional

import torch
from torch import nn

from ...errors import UnsupportedError
from ..device import this_ranks_gpu

__all__ = ["mc_sharding_on_meta", "refuse_unsupported_kinds", "is_mc_container",
           "is_mc_collection", "is_quant_mc_collection", "sharded_quant_mc_classes",
           "smcc_class", "how_filled", "supported_kinds", "FREE_SLOT", "OWN_ROW", "NO_ID", "ZERO",
           "RECORDED"]

# buffer name -> how TorchRec's constructor fills it (MCHManagedCollisionModule._init_buffers;
# HashZchManagedCollisionModule: fbgemm's create_zch_buffer and its runtime metadata)
FREE_SLOT, OWN_ROW, NO_ID, ZERO, RECORDED = "free slot", "own row", "no id", "zero", "recorded"


def smcc_class():
    """TorchRec's ShardedManagedCollisionCollection, or None (a TorchRec without it)."""
    try:
        from torchrec.distributed.mc_modules import ShardedManagedCollisionCollection
    except ImportError:  # a TorchRec without managed collision
        return None
    return ShardedManagedCollisionCollection


def _exchange_device(env: Any, gpu: Optional[torch.device]) -> torch.device:
    """Where the zch sizes can be all-gathered: the CPU on gloo, else ``gpu`` (the GPU the
    tables are laid out for) or this rank's GPU."""
    import torch.distributed as dist

    pg = getattr(env, "sharding_pg", None) or getattr(env, "process_group", None)
    if pg is None or not dist.is_initialized():
        return torch.device("cpu")
    backend = str(dist.get_backend(pg))
    if "gloo" in backend or not torch.cuda.is_available():
        return torch.device("cpu")
    # the GPU the tables are laid out for; else this rank's (NCCL needs one per rank)
    return gpu if gpu is not None else this_ranks_gpu(torch.device("cuda"))


def _rebuild_on(mc: nn.Module, meta: torch.device, output_id_range, output_segments,
                device: Optional[torch.device] = None) -> nn.Module:
    """``mc.rebuild_with_output_id_range`` on ``meta``, whatever device TorchRec passes. The
    row-sized buffers keep no recorded CPU copy of their value (MetaFactories records small
    meta tensors, up to 1M elements: 8 MB per buffer and table); ``mc_targets`` writes them."""
    new = type(mc).rebuild_with_output_id_range(mc, output_id_range, output_segments,
                                                 device=meta)
    for name, buf in [*new.named_buffers(recurse=False), *new.named_parameters(recurse=False)]:
        if how_filled(name) in (FREE_SLOT, OWN_ROW, NO_ID, ZERO) and name != "_mch_slots":
            buf.__dict__.pop("_metamat_value", None)
    return new


def _create_on_meta(real, gpu: Optional[torch.device]):
    def create(self, module):
        meta = self._device  # set by the constructor before it calls this
        if not isinstance(meta, torch.device) or meta.type != "meta":
            return real(self, module)
        exchange = _exchange_device(self._env, gpu)
        mcs = list(module._managed_collision_modules.values())
        try:
            for mc in mcs:  # an instance attribute, removed below: the user's module untouched
                mc.__dict__["rebuild_with_output_id_range"] = functools.partial(
                    _rebuild_on, mc, meta)
            self._device = exchange
            return real(self, module)
        finally:
            self._device = meta
            for mc in mcs:
                mc.__dict__.pop("rebuild_with_output_id_range", None)
    create.__wrapped__ = real
    return create


@contextlib.contextmanager
def mc_sharding_on_meta(gpu: Optional[torch.device] = None) -> Iterator[None]:
    """While active, TorchRec's managed-collision sharder works on meta (module docstring).
    ``gpu``: the GPU the tables are laid out for, if any."""
    cls = smcc_class()
    if cls is None:
        yield
        return
    from . import upstream

    real = cls._create_managed_collision_modules
    with upstream.patch(upstream.SMCC, "_create_managed_collision_modules",
                        _create_on_meta(real, gpu)):
        yield


@functools.lru_cache(maxsize=None)
def supported_kinds() -> tuple:
    """The managed-collision module classes metamat materializes: exactly these (a subclass
    may fill its own way)."""
    from torchrec.modules.mc_modules import MCHManagedCollisionModule

    try:
        from torchrec.modules.hash_mc_modules import HashZchManagedCollisionModule
    except ImportError:  # a TorchRec without multi-probe ZCH
        return (MCHManagedCollisionModule,)
    return (MCHManagedCollisionModule, HashZchManagedCollisionModule)


def refuse_unsupported_kinds(module: nn.Module) -> None:
    """Managed-collision modules other than MCH and HashZch (subclasses, others), named before
    anything is built."""
    try:
        from torchrec.modules.mc_modules import ManagedCollisionCollection
    except ImportError:  # a TorchRec without managed collision
        return
    kinds = supported_kinds()
    for name, m in module.named_modules():
        if not isinstance(m, ManagedCollisionCollection):
            continue
        for table, mc in m._managed_collision_modules.items():
            if type(mc) not in kinds:
                raise UnsupportedError(
                    f"{name or '<root>'}: managed-collision module {type(mc).__name__} of "
                    f"table {table!r} is not supported (supported: "
                    f"{', '.join(k.__name__ for k in kinds)})")


def how_filled(buffer: str) -> str:
    if buffer == "_mch_sorted_raw_ids":
        return FREE_SLOT
    if buffer == "_mch_remapped_ids_mapping":
        return OWN_ROW
    if buffer.startswith("_mch_"):
        return ZERO  # eviction metadata (counts, last access iteration)
    if buffer in ("_hash_zch_identities", "_hash_zch_metadata"):
        return NO_ID  # fbgemm's create_zch_buffer: -1, an empty slot / no eviction time
    if buffer == "_hash_zch_runtime_meta":
        return ZERO  # id frequencies or custom per-id metadata
    return RECORDED


def is_mc_container(m: nn.Module) -> bool:
    """TorchRec's sharded MC-EBC/MC-EC: a table collection and an MC collection, each found
    on its own."""
    try:
        from torchrec.distributed.mc_embedding_modules import (
            BaseShardedManagedCollisionEmbeddingCollection as Base)
    except ImportError:
        return False
    return isinstance(m, Base)


def is_mc_collection(m: nn.Module) -> bool:
    """TorchRec's ShardedManagedCollisionCollection (training; not its quantized subclass)."""
    cls = smcc_class()
    return cls is not None and type(m) is cls


def is_quant_mc_collection(m: nn.Module) -> bool:
    """TorchRec's ShardedQuantManagedCollisionCollection (inference sharding): the MC state of
    a sharded quantized MC collection, found with it (``quant_mc``)."""
    try:
        from torchrec.distributed.mc_modules import ShardedQuantManagedCollisionCollection
    except ImportError:  # a TorchRec without it
        return False
    return type(m) is ShardedQuantManagedCollisionCollection


def sharded_quant_mc_classes() -> tuple:
    """TorchRec's inference-sharded quantized MC collections (EBC, EC); () without them."""
    try:
        from torchrec.distributed.quant_embedding import (
            ShardedQuantManagedCollisionEmbeddingCollection as SQMCEC)
        from torchrec.distributed.quant_embeddingbag import (
            ShardedQuantManagedCollisionEmbeddingBagCollection as SQMCEBC)
    except ImportError:  # pragma: no cover - a TorchRec without them
        return ()
    return SQMCEBC, SQMCEC
