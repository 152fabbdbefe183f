"""Build TorchRec's per-table fused optimizers in time linear in the table count.

For every table of a fused TBE, TorchRec builds an ``EmbeddingFusedOptimizer`` with
``create_for_table=<name>`` and the config of the *whole* group: each one loops over every
table of the group and skips all but its own (quadratic in the table count, in eager DMP too:
15.3 of 18 s of ``shard_on_meta`` at 3,000 tables), and each defines a dataclass inside
``__init__`` (~0.5-1 ms per call, most of the rest).

``linear_table_optimizers()`` makes ``shard_on_meta`` hand each of those constructors only its
own table's entries of the group (the entries the constructor keeps anyway) and reuse the first
``ShardParams`` class. The optimizers built hold the same state, keys and shards as TorchRec's
(tests/test_torchrec_fastbuild.py compares their ``state_dict``s). A constructor whose
signature is not the one this was checked against is left alone (recorded:
``upstream.BOUNDARY.left_alone``); a name that is missing raises UnsupportedError.

Each constructor also deep-copies its table's ``ShardedTensorMetadata`` (~14% of
``shard_on_meta``, sampled): while active, the kernel module's ``copy.deepcopy`` copies that
one type directly (:func:`copy_sharded_tensor_metadata`, the same result; the fields are
checked first) and hands everything else to ``copy.deepcopy``.
"""
from __future__ import annotations

import contextlib
import copy
import dataclasses
import inspect
from typing import Any, Dict, Iterator, List, Tuple

import torch

__all__ = ["linear_table_optimizers", "STM_FIELDS"]

_CHECKED_SIGNATURE = ["self", "config", "emb_module", "pg", "create_for_table",
                      "param_weight_for_table", "embedding_weights_by_table",
                      "all_optimizer_states"]
_SHARD_PARAMS = "EmbeddingFusedOptimizer.__init__.<locals>.ShardParams"


def _own_entries(config: Any, index: Dict[int, Tuple[Any, Dict[str, List[int]]]]
                 ) -> Dict[str, List[int]]:
    """Table name -> its positions in ``config.embedding_tables`` (built once per config)."""
    hit = index.get(id(config))
    if hit is None or hit[0] is not config:
        by_name: Dict[str, List[int]] = {}
        for i, t in enumerate(config.embedding_tables):
            by_name.setdefault(t.name, []).append(i)
        hit = index[id(config)] = (config, by_name)  # holds config: the id stays its own
    return hit[1]


STM_FIELDS = {"ShardedTensorMetadata": ("shards_metadata", "size", "tensor_properties"),
              "ShardMetadata": ("shard_offsets", "shard_sizes", "placement"),
              "TensorProperties": ("dtype", "layout", "requires_grad", "memory_format",
                                   "pin_memory")}
_REMOTE_DEVICE_ATTRS = {"_worker_name", "_rank", "_device"}  # torch_upstream.REMOTE_DEVICE_FIELDS


def _metadata_types() -> Any:
    """(ShardedTensorMetadata, ShardMetadata, TensorProperties, _remote_device) if their fields
    are the ones :func:`copy_sharded_tensor_metadata` copies, else None (another torch's
    fields: ``copy.deepcopy``, the same result, slower). The classes are torch's declared
    internals (:mod:`..torch_upstream`): a missing one raises UnsupportedError."""
    from .. import torch_upstream as tu

    tu.require("sharded_tensor")
    from torch.distributed._shard.metadata import ShardMetadata
    from torch.distributed._shard.sharded_tensor.metadata import (ShardedTensorMetadata,
                                                                    TensorProperties)
    from torch.distributed.remote_device import _remote_device
    types = (ShardedTensorMetadata, ShardMetadata, TensorProperties)
    if any(tuple(f.name for f in dataclasses.fields(t)) != STM_FIELDS[t.__name__]
           for t in types) or set(vars(tu.remote_device("rank:0/cpu"))) != _REMOTE_DEVICE_ATTRS:
        return None
    return types + (_remote_device,)


def copy_sharded_tensor_metadata(md: Any, memo: Dict[int, Any], types: Any) -> Any:
    """``copy.deepcopy(md)`` of a ShardedTensorMetadata, built directly: new metadata, shard
    list, ShardMetadata, offset and size lists, placements and tensor properties; ``size``
    (a ``torch.Size``) and the dtype/layout/format/device values are immutable and shared,
    as deepcopy would give equal ones. ``memo`` keeps shared placements shared."""
    stm_t, sm_t, tp_t, rd_t = types

    def new(cls: type, values: Dict[str, Any]) -> Any:
        obj = object.__new__(cls)
        for k, v in values.items():
            object.__setattr__(obj, k, v)
        return obj

    def placement(p: Any) -> Any:
        if p is None or type(p) is not rd_t:
            return copy.deepcopy(p, memo)
        hit = memo.get(id(p))
        if hit is None:
            hit = memo[id(p)] = new(rd_t, dict(vars(p)))
        return hit

    def ints(v: Any) -> Any:  # a list of ints: its copy
        if type(v) is list and all(type(i) is int for i in v):
            return list(v)
        return copy.deepcopy(v, memo)

    def shard(sm: Any) -> Any:
        if type(sm) is not sm_t:
            return copy.deepcopy(sm, memo)
        hit = memo.get(id(sm))
        if hit is None:
            hit = memo[id(sm)] = new(sm_t, {
                "shard_offsets": ints(sm.shard_offsets), "shard_sizes": ints(sm.shard_sizes),
                "placement": placement(sm.placement)})
        return hit

    if type(md.shards_metadata) is not list or type(md.size) is not torch.Size:
        return copy.deepcopy(md, memo)
    tp = md.tensor_properties
    props = new(tp_t, {k: getattr(tp, k) for k in STM_FIELDS["TensorProperties"]}) \
        if type(tp) is tp_t else copy.deepcopy(tp, memo)
    out = new(stm_t, {"shards_metadata": [shard(s) for s in md.shards_metadata],
                      "size": md.size, "tensor_properties": props})
    memo[id(md)] = out
    return out


class _FastDeepcopy:
    """Stands in for the ``copy`` module inside TorchRec's kernel module (module docstring)."""

    def __init__(self, types: Any) -> None:
        self._types = types

    def __getattr__(self, name: str) -> Any:
        return getattr(copy, name)

    def deepcopy(self, x: Any, memo: Any = None) -> Any:
        if type(x) is self._types[0]:
            memo = {} if memo is None else memo
            hit = memo.get(id(x))
            return hit if hit is not None else copy_sharded_tensor_metadata(x, memo, self._types)
        return copy.deepcopy(x, memo) if memo is not None else copy.deepcopy(x)


def _stateless(emb_module: Any, cache: Dict[int, Tuple[Any, bool]]) -> bool:
    """Whether the TBE keeps no optimizer state (asked once per TBE)."""
    hit = cache.get(id(emb_module))
    if hit is None or hit[0] is not emb_module:
        hit = cache[id(emb_module)] = (emb_module, not emb_module.get_optimizer_state())
    return hit[1]


@contextlib.contextmanager
def linear_table_optimizers() -> Iterator[None]:
    """While active, per-table ``EmbeddingFusedOptimizer``s are built from their own table's
    entries only (module docstring).

    The names replaced are declared patch sites (:mod:`.upstream`: a missing one raises
    UnsupportedError). A constructor whose signature is not :data:`_CHECKED_SIGNATURE`, or a
    ``dataclass`` / ``copy`` that is not the standard library's (another patch of them), is
    left alone: TorchRec's own code then runs, with the same result, slower."""
    import torchrec.distributed.batched_embedding_kernel as bek

    from . import upstream

    owner = f"{upstream.BEK}.EmbeddingFusedOptimizer"
    cls = bek.EmbeddingFusedOptimizer
    real_init = cls.__dict__["__init__"]
    try:
        known = list(inspect.signature(real_init).parameters) == _CHECKED_SIGNATURE
    except (TypeError, ValueError):
        known = False
    if not known or bek.dataclass is not dataclasses.dataclass:
        upstream.BOUNDARY.note_left_alone(
            upstream.site(owner, "__init__"),
            "signature differs from the one checked" if not known
            else "torchrec's dataclass is not the standard library's")
        yield
        return
    types = _metadata_types() if bek.copy is copy else None
    index: Dict[int, Tuple[Any, Dict[str, List[int]]]] = {}
    shard_params: Dict[Tuple, type] = {}
    stateless: Dict[int, Tuple[Any, bool]] = {}

    def init(self, config, emb_module, pg=None, create_for_table=None,
             param_weight_for_table=None, embedding_weights_by_table=None,
             all_optimizer_states=None):
        n = len(config.embedding_tables)
        own = None
        if create_for_table is not None and embedding_weights_by_table \
                and len(embedding_weights_by_table) == n and all_optimizer_states is not None:
            if not all_optimizer_states and not _stateless(emb_module, stateless):
                pass  # the constructor would ask emb_module again: let it
            elif not all_optimizer_states or len(all_optimizer_states) == n:
                own = _own_entries(config, index).get(create_for_table)
        if own:
            sub = copy.copy(config)  # shallow: the constructor only reads the group
            sub.embedding_tables = [config.embedding_tables[i] for i in own]
            # no state (SGD): None per entry is what the constructor's zip_longest pads with
            states = [all_optimizer_states[i] for i in own] if all_optimizer_states \
                else [None] * len(own)
            return real_init(self, sub, emb_module, pg, create_for_table, param_weight_for_table,
                             [embedding_weights_by_table[i] for i in own], states)
        return real_init(self, config, emb_module, pg, create_for_table, param_weight_for_table,
                         embedding_weights_by_table, all_optimizer_states)

    def dataclass(cls=None, **kwargs):
        # ShardParams lives only inside one constructor call: one class serves them all.
        if cls is None or kwargs or cls.__qualname__ != _SHARD_PARAMS:
            return dataclasses.dataclass(cls, **kwargs) if cls is not None \
                else dataclasses.dataclass(**kwargs)
        key = tuple(cls.__dict__.get("__annotations__", {}).items())
        made = shard_params.get(key)
        if made is None:
            made = shard_params[key] = dataclasses.dataclass(cls)
        return made

    with contextlib.ExitStack() as stack:
        stack.enter_context(upstream.patch(owner, "__init__", init))
        stack.enter_context(upstream.patch(upstream.BEK, "dataclass", dataclass))
        if types is not None:
            stack.enter_context(upstream.patch(upstream.BEK, "copy", _FastDeepcopy(types)))
        yield
