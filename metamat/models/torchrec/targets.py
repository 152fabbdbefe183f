"""TorchRec adapter, targets: every checkpointable block of the sharded collections (table
shards from their ``state_dict``, fused-optimizer state) and how each is initialised."""
from __future__ import annotations

from typing import Any, Dict, List, Optional, Set, Tuple

import torch
from torch import nn

from ...errors import UnsupportedError
from ...plan import Target
from ...rules import default_table_dist, dist_from_init_fn, match_init
from ...spec import Dist, Zeros
from .sharded import table_configs
from .state_dict import module_state_dict

__all__ = ["table_targets", "optimizer_targets", "local_blocks", "table_name_from_key"]


def local_blocks(value: Any) -> List[Tuple[torch.Tensor, Tuple[int, ...], Tuple[int, ...]]]:
    """(local tensor, offsets, global shape) for a state_dict value."""
    if hasattr(value, "local_shards"):
        # ShardedTensor.size() goes through __torch_function__ (~150 µs); its metadata is plain
        md = getattr(value, "metadata", None)
        gshape = tuple(md().size) if callable(md) else tuple(value.size())
        return [(s.tensor, tuple(s.metadata.shard_offsets), gshape) for s in value.local_shards()]
    from ..modules import is_dtensor

    if is_dtensor(value):
        from ..torch_upstream import local_shape_and_offset, local_tensor
        from .upstream import wrapped_shards

        local = local_tensor(value)
        shards = wrapped_shards(local)  # TorchRec's 2D parallelism: the rank's shards
        if shards is not None:
            return [(t, off, tuple(value.shape)) for t, off in shards]
        _, off = local_shape_and_offset(value.shape, value.device_mesh, value.placements)
        return [(local, tuple(off), tuple(value.shape))]
    return [(value, tuple(0 for _ in value.shape), tuple(value.shape))]


def table_name_from_key(key: str) -> Optional[Tuple[str, str]]:
    parts = key.split(".")
    if len(parts) >= 3 and parts[-1] == "weight" and parts[-3] in ("embedding_bags", "embeddings"):
        return ".".join(parts[:-3]), parts[-2]
    return None


def table_targets(sharded: List[Tuple[str, nn.Module]], init, warnings: List[str],
                   loading: bool, refill: Set[int], names: Set[str]) -> List[Target]:
    """Targets of every table shard (meta ones; real ones beside meta ones, which are
    refilled and recorded in ``refill``; all real ones when ``loading``). ``names`` receives
    every state_dict key of the sharded modules, with or without a block on this rank."""
    configs: Dict[str, Dict[str, Any]] = {name: table_configs(sm) for name, sm in sharded}
    targets = []
    for name, sm in sharded:
        prefix = f"{name}." if name else ""
        warned = set()
        sd = module_state_dict(sm, prefix)  # sm.state_dict(prefix=prefix), faster
        # DMP(device=meta) still builds DATA_PARALLEL tables on CPU with torch's RNG; refill
        # them (in place) when the module's other tables are on meta, so every table gets
        # plan-invariant values.
        any_meta = any(b[0].is_meta for v in sd.values() if isinstance(v, torch.Tensor)
                       for b in local_blocks(v))
        names.update(k for k, v in sd.items() if isinstance(v, torch.Tensor))
        for key, value in sd.items():
            tn = table_name_from_key(key)
            if tn is None:
                continue
            table = tn[1]
            cfg = configs[name].get(table)
            if cfg is None:
                continue
            dist = match_init(init, (key, table))
            init_fn = None
            if dist is not None and not isinstance(dist, Dist):
                init_fn, dist = _init_callable(key, dist), None
            elif dist is None:
                if cfg.init_fn is None:
                    dist = default_table_dist(cfg.num_embeddings)
                else:
                    dist = dist_from_init_fn(cfg.init_fn)
                    if dist is None:
                        init_fn = cfg.init_fn
                        if table not in warned:
                            warned.add(table)
                            warnings.append(
                                f"table {table!r}: init_fn {cfg.init_fn!r} is not a known "
                                "distribution; applying it to each local shard (slower, and "
                                "values depend on the sharding plan)"
                            )
            for local, offsets, gshape in local_blocks(value):
                if local.numel() == 0 or (not local.is_meta and not any_meta
                                          and not loading):
                    continue
                # positional (~0.5 µs per target less than keywords): fqn, key, global_shape,
                # offsets, local_shape, dtype, dist, tensor, init_fn
                targets.append(Target(key, table, gshape, offsets, tuple(local.shape),
                                      local.dtype, dist, local, init_fn))
                if not local.is_meta and any_meta:
                    refill.add(id(targets[-1]))
        for key, value in sd.items():  # real non-table tensors of the module (eager loads)
            if not loading or table_name_from_key(key) is not None \
                    or not isinstance(value, torch.Tensor):
                continue
            for local, offsets, gshape in local_blocks(value):
                if not local.is_meta and local.numel():
                    targets.append(Target(fqn=key, key=key, global_shape=gshape,
                                          offsets=offsets, local_shape=tuple(local.shape),
                                          dtype=local.dtype, tensor=local))
    return targets


def _init_callable(key: str, value):
    """An ``init=`` tensor or callable for a table, as a per-block init_fn."""
    if isinstance(value, torch.Tensor):
        def copy_block(t: torch.Tensor, offsets, _v=value) -> None:
            t.copy_(_v[tuple(slice(o, o + n) for o, n in zip(offsets, t.shape))])
        copy_block.metamat_block = True
        return copy_block
    return value


_ZEROS = Zeros()  # frozen: one for every optimizer state block


def optimizer_targets(model: nn.Module, loading: bool, names: Set[str]) -> List[Target]:
    """Targets of the fused optimizer's state: the meta blocks, and when ``loading`` the
    blocks already on a real device too (an eager model). ``names`` receives every state
    path, with or without a block on this rank."""
    fo = getattr(model, "fused_optimizer", None)
    if fo is None:
        return []
    try:
        sd = fo.state_dict()
    except Exception as e:  # noqa: BLE001
        raise UnsupportedError(f"fused_optimizer.state_dict() failed on meta: {e}") from e
    targets = []
    for pfqn, states in sd.get("state", {}).items():
        for sname, value in states.items():
            if not isinstance(value, torch.Tensor):
                continue
            path = f"state.{pfqn}.{sname}"
            names.add(path)
            for local, offsets, gshape in local_blocks(value):
                if local.numel() == 0 or (not local.is_meta and not loading):
                    continue
                tg = Target(path, sname, gshape, offsets, tuple(local.shape), local.dtype,
                            _ZEROS, local)  # positional, as in _table_targets
                tg.optimizer = True
                targets.append(tg)
    return targets
