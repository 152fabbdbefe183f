"""TorchRec fused-optimizer state in a checkpoint: which keys, and row-wise state remapping.

Fused-optimizer state uses its ``dmp.fused_optimizer.state_dict()`` path
``state.<param fqn>.<table>.momentum1`` behind one prefix among ``"optim."``,
``"optimizer."`` and ``""`` (:func:`metamat.checkpoint.view.resolve_keys`):
``dcp.save({"model": ..., "optim": dmp.fused_optimizer.state_dict()})`` works, and so does
merging both dicts into one. Optimizer state is optional, per tensor: a table whose state the
checkpoint lacks (a weights-only checkpoint, or a table that was DATA_PARALLEL when saved and
so had no fused state) gets it initialised as TorchRec does (zeros) on a meta model and keeps
it on an eager one, and the Report lists it. State that is present must be complete and match
(coverage, shape, dtype are validated by the planner). Saved state of a model table that this
rank does not take may be another rank's (a table-wise table it does not hold is absent from
its optimizer): :attr:`OptimMatch.candidates` lists it, and what no rank takes (a table that is
data-parallel now, state of another optimizer) is unexpected like any unused key, decided in
the validation agreement (:func:`metamat.materialize`): ``strict=True`` refuses it unless
``ignore_unexpected`` names it; it is never dropped silently.

Row-wise optimizer state of COLUMN_WISE tables: TorchRec keeps one per-row accumulator per
column shard, so its global shape is ``rows * k`` for ``k`` column shards (plan-dependent).
Between layouts: same ``k`` loads as is; a checkpoint with one accumulator per row
(TW/RW/TWRW/one CW shard) loads into ``k`` column shards by giving each shard the saved row
value (bit-identical copies); ``k`` saved accumulators load into one per row as their mean
(what a single shard over all columns of equal-width shards would have accumulated; not
bit-exact); any other ``k -> k'`` raises ``ShapeMismatchError`` (``strict=False``: it is
initialised instead).
"""
from __future__ import annotations

import dataclasses
from typing import Callable, Dict, List, Mapping, Optional, Sequence, Set, Tuple

import torch

from ...checkpoint.errors import ShapeMismatchError
from ...checkpoint.view import MODEL_PREFIXES, OPTIM_PREFIXES, resolve_keys
from ...plan import Target

__all__ = ["OptimMatch", "match_optimizer", "finish_means", "renamed_weights", "renamed_state"]


@dataclasses.dataclass
class OptimMatch:
    """Result of :func:`match_optimizer`.

    Attributes:
        load: targets for the loader (fqn = the name the view knows them by).
        keys: those names -> checkpoint keys.
        loaded: the optimizer targets that get loaded (by identity).
        unmatched: optimizer targets the checkpoint does not provide.
        used: checkpoint keys taken.
        prefix: the prefix chosen (None when the checkpoint holds no optimizer state).
        means: (destination, parts) whose mean :func:`finish_means` stores after the read.
        warnings: row-wise state loaded as a mean.
        candidates: saved state of model tables, sorted (the same list on every rank):
            what is not in ``used`` may be another rank's.
    """

    load: List[Target]
    keys: Dict[str, str]
    loaded: List[Target]
    unmatched: List[Target]
    used: Set[str]
    prefix: Optional[str]
    means: List[Tuple[Target, List[Target]]]
    warnings: List[str]
    candidates: List[str] = dataclasses.field(default_factory=list)


def match_optimizer(targets: Sequence[Target], keys: Mapping[str, object],
                    model_rows: Mapping[str, int], *, names: Mapping[str, List[str]],
                    tables: Set[str],
                    strict: bool, ckpt_path: str) -> OptimMatch:
    """Match optimizer-state targets to the checkpoint (module docstring).

    Args:
        targets: this rank's optimizer-state targets.
        keys: the checkpoint's tensors (name -> entry with ``global_shape``).
        model_rows: table fqn -> its global row count (for the row-wise remap).
        names: every optimizer state path of the model (all ranks' tables) -> its names
            (its own first, then aliases).
        tables: every table weight fqn of the model: saved state of one is a candidate
            (another rank may take it, or none: then it is unexpected).
        strict: a shape that cannot be remapped raises (else the target is initialised).
        ckpt_path: for messages.

    Raises:
        ShapeMismatchError: ``strict`` and row-wise state that cannot be remapped.
    """
    found, prefix, used = resolve_keys(keys, names, prefixes=OPTIM_PREFIXES)
    cands = _table_state(keys, tables)
    if not found:
        return OptimMatch([], {}, [], list(targets), set(), None, [], [], cands)
    out = OptimMatch([], {}, [], [], used, prefix, [], [], cands)
    for t in targets:
        key = found.get(t.fqn)
        if key is None:
            out.unmatched.append(t)
            continue
        saved = tuple(keys[key].global_shape)
        if saved == tuple(t.global_shape):
            out.load.append(t)
            out.keys[t.fqn] = key
            out.loaded.append(t)
            continue
        plan = _rowwise_remap(t, saved, model_rows)
        if isinstance(plan, str):
            if strict:
                raise ShapeMismatchError(plan, file=ckpt_path, tensor=key)
            out.unmatched.append(t)
            continue
        rows, copies = plan
        out.loaded.append(t)
        parts = _remap_parts(t, key, rows, copies)
        out.load += parts
        out.keys[key] = key
        if copies > 1:
            out.means.append((t, parts))
            out.warnings.append(f"{t.fqn}: row-wise optimizer state of {copies} column shards "
                                "loaded as their mean")
    return out


def renamed_weights(weight: str, rename: Callable[[str], str]) -> List[str]:
    """The names under which the fused-optimizer state of table weight ``weight`` is saved
    when ``rename`` maps the weight to another checkpoint key: that key without each model
    prefix it starts with, the longest first (``dcp.save({"model": ..., "optim": ...})``
    keeps the weight under ``model.<w>`` and its state under ``optim.state.<w>...``).
    Nothing when ``rename`` leaves it as it is."""
    c = rename(weight)
    if not isinstance(c, str) or c == weight:
        return []
    heads = sorted((p for p in MODEL_PREFIXES if c.startswith(p)), key=len, reverse=True)
    return list(dict.fromkeys(c[len(p):] for p in heads if len(c) > len(p)))


def renamed_state(name: str, weights: Set[str], rename: Callable[[str], str]) -> List[str]:
    """Other names of fused-optimizer state ``name`` (``state.<weight>.<table>.<state>``)
    under ``rename``: ``state.<renamed weight>.<its table>.<state>`` for each of
    :func:`renamed_weights`, the table's name taken from the renamed weight (TorchRec names
    the state after the table: ``...embedding_bags.<table>.weight``)."""
    rest = name[len("state."):]
    i = rest.find(".weight.")
    while i >= 0 and rest[:i + 7] not in weights:
        i = rest.find(".weight.", i + 1)
    if i < 0:
        return []
    weight, tail = rest[:i + 7], rest[i + 8:]
    old = _table_of(weight)
    out = []
    for c in renamed_weights(weight, rename):
        new = _table_of(c)
        t = new + tail[len(old):] if old and new and tail.startswith(old + ".") else tail
        out.append(f"state.{c}.{t}")
    return out


def _table_of(weight: str) -> Optional[str]:
    """The table of a TorchRec weight key (``<collection>.<table>.weight``), or None."""
    if not weight.endswith(".weight") or "." not in weight[:-7]:
        return None
    return weight[:-7].rsplit(".", 1)[1]


def _table_state(keys: Mapping[str, object], tables: Set[str]) -> List[str]:
    """Keys ``<prefix>state.<table>.<state>`` of model tables behind any of the optimizer
    prefixes, sorted: the same list on every rank (it depends on no plan)."""
    out = []
    for k in keys:
        for p in OPTIM_PREFIXES:
            if not k.startswith(p + "state."):
                continue
            rest = k[len(p) + 6:]
            i = rest.find(".weight.")
            while i >= 0 and rest[:i + 7] not in tables:
                i = rest.find(".weight.", i + 1)
            if i >= 0:
                out.append(k)
                break
    return sorted(out)


def _rowwise_remap(t: Target, saved: Tuple[int, ...], model_rows: Mapping[str, int]):
    """(rows per accumulator, saved copies), or why the state cannot be remapped."""
    pfqn = t.fqn[len("state."):].rsplit(".", 2)[0]
    rows = model_rows.get(pfqn)
    base = f"checkpoint shape {saved} != model shape {tuple(t.global_shape)}"
    if rows is None or len(saved) != 1 or len(t.global_shape) != 1 or rows == 0 \
            or saved[0] % rows or t.global_shape[0] % rows:
        return base
    copies, have = saved[0] // rows, int(t.global_shape[0]) // rows
    if copies != 1 and have != 1:
        return (base + f": row-wise state of {copies} column shards cannot be loaded into "
                f"{have} column shards")
    return rows, copies


def _remap_parts(t: Target, key: str, rows: int, copies: int) -> List[Target]:
    """Loader targets (named by the checkpoint key) that fill ``t``'s block: slices of it for
    one saved accumulator per row, scratch blocks to average for several."""
    o, n = int(t.offsets[0]), int(t.local_shape[0])
    if copies == 1:  # one accumulator per row -> each column shard's copy
        out = []
        for i in range(o // rows, (o + n + rows - 1) // rows):
            a, b = max(o, i * rows), min(o + n, (i + 1) * rows)
            out.append(Target(fqn=key, key=t.key, global_shape=(rows,),
                              offsets=(a - i * rows,), local_shape=(b - a,), dtype=t.dtype,
                              tensor=t.tensor[a - o:b - o], optimizer=True))
        return out
    # saved copies -> their mean: scratch blocks (meta now, allocated at bind)
    return [Target(fqn=key, key=t.key, global_shape=(rows * copies,), offsets=(i * rows + o,),
                   local_shape=(n,), dtype=t.dtype,
                   tensor=torch.empty(n, dtype=t.dtype, device="meta"), optimizer=True)
            for i in range(copies)]


def finish_means(means: Sequence[Tuple[Target, List[Target]]]) -> None:
    """Store the mean of each group of parts read by the loader into its destination."""
    with torch.no_grad():
        for dst, parts in means:
            dst.tensor.copy_(torch.stack([p.tensor for p in parts]).mean(0))
