"""TorchRec's managed-collision (zero-collision hashing) collections, on meta and materialized.

``ManagedCollisionEmbeddingBagCollection`` / ``ManagedCollisionEmbeddingCollection`` pair a
table collection with a ``ManagedCollisionCollection``: per table, an
``MCHManagedCollisionModule`` that remaps raw ids into the table's rows. Sharded (ROW_WISE,
the only sharding TorchRec gives them), each rank keeps the remapping state of its own rows:
``_mch_sorted_raw_ids`` (int64 max = free slot), ``_mch_remapped_ids_mapping`` (each slot's
global row), one int64 array per eviction-policy metadata (counts, last access iteration),
all row-wise ShardedTensors in the state_dict, and two small replicated buffers
(``_output_segments_tensor``: the shards' row boundaries; ``_current_iter_tensor``).

* Sharding on meta: :mod:`.mc_sharding`.
* Values (:func:`mc_targets`): every buffer is a target (loadable from a checkpoint) whose
  initial value is TorchRec's, written on the device: free slots, each slot's own global row
  (``_mch_remapped_ids_mapping[i] = i``: the same on any plan), zero metadata, the segments
  and iteration TorchRec recorded while sharding.
* After a load (:func:`check_loaded_segments`, :func:`validate_loaded`): TorchRec's own
  load hook (``validate_state``: the checkpoint's row boundaries must contain this rank's,
  then the slots are sorted again) runs on the real modules; its condition is checked before
  anything is swapped in, with an error naming the table.
* Not sharded (an MC collection used as a plain module; the modules adapter): the same initial
  values as a reset (:func:`unsharded_initial_values`), the same check and re-sort after a load
  (:func:`check_segments`, ``validate_state``).
* Multi-probe ZCH (``HashZchManagedCollisionModule``) instead of MCH: each slot's id
  (``_hash_zch_identities``, -1 free), eviction metadata (-1), optional per-id counts (0), the
  bucket count (``_hash_zch_bucket``, a real CPU tensor even on meta). An id is probed within
  its bucket, so the state reshards at bucket boundaries; a load is checked for the bucket
  count (:func:`check_buckets`); no re-sort. Serving modules drop a checkpoint's eviction
  metadata (:func:`inference_dropped`).
* Every MC target is loaded through a shadow copy, ``inplace=True`` included (its checks need
  the bytes read); once real, the modules get what TorchRec's constructor skips on meta
  (:func:`finish_mc_modules`).
"""
from __future__ import annotations

from typing import Dict, List, Optional, Set, Tuple

import torch
from torch import nn

from ...errors import UnsupportedError
from ...plan import Target
from .mc_sharding import (FREE_SLOT, NO_ID, OWN_ROW, RECORDED, ZERO, how_filled, smcc_class,
                          supported_kinds)
from .meta_factories import recorded_value
from .state_dict import module_state_dict
from .targets import local_blocks

__all__ = ["mc_collections", "mc_targets", "mc_modules_of", "own_tensors", "initial_fill",
           "check_loaded_segments", "validate_loaded", "unsharded_initial_values",
           "check_segments", "check_rows", "check_buckets", "is_mch", "is_hash_zch", "finish_mc_modules",
           "mc_named_modules", "inference_dropped", "MCH_SMALL", "mch_small_value"]

_INT64_MAX = torch.iinfo(torch.int64).max
HASH_ZCH_METADATA = "_hash_zch_metadata"


def mc_collections(root: nn.Module) -> List[Tuple[str, nn.Module]]:
    """(name, ShardedManagedCollisionCollection) of every sharded MC collection of ``root``
    (not below a table collection: its ~1 module per table holds none)."""
    cls = smcc_class()
    if cls is None:
        return []
    from torchrec.distributed.embedding import ShardedEmbeddingCollection
    from torchrec.distributed.embeddingbag import ShardedEmbeddingBagCollection

    from ..modules import named_modules_pruned

    stop = (ShardedEmbeddingBagCollection, ShardedEmbeddingCollection, cls)
    return [(n, m) for n, m in named_modules_pruned(root, lambda _n, m: isinstance(m, stop))
            if type(m) is cls]


def mc_modules_of(mcc: nn.Module) -> Dict[str, nn.Module]:
    """Table -> its MC module (the declared attributes checked); other kinds refused."""
    from . import upstream

    kinds = supported_kinds()
    out = {}
    for table, mc in upstream.BOUNDARY.check_instance(mcc)._managed_collision_modules.items():
        if type(mc) not in kinds:  # a subclass may fill its own way
            raise UnsupportedError(
                f"managed-collision module {type(mc).__name__} of table {table!r} is not "
                f"supported (supported: {', '.join(k.__name__ for k in kinds)})")
        out[table] = upstream.BOUNDARY.check_instance(mc)
    return out


def own_tensors(mc: nn.Module):
    """(name, tensor) of an MC module's own buffers and parameters, each once (HashZch keeps
    its slots' ids as a frozen parameter, and its ``named_buffers`` lists its parameters too)."""
    return list({**dict(mc.named_buffers(recurse=False)),
                 **dict(mc.named_parameters(recurse=False))}.items())


def initial_fill(how: str, value: Optional[torch.Tensor]):
    """The block init_fn giving TorchRec's initial value of a buffer."""
    def fill(t: torch.Tensor, offsets) -> None:
        if how == FREE_SLOT:
            t.fill_(_INT64_MAX)
        elif how == NO_ID:
            t.fill_(-1)
        elif how == OWN_ROW:
            start = int(offsets[0]) if len(offsets) else 0
            torch.arange(start, start + t.numel(), dtype=t.dtype, out=t)
        elif how == ZERO:
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
        for table, mc in mc_modules_of(mcc).items():
            for bname, buf in own_tensors(mc):
                buffers[f"{prefix}_managed_collision_modules.{table}.{bname}"] = buf
        for key, value in module_state_dict(mcc, prefix).items():
            if not isinstance(value, torch.Tensor):
                continue
            names.add(key)
            bname = key.rsplit(".", 1)[-1]
            how = how_filled(bname)
            for local, offsets, gshape in local_blocks(value):
                if local.numel() == 0 or (not local.is_meta and not loading):
                    continue
                recorded = None
                if how == RECORDED and local.is_meta:
                    recorded = recorded_value(buffers.get(key, local))
                    if recorded is None:
                        raise UnsupportedError(
                            f"meta tensor {key} holds managed-collision state whose value "
                            "metamat cannot compute; build the model with "
                            "metamat.shard_on_meta")
                # checked after the read (check_loaded_segments): never written in place
                targets.append(Target(key, key, gshape, offsets, tuple(local.shape),
                                      local.dtype, None, local, initial_fill(how, recorded),
                                      shadowed=True))
    return targets


def check_loaded_segments(mcs: List[Tuple[str, nn.Module]],
                          loaded: Dict[str, torch.Tensor]) -> None:
    """The conditions under which loaded state means what it meant when saved, checked before
    anything is swapped in. MCH (TorchRec's ``validate_state`` condition): the checkpoint's row
    boundaries (``_output_segments_tensor``) must contain this rank's shard boundaries (a
    checkpoint of another world size whose shards do not line up cannot be resharded by
    TorchRec's MC modules). HashZch: the checkpoint's bucket count must be the module's (an id
    is probed within its bucket, ``id % buckets``: another count puts it elsewhere).
    ``loaded``: key -> the real loaded tensor."""
    for name, mcc in mcs:
        prefix = f"{name}." if name else ""
        for table, mc in mc_modules_of(mcc).items():
            key = f"{prefix}_managed_collision_modules.{table}._output_segments_tensor"
            if key in loaded:
                check_segments(key, table, mc, loaded[key])
            key = f"{prefix}_managed_collision_modules.{table}._mch_remapped_ids_mapping"
            if key in loaded:
                check_rows(key, table, mc, loaded[key])
            key = f"{prefix}_managed_collision_modules.{table}._hash_zch_bucket"
            if key in loaded:
                check_buckets(key, table, mc, loaded[key])


def check_rows(key: str, table: str, mc: nn.Module, loaded: torch.Tensor) -> None:
    """An MCH module's loaded slots remap into its own rows (each slot's row,
    ``_mch_remapped_ids_mapping``, in ``[first row, first row + rows)``), as every module
    TorchRec trains keeps them. A state sorted as one table (an unsharded model loaded from a
    sharded checkpoint) mixes the shards' slots: a rank would remap ids to other ranks' rows."""
    start, end = mc._output_global_offset, mc._output_global_offset + mc._zch_size
    outside = int(((loaded < start) | (loaded >= end)).sum())
    if outside:
        raise UnsupportedError(
            f"{key}: the checkpoint's slots of rows [{start}, {end}) of table {table!r} remap "
            f"{outside} of {loaded.numel()} ids to rows outside them: this state was sorted as "
            "one table (a model loaded from a sharded checkpoint without being sharded the "
            "same way), which TorchRec's MC modules cannot split into shards")


def check_buckets(key: str, table: str, mc: nn.Module, loaded: torch.Tensor) -> None:
    """A HashZch module's bucket count is the checkpoint's (:func:`check_loaded_segments`)."""
    saved = loaded.flatten().tolist()
    if saved != [mc._buckets]:
        raise UnsupportedError(
            f"{key}: the checkpoint's multi-probe ZCH table {table!r} has {saved} buckets, "
            f"this module {mc._buckets}: its ids would be probed in other slots (build the "
            "module with the checkpoint's total_num_buckets)")


def inference_dropped(named_modules) -> List[str]:
    """Names of the ``_hash_zch_metadata`` of inference HashZch modules (``is_inference``)
    among ``named_modules`` ((fqn, module) pairs): they keep no eviction metadata, and
    TorchRec's load hook drops the one a training checkpoint holds
    (``_reset_inference_mode_load_state_dict_pre_hook``)."""
    return [f"{n}.{HASH_ZCH_METADATA}" if n else HASH_ZCH_METADATA for n, m in named_modules
            if is_hash_zch(m) and m._is_inference and m._hash_zch_metadata is None]


def finish_mc_modules(modules) -> None:
    """What an MC module built on meta lacks once its tensors are real (the sharded path's
    graph walk fixes the device attributes already; an unsharded module's are fixed here):

    * MCH: the real device in ``_device``, where training builds its history buffers at the
      first step (left meta, they would silently stay meta); a real placeholder in
      ``_evicted_emb_indices`` (the constructor's ``torch.empty((1,))``).
    * HashZch: the real device in its and its eviction module's ``_device``; its output
      offset (``_output_global_offset_tensor``, left on the CPU on meta); the metrics logger
      its constructor skips on meta (TorchRec builds one on a real device when
      ``tb_logging_frequency`` > 0; it holds no state).
    """
    from . import upstream

    for mc in modules:
        if is_mch(mc) and not mc._mch_sorted_raw_ids.is_meta:
            upstream.BOUNDARY.check_instance(mc)
            device = mc._mch_sorted_raw_ids.device
            if mc._device.type == "meta":
                mc._device = device
            if mc._evicted_emb_indices.is_meta:
                mc._evicted_emb_indices = torch.empty(
                    mc._evicted_emb_indices.shape, dtype=mc._evicted_emb_indices.dtype,
                    device=device)
            continue
        if not is_hash_zch(mc) or mc._hash_zch_identities.is_meta:
            continue
        upstream.BOUNDARY.check_instance(mc)
        device = mc._hash_zch_identities.device
        if mc._device.type == "meta":
            mc._device = device
        ev = mc._eviction_module
        if ev is not None and upstream.BOUNDARY.check_instance(ev)._device.type == "meta":
            ev._device = device
        offset = mc._output_global_offset_tensor  # on the CPU when built on meta
        if offset is not None and offset.device != device:
            mc._output_global_offset_tensor = offset.to(device)
        # the constructor's condition (it zeroes the frequency of unnamed or inference modules)
        if mc._scalar_logger is None and mc._tb_logging_frequency > 0:
            from torchrec.modules.hash_mc_metrics import ScalarLogger

            # the constructor's own call (TorchRec 1.6 inlines it, later ones have a method)
            mc._scalar_logger = ScalarLogger(
                name=mc._name, zch_size=mc._zch_size, frequency=mc._tb_logging_frequency,
                start_bucket=mc._start_bucket,
                num_buckets_per_rank=mc._end_bucket - mc._start_bucket,
                num_reserved_slots_per_bucket=mc.get_reserved_slots_per_bucket(),
                device=device, disable_fallback=mc._disable_fallback)


def mc_named_modules(mcs: List[Tuple[str, nn.Module]]) -> List[Tuple[str, nn.Module]]:
    """(fqn, module) of every MC module of the sharded MC collections ``mcs``."""
    return [(f"{name}._managed_collision_modules.{table}" if name
             else f"_managed_collision_modules.{table}", mc)
            for name, mcc in mcs for table, mc in mc_modules_of(mcc).items()]


def validate_loaded(mcs: List[Tuple[str, nn.Module]], loaded_keys: Set[str]) -> None:
    """Run TorchRec's load hook (``validate_state``: sort the slots again) on every real MCH
    module whose state was loaded (HashZch has no such hook: its slots are where the hash put
    them)."""
    with torch.no_grad():
        for name, mcc in mcs:
            prefix = f"{name}." if name else ""
            for table, mc in mc_modules_of(mcc).items():
                if is_mch(mc) and f"{prefix}_managed_collision_modules.{table}."\
                        "_mch_sorted_raw_ids" in loaded_keys:
                    mc.validate_state()


# -- unsharded MCH modules (an MC collection not sharded by TorchRec: the modules adapter) ------
def is_mch(m: nn.Module) -> bool:
    """``m`` is exactly TorchRec's MCHManagedCollisionModule (a subclass may fill its own way)."""
    from torchrec.modules.mc_modules import MCHManagedCollisionModule

    return type(m) is MCHManagedCollisionModule


def is_hash_zch(m: nn.Module) -> bool:
    """``m`` is exactly TorchRec's HashZchManagedCollisionModule (multi-probe ZCH)."""
    kinds = supported_kinds()
    return len(kinds) > 1 and type(m) is kinds[1]


#: MCH buffers whose value TorchRec's constructor computes from the rows and row boundaries
MCH_SMALL = ("_output_segments_tensor", "_current_iter_tensor", "_mch_slots", "_delimiter")


def mch_small_value(name: str, rows: int, segments: List[int]) -> List[int]:
    """TorchRec's constructor value of MCH buffer ``name`` (one of :data:`MCH_SMALL`) for a
    module of ``rows`` rows whose row boundaries are ``segments`` (ManagedCollisionModule pads
    them with -1 to 1025)."""
    if name == "_output_segments_tensor":
        return segments + [-1] * (1025 - len(segments))
    return {"_current_iter_tensor": [0], "_mch_slots": [rows - 1],
            "_delimiter": [_INT64_MAX]}[name]


def unsharded_initial_values(m: nn.Module):
    """For an unsharded MCH or HashZch module built on meta: a reset that writes TorchRec's
    initial values into its buffers (the modules adapter runs it on CPU tensors of their
    shapes); None for other modules. An MCH module's row boundaries are the constructor's
    default, its own rows (``output_segments``, which TorchRec's sharder passes and users do
    not, is not kept on meta)."""
    if is_hash_zch(m):
        return _hash_zch_initial_values(m)
    if not is_mch(m):
        return None
    if any(how_filled(n) == RECORDED and n not in MCH_SMALL for n in m._buffers):
        return None  # a buffer this TorchRec added: named by the MissingValueError instead

    def initial_values() -> None:
        start, n = m._output_global_offset, m._zch_size
        for name, buf in m._buffers.items():
            if buf is None:
                continue
            if name in MCH_SMALL:
                buf.copy_(torch.tensor(mch_small_value(name, n, [start, start + n]),
                                       dtype=buf.dtype).reshape(buf.shape))
            else:
                how = how_filled(name)
                initial_fill(how, None)(buf, (start,) if how == OWN_ROW else (0,))
    return initial_values


def _hash_zch_initial_values(m: nn.Module):
    """A HashZch module's tensors as fbgemm's ``create_zch_buffer`` and the constructor leave
    them (empty slots, no eviction time, zero runtime metadata); None if it holds one this
    code does not know (named by the MissingValueError instead)."""
    tensors = {**m._buffers, **m._parameters}
    if any(t is not None and t.is_meta and how_filled(n) == RECORDED
           for n, t in tensors.items()):
        return None

    def initial_values() -> None:
        for name, t in {**m._buffers, **m._parameters}.items():
            if t is not None and how_filled(name) != RECORDED:
                initial_fill(how_filled(name), None)(t.data, (0,))
    return initial_values


def check_segments(key: str, table: str, mc: nn.Module, loaded: torch.Tensor) -> None:
    """TorchRec's ``validate_state`` condition: the loaded row boundaries contain this
    module's rows (a named error before anything is swapped in; a checkpoint of another world
    size whose shards do not line up cannot be resharded by TorchRec's MC modules)."""
    seg = {int(v) for v in loaded.tolist() if v >= 0}
    start = mc._output_global_offset
    end = start + mc._zch_size
    if start not in seg or end not in seg:
        raise UnsupportedError(
            f"{key}: the checkpoint's managed-collision rows of table {table!r} are split at "
            f"{sorted(seg)}; the rows [{start}, {end}) of this module are not a union of those "
            "shards, which TorchRec's MC modules cannot reshard")
