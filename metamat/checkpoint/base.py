"""Plain data describing what a checkpoint holds and where its bytes are.

A checkpoint, whatever its format, is reduced to a dict ``fqn -> TensorEntry``; each entry is
a list of ``Chunk`` boxes (offsets, sizes inside the global tensor) with the absolute byte
range in one file holding that box in row-major order. Readers of each format build these;
the load planner (``metamat.load``) only ever sees this representation.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Dict, List, NamedTuple, Optional, Tuple

import torch

from ..dtypes import itemsize
from . import storage as fs
from .access import open_regular
from .errors import (InvalidOffsetError, MissingFileError, ReadError, ShapeMismatchError,
                     TruncatedFileError)

__all__ = ["Chunk", "TensorEntry", "Checkpoint", "itemsize", "numel", "open_binary"]


def open_binary(path: str, what: str = "file", tensor: Optional[str] = None):
    """Open ``path`` for reading with every failure as a named error: non-blocking, and
    only a regular file (after following symlinks); see :func:`.limits.open_regular`.

    Raises:
        MissingFileError: ``path`` does not exist.
        ReadError: it is a directory, FIFO, device, unreadable, or the OS refuses otherwise.
    """
    return open_regular(path, what, tensor)


def numel(shape) -> int:
    n = 1
    for s in shape:
        n *= int(s)
    return n


class Chunk(NamedTuple):
    """One saved box of a global tensor (immutable; a NamedTuple rather than a frozen
    dataclass: a checkpoint has one per saved box, up to millions, and a NamedTuple is built
    in a third of the time).

    Attributes:
        file: absolute path of the file holding the bytes.
        byte_offset: absolute offset of element (0, ..., 0) of the box in ``file``.
        nbytes: bytes the box's data occupies in the file (from element 0 to the last).
        offsets: position of the box in the global tensor, one per dim.
        sizes: shape of the box.
        strides: element strides of the saved data; ``None`` means row-major contiguous.
            Only torch.save'd views can be non-contiguous.
    """

    file: str
    byte_offset: int
    nbytes: int
    offsets: Tuple[int, ...]
    sizes: Tuple[int, ...]
    strides: Optional[Tuple[int, ...]] = None

    @property
    def numel(self) -> int:
        """Elements of the chunk."""
        return numel(self.sizes)


@dataclass
class TensorEntry:
    """One global tensor of a checkpoint.

    Attributes:
        name: the fqn (state_dict key).
        global_shape: shape of the whole tensor.
        dtype: saved dtype (a torch dtype).
        chunks: the saved boxes; disjoint, together normally covering the tensor.
    """

    name: str
    global_shape: Tuple[int, ...]
    dtype: torch.dtype
    chunks: List[Chunk] = field(default_factory=list)

    def validate(self) -> None:
        """Check every chunk lies inside the global shape and has a consistent byte size.

        Raises:
            ShapeMismatchError: a chunk box has the wrong rank or lies outside the tensor.
            InvalidOffsetError: a chunk's byte length disagrees with its shape.
        """
        isz = itemsize(self.dtype)
        gshape = self.global_shape
        nd = len(gshape)
        for ch in self.chunks:
            offsets, sizes = ch.offsets, ch.sizes
            if len(offsets) != nd or len(sizes) != nd:
                raise ShapeMismatchError(
                    f"chunk at {tuple(offsets)} has rank {len(sizes)}, tensor has rank {nd}",
                    file=ch.file, tensor=self.name)
            n = 1
            for o, s, g in zip(offsets, sizes, gshape):
                if o < 0 or s < 0 or o + s > g:
                    raise ShapeMismatchError(
                        f"chunk offsets {tuple(offsets)} sizes {tuple(sizes)} lie outside "
                        f"global shape {tuple(gshape)}", file=ch.file, tensor=self.name)
                n *= s
            if ch.byte_offset < 0:
                raise InvalidOffsetError(f"negative byte offset {ch.byte_offset}",
                                         file=ch.file, tensor=self.name)
            strides = ch.strides
            if strides is None:
                want = n * isz
            else:
                if len(strides) != nd or any(st < 0 for st in strides):
                    raise InvalidOffsetError(f"bad strides {strides}", file=ch.file,
                                             tensor=self.name)
                want = 0 if n == 0 else (
                    1 + sum((s - 1) * st for s, st in zip(sizes, strides))) * isz
            if ch.nbytes != want:
                raise InvalidOffsetError(
                    f"chunk at {tuple(offsets)} holds {ch.nbytes} bytes, shape "
                    f"{tuple(sizes)} x {isz} B needs {want}", file=ch.file, tensor=self.name)


class Checkpoint:
    """A parsed checkpoint: metadata only, no tensor data is read.

    Attributes:
        format: ``"dcp"``, ``"dcp-safetensors"``, ``"safetensors"`` or ``"torch_save"``.
        path: what was opened.
        files: every data file the entries point into.
        storage_options: what :func:`~metamat.checkpoint.open_checkpoint` was given (an
            ``s3://`` checkpoint's later reads use them).
    """

    def __init__(self, fmt: str, path: str, entries: Dict[str, TensorEntry]) -> None:
        self.format = fmt
        self.path = str(path)
        self.storage_options = None
        self._entries = entries
        self.files = sorted({c.file for e in entries.values() for c in e.chunks})
        for e in entries.values():
            e.validate()
        self._check_file_sizes()

    def _check_file_sizes(self) -> None:
        sizes = {}
        self._identities: Dict[str, Tuple[int, int, int, int]] = {}
        for f in self.files:
            try:
                st = fs.storage_for(f).stat(f)
            except FileNotFoundError:
                raise MissingFileError("data file does not exist", file=f) from None
            except (OSError, ValueError) as e:  # not a directory, symlink loop, NUL byte
                raise ReadError(f"cannot stat data file ({getattr(e, 'strerror', None) or e})",
                                file=f) from None
            sizes[f] = st.size
            if st.identity is not None:  # None: the storage pins the object itself (S3)
                self._identities[f] = st.identity
        for e in self._entries.values():
            for ch in e.chunks:
                end = ch.byte_offset + ch.nbytes
                if end > sizes[ch.file]:
                    raise TruncatedFileError(
                        f"chunk at {tuple(ch.offsets)} needs bytes [{ch.byte_offset}, {end}) but "
                        f"the file has {sizes[ch.file]}", file=ch.file, tensor=e.name)
        self.file_sizes = sizes

    def file_identity(self, path: str) -> Optional[Tuple[int, int, int, int]]:
        """``(st_dev, st_ino, st_size, st_mtime_ns)`` of data file ``path`` when the checkpoint
        was opened (``None`` for a file it does not use). The C++ reader refuses a file whose
        identity changed since, e.g. rewritten in place or replaced with a same-size file."""
        return getattr(self, "_identities", {}).get(path)

    def tensors(self) -> Dict[str, TensorEntry]:
        """Return ``fqn -> TensorEntry`` (the checkpoint's own dict; do not mutate)."""
        return self._entries

    def close(self) -> None:
        """Release resources. Parsing keeps no file open, so this only drops the index."""
        self._entries = {}

    def __enter__(self) -> "Checkpoint":
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def __repr__(self) -> str:
        return (f"Checkpoint(format={self.format!r}, path={self.path!r}, "
                f"tensors={len(self._entries)}, files={len(self.files)})")

