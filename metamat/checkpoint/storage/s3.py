"""Objects in an S3-compatible store: the :class:`~.base.Storage` of ``s3://bucket/key`` paths.

A "directory" is a key prefix. Each object's size and :class:`~.s3_session.Pin` are recorded
when a parser first asks for them during an open, and every later read of it requires the
same object (:func:`fetch_range`). Metadata is read through :class:`S3File` (a small cache of
aligned blocks); tensor data by :mod:`metamat.load.remote` (coalesced concurrent ranged GETs).
"""
from __future__ import annotations

import contextlib
import io
import posixpath
import random
import time
from collections import OrderedDict
from typing import Any, BinaryIO, Dict, Iterator, List, Mapping, Optional, Tuple

from ..errors import CheckpointError, MissingFileError, ReadError
from .base import FileStat
from .s3_deadline import Deadline, DeadlineExceeded
from .s3_session import SCHEME, Pin, PinMismatch, S3Session, current
from .s3_session import deadline as current_deadline
from .s3_session import opening, split_url, using

__all__ = ["S3Storage", "S3", "S3File", "remote_meta", "unpinned", "fetch_range"]

#: url -> (session, size, pin) of every object whose size a checkpoint reader asked for.
_META: Dict[str, Tuple[S3Session, int, Pin]] = {}


def remote_meta(url: str) -> Tuple[S3Session, int, Pin]:
    """(session, size, :class:`Pin`) recorded when a reader asked for ``url``'s size."""
    m = _META.get(url)
    if m is None:
        s = current()
        h = s.head(url)
        if h is None:
            raise FileNotFoundError(url)
        m = _META[url] = (s, int(h["size"]), Pin.of(h))
    return m


def unpinned(urls) -> List[str]:
    """Those of ``urls`` (opened objects) that nothing pins: no ETag, version id or
    Last-Modified, so a rewrite between open and read would go unseen."""
    return [u for u in urls if u in _META and _META[u][2].by is None]


def _root_and_key(path: str) -> Tuple[str, str]:
    bucket, key = split_url(path)
    return SCHEME + bucket, key


class S3Storage:
    """Objects of an S3-compatible store, through the session of the open in progress
    (:func:`~.s3_session.using`)."""

    name = "s3"
    sep = "/"
    os_files = False

    # -- paths
    def join(self, a: str, *p: str) -> str:
        return posixpath.join(a, *p)

    def normpath(self, path: str) -> str:
        root, key = _root_and_key(path)
        key = posixpath.normpath("/" + key).lstrip("/")
        return root + "/" + key if key else root

    def abspath(self, path: str) -> str:
        return self.normpath(path)

    def dirname(self, path: str) -> str:
        root, key = _root_and_key(path)
        d = posixpath.dirname(key)
        return root + "/" + d if d else root

    def basename(self, path: str) -> str:
        return posixpath.basename(path)

    # -- what exists
    def exists(self, path: str) -> bool:
        return self.isfile(path) or self.isdir(path)

    def lexists(self, path: str) -> bool:
        return self.isfile(path)  # no links or special files in a store

    def isfile(self, path: str) -> bool:
        if path.endswith("/") or not split_url(path)[1]:
            return False
        return current().head(path) is not None

    def isdir(self, path: str) -> bool:
        """A prefix with at least one object under it (one listing answer, however long the
        listing)."""
        return current().any_under(path.rstrip("/") + "/")

    def listdir(self, path: str) -> List[str]:
        """Names directly under a prefix.

        Raises:
            LimitExceededError: more than ``METAMAT_MAX_LIST_ENTRIES`` objects under it (the
                listing is streamed and stopped there).
        """
        return current().names_under(path.rstrip("/") + "/")

    def getsize(self, path: str) -> int:
        """Size in bytes; during an open, also records the object's pin for the reads.

        Raises:
            FileNotFoundError, OSError.
        """
        known = _META.get(path)
        now_opening = opening()
        s = known[0] if known is not None and not now_opening else current()
        h = s.head(path)
        if h is None:
            raise FileNotFoundError(path)
        if now_opening or known is None:
            _META[path] = (s, int(h["size"]), Pin.of(h))
        return int(h["size"])

    def stat(self, path: str) -> FileStat:
        return FileStat(self.getsize(path), None)  # identity: the pin recorded at open

    def require(self, path: str) -> None:
        if not self.exists(path):  # an unreachable store raises OSError: see opening()
            raise MissingFileError("checkpoint path does not exist", file=path)

    # -- reading metadata
    def open_regular(self, path: str, what: str = "file",
                     tensor: Optional[str] = None) -> BinaryIO:
        """A ranged-read file object over the object (no special files in a store)."""
        try:
            return _open_object(path)
        except FileNotFoundError:
            raise MissingFileError(f"{what} does not exist", file=path, tensor=tensor) from None
        except OSError as e:
            raise ReadError(f"cannot open {what} ({e.strerror or e})", file=path,
                            tensor=tensor) from None
        except ValueError as e:  # not a usable URL (no bucket)
            raise ReadError(str(e), file=path, tensor=tensor) from None

    # -- one open of a checkpoint
    @contextlib.contextmanager
    def opening(self, path: str,
                options: Optional[Mapping[str, Any]] = None) -> Iterator[None]:
        """Parsers inside see ``options``, share one deadline, and record each object's pin;
        the store's own failures (unreachable, denied, no bucket) become a ReadError naming
        ``path`` (no secrets)."""
        with using(options):
            try:
                yield
            except CheckpointError:
                raise
            except (OSError, ValueError) as e:
                raise ReadError(str(e), file=path) from None

    def pins(self, files: List[str]) -> Optional[Dict[str, Any]]:
        """What the reads will require (If-Match): this open's pins, not a later one's."""
        return {f: remote_meta(f) for f in files}


S3 = S3Storage()


def _open_object(path: str) -> BinaryIO:
    """An :class:`S3File` over object ``path``, its pin recorded during an open.

    Raises:
        FileNotFoundError, IsADirectoryError, OSError (as ``open``).
    """
    if path.endswith("/") or not split_url(path)[1]:
        raise IsADirectoryError(path)
    s = current()
    h = s.head(path)
    if h is None:
        if S3.isdir(path):
            raise IsADirectoryError(path)
        raise FileNotFoundError(path)
    pin = Pin.of(h)
    if opening() or path not in _META:
        _META[path] = (s, int(h["size"]), pin)
    return io.BufferedReader(S3File(path, s, int(h["size"]), pin), 1 << 16)


class S3File(io.RawIOBase):
    """A seekable read-only file over one object, for metadata parsing.

    Reads go through a small LRU of aligned blocks so a parser's many small reads cost few
    requests. Tensor data is not read through this (see :mod:`metamat.load.remote`).
    """

    BLOCK = 256 << 10

    def __init__(self, url: str, sess: S3Session, size: int, pin: Optional[Pin]) -> None:
        self.name = url
        self._s = sess
        self._size = size
        self._pin = pin
        self._pos = 0
        self._blocks: "OrderedDict[int, bytes]" = OrderedDict()

    def readable(self) -> bool:
        return True

    def seekable(self) -> bool:
        return True

    @property
    def size(self) -> int:
        return self._size

    def tell(self) -> int:
        return self._pos

    def seek(self, pos: int, whence: int = 0) -> int:
        base = {0: 0, 1: self._pos, 2: self._size}[whence]
        self._pos = max(0, base + pos)
        return self._pos

    def _block(self, i: int) -> bytes:
        b = self._blocks.get(i)
        if b is None:
            start = i * self.BLOCK
            end = min(self._size, start + self.BLOCK)
            b = bytes(fetch_range(self._s, self.name, start, end, self._pin, size=self._size))
            self._blocks[i] = b
            if len(self._blocks) > 32:
                self._blocks.popitem(last=False)
        else:
            self._blocks.move_to_end(i)
        return b

    def pread(self, n: int, off: int) -> bytes:
        end = min(self._size, off + max(0, n))
        if off >= end:
            return b""
        if end - off > 4 * self.BLOCK:  # a big read (an index json): one request
            return bytes(fetch_range(self._s, self.name, off, end, self._pin, size=self._size))
        out = []
        p = off
        while p < end:
            i = p // self.BLOCK
            b = self._block(i)
            s = p - i * self.BLOCK
            piece = b[s:s + (end - p)]
            out.append(piece)
            p += len(piece)
        return b"".join(out)

    def readinto(self, b) -> int:
        data = self.pread(len(b), self._pos)
        n = len(data)
        b[:n] = data
        self._pos += n
        return n

    def readall(self) -> bytes:
        data = self.pread(self._size - self._pos, self._pos)
        self._pos += len(data)
        return data


def _transient(e: BaseException) -> bool:
    """Errors worth another attempt (the client already retried statuses it knows)."""
    name = type(e).__name__
    if name in ("PreconditionError", "NotFoundError", "PermissionDeniedError",
                "UnauthenticatedError", "NotSupportedError", "InvalidPathError"):
        return False
    if isinstance(e, (FileNotFoundError, PermissionError, ValueError, TypeError)):
        return False
    return True


def fetch_range(sess, url: str, start: int, end: int, pin: Optional[Pin], *,
                into: Optional[memoryview] = None, what: str = "object",
                deadline: Optional[Deadline] = None, size: Optional[int] = None):
    """Bytes [start, end) of ``url``, retried; with ``into``, written there (returns it).

    Args:
        pin: what the object was at open (:class:`~.s3_session.Pin`).
        deadline: when to give up (default: the open's in progress, else a new one).
        size: the object's size at open (an answer for another size is refused).

    Raises:
        ReadError: the object is gone or changed, access is denied, retries ran out
            (throttled, dropped connections, short bodies), or the deadline passed, naming
            the object key.
    """
    want = end - start
    dl = deadline or current_deadline(sess)
    delay = 0.05
    last = None
    for attempt in range(max(1, sess.attempts)):
        if attempt:
            time.sleep(max(0.0, min(delay * (1 + random.random()), dl.left())))
            delay = min(delay * 2, 2.0)
        try:
            data = sess.get_range(url, start, end, pin, dl, size)
        except DeadlineExceeded as e:
            raise ReadError(str(e), file=url) from None
        except PinMismatch as e:
            raise ReadError(f"object changed since the checkpoint was opened ({e})",
                            file=url) from None
        except Exception as e:  # noqa: BLE001 - obstore raises its own hierarchy
            name = type(e).__name__
            if name == "PreconditionError":
                raise ReadError(f"object changed since the checkpoint was opened (its "
                                f"{pin.by if pin else 'ETag'} is no longer "
                                f"{pin.describe() if pin else '?'})", file=url) from None
            if isinstance(e, FileNotFoundError) or name == "NotFoundError":
                raise ReadError(f"{what} no longer exists", file=url) from None
            if not _transient(e):
                raise ReadError(f"cannot read bytes [{start}, {end}) ({name})",
                                file=url) from None
            last = f"{name}: {_short(e)}"
            continue
        n = len(data)
        if n != want:
            last = f"short body: {n} of {want} bytes"
            continue
        if into is None:
            return data
        into[:] = memoryview(data)
        return into
    raise ReadError(f"reading bytes [{start}, {end}) failed after {sess.attempts} attempts "
                    f"({last})", file=url)


def _short(e: BaseException) -> str:
    s = str(e).splitlines()[0] if str(e) else ""
    return s[:200]
