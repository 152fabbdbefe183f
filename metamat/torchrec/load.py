"""Load path: which model tensors a checkpoint fills, under which checkpoint key.

Key matching (decided once per call, the same on every rank since every rank opens the same
checkpoint):

* Model tensors (embedding tables, dense parameters and persistent buffers) use their
  ``model.state_dict()`` key behind one prefix chosen among ``""``, ``"model."`` and
  ``"module."``: the one under which the most of this rank's model tensors are found (ties
  go to the earlier). ``dcp.save(dmp.state_dict())`` and
  ``dcp.save({"model": dmp.state_dict(), ...})`` both work.
* Fused-optimizer state uses its ``dmp.fused_optimizer.state_dict()`` path
  ``state.<param fqn>.<table>.momentum1`` behind one prefix among ``"optim."``,
  ``"optimizer."`` and ``""`` (same rule): ``dcp.save({"model": ..., "optim":
  dmp.fused_optimizer.state_dict()})`` works, and so does merging both dicts into one.

Strictness: ``strict=True`` requires every model tensor. Optimizer state is optional, per
tensor: a table whose state the checkpoint lacks (a weights-only checkpoint, or a table that
was DATA_PARALLEL when saved and so had no fused state) gets it initialised as TorchRec does
(zeros) on a meta model and keeps it on an eager one, and the Report lists it. State that
is present must be complete and match (coverage, shape, dtype are validated).

Row-wise optimizer state of COLUMN_WISE tables: TorchRec keeps one per-row accumulator per
column shard, so its global shape is ``rows * k`` for ``k`` column shards (plan-dependent).
Between layouts: same ``k`` loads as is; a checkpoint with one accumulator per row
(TW/RW/TWRW/one CW shard) loads into ``k`` column shards by giving each shard the saved
row value (bit-identical copies); ``k`` saved accumulators load into one per row as their
mean (what a single shard over all columns of equal-width shards would have accumulated;
not bit-exact); any other ``k -> k'`` raises ``ShapeMismatchError`` (``strict=False``:
initialised).
"""
from __future__ import annotations

import dataclasses
from typing import Dict, List, Optional, Sequence, Set, Tuple

import torch
from torch import nn

from ..checkpoint.base import Checkpoint
from ..checkpoint.errors import MissingTensorError, ShapeMismatchError
from ..plan import Target
from .walk import Plan, _local_blocks, _optimizer_targets

__all__ = ["MODEL_PREFIXES", "OPTIM_PREFIXES", "KeyMatch", "inplace_targets", "match_keys"]

MODEL_PREFIXES = ("", "model.", "module.")
OPTIM_PREFIXES = ("optim.", "optimizer.", "")


def inplace_targets(model: nn.Module, plan: Plan) -> Tuple[List[Target], Set[str]]:
    """Targets for tensors that are already real (an eager model, or real parts of a meta
    one): every local block of ``model.state_dict()`` and of the fused optimizer's state not
    already planned. ``tensor`` is the live storage (state_dict values alias it), so loading
    writes in place. Returns (targets, fqns of the optimizer ones)."""
    covered = {t.fqn for t in plan.targets}
    out: List[Target] = []
    for key, value in model.state_dict().items():
        if key in covered or not isinstance(value, torch.Tensor):
            continue
        for local, offsets, gshape in _local_blocks(value):
            if local.device.type == "meta" or local.numel() == 0:
                continue
            out.append(Target(fqn=key, key=key, global_shape=gshape, offsets=offsets,
                              local_shape=tuple(local.shape), dtype=local.dtype, tensor=local))
    opt = [t for t in _optimizer_targets(model, real=True) if t.fqn not in covered]
    return out + opt, {t.fqn for t in opt}


def _choose(fqns: Sequence[str], keys, prefixes: Sequence[str]) -> Tuple[str, int]:
    best, n = prefixes[0], -1
    uniq = set(fqns)
    for p in prefixes:
        c = sum(1 for f in uniq if p + f in keys)
        if c > n:
            best, n = p, c
    return best, n


@dataclasses.dataclass
class KeyMatch:
    """Result of :func:`match_keys`.

    Attributes:
        load: (target, checkpoint key) for every target the checkpoint holds.
        init: meta targets the checkpoint lacks (to initialise).
        unchanged: real targets the checkpoint lacks (left as they are).
        prefixes: {"model": prefix, "optim": prefix or None when no optimizer state found}.
    """

    load: List[Tuple[Target, str]]
    init: List[Target]
    unchanged: List[Target]
    prefixes: Dict[str, Optional[str]]
    # target id -> (checkpoint key, rows per accumulator, saved copies): optimizer state of
    # column-wise tables whose number of column shards differs from the checkpoint's
    remap: Dict[int, Tuple[str, int, int]] = dataclasses.field(default_factory=dict)

    def renamed(self) -> Tuple[List[Target], List[Tuple[torch.Tensor, List[Target]]]]:
        """Targets for the loader: copies of the loaded targets whose ``fqn`` is the
        checkpoint key, with the current ``tensor`` (call after the allocate stage to get
        the real destinations), remapped row-wise state split into pieces; and the
        (destination, parts) pairs whose mean :func:`finish` stores after the read."""
        out: List[Target] = []
        means: List[Tuple[torch.Tensor, List[Target]]] = []
        for t, k in self.load:
            if id(t) not in self.remap:
                out.append(dataclasses.replace(t, fqn=k))
                continue
            key, rows, saved = self.remap[id(t)]
            o, n = int(t.offsets[0]), int(t.local_shape[0])
            if saved == 1:  # one accumulator per row -> each column shard's copy
                for i in range(o // rows, (o + n + rows - 1) // rows):
                    a, b = max(o, i * rows), min(o + n, (i + 1) * rows)
                    out.append(Target(fqn=key, key=t.key, global_shape=(rows,),
                                      offsets=(a - i * rows,), local_shape=(b - a,),
                                      dtype=t.dtype, tensor=t.tensor[a - o:b - o]))
            else:  # saved copies -> their mean
                parts = [Target(fqn=key, key=t.key, global_shape=(rows * saved,),
                                offsets=(i * rows + o,), local_shape=(n,), dtype=t.dtype,
                                tensor=torch.empty(n, dtype=t.dtype, device=t.tensor.device))
                         for i in range(saved)]
                out += parts
                means.append((t.tensor, parts))
        return out, means


def finish(means: List[Tuple[torch.Tensor, List[Target]]]) -> None:
    """Store the mean of each group of parts read by the loader into its destination."""
    with torch.no_grad():
        for dst, parts in means:
            dst.copy_(torch.stack([p.tensor for p in parts]).mean(0))


def match_keys(targets: Sequence[Target], optimizer_fqns: Set[str], ckpt: Checkpoint, *,
               strict: bool, inplace: Sequence[Target] = ()) -> KeyMatch:
    """Match targets to checkpoint keys (module docstring).

    Args:
        targets: every target (planned and ``inplace``).
        optimizer_fqns: fqns of the optimizer-state targets.
        ckpt: the opened checkpoint.
        strict: see the module docstring.
        inplace: the targets from :func:`inplace_targets`; when absent from the checkpoint
            they are left unchanged, the others are initialised.

    Raises:
        MissingTensorError: ``strict`` and model tensors are absent (every missing name is
            listed; optimizer state is never required).
    """
    keys = ckpt.tensors()
    keep = {id(t) for t in inplace}
    model_t = [t for t in targets if t.fqn not in optimizer_fqns]
    opt_t = [t for t in targets if t.fqn in optimizer_fqns]
    mp, _ = _choose([t.fqn for t in model_t], keys, MODEL_PREFIXES)
    op, n_opt = _choose([t.fqn for t in opt_t], keys, OPTIM_PREFIXES)
    has_opt = n_opt > 0
    load, init, unchanged, missing = [], [], [], []
    remap: Dict[int, Tuple[str, int, int]] = {}
    rows_of = {t.fqn: int(t.global_shape[0]) for t in model_t if t.global_shape}
    for t in model_t:
        if mp + t.fqn in keys:
            load.append((t, mp + t.fqn))
        else:
            missing.append(mp + t.fqn)
            (unchanged if id(t) in keep else init).append(t)
    for t in opt_t:
        key = op + t.fqn
        if has_opt and key in keys and tuple(keys[key].global_shape) != tuple(t.global_shape):
            why = _rowwise_remap(t, keys[key], rows_of, remap, key)
            if why is not None:
                if strict:
                    raise ShapeMismatchError(why, file=ckpt.path, tensor=key)
                (unchanged if id(t) in keep else init).append(t)
                continue
        if has_opt and key in keys:
            load.append((t, key))
        else:
            (unchanged if id(t) in keep else init).append(t)
    if missing and strict:
        names = sorted(set(missing))
        raise MissingTensorError(
            f"{len(names)} tensor(s) missing from checkpoint: {', '.join(names[:20])}"
            + (" ..." if len(names) > 20 else "") + " (pass strict=False to initialise them)",
            names=names, file=ckpt.path)
    return KeyMatch(load, init, unchanged, {"model": mp, "optim": op if has_opt else None},
                    remap)


def _rowwise_remap(t: Target, entry, rows_of: Dict[str, int], remap, key: str) -> Optional[str]:
    """Record how to load row-wise state saved with another number of column shards;
    return why it cannot be, or None."""
    pfqn = t.fqn[len("state."):].rsplit(".", 2)[0]
    rows = rows_of.get(pfqn)
    shape = tuple(entry.global_shape)
    base = (f"checkpoint shape {shape} != model shape {tuple(t.global_shape)}")
    if rows is None or len(shape) != 1 or len(t.global_shape) != 1 or rows == 0 \
            or shape[0] % rows or t.global_shape[0] % rows:
        return base
    saved, have = shape[0] // rows, int(t.global_shape[0]) // rows
    if saved != 1 and have != 1:
        return (base + f": row-wise state of {saved} column shards cannot be loaded into "
                f"{have} column shards")
    remap[id(t)] = (key, rows, saved)
    return None
