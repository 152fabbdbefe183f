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
"""
from __future__ import annotations

from typing import Dict, List, Optional, Set, Tuple

import torch
from torch import nn

from ...errors import UnsupportedError
from ...plan import Target
from .mc_sharding import FREE_SLOT, OWN_ROW, RECORDED, ZERO, how_filled, smcc_class
from .meta_factories import recorded_value
from .state_dict import module_state_dict
from .targets import local_blocks

__all__ = ["mc_collections", "mc_targets", "check_loaded_segments", "validate_loaded",
           "refuse_inplace", "unsharded_initial_values", "check_segments", "is_mch"]

_INT64_MAX = torch.iinfo(torch.int64).max


def refuse_inplace(mcs: List[Tuple[str, nn.Module]]) -> None:
    """``inplace=True`` loads into live managed-collision state are refused: whether a
    checkpoint's row boundaries fit this plan is known only after its bytes are read, too late
    to refuse a load that writes the live model (a model on meta has nothing live)."""
    if any(not b.is_meta for _, mcc in mcs for b in mcc.buffers()):
        raise UnsupportedError(
            f"{mcs[0][0] or '<root>'}: a model with managed-collision collections is not "
            "loaded with inplace=True (the checkpoint's row boundaries are checked after the "
            "read); load it with inplace=False (the default), through shadow copies")


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


def _initial(how: str, value: Optional[torch.Tensor]):
    """The block init_fn giving TorchRec's initial value of a buffer."""
    def fill(t: torch.Tensor, offsets) -> None:
        if how == FREE_SLOT:
            t.fill_(_INT64_MAX)
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
        for table, mc in _mch_modules(mcc).items():
            for bname, buf in mc.named_buffers(recurse=False):
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
                targets.append(Target(key, key, gshape, offsets, tuple(local.shape),
                                      local.dtype, None, local, _initial(how, recorded)))
    return targets


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
            check_segments(key, table, mc, loaded[key])


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


# -- unsharded MCH modules (an MC collection not sharded by TorchRec: the modules adapter) ------
def is_mch(m: nn.Module) -> bool:
    """``m`` is exactly TorchRec's MCHManagedCollisionModule (a subclass may fill its own way)."""
    from torchrec.modules.mc_modules import MCHManagedCollisionModule

    return type(m) is MCHManagedCollisionModule


def unsharded_initial_values(m: nn.Module):
    """For an unsharded MCH module built on meta: a reset that writes TorchRec's initial
    values into its buffers (the modules adapter runs it on CPU tensors of their shapes); None
    for other modules. Its row boundaries are the constructor's default, its own rows
    (``output_segments``, which TorchRec's sharder passes and users do not, is not kept on
    meta)."""
    if not is_mch(m):
        return None
    own = ("_output_segments_tensor", "_current_iter_tensor", "_mch_slots", "_delimiter")
    if any(how_filled(n) == RECORDED and n not in own for n in m._buffers):
        return None  # a buffer this TorchRec added: named by the MissingValueError instead

    def initial_values() -> None:
        start, n = m._output_global_offset, m._zch_size
        for name, buf in m._buffers.items():
            if buf is None:
                continue
            if name == "_output_segments_tensor":  # ManagedCollisionModule's constructor
                buf.fill_(-1)
                buf[:2] = torch.tensor([start, start + n])
            elif name == "_current_iter_tensor":
                buf.zero_()
            elif name == "_mch_slots":
                buf.fill_(n - 1)
            elif name == "_delimiter":
                buf.fill_(_INT64_MAX)
            else:
                how = how_filled(name)
                _initial(how, None)(buf, (start,) if how == OWN_ROW else (0,))
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
