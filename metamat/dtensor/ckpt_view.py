"""A checkpoint as the model sees it: renamed keys, tied aliases, N-D tensors as 2-D views.

``metamat.fill_load`` matches targets to ``ckpt.tensors()`` by fqn and plans 0/1/2-D blocks.
:class:`CheckpointView` gives it, for every tensor the model needs, an entry under the model's
canonical fqn: found under ``rename(fqn)`` (or under another name of a tied parameter), and for
N-D tensors (N > 2) with every saved chunk cut into 2-D blocks of the ``(rows, cols)`` view
(:func:`metamat.dtensor.blocks.row_blocks`). Only metadata is touched.
"""
from __future__ import annotations

from typing import Callable, Dict, Mapping, Optional, Sequence, Union

from ..checkpoint.base import Checkpoint, Chunk, TensorEntry, itemsize
from ..checkpoint.errors import ShapeMismatchError, UnsupportedFormatError
from .blocks import row_blocks, view_shape

__all__ = ["CheckpointView", "Rename", "make_rename", "AUTO_PREFIXES"]

AUTO_PREFIXES = ("model.", "module.")

Rename = Union[None, Callable[[str], str], Mapping[str, str]]


def make_rename(rename: Rename) -> Callable[[str], str]:
    """``rename=`` argument -> a function model key -> checkpoint key.

    A mapping renames the keys it holds and leaves the others unchanged.
    """
    if rename is None:
        return lambda k: k
    if callable(rename):
        return rename
    if isinstance(rename, Mapping):
        table = dict(rename)
        return lambda k: table.get(k, k)
    raise TypeError(f"rename must be None, a callable or a mapping, got {type(rename).__name__}")


def _best_prefix(src: Mapping[str, object], names: Sequence[str]) -> str:
    """The prefix ("" or one of ``AUTO_PREFIXES``) under which most ``names`` are in ``src``."""
    best, hits = "", sum(n in src for n in names)
    if hits == len(names):
        return ""
    for p in AUTO_PREFIXES:
        h = sum(p + n in src for n in names)
        if h > hits:
            best, hits = p, h
    return best


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
    """What ``metamat.fill_load.plan_load`` needs of a checkpoint (``path``, ``tensors()``),
    keyed by the model's fqns.

    Args:
        ckpt: the opened checkpoint.
        names: canonical fqn -> every model name of that tensor (tied parameters have several;
            the first present in the checkpoint, after ``rename``, is used).
        shapes: canonical fqn -> the model tensor's global shape (N-D ones are viewed 2-D).
        rename: model key -> checkpoint key (callable or mapping). Without it the keys are
            tried as they are and behind each of ``AUTO_PREFIXES``; the prefix matching the
            most tensors wins (``prefix``).

    Raises:
        ShapeMismatchError, UnsupportedFormatError: an N-D chunk that cannot be viewed 2-D.
    """

    def __init__(self, ckpt: Checkpoint, names: Mapping[str, Sequence[str]],
                 shapes: Mapping[str, Sequence[int]], rename: Rename = None) -> None:
        self.format = ckpt.format
        self.path = ckpt.path
        self.ckpt = ckpt
        src = ckpt.tensors()
        self.prefix = ""
        if rename is None:
            self.prefix = _best_prefix(src, [a for al in names.values() for a in al])
            fn = (lambda k: self.prefix + k) if self.prefix else make_rename(None)
        else:
            fn = make_rename(rename)
        self.source_key: Dict[str, str] = {}
        self._entries: Dict[str, TensorEntry] = {}
        for fqn, aliases in names.items():
            key: Optional[str] = None
            for alias in aliases:
                k = fn(alias)
                if not isinstance(k, str):
                    raise TypeError(f"rename({alias!r}) returned {type(k).__name__}, not str")
                if k in src:
                    key = k
                    break
            if key is None:
                continue
            e = src[key]
            want = tuple(int(x) for x in shapes[fqn])
            if len(want) > 2:
                if tuple(e.global_shape) != want:
                    raise ShapeMismatchError(f"checkpoint shape {tuple(e.global_shape)} != model "
                                             f"shape {want}", file=ckpt.path, tensor=key)
                e = _as_view_entry(fqn, e)
            elif key != fqn:
                e = TensorEntry(fqn, e.global_shape, e.dtype, e.chunks)
            self.source_key[fqn] = key
            self._entries[fqn] = e
        self.files = sorted({c.file for e in self._entries.values() for c in e.chunks})

    def tensors(self) -> Dict[str, TensorEntry]:
        """Canonical model fqn -> entry (renamed, N-D viewed as 2-D)."""
        return self._entries

    def __repr__(self) -> str:
        return f"CheckpointView({self.ckpt!r}, tensors={len(self._entries)})"
