"""TorchRec's managed-collision (zero-collision hashing) collections, on meta and materialized.

``ManagedCollisionEmbeddingBagCollection`` / ``ManagedCollisionEmbeddingCollection`` pair a
table collection with a ``ManagedCollisionCollection``: per table, an
``MCHManagedCollisionModule`` that remaps raw ids into the table's rows. Sharded (ROW_WISE,
the only sharding TorchRec gives them), each rank keeps the remapping state of its own rows:
``_mch_sorted_raw_ids`` (int64 max = free slot), ``_mch_remapped_ids_mapping`` (each slot's
global row), one int64 array per eviction-policy metadata (counts, last access iteration),
all row-wise ShardedTensors in the state_dict, and two small replicated buffers
(``_output_segments_tensor``: the shards' row boundaries; ``_current_iter_tensor``).

* Sharding on meta (:func:`mc_sharding_on_meta`): TorchRec's sharder gathers every rank's
  zch size into tensors on the DMP's device and reads them back (``.tolist()``), which fails
  on meta. While ``shard_on_meta`` builds the model, that exchange runs on a device the
  process group can carry (the CPU for gloo, this rank's GPU for NCCL); the rebuilt MC
  modules stay on meta.
* Values (:func:`mc_targets`): every buffer is a target (loadable from a checkpoint) whose
  initial value is TorchRec's, written on the device: free slots, each slot's own global row
  (``_mch_remapped_ids_mapping[i] = i``: the same on any plan), zero metadata, the segments
  and iteration TorchRec recorded while sharding.
* After a load (:func:`check_loaded_segments`, :func:`validate_loaded`): TorchRec's own
  load hook (``validate_state``: the checkpoint's row boundaries must contain this rank's,
  then the slots are sorted again) runs on the real modules; its condition is checked before
  anything is swapped in, with an error naming the table.
"""
from __future__ import annotations

import contextlib
import functools
from typing import Any, Dict, Iterator, List, Optional, Set, Tuple

import torch
from torch import nn

from ...errors import UnsupportedError
from ...plan import Target
from .meta_factories import recorded_value
from .state_dict import module_state_dict
from .targets import local_blocks

__all__ = ["mc_sharding_on_meta", "mc_collections", "mc_targets", "check_loaded_segments",
           "validate_loaded", "is_mc_container", "is_mc_collection", "refuse_unsupported_kinds",
           "refuse_inplace"]

_INT64_MAX = torch.iinfo(torch.int64).max
# buffer name -> how TorchRec's constructor fills it (MCHManagedCollisionModule._init_buffers)
_FREE_SLOT, _OWN_ROW, _ZERO, _RECORDED = "free slot", "own row", "zero", "recorded"


def _smcc_class():
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
    from .shard import this_ranks_gpu

    return this_ranks_gpu(gpu if gpu is not None else torch.device("cuda"))


def _rebuild_on(mc: nn.Module, meta: torch.device, output_id_range, output_segments,
                device: Optional[torch.device] = None) -> nn.Module:
    """``mc.rebuild_with_output_id_range`` on ``meta``, whatever device TorchRec passes. The
    row-sized buffers keep no recorded CPU copy of their value (MetaFactories records small
    meta tensors, up to 1M elements: 8 MB per buffer and table); ``mc_targets`` writes them."""
    new = type(mc).rebuild_with_output_id_range(mc, output_id_range, output_segments,
                                                 device=meta)
    for name, buf in new.named_buffers(recurse=False):
        if _how(name) in (_FREE_SLOT, _OWN_ROW, _ZERO) and name != "_mch_slots":
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
    cls = _smcc_class()
    if cls is None:
        yield
        return
    from . import upstream

    real = cls._create_managed_collision_modules
    with upstream.patch(upstream.SMCC, "_create_managed_collision_modules",
                        _create_on_meta(real, gpu)):
        yield


def refuse_unsupported_kinds(module: nn.Module) -> None:
    """Managed-collision modules other than MCH (HashZch, subclasses), named before anything
    is built."""
    try:
        from torchrec.modules.mc_modules import (ManagedCollisionCollection,
                                                 MCHManagedCollisionModule)
    except ImportError:  # a TorchRec without managed collision
        return
    for name, m in module.named_modules():
        if not isinstance(m, ManagedCollisionCollection):
            continue
        for table, mc in m._managed_collision_modules.items():
            if type(mc) is not MCHManagedCollisionModule:
                raise UnsupportedError(
                    f"{name or '<root>'}: managed-collision module {type(mc).__name__} of "
                    f"table {table!r} is not supported (supported: MCHManagedCollisionModule)")


def refuse_inplace(mcs: List[Tuple[str, nn.Module]]) -> None:
    """``inplace=True`` loads cannot hold managed-collision state: whether a checkpoint's row
    boundaries fit this plan is known only after its bytes are read, too late to refuse a
    load that writes the live model."""
    if mcs:
        raise UnsupportedError(
            f"{mcs[0][0] or '<root>'}: a model with managed-collision collections is not "
            "loaded with inplace=True (the checkpoint's row boundaries are checked after the "
            "read); load it with inplace=False (the default), through shadow copies")


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
    cls = _smcc_class()
    return cls is not None and type(m) is cls


def mc_collections(root: nn.Module) -> List[Tuple[str, nn.Module]]:
    """(name, ShardedManagedCollisionCollection) of every sharded MC collection of ``root``
    (not below a table collection: its ~1 module per table holds none)."""
    cls = _smcc_class()
    if cls is None:
        return []
    from torchrec.distributed.embedding import ShardedEmbeddingCollection
    from torchrec.distributed.embeddingbag import ShardedEmbeddingBagCollection

    from ..modules import named_modules_pruned

    stop = (ShardedEmbeddingBagCollection, ShardedEmbeddingCollection, cls)
    return [(n, m) for n, m in named_modules_pruned(root, lambda _n, m: isinstance(m, stop))
            if type(m) is cls]


def _mch_modules(mcc: nn.Module) -> Dict[str, nn.Module]:
    """Table -> its MCH module (the declared attributes checked); other kinds refused."""
    from torchrec.modules.mc_modules import MCHManagedCollisionModule

    from . import upstream

    out = {}
    for table, mc in upstream.BOUNDARY.check_instance(mcc)._managed_collision_modules.items():
        if type(mc) is not MCHManagedCollisionModule:  # a subclass may fill its own way
            raise UnsupportedError(
                f"managed-collision module {type(mc).__name__} of table {table!r} is not "
                "supported (supported: MCHManagedCollisionModule)")
        out[table] = upstream.BOUNDARY.check_instance(mc)
    return out


def _how(buffer: str) -> str:
    if buffer == "_mch_sorted_raw_ids":
        return _FREE_SLOT
    if buffer == "_mch_remapped_ids_mapping":
        return _OWN_ROW
    if buffer.startswith("_mch_"):
        return _ZERO  # eviction metadata (counts, last access iteration)
    return _RECORDED


def _initial(how: str, value: Optional[torch.Tensor]):
    """The block init_fn giving TorchRec's initial value of a buffer."""
    def fill(t: torch.Tensor, offsets) -> None:
        if how == _FREE_SLOT:
            t.fill_(_INT64_MAX)
        elif how == _OWN_ROW:
            start = int(offsets[0]) if len(offsets) else 0
            torch.arange(start, start + t.numel(), dtype=t.dtype, out=t)
        elif how == _ZERO:
            t.zero_()
        else:
            t.copy_(value)
    fill.metamat_block = True
    fill.metamat_unseeded = True  # no randomness: the RNGs are left alone
    return fill


def mc_targets(mcs: List[Tuple[str, nn.Module]], loading: bool,
               names: Set[str]) -> List[Target]:
    """A target for every local block of every MC collection's state_dict tensor (module
    docstring), meta ones, and real ones too when ``loading``. ``names`` receives every key."""
    targets: List[Target] = []
    for name, mcc in mcs:
        prefix = f"{name}." if name else ""
        buffers = {}  # the module's own tensors: state_dict gives detached ones
        for table, mc in _mch_modules(mcc).items():
            for bname, buf in mc.named_buffers(recurse=False):
                buffers[f"{prefix}_managed_collision_modules.{table}.{bname}"] = buf
        for key, value in module_state_dict(mcc, prefix).items():
            if not isinstance(value, torch.Tensor):
                continue
            names.add(key)
            bname = key.rsplit(".", 1)[-1]
            how = _how(bname)
            for local, offsets, gshape in local_blocks(value):
                if local.numel() == 0 or (not local.is_meta and not loading):
                    continue
                recorded = None
                if how == _RECORDED and local.is_meta:
                    recorded = recorded_value(buffers.get(key, local))
                    if recorded is None:
                        raise UnsupportedError(
                            f"meta tensor {key} holds managed-collision state whose value "
                            "metamat cannot compute; build the model with "
                            "metamat.shard_on_meta")
                targets.append(Target(key, key, gshape, offsets, tuple(local.shape),
                                      local.dtype, None, local, _initial(how, recorded)))
    return targets


def _segments(mc: nn.Module, loaded: Dict[str, torch.Tensor], key: str) -> List[int]:
    t = loaded.get(key)
    return [] if t is None else [int(v) for v in t.tolist() if v >= 0]


def check_loaded_segments(mcs: List[Tuple[str, nn.Module]],
                          loaded: Dict[str, torch.Tensor]) -> None:
    """TorchRec's ``validate_state`` condition on loaded state, before anything is swapped in:
    the checkpoint's row boundaries (``_output_segments_tensor``) must contain this rank's
    shard boundaries (a checkpoint of another world size whose shards do not line up cannot
    be resharded by TorchRec's MC modules). ``loaded``: key -> the real loaded tensor."""
    for name, mcc in mcs:
        prefix = f"{name}." if name else ""
        for table, mc in _mch_modules(mcc).items():
            key = f"{prefix}_managed_collision_modules.{table}._output_segments_tensor"
            if key not in loaded:
                continue
            seg = set(_segments(mc, loaded, key))
            start = mc._output_global_offset
            end = start + mc._zch_size
            if start not in seg or end not in seg:
                raise UnsupportedError(
                    f"{key}: the checkpoint's managed-collision rows of table {table!r} are "
                    f"split at {sorted(seg)}; this rank's rows [{start}, {end}) are not a "
                    "union of those shards, which TorchRec's MC modules cannot reshard")


def validate_loaded(mcs: List[Tuple[str, nn.Module]], loaded_keys: Set[str]) -> None:
    """Run TorchRec's load hook (``validate_state``: sort the slots again) on every real MC
    module whose state was loaded."""
    with torch.no_grad():
        for name, mcc in mcs:
            prefix = f"{name}." if name else ""
            for table, mc in _mch_modules(mcc).items():
                if f"{prefix}_managed_collision_modules.{table}._mch_sorted_raw_ids" \
                        in loaded_keys:
                    mc.validate_state()
