"""Model tensors assembled from several checkpoint tensors: stack, concatenate, rename.

A model may keep in one tensor what its checkpoints hold in many: transformers 5 keeps a
mixture-of-experts layer's experts fused (``mlp.experts.gate_up_proj`` of shape
``(experts, 2 * inter, hidden)``) while checkpoints, its own ``save_pretrained`` included, hold
one tensor per expert (``block_sparse_moe.experts.<e>.w1.weight`` and ``w3``). Such a tensor is
an :class:`Assembly`: segments of checkpoint tensors, each segment stacked along a new dim,
the segments concatenated along a dim. :func:`assemble_entry` turns it into one
:class:`~metamat.checkpoint.base.TensorEntry` of the model's name whose chunks are the pieces'
chunks moved to their place in the assembled tensor; the load planner then reads only the
bytes each rank's block needs, as for any chunked tensor (an expert-parallel shard reads only
its experts, a row shard only its rows). Nothing is read or copied to assemble.

Where assemblies come from: :class:`Merge` rules given to ``materialize(merge=[...])``, or the
model's own conversion rules (``merge="auto"``: transformers' checkpoint conversion mapping,
:mod:`metamat.models.hf.convert`). Only stacking and concatenation are expressed (they keep
every piece a contiguous box); a transpose or a split of one checkpoint tensor into several
is not.
"""
from __future__ import annotations

import re
from dataclasses import dataclass, field
from typing import Dict, List, Mapping, Optional, Sequence, Set, Tuple

from .base import Chunk, TensorEntry
from .errors import DtypeMismatchError, MissingTensorError, ShapeMismatchError

__all__ = ["Merge", "Assembly", "MergeResult", "assemble_entry", "resolve_merges",
           "lookalikes", "missing_message"]


@dataclass
class Assembly:
    """One model tensor built from checkpoint tensors.

    Attributes:
        name: the model tensor's name.
        segments: per segment, the checkpoint keys stacked (in index order); a segment of one
            key and ``stack_dim=None`` is that tensor itself.
        stack_dim: the new dim the keys of a segment are stacked along (None: no stacking).
        cat_dim: the dim of the stacked segments they are concatenated along (None: one
            segment).
        rule: what produced it (for messages and the Report).
    """

    name: str
    segments: List[List[str]]
    stack_dim: Optional[int] = None
    cat_dim: Optional[int] = None
    rule: str = ""

    @property
    def keys(self) -> List[str]:
        return [k for seg in self.segments for k in seg]

    def describe(self) -> str:
        n = len(self.keys)
        how = []
        if self.stack_dim is not None:
            how.append(f"stacked on dim {self.stack_dim}")
        if self.cat_dim is not None:
            how.append(f"concatenated on dim {self.cat_dim}")
        first = ", ".join(seg[0] for seg in self.segments if seg)
        return (f"{n} checkpoint tensors {' then '.join(how)} ({first}, ...)"
                + (f" by {self.rule}" if self.rule else ""))


def _insert(xs: Tuple[int, ...], dim: int, v: int) -> Tuple[int, ...]:
    return tuple(xs[:dim]) + (v,) + tuple(xs[dim:])


def _contiguous(sizes: Sequence[int]) -> Tuple[int, ...]:
    st, acc = [], 1
    for s in reversed(sizes):
        st.append(acc)
        acc *= int(s)
    return tuple(reversed(st))


def assemble_entry(a: Assembly, src: Mapping[str, TensorEntry], shape: Sequence[int],
                   path: Optional[str] = None) -> TensorEntry:
    """The checkpoint entry of ``a.name``: its pieces' chunks placed in the assembled tensor.

    Args:
        a: the assembly.
        src: the checkpoint's entries.
        shape: the model tensor's global shape (the assembled shape must equal it).
        path: the checkpoint's path, for messages.

    Raises:
        MissingTensorError: a key of the assembly is not in the checkpoint, or a segment has
            fewer stacked tensors than the model's size along the stack dim.
        ShapeMismatchError: pieces of one segment differ in shape, segments do not line up
            along the concatenation dim, or the result's shape is not the model's.
        DtypeMismatchError: pieces saved in different dtypes.
    """
    shape = tuple(int(s) for s in shape)
    absent = [k for k in a.keys if k not in src]
    if absent:
        raise MissingTensorError(f"{a.name}: {len(absent)} of the checkpoint tensors it is "
                                 f"assembled from are absent: {', '.join(absent[:10])}",
                                 names=[a.name], file=path)
    dtype = src[a.keys[0]].dtype
    if a.stack_dim is not None and a.cat_dim != a.stack_dim and a.stack_dim < len(shape):
        n = shape[a.stack_dim]
        for seg in a.segments:
            if len(seg) < n:
                raise MissingTensorError(
                    f"the checkpoint has {len(seg)} of the {n} tensors stacked on dim "
                    f"{a.stack_dim} ({seg[0]} ... {seg[-1]}; the others are absent)",
                    names=[a.name], file=path)
    seg_shapes: List[Tuple[int, ...]] = []
    for seg in a.segments:
        first = tuple(src[seg[0]].global_shape)
        for k in seg:
            e = src[k]
            if tuple(e.global_shape) != first:
                raise ShapeMismatchError(f"{a.name}: {k} has shape {tuple(e.global_shape)}, "
                                         f"{seg[0]} {first}; pieces stacked together must agree",
                                         file=path, tensor=k)
            if e.dtype != dtype:
                raise DtypeMismatchError(f"{a.name}: {k} is saved as {e.dtype}, "
                                         f"{a.keys[0]} as {dtype}", file=path, tensor=k)
        if a.stack_dim is not None:
            if not 0 <= a.stack_dim <= len(first):
                raise ShapeMismatchError(f"{a.name}: stack dim {a.stack_dim} out of range for "
                                         f"pieces of shape {first}", file=path, tensor=seg[0])
            first = _insert(first, a.stack_dim, len(seg))
        elif len(seg) != 1:
            raise ShapeMismatchError(f"{a.name}: {len(seg)} pieces in a segment and no stack "
                                     "dim", file=path, tensor=seg[0])
        seg_shapes.append(first)
    cat = a.cat_dim
    if cat is None and len(seg_shapes) != 1:
        raise ShapeMismatchError(f"{a.name}: {len(seg_shapes)} segments and no concatenation "
                                 "dim", file=path, tensor=a.keys[0])
    base = seg_shapes[0]
    if cat is not None:
        if not 0 <= cat < len(base):
            raise ShapeMismatchError(f"{a.name}: concatenation dim {cat} out of range for "
                                     f"segments of shape {base}", file=path, tensor=a.keys[0])
        for s in seg_shapes:
            if len(s) != len(base) or any(x != y for d, (x, y) in enumerate(zip(s, base))
                                          if d != cat):
                raise ShapeMismatchError(
                    f"{a.name}: segments of shapes {seg_shapes} cannot be concatenated on dim "
                    f"{cat}", file=path, tensor=a.keys[0])
        total = list(base)
        total[cat] = sum(s[cat] for s in seg_shapes)
        whole = tuple(total)
    else:
        whole = base
    if whole != shape:
        raise ShapeMismatchError(f"assembled from the checkpoint ({a.describe()}) the shape is "
                                 f"{whole}, the model's is {shape}", file=path, tensor=a.name)
    out = TensorEntry(a.name, shape, dtype)
    cat_off = 0
    for seg, sshape in zip(a.segments, seg_shapes):
        for i, k in enumerate(seg):
            for ch in src[k].chunks:
                offs, sizes, strides = tuple(ch.offsets), tuple(ch.sizes), ch.strides
                if a.stack_dim is not None:
                    d = a.stack_dim
                    offs, sizes = _insert(offs, d, i), _insert(sizes, d, 1)
                    if strides is not None:  # a size-1 dim: any stride describes it
                        strides = _insert(tuple(strides), d, 0)
                if cat is not None:
                    offs = tuple(o + cat_off if dd == cat else o for dd, o in enumerate(offs))
                if strides is not None and all(st == want for st, want, sz in
                                               zip(strides, _contiguous(sizes), sizes) if sz > 1):
                    strides = None
                out.chunks.append(Chunk(ch.file, ch.byte_offset, ch.nbytes, offs, sizes,
                                        strides))
        if cat is not None:
            cat_off += sshape[cat]
    out.validate()
    return out


# ---------------------------------------------------------------------------------------------
# user rules


def _glob_regex(pattern: str) -> "re.Pattern[str]":
    return re.compile("(.+?)".join(re.escape(p) for p in pattern.split("*")))


@dataclass(frozen=True)
class Merge:
    """A model tensor assembled from checkpoint tensors (``materialize(merge=[...])``).

    Args:
        target: the model tensor's name; each ``*`` matches any text (captured).
        sources: one pattern per segment: checkpoint keys with the target's captures in
            place of its ``*`` (in order) and, when stacking, ``{i}`` for the index along
            ``stack_dim`` (0, 1, ... as long as the checkpoint has them).
        stack_dim: the new dim the tensors of each source are stacked along (needed when
            the sources use ``{i}``).
        cat_dim: the dim the stacked sources are concatenated along (needed with several
            sources).

    Example: Mixtral's per-expert checkpoint into transformers 5's fused experts::

        Merge("*.mlp.experts.gate_up_proj",
              ["*.block_sparse_moe.experts.{i}.w1.weight",
               "*.block_sparse_moe.experts.{i}.w3.weight"], stack_dim=0, cat_dim=1)

    Raises:
        ValueError: patterns that do not fit together, or a missing dim.
    """

    target: str
    sources: Tuple[str, ...]
    stack_dim: Optional[int] = None
    cat_dim: Optional[int] = None

    def __post_init__(self) -> None:
        srcs = (self.sources,) if isinstance(self.sources, str) else tuple(self.sources)
        object.__setattr__(self, "sources", srcs)
        if not srcs:
            raise ValueError("Merge: sources must name at least one checkpoint pattern")
        n = self.target.count("*")
        for s in srcs:
            if s.count("*") != n:
                raise ValueError(f"Merge: source {s!r} has {s.count('*')} '*', the target "
                                 f"{self.target!r} has {n}")
        stacked = {("{i}" in s) for s in srcs}
        if len(stacked) != 1:
            raise ValueError("Merge: either every source uses {i} (stacked) or none does")
        if stacked.pop() and self.stack_dim is None:
            raise ValueError("Merge: sources with {i} need stack_dim")
        if not any("{i}" in s for s in srcs) and self.stack_dim is not None:
            raise ValueError("Merge: stack_dim given but no source uses {i}")
        if len(srcs) > 1 and self.cat_dim is None:
            raise ValueError("Merge: several sources need cat_dim")
        for d in (self.stack_dim, self.cat_dim):
            if d is not None and (not isinstance(d, int) or isinstance(d, bool) or d < 0):
                raise ValueError(f"Merge: dims must be non-negative ints, got {d!r}")

    def match(self, missing: Sequence[str], keys: Mapping[str, object], unused: Set[str],
              prefix: str) -> Dict[str, Assembly]:
        """Assemblies for the ``missing`` model names this rule covers (keys behind
        ``prefix``; only ``unused`` checkpoint keys are taken)."""
        rx = _glob_regex(self.target)
        out: Dict[str, Assembly] = {}
        for name in missing:
            m = rx.fullmatch(name)
            if m is None:
                continue
            caps = m.groups()
            segs: List[List[str]] = []
            for s in self.sources:
                for c in caps:
                    s = s.replace("*", c, 1)
                if self.stack_dim is None:
                    k = prefix + s
                    segs.append([k] if k in unused else [])
                    continue
                seg, i = [], 0
                while (prefix + s.replace("{i}", str(i))) in unused:
                    seg.append(prefix + s.replace("{i}", str(i)))
                    i += 1
                segs.append(seg)
            if all(segs):
                out[name] = Assembly(name, segs, self.stack_dim, self.cat_dim,
                                     rule=f"Merge({self.target!r})")
        return out


@dataclass
class MergeResult:
    """What the merge rules gave: renames (one key), assembled entries, keys they take."""

    renamed: Dict[str, str] = field(default_factory=dict)
    entries: Dict[str, TensorEntry] = field(default_factory=dict)
    used: Set[str] = field(default_factory=set)
    described: Dict[str, str] = field(default_factory=dict)
    incomplete: Dict[str, str] = field(default_factory=dict)  # name -> why (still missing)


def resolve_merges(rules: Sequence[object], missing: Sequence[str],
                   src: Mapping[str, TensorEntry], used: Set[str], prefix: str,
                   shapes: Mapping[str, Sequence[int]], path: Optional[str] = None
                   ) -> MergeResult:
    """Apply ``rules`` (in order; the first that covers a name wins) to the model names the
    checkpoint does not hold as they are.

    Args:
        rules: objects with ``match(missing, keys, unused, prefix)`` returning
            ``{name: Assembly | checkpoint key}`` (:class:`Merge`, the model's own rules).
        missing: model names not found directly.
        src: the checkpoint's entries.
        used: checkpoint keys already taken (never taken again).
        prefix: the model-key prefix chosen for the checkpoint.
        shapes: model name -> global shape.
        path: for messages.

    Raises:
        ShapeMismatchError, DtypeMismatchError: from :func:`assemble_entry` (pieces that are
            absent leave the name missing, with the reason in ``incomplete``).
    """
    out = MergeResult()
    todo = list(missing)
    unused = {k for k in src if k not in used}
    for rule in rules:
        if not todo:
            break
        got = rule.match(todo, src, unused, prefix)
        for name, how in got.items():
            if isinstance(how, str):
                if how not in unused:
                    continue
                out.renamed[name] = how
                out.used.add(how)
                unused.discard(how)
                out.described[name] = f"checkpoint {how}"
                continue
            if any(k not in unused for k in how.keys):
                continue
            try:
                out.entries[name] = assemble_entry(how, src, shapes[name], path)
            except MissingTensorError as e:
                out.incomplete[name] = e.detail
                continue
            out.used |= set(how.keys)
            unused -= set(how.keys)
            out.described[name] = "checkpoint: " + how.describe()
        todo = [n for n in todo if n not in out.renamed and n not in out.entries]
    return out


_STOP = {"weight", "bias", "model", "module", "layers", "layer", "h", "blocks", "transformer",
         "encoder", "decoder"}


def _tokens(name: str) -> Tuple[str, Set[str]]:
    """(the name up to and including its first number, its other word tokens)."""
    parts = name.split(".")
    head = next((i for i, p in enumerate(parts) if p.isdigit()), None)
    scope = ".".join(parts[:head + 1]) if head is not None else ""
    words = {w for p in parts[(head + 1 if head is not None else 0):]
             for w in re.split(r"[_\d]+", p) if w and w not in _STOP}
    return scope, words


def lookalikes(missing: Sequence[str], unused: Sequence[str]) -> Dict[str, List[str]]:
    """Unused checkpoint keys that look like each missing model name: the same numbered
    scope (``model.layers.3``) and a shared word (``experts``, ``proj``). A hint, not a rule."""
    by_scope: Dict[str, List[Tuple[str, Set[str]]]] = {}
    for k in unused:
        s, w = _tokens(k)
        by_scope.setdefault(s, []).append((k, w))
    out: Dict[str, List[str]] = {}
    for name in missing:
        s, w = _tokens(name)
        if not w:
            continue
        hits = [k for k, kw in by_scope.get(s, ()) if kw & w]
        if hits:
            out[name] = sorted(hits)
    return out


def missing_message(missing: Sequence[str], unused: Sequence[str],
                    notes: Optional[Mapping[str, str]] = None, strict: bool = True
                    ) -> Tuple[str, Dict[str, List[str]]]:
    """The message of a ``MissingTensorError`` for ``missing``, and the lookalikes found.

    Where unused checkpoint tensors look like missing ones (:func:`lookalikes`), or a
    conversion rule matched them but cannot be read (``notes``), the message says so and
    names them, and does not suggest ``strict=False``: that would give those tensors random
    values while their values are in the checkpoint. ``strict=False``: the message of the
    Report's warning (they were initialised).
    """
    notes = dict(notes or {})
    looks = lookalikes(missing, unused)
    msg = (f"{len(missing)} tensor(s) missing from checkpoint: {', '.join(missing[:20])}"
           + (" ..." if len(missing) > 20 else ""))
    if not looks and not notes:
        if not unused:
            return msg + " (pass strict=False to initialise them)", looks
        ex = sorted(unused)[:5]
        return (msg + f". The checkpoint also holds {len(unused)} tensor(s) that no model tensor "
                f"takes ({', '.join(ex)}{' ...' if len(unused) > 5 else ''}): if they hold "
                "these values under other names or in another layout, map them with "
                "merge=[metamat.Merge(...)] or rename=; "
                + ("strict=False would initialise the missing ones with random values instead"
                   if strict else "strict=False initialised the missing ones with random "
                   "values")), looks
    shown = [n for n in missing if n in looks or n in notes]
    parts = []
    for n in shown[:5]:
        bits = []
        if n in looks:
            k = len(looks[n])
            bits.append(f"the checkpoint has {k} unused tensor{'s' if k > 1 else ''} like it: "
                        + ", ".join(looks[n][:3]) + (" ..." if k > 3 else ""))
        if n in notes:
            bits.append(notes[n])
        parts.append(f"{n}: {'; '.join(bits)}")
    msg += (f". The checkpoint holds tensors that look like {len(shown)} of them under other "
            "names or in another layout (e.g. one tensor per expert): " + " | ".join(parts)
            + (" ..." if len(shown) > 5 else "") + ". Map them with merge=[metamat.Merge(...)] "
            "or rename=, or check that this is the model's checkpoint; "
            + ("they were not initialised (strict=False would give them random values, not "
               "the checkpoint's)" if strict else
               "strict=False initialised them with random values instead"))
    return msg, {**looks, **{n: [] for n in notes if n not in looks}}
