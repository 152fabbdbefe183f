"""TorchRec's inference sharding of quantized managed-collision collections: each rank's MC
modules, found and given their values (the quantized adapter, :mod:`.quant_part`, plans,
fills and registers them).

``shard_quant_model`` with ``QuantManagedCollisionEmbedding[Bag]CollectionSharder`` and
``InferManagedCollisionCollectionSharder`` (row-wise, the only sharding TorchRec gives them)
turns a ``QuantManagedCollisionEmbedding[Bag]Collection`` into a sharded one holding two kinds
of MC modules:

* the global ones (``<m>._managed_collision_collection._managed_collision_modules.<table>``):
  the unsharded collection's own, which hash the raw ids before the input dist. Their state is
  the whole table's; the modules adapter fills them as it fills an unsharded collection's
  (:func:`.quant.quant_mc_collections`);
* one per rank and table (``<m>._mcebc_lookup.<sharding>.<rank>._mcc_remapper.zchs.<table>``;
  ``_mcec_lookup`` for an EC), which TorchRec rebuilds for the rank's rows ``[offset, offset +
  rows)`` with fresh state, and which remap the ids in the forward. Each is filled here as the
  training module of the same rows is: from a checkpoint, its rows of the training state (the
  checkpoint's global key, read as a row block, as a training rank reads it: a training
  checkpoint of any world size whose shards line up), checked and sorted again as TorchRec's
  load hook does; else TorchRec's initial values for those rows, the same on any plan.
"""
from __future__ import annotations

import dataclasses
from typing import Dict, List, Set, Tuple

import torch
from torch import nn

from ...errors import UnsupportedError
from ...plan import Target
from .managed_collision import (MCH_SMALL, check_buckets, check_rows, check_segments,
                                initial_fill, is_mch, mc_modules_of, mch_small_value,
                                own_tensors)
from .mc_sharding import RECORDED, how_filled, sharded_quant_mc_classes

__all__ = ["RankMC", "RankTarget", "rank_mc_modules", "rank_mc_targets", "match_own_state",
           "check_loaded", "validate_loaded"]

@dataclasses.dataclass
class RankMC:
    """One rank's MC module of one table of a sharded quantized MC collection.

    ``fqn``: its name in the model's state_dict; ``key``: the prefix of its tensors' checkpoint
    names (the global module's: ``<m>._managed_collision_collection._managed_collision_modules.
    <table>.``); ``offset``/``rows``: its rows of the table; ``segments``: every rank's first
    row and the table's end (the row boundaries TorchRec gives it)."""

    fqn: str
    key: str
    table: str
    module: nn.Module
    global_module: nn.Module
    offset: int
    rows: int
    segments: List[int]


def rank_mc_modules(modules: List[Tuple[str, nn.Module]]) -> List[RankMC]:
    """Every rank's MC modules of the sharded quantized MC collections among ``modules``
    ((name, module) of quantized collections)."""
    kinds = sharded_quant_mc_classes()
    if not kinds:
        return []
    from . import upstream

    out: List[RankMC] = []
    for name, m in modules:
        if not isinstance(m, kinds):
            continue
        prefix = f"{name}." if name else ""
        smcc = upstream.BOUNDARY.check_instance(m._managed_collision_collection)
        global_modules = mc_modules_of(smcc)  # the declared attributes checked, kinds refused
        names = {id(sub): n for n, sub in m.named_modules()}
        per_rank, metadata = smcc._managed_collision_modules_per_rank, \
            smcc._shard_metadata_per_rank
        for rank, (mcs, md) in enumerate(zip(per_rank, metadata)):
            for table, mc in mcs.items():
                g = global_modules[table]
                if type(mc) is not type(g) or id(mc) not in names:
                    raise UnsupportedError(
                        f"{name or '<root>'}: the MC module of table {table!r} on rank {rank} "
                        f"({type(mc).__name__}) is not one metamat knows how to fill")
                upstream.BOUNDARY.check_instance(mc)
                starts = sorted({int(d[table][0]) for d in metadata if table in d})
                total = max(int(d[table][0]) + int(d[table][1]) for d in metadata
                            if table in d)
                offset, rows = (int(v) for v in md[table])
                out.append(RankMC(prefix + names[id(mc)],
                                  f"{prefix}_managed_collision_collection."
                                  f"_managed_collision_modules.{table}.",
                                  table, mc, g, offset, rows, starts + [total]))
    return out


def _recorded_initial(name: str, r: RankMC):
    """The block init_fn of a small MCH buffer, TorchRec's constructor value for the rank's
    rows (None: one this code does not know)."""
    if name not in MCH_SMALL:
        return None

    def fill(t: torch.Tensor, _offsets) -> None:
        t.copy_(torch.tensor(mch_small_value(name, r.rows, r.segments),
                             dtype=t.dtype).reshape(t.shape))
    fill.metamat_block = True
    fill.metamat_unseeded = True
    return fill


RankTarget = Tuple[RankMC, str, Target]  # the module, the tensor's attribute, its target


def rank_mc_targets(ranks: List[RankMC], loading: bool) -> List[RankTarget]:
    """A target per tensor of every rank's MC module: its meta tensors, and with ``loading``
    its real persistent ones too (a live model refreshed). Persistent ones go by their
    checkpoint name, row-sized ones as a row block of the global tensor; all are loaded through
    a shadow copy (checked after the read)."""
    out: List[RankTarget] = []
    for r in ranks:
        persistent = set(r.module.state_dict(keep_vars=True))
        for bname, t in own_tensors(r.module):
            if t is None or t.numel() == 0:
                continue
            kept = bname in persistent
            if not t.is_meta and not (loading and kept):
                continue
            how = how_filled(bname)
            if how != RECORDED and bname != "_mch_slots":  # a row per slot: a row block
                glob = getattr(r.global_module, bname, None)
                if t.shape[0] != r.rows or glob is None or glob.shape[1:] != t.shape[1:]:
                    raise UnsupportedError(
                        f"{r.fqn}.{bname}: {tuple(t.shape)} is not {r.rows} rows of the "
                        f"table's {tuple(getattr(glob, 'shape', ()))}")
                gshape = tuple(glob.shape)
                offsets = (r.offset,) + (0,) * (t.dim() - 1)
                init = initial_fill(how, None)
            else:
                gshape, offsets = tuple(t.shape), (0,) * t.dim()
                init = _recorded_initial(bname, r)
                if init is None and t.is_meta:
                    raise UnsupportedError(
                        f"meta tensor {r.fqn}.{bname} holds managed-collision state whose "
                        "value metamat cannot compute")
            fqn = r.key + bname if kept else f"{r.fqn}.{bname}"
            out.append((r, bname, Target(fqn, fqn, gshape, offsets, tuple(t.shape), t.dtype,
                                         None, t, init, persistent=kept, shadowed=True)))
    return out


def match_own_state(items: List[RankTarget], keys, prefix: str,
                    loaded_tables: Set[str]) -> Tuple[Dict[str, str], Set[str]]:
    """A sharded quantized model's own checkpoint (its ``state_dict``, saved by DCP) holds each
    rank's MC modules under their own names, whole, and each rank's view of its tables
    (``<m>._mcebc_lookup.<s>.<rank>._ebc_lookup.<table>.weight``, ``_mcec_lookup`` /
    ``_ec_lookup`` for an EC), the same bytes as the tables' ShardedTensor blocks. A rank
    target whose own name ``keys`` holds reads it (instead of its block of the global tensor:
    the target is renamed); the table views of the tables the checkpoint gives
    (``loaded_tables``: table names) are taken as read. Returns (target name -> checkpoint
    key, checkpoint keys taken)."""
    names: Dict[str, str] = {}
    used: Set[str] = set()
    lookups = set()
    for r, bname, tg in items:
        lookups.add(r.fqn.split("._mcc_remapper.")[0])
        own = f"{r.fqn}.{bname}"
        if not tg.persistent or prefix + own not in keys:
            continue
        tg.fqn = tg.key = own
        tg.global_shape, tg.offsets = tg.local_shape, (0,) * len(tg.local_shape)
        names[own] = prefix + own
        used.add(prefix + own)
    for lookup in lookups:
        for view in ("_ebc_lookup", "_ec_lookup"):
            head = f"{prefix}{lookup}.{view}."
            used |= {k for k in keys if k.startswith(head)
                     and k[len(head):].split(".")[0] in loaded_tables}
    return names, used


def check_loaded(items: List[RankTarget], loaded: Set[int]) -> None:
    """The loaded state's conditions (:func:`.managed_collision.check_loaded_segments`: MCH
    row boundaries and rows, HashZch bucket count), checked before anything is swapped in."""
    for r, bname, tg in items:
        if id(tg) not in loaded:
            continue
        if bname == "_output_segments_tensor":
            check_segments(tg.fqn, r.table, r.module, tg.tensor)
        elif bname == "_mch_remapped_ids_mapping":
            check_rows(tg.fqn, r.table, r.module, tg.tensor)
        elif bname == "_hash_zch_bucket":
            check_buckets(tg.fqn, r.table, r.module, tg.tensor)


def validate_loaded(items: List[RankTarget], loaded: Set[int]) -> None:
    """TorchRec's load hook on every loaded MCH module once real: its slots sorted again."""
    with torch.no_grad():
        for r, bname, tg in items:
            if bname == "_mch_sorted_raw_ids" and id(tg) in loaded and is_mch(r.module):
                r.module.validate_state()
