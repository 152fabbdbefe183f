"""Where checkpoint bytes live: local files or objects in an S3-compatible store.

One interface (:class:`~.base.Storage`), two implementations: :class:`~.local.LocalStorage`
and :class:`~.s3.S3Storage`. :func:`storage_for` is the one place that tells them apart, by
a path's spelling (``s3://bucket/key`` is an object). The functions below are the few path
and file operations checkpoint parsers use (``fs.<op>`` where they would call
``os.path.<op>``), each answered by the path's storage. Tensor data of a storage without OS
files is read by :mod:`metamat.load.remote` (coalesced concurrent ranged GETs).
"""
from __future__ import annotations

import os
from typing import Any, List

from .base import FileStat, Storage
from .local import LOCAL, LocalStorage
from .s3 import S3, S3File, S3Storage, fetch_range, remote_meta, unpinned
from .s3_deadline import DEADLINE_ENV, DEFAULT_DEADLINE, Deadline, DeadlineExceeded
from .s3_session import (SCHEME, Pin, PinMismatch, S3Session, current, deadline, session,
                         split_url, using)

__all__ = ["Storage", "FileStat", "LocalStorage", "S3Storage", "storage_for",
           "exists", "lexists", "isdir", "isfile", "listdir", "getsize", "join", "normpath",
           "abspath", "dirname", "basename", "pread", "fsize",
           "split_url", "S3Session", "session", "using", "current", "remote_meta", "Pin",
           "PinMismatch", "Deadline", "DeadlineExceeded", "deadline", "unpinned",
           "fetch_range", "DEFAULT_DEADLINE", "DEADLINE_ENV"]


def storage_for(path: Any) -> Storage:
    """The storage holding ``path``: S3 for an ``s3://`` URL, else local files."""
    return S3 if isinstance(path, str) and path.startswith(SCHEME) else LOCAL


# -- path operations, answered by the path's storage
def exists(path: str) -> bool:
    return storage_for(path).exists(path)


def lexists(path: str) -> bool:
    return storage_for(path).lexists(path)


def isfile(path: str) -> bool:
    return storage_for(path).isfile(path)


def isdir(path: str) -> bool:
    """A local directory, or a prefix with at least one object under it."""
    return storage_for(path).isdir(path)


def listdir(path: str) -> List[str]:
    """Names in a local directory or directly under a prefix (bounded, see
    :meth:`.S3Storage.listdir`)."""
    return storage_for(path).listdir(path)


def getsize(path: str) -> int:
    """Size in bytes; for an object during an open, also records its pin for the reads."""
    return storage_for(path).getsize(path)


def join(a: str, *p: str) -> str:
    return storage_for(a).join(a, *p)


def normpath(path: str) -> str:
    return storage_for(path).normpath(path)


def abspath(path: str) -> str:
    return storage_for(path).abspath(path)


def dirname(path: str) -> str:
    return storage_for(path).dirname(path)


def basename(path: str) -> str:
    return storage_for(path).basename(path)


# -- open file objects (from Storage.open_regular)
def pread(fh, n: int, off: int) -> bytes:
    """``os.pread`` on a local or S3 file object."""
    raw = getattr(fh, "raw", fh)
    if isinstance(raw, S3File):
        return raw.pread(n, off)
    return os.pread(fh.fileno(), n, off)


def fsize(fh) -> int:
    """Size of an open local or S3 file object."""
    raw = getattr(fh, "raw", fh)
    if isinstance(raw, S3File):
        return raw.size
    return os.fstat(fh.fileno()).st_size
