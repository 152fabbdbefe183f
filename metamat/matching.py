"""Match a model's adapters to a checkpoint and plan the reads, before anything is allocated.

:func:`match_parts` is the validate stage of :func:`metamat.materialize` for a load: every
target is matched to a checkpoint tensor by name (through the model's prefixes, renames and
merge rules), the adapters match what they match themselves (quantized tables, fused-optimizer
state), unexpected and missing tensors are named, and the read plan is computed and validated.
Its result, a :class:`LoadMatch`, is plain data the later stages use.
"""
from __future__ import annotations

import fnmatch
from typing import Any, Dict, List, Optional, Sequence, Set

from .checkpoint.base import Checkpoint
from .checkpoint.errors import MissingTensorError, UnexpectedTensorError
from .checkpoint.merge import Merge, missing_message, resolve_merges
from .checkpoint.view import MODEL_PREFIXES, CheckpointView, Rename, resolve_keys
from .load import ReadPlan, plan_reads
from .load.quantize import refuse_quantized
from .models.adapter import Adapter
from .plan import Target

__all__ = ["LoadMatch", "match_parts", "settle_optimizer", "merge_rules_arg"]


class LoadMatch:
    """What a checkpoint gives the adapters of one call, and the read plan (computed once,
    before allocation).

    Attributes:
        reads: the read plan of the targets loaded by name (:class:`~metamat.load.ReadPlan`).
        loaded: ids of the targets the checkpoint provides.
        unexpected: checkpoint keys that match nothing (non-strict, or ignored).
        prefixes: "model"/"optim" -> the key prefix the checkpoint uses.
        means: (destination, parts) of optimizer state averaged after the read.
        manifest: the checksum manifest the reads are verified against, or None.
        described: names assembled or renamed by merge rules -> how.
        warnings: what the Report should say.
        pending: saved optimizer state of model tables that this or another rank takes;
            ``mine``: bit i set when this rank takes ``pending[i]`` (settled by
            :func:`settle_optimizer` in the validation agreement).
        quant: reads the adapters run themselves (float rows quantized while read).
    """

    def __init__(self) -> None:
        self.reads: Optional[ReadPlan] = None
        self.loaded: Set[int] = set()
        self.unexpected: List[str] = []
        self.prefixes: Dict[str, Optional[str]] = {}
        self.means: list = []
        self.manifest = None
        self.described: Dict[str, str] = {}
        self.warnings: List[str] = []
        self.pending: List[str] = []
        self.mine = 0
        self.ignore: Sequence[str] = ()
        self.strict = True
        self.path = ""
        self.quant: list = []


def _optimizer_hint(unexpected: Sequence[str], has_fused: bool, orphans=frozenset()) -> str:
    lost = [k for k in unexpected if k in orphans]
    if lost:
        return (f" {len(lost)} of them are saved optimizer state of tables that have no such "
                "state in this plan (e.g. data-parallel now, or another optimizer), so nothing "
                "can load it; accept losing it with ignore_unexpected=[...] naming them")
    opt = [k for k in unexpected
           if k.startswith(("optim.", "optimizer.", "state.")) or ".state." in k]
    if opt and not has_fused:
        return (f" {len(opt)} of them look like optimizer state, and this model has no fused "
                "optimizer to load it into; ignore them with ignore_unexpected=['optim.*'] "
                "(or the prefix your checkpoint uses)")
    return ""


def _unexpected_error(keys: Sequence[str], hint: str, path: str) -> UnexpectedTensorError:
    return UnexpectedTensorError(
        f"{len(keys)} checkpoint tensor(s) match nothing in the model: {', '.join(keys[:20])}"
        + (" ..." if len(keys) > 20 else "") + "." + hint
        + " Pass ignore_unexpected=[patterns] or strict=False to load anyway.",
        names=list(keys), file=path)


def match_parts(parts: Sequence[Adapter], ck: Checkpoint, *, strict: bool, dtype,
                rename: Rename, ignore: Sequence[str], merge=None) -> LoadMatch:
    """Match every target to the checkpoint and plan the reads (no allocation, no writes).

    Args:
        parts: the model's adapters.
        ck: the opened checkpoint.
        strict, dtype, rename: as :func:`metamat.materialize`'s.
        ignore: fnmatch patterns of checkpoint keys that may match nothing.
        merge: None or a list of merge rules ("auto": the adapters' own), see
            :func:`merge_rules_arg`.

    Raises:
        MissingTensorError, UnexpectedTensorError (``strict``), and every error of planning
        the reads (:func:`~metamat.load.plan_reads`).
    """
    out = LoadMatch()
    keys = ck.tensors()
    model_t = [t for p in parts for t in p.checkpoint_targets()]
    names: Dict[str, List[str]] = {}
    for p in parts:  # global names: a rank without a block of a tensor still knows it
        names.update(p.names())
    found, prefix, used = resolve_keys(keys, names, prefixes=MODEL_PREFIXES, rename=rename)
    out.prefixes["model"] = prefix
    used |= {k for p in parts for k in (prefix + n for n in p.dropped_keys()) if k in keys}
    missing = sorted(n for n in names if n not in found)
    assembled: Dict[str, Any] = {}
    notes: Dict[str, str] = {}
    if missing and merge is not None:  # checkpoint tensors in another layout or name
        rules = [r for m in merge for r in ([m] if m != "auto" else
                                            [x for p in parts for x in p.merge_rules()])]
        shapes_all: Dict[str, tuple] = {}
        for p in parts:
            shapes_all.update(p.shapes())
        mr = resolve_merges(rules, missing, keys, used, prefix, shapes_all, ck.path)
        found.update(mr.renamed)
        used |= mr.used
        assembled, out.described = mr.entries, mr.described
        notes = {n: why for r in rules for n, why in getattr(r, "notes", {}).items()}
        notes.update(mr.incomplete)
        missing = [n for n in missing if n not in found and n not in assembled]
    if missing:
        msg, looks = missing_message(missing, [k for k in keys if k not in used], notes,
                                     strict)
        if strict:
            raise MissingTensorError(msg, names=missing, file=ck.path)
        if looks:
            out.warnings.append(msg)
    load: List[Target] = [t for t in model_t if t.fqn in found or t.fqn in assembled]
    view_keys = {n: found[n] for n in found}
    refuse_quantized(load, keys, view_keys, ck.path)  # quantized tables into a float model
    for p in parts:  # quantized tables: from float rows (quantized while read) or quantized
        m = p.match_checkpoint(keys, found, ckpt_path=ck.path)
        if m is not None:
            load += m.load
            view_keys.update(m.keys)
            used |= m.used
            out.loaded |= {id(t) for t in p.loaded_targets()}
    has_fused = any(t.optimizer for p in parts for t in p.targets)
    cands: Set[str] = set()
    for p in parts:
        m = p.match_optimizer(keys, strict=strict, ckpt_path=ck.path, rename=rename)
        if m is None:
            continue
        load += m.load
        view_keys.update(m.keys)
        used |= m.used
        out.loaded |= {id(t) for t in m.loaded}
        out.means += m.means
        out.prefixes["optim"] = m.prefix
        cands |= set(m.candidates)
    out.pending, out.ignore, out.strict, out.path = sorted(cands), tuple(ignore), strict, ck.path
    out.mine = sum(1 << i for i, k in enumerate(out.pending) if k in used)
    out.unexpected = sorted(k for k in keys if k not in used and k not in cands
                            and not any(fnmatch.fnmatchcase(k, pat) for pat in ignore))
    if out.unexpected and strict:
        raise _unexpected_error(out.unexpected, _optimizer_hint(out.unexpected, has_fused),
                                ck.path)
    shapes: Dict[str, tuple] = {}
    for p in parts:
        shapes.update(p.nd_shapes())
    view = CheckpointView(ck, view_keys, shapes, extra=assembled)
    out.reads = plan_reads(load, view, strict=True, dtype=dtype, check_destinations=False)
    out.loaded |= {id(t) for t in load}
    out.quant = [q for q in (p.plan_reads(view, dtype) for p in parts) if q is not None]
    out.reads.bytes_needed += sum(q.bytes_needed for q in out.quant)
    return out


def settle_optimizer(ld: LoadMatch, taken: Sequence[int]) -> None:
    """Saved optimizer state of a model table that no rank takes (a table that is data-parallel
    now, state of another optimizer) is unexpected: every rank has the same lists, so every
    rank raises the same error under ``strict`` (nothing was allocated), else the Report
    lists it. Never dropped silently.

    Args:
        taken: every rank's ``mine`` bits (from the validation agreement).

    Raises:
        UnexpectedTensorError: ``strict`` and such state that ``ignore_unexpected`` does not
            name.
    """
    bits = 0
    for t in taken:
        bits |= t or 0
    lost = [k for i, k in enumerate(ld.pending) if not bits >> i & 1
            and not any(fnmatch.fnmatchcase(k, pat) for pat in ld.ignore)]
    if not lost:
        return
    if ld.strict:
        raise _unexpected_error(lost, _optimizer_hint(lost, True, set(lost)), ld.path)
    ld.unexpected = sorted(ld.unexpected + lost)


def merge_rules_arg(merge) -> Optional[list]:
    """``merge=`` -> a list of rules ("auto" kept as a marker) or None.

    Raises:
        TypeError: neither "auto", None nor a list of Merge rules and "auto".
    """
    if merge is None:
        return None
    if isinstance(merge, str):
        if merge != "auto":
            raise TypeError(f"merge must be 'auto', None or a list of metamat.Merge, got {merge!r}")
        return ["auto"]
    if isinstance(merge, Merge):
        return [merge]
    rules = list(merge)
    for r in rules:
        if not (r == "auto" or isinstance(r, Merge) or callable(getattr(r, "match", None))):
            raise TypeError(f"merge: {r!r} is not a metamat.Merge (nor 'auto')")
    return rules
