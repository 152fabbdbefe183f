"""Guarded access to checkpoint metadata: every metadata open and every path a checkpoint's
metadata names goes through here.

* :func:`open_regular`: a non-blocking open of regular files only (no FIFO, device or
  directory), whatever the storage;
* :func:`read_metadata_file`: a whole metadata file, refused above the size limit before a
  byte is read;
* :func:`contained_path`: a path from a checkpoint's metadata stays inside its directory.
"""
from __future__ import annotations

import os
from typing import Any, BinaryIO, Optional

from . import storage as fs
from .errors import UnsafePathError
from .limits import METADATA_BYTES, check, limit, short_repr

__all__ = ["open_regular", "read_metadata_file", "contained_path"]


def open_regular(path: str, what: str = "file", tensor: Optional[str] = None) -> BinaryIO:
    """Open ``path`` for binary reading, never blocking, and only if it is a regular file
    (symlinks are followed first): :meth:`~.storage.base.Storage.open_regular` of its storage.

    Raises:
        MissingFileError: ``path`` does not exist.
        ReadError: it is not a regular file, or the OS (the store) refuses to open it.
    """
    return fs.storage_for(path).open_regular(path, what, tensor)


def read_metadata_file(path: str, what: str) -> bytes:
    """All bytes of a metadata file, refusing special files and files above the size limit
    before reading (a sparse multi-GiB file fails at ``fstat``)."""
    with open_regular(path, what) as f:
        check(METADATA_BYTES, fs.fsize(f), file=path, what=f"{what} size")
        return f.read(limit(METADATA_BYTES) + 1)


def contained_path(root: str, rel: Any, what: str, where: str,
                   tensor: Optional[str] = None) -> str:
    """``root/rel`` for a path a checkpoint's own metadata names, kept inside ``root``.

    The check is lexical (after ``normpath``), not on resolved symlinks: a symlink sitting in
    the directory is followed (HF cache snapshots link into ``../../blobs``), but the
    metadata cannot name ``../x``, an absolute path or a NUL byte.

    Args:
        root: the checkpoint directory.
        rel: the path as the metadata spells it.
        what: what the path is, for the message (``"weight_map entry"``).
        where: the metadata file, named by the error.

    Raises:
        UnsafePathError: ``rel`` is not a non-empty relative string inside ``root``.
    """
    if not isinstance(rel, str) or not rel:
        raise UnsafePathError(f"{what} {short_repr(rel)} is not a file name", file=where,
                              tensor=tensor)
    if "\0" in rel:
        raise UnsafePathError(f"{what} {short_repr(rel)} holds a NUL byte", file=where,
                              tensor=tensor)
    if os.path.isabs(rel):
        raise UnsafePathError(f"{what} {short_repr(rel)} is an absolute path", file=where,
                              tensor=tensor)
    store = fs.storage_for(root)
    root = store.normpath(store.abspath(root))
    p = store.normpath(store.join(root, rel))
    if not p.startswith(root.rstrip(store.sep) + store.sep):
        raise UnsafePathError(f"{what} {short_repr(rel)} leaves the checkpoint directory",
                              file=where, tensor=tensor)
    return p
