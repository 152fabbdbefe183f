"""The storage interface: what checkpoint parsers and the load stage may ask of the place a
checkpoint's bytes live. :class:`~.local.LocalStorage` (files) and :class:`~.s3.S3Storage`
(objects in an S3-compatible store) implement it; :func:`metamat.checkpoint.storage.storage_for`
picks one by a path's spelling, and nothing above this package tells them apart.
"""
from __future__ import annotations

from typing import Any, BinaryIO, ContextManager, Dict, List, Mapping, NamedTuple, Optional
from typing import Protocol, Tuple

__all__ = ["Storage", "FileStat"]


class FileStat(NamedTuple):
    """A data file as the storage sees it now.

    Attributes:
        size: bytes.
        identity: ``(st_dev, st_ino, st_size, st_mtime_ns)`` for the C++ reader to require of
            the file it opens later (a same-size rewrite is refused), or None where the
            storage pins its objects itself (S3: the ETag recorded at open).
    """

    size: int
    identity: Optional[Tuple[int, int, int, int]]


class Storage(Protocol):
    """Path and file operations over one kind of storage.

    Paths are strings in the storage's own spelling (an OS path, ``s3://bucket/key``); a
    "directory" of an object store is a key prefix. Operations that name a checkpoint problem
    raise :class:`~metamat.checkpoint.errors.CheckpointError` subclasses naming the path; the
    others raise ``OSError`` subclasses (``FileNotFoundError`` for what does not exist).

    Attributes:
        name: ``"local"`` or ``"s3"`` (reports, messages).
        sep: the separator of path components.
        os_files: its paths are files the operating system opens, so the C++ reader (page
            cache, ``O_DIRECT``, file identities) reads them; otherwise tensor data is read
            with the storage's own ranged reads (:mod:`metamat.load.remote`).
    """

    name: str
    sep: str
    os_files: bool

    # -- paths (no I/O)
    def join(self, a: str, *p: str) -> str: ...
    def normpath(self, path: str) -> str: ...
    def abspath(self, path: str) -> str: ...
    def dirname(self, path: str) -> str: ...
    def basename(self, path: str) -> str: ...

    # -- what exists
    def exists(self, path: str) -> bool: ...

    def lexists(self, path: str) -> bool:
        """An entry of that name, even one that cannot be opened (a dangling link, a FIFO):
        a parser then refuses it by name instead of skipping it."""

    def isfile(self, path: str) -> bool: ...
    def isdir(self, path: str) -> bool: ...

    def listdir(self, path: str) -> List[str]:
        """Names directly in the directory (bounded: a listing that never ends raises
        :class:`~metamat.checkpoint.errors.LimitExceededError`)."""

    def getsize(self, path: str) -> int: ...

    def stat(self, path: str) -> FileStat:
        """Size and identity of a data file (raises ``FileNotFoundError``, ``OSError``)."""

    def require(self, path: str) -> None:
        """Raise :class:`~metamat.checkpoint.errors.MissingFileError` if ``path`` does not
        exist, :class:`~metamat.checkpoint.errors.ReadError` if it cannot be reached."""

    # -- reading metadata
    def open_regular(self, path: str, what: str = "file",
                     tensor: Optional[str] = None) -> BinaryIO:
        """A binary file object of a regular file, never blocking; failures are named
        (:class:`~metamat.checkpoint.errors.MissingFileError`,
        :class:`~metamat.checkpoint.errors.ReadError`)."""

    # -- one open of a checkpoint
    def opening(self, path: str,
                options: Optional[Mapping[str, Any]] = None) -> ContextManager[None]:
        """The context of opening the checkpoint at ``path``: the storage options and one
        deadline for the whole open; what the reads will require of each file is recorded
        then; errors of the storage itself become named ones."""

    def pins(self, files: List[str]) -> Optional[Dict[str, Any]]:
        """What the reads of ``files`` must require of them, recorded at open (S3: session,
        size and :class:`~.s3_session.Pin` per object); None where the file identities
        (:meth:`stat`) do that."""
