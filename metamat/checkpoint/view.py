"""A checkpoint as the model sees it: model names matched to checkpoint keys, N-D as 2-D.

Key matching is the same for every model kind (:func:`resolve_keys`): with ``rename=`` each
model name is mapped by it; otherwise the names are tried behind each of a group's prefixes
(model tensors: ``""``, ``"model."``, ``"module."``; fused-optimizer state: ``"optim."``,
``"optimizer."``, ``""``) and the prefix matching the most names wins (ties: the earlier).
A tensor known by several names (tied parameters) takes the first name the checkpoint holds.

:class:`CheckpointView` then gives the load planner (:func:`metamat.load.plan_load`) one entry
per model name, N-D tensors (N > 2) with every saved chunk cut into 2-D blocks of the
``(rows, cols)`` view (:func:`metamat.blocks.row_blocks`). Only metadata is touched.
"""
from __future__ import annotations

from typing import Callable, Dict, Iterable, Mapping, Optional, Sequence, Set, Tuple, Union

from ..blocks import row_blocks, view_shape
from .base import Checkpoint, Chunk, TensorEntry, itemsize
from .errors import ShapeMismatchError, UnsupportedFormatError

__all__ = ["CheckpointView", "Rename", "make_rename", "resolve_keys", "MODEL_PREFIXES",
           "OPTIM_PREFIXES"]

MODEL_PREFIXES = ("", "model.", "module.")
OPTIM_PREFIXES = ("optim.", "optimizer.", "")

Rename = Union[None, Callable[[str], str], Mapping[str, str]]


def make_rename(rename: Rename) -> Callable[[str], str]:
    """``rename=`` argument -> a function model key -> checkpoint key.

    A mapping renames the keys it holds and leaves the others unchanged.

    Raises:
        TypeError: neither None, a callable nor a mapping.
    """
    if rename is None:
        return lambda k: k
    if callable(rename):
        return rename
    if isinstance(rename, Mapping):
        table = dict(rename)
        return lambda k: table.get(k, k)
    raise TypeError(f"rename must be None, a callable or a mapping, got {type(rename).__name__}")


def resolve_keys(keys: Mapping[str, object], names: Mapping[str, Sequence[str]], *,
                 prefixes: Sequence[str] = MODEL_PREFIXES, rename: Rename = None
                 ) -> Tuple[Dict[str, str], str, Set[str]]:
    """Match model tensors to checkpoint keys.

    Args:
        keys: the checkpoint's tensors (only membership is used).
        names: canonical model name -> every name of that tensor (canonical first).
        prefixes: candidate prefixes when ``rename`` is None.
        rename: model name -> checkpoint key (callable or mapping), or None.

    Returns:
        (canonical name -> checkpoint key for every tensor found, the prefix chosen ("" with
        ``rename``), every checkpoint key that names one of these tensors (all present names
        of a tied tensor count as used)).

    Raises:
        TypeError: ``rename`` returned something other than a str.
    """
    if rename is not None:
        fn = make_rename(rename)
        prefix = ""
    else:
        all_names = {a for al in names.values() for a in al}
        prefix, hits = prefixes[0], -1
        for p in prefixes:
            h = sum(1 for a in all_names if p + a in keys)
            if h > hits:
                prefix, hits = p, h
        fn = (lambda k: prefix + k)
    found: Dict[str, str] = {}
    used: Set[str] = set()
    for fqn, aliases in names.items():
        for alias in aliases:
            k = fn(alias)
            if not isinstance(k, str):
                raise TypeError(f"rename({alias!r}) returned {type(k).__name__}, not str")
            if k in keys:
                found.setdefault(fqn, k)
                used.add(k)
    return found, prefix, used


def _contiguous_strides(sizes: Sequence[int]):
    st, acc = [], 1
    for s in reversed(sizes):
        st.append(acc)
        acc *= int(s)
    return tuple(reversed(st))


def _as_view_entry(name: str, e: TensorEntry) -> TensorEntry:
    """An N-D entry (N > 2) as an entry of its 2-D view, each chunk cut into row blocks."""
    isz = itemsize(e.dtype)
    out = TensorEntry(name, view_shape(e.global_shape), e.dtype)
    for ch in e.chunks:
        if ch.strides is not None and any(
                st != want for st, want, sz in zip(ch.strides, _contiguous_strides(ch.sizes),
                                                   ch.sizes) if sz > 1):
            raise UnsupportedFormatError(
                f"{len(e.global_shape)}-D chunk at {tuple(ch.offsets)} is saved with strides "
                f"{tuple(ch.strides)} (a non-contiguous view); re-save it contiguous",
                file=ch.file, tensor=e.name)
        try:
            blocks = row_blocks(e.global_shape, ch.offsets, ch.sizes)
        except ValueError as err:
            raise ShapeMismatchError(str(err), file=ch.file, tensor=e.name) from None
        for b in blocks:
            if b.rows * b.cols == 0:
                continue
            out.chunks.append(Chunk(ch.file, ch.byte_offset + b.elem_offset * isz,
                                    b.rows * b.cols * isz, (b.row, b.col), (b.rows, b.cols)))
    return out


class CheckpointView:
    """What :func:`metamat.load.plan_load` needs of a checkpoint (``path``, ``tensors()``),
    keyed by the names the model's targets use.

    Args:
        ckpt: the opened checkpoint.
        keys: target name -> checkpoint key (from :func:`resolve_keys`, or identity).
        shapes: target name -> the model tensor's global shape, for names whose tensor has
            more than 2 dims (viewed 2-D; the checkpoint's shape must equal it).
        extra: target name -> an entry assembled from several checkpoint tensors
            (:func:`metamat.checkpoint.merge.assemble_entry`), in the model's shape.

    Raises:
        ShapeMismatchError, UnsupportedFormatError: an N-D tensor whose shape or chunks do not
            match the model's 2-D view.
    """

    def __init__(self, ckpt: Checkpoint, keys: Mapping[str, str],
                 shapes: Optional[Mapping[str, Sequence[int]]] = None,
                 extra: Optional[Mapping[str, TensorEntry]] = None) -> None:
        self.format = ckpt.format
        self.path = ckpt.path
        self.ckpt = ckpt
        src = ckpt.tensors()
        shapes = shapes or {}
        self.source_key: Dict[str, str] = {}
        self._entries: Dict[str, TensorEntry] = {}
        for name, key in keys.items():
            e = src[key]
            want = shapes.get(name)
            if want is not None and len(want) > 2:
                want = tuple(int(x) for x in want)
                if tuple(e.global_shape) != want:
                    raise ShapeMismatchError(f"checkpoint shape {tuple(e.global_shape)} != model "
                                             f"shape {want}", file=ckpt.path, tensor=key)
                e = _as_view_entry(name, e)
            elif key != name:
                e = TensorEntry(name, e.global_shape, e.dtype, e.chunks)
            self.source_key[name] = key
            self._entries[name] = e
        for name, e in (extra or {}).items():
            if len(e.global_shape) > 2:
                e = _as_view_entry(name, e)
            self.source_key[name] = name
            self._entries[name] = e
        self.files = sorted({c.file for e in self._entries.values() for c in e.chunks})

    def tensors(self) -> Dict[str, TensorEntry]:
        """Target name -> entry (renamed, N-D viewed as 2-D)."""
        return self._entries

    def __repr__(self) -> str:
        return f"CheckpointView({self.ckpt!r}, tensors={len(self._entries)})"


def unexpected_keys(keys: Iterable[str], used: Set[str]) -> list:
    """Checkpoint keys no model tensor took, sorted."""
    return sorted(k for k in keys if k not in used)
