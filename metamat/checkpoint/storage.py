"""Where checkpoint bytes live: local files or objects in an S3-compatible store.

Checkpoint readers name files by path strings; an ``s3://bucket/key`` string is an object.
This module gives the readers the few path and file operations they use (exists, isdir,
listdir, size, join, normpath, open for metadata reads) for both, so a parser's only change is
calling ``fs.<op>`` instead of ``os.path.<op>``. Tensor data of remote checkpoints is read by
:mod:`metamat.load.remote` (coalesced concurrent ranged GETs).

S3 access uses ``obstore`` (Rust ``object_store``), imported only when an ``s3://`` path is
opened (``pip install metamat[s3]``). Credentials, region and endpoint come from the usual
environment (``AWS_ACCESS_KEY_ID``, ``AWS_SECRET_ACCESS_KEY``, ``AWS_SESSION_TOKEN``,
``AWS_REGION``, ``AWS_ENDPOINT_URL``; ``AWS_PROFILE`` through boto3 when it is installed) or
an explicit ``storage_options`` dict (obstore S3 config keys such as ``aws_endpoint``,
``aws_access_key_id``, ``aws_region``, plus ``allow_http``); they are never logged or put in
error messages.
"""
from __future__ import annotations

import contextlib
import contextvars
import io
import os
import posixpath
import threading
import time
from collections import OrderedDict
from typing import Any, Dict, Iterator, List, Mapping, Optional, Tuple

__all__ = ["is_remote", "split_url", "S3Session", "session", "using", "current",
           "exists", "isdir", "isfile", "listdir", "getsize", "join", "normpath", "abspath",
           "dirname", "basename", "open_raw", "remote_meta"]

SCHEME = "s3://"

#: storage_options of the open call in progress (parsers see it through :func:`current`).
_CURRENT: contextvars.ContextVar = contextvars.ContextVar("metamat_storage_options",
                                                         default=None)
#: True while a checkpoint is being opened: sizes looked up then record the ETag the reads
#: will require (later look-ups, e.g. the planner's re-check, keep it).
_OPENING: contextvars.ContextVar = contextvars.ContextVar("metamat_opening", default=False)
_SESSIONS: Dict[Tuple, "S3Session"] = {}
#: url -> (session, size, etag) of every object whose size a checkpoint reader asked for.
_META: Dict[str, Tuple["S3Session", int, Optional[str]]] = {}
_LOCK = threading.Lock()


def is_remote(path: Any) -> bool:
    return isinstance(path, str) and path.startswith(SCHEME)


def split_url(url: str) -> Tuple[str, str]:
    """``s3://bucket/a/b`` -> ``("bucket", "a/b")``."""
    rest = url[len(SCHEME):]
    bucket, _, key = rest.partition("/")
    if not bucket:
        raise ValueError(f"no bucket in {url!r}")
    return bucket, key


def _import_obstore():
    try:
        import obstore  # noqa: F401
        import obstore.store  # noqa: F401
    except ImportError:
        raise ImportError(
            "reading s3:// checkpoints needs the 'obstore' package: pip install 'metamat[s3]'"
        ) from None
    return obstore


#: Keys of ``storage_options`` that are obstore client options, not S3 config.
_CLIENT_KEYS = {"allow_http", "timeout", "connect_timeout", "pool_max_idle_per_host",
                "http2_only", "allow_invalid_certificates"}
#: metamat's own keys.
_OWN_KEYS = {"max_concurrency", "part_bytes", "coalesce_gap", "attempts", "max_retries"}


class S3Session:
    """One set of storage options: an obstore S3Store per bucket, and read settings.

    Args:
        options: None (environment only) or a dict: obstore S3 config keys (``aws_endpoint``,
            ``aws_region``, ``aws_access_key_id``, ``aws_secret_access_key``,
            ``aws_session_token``, ...), client keys (``allow_http``, ``timeout``), and
            metamat's read settings (``max_concurrency``, ``part_bytes``, ``coalesce_gap``,
            ``attempts``, ``max_retries``).
    """

    def __init__(self, options: Optional[Mapping[str, Any]] = None) -> None:
        opts = dict(options or {})
        self.max_concurrency = int(opts.pop("max_concurrency", 16))
        self.part_bytes = int(opts.pop("part_bytes", 8 << 20))
        self.coalesce_gap = int(opts.pop("coalesce_gap", 64 << 10))
        self.attempts = int(opts.pop("attempts", 4))
        self.max_retries = int(opts.pop("max_retries", 3))
        self._client = {k: opts.pop(k) for k in list(opts) if k in _CLIENT_KEYS}
        self._config = opts
        self._stores: Dict[str, Any] = {}
        self._lock = threading.Lock()

    def __repr__(self) -> str:  # never the options: they may hold secrets
        return "S3Session(...)"

    def store(self, bucket: str):
        with self._lock:
            st = self._stores.get(bucket)
            if st is None:
                st = self._stores[bucket] = self._make_store(bucket)
            return st

    def _make_store(self, bucket: str):
        from datetime import timedelta
        _import_obstore()
        from obstore.store import S3Store
        cfg = dict(self._config)
        client = dict(self._client)
        endpoint = cfg.get("aws_endpoint") or cfg.get("endpoint") or os.environ.get(
            "AWS_ENDPOINT_URL_S3") or os.environ.get("AWS_ENDPOINT_URL")
        if endpoint:
            cfg.setdefault("aws_endpoint", endpoint)
            cfg.pop("endpoint", None)
            if endpoint.startswith("http://"):
                client.setdefault("allow_http", True)
        if "aws_region" not in cfg and "region" not in cfg and not (
                os.environ.get("AWS_REGION") or os.environ.get("AWS_DEFAULT_REGION")):
            cfg["aws_region"] = "us-east-1"
        kw: Dict[str, Any] = {}
        if (os.environ.get("AWS_PROFILE") and "aws_access_key_id" not in cfg
                and not os.environ.get("AWS_ACCESS_KEY_ID")):
            try:  # profiles (~/.aws/config, SSO) are resolved by boto3 when present
                from obstore.auth.boto3 import Boto3CredentialProvider
                kw["credential_provider"] = Boto3CredentialProvider()
            except ImportError:
                pass
        retry = {"max_retries": self.max_retries,
                 "backoff": {"init_backoff": timedelta(milliseconds=50),
                             "max_backoff": timedelta(seconds=2), "base": 2.0},
                 "retry_timeout": timedelta(seconds=60)}
        return S3Store(bucket, config=cfg, client_options=client, retry_config=retry, **kw)

    # -- object operations (errors are obstore's; callers name them) --
    def head(self, url: str) -> Optional[dict]:
        """The object's metadata (size, e_tag), None if there is none; retried.

        Raises:
            OSError: access denied, or the store unreachable after retries (no secrets in
                the message).
        """
        import obstore
        bucket, key = split_url(url)
        try:
            return self._retry(url, "stat", lambda: obstore.head(self.store(bucket), key))
        except FileNotFoundError:
            return None

    def _retry(self, url: str, what: str, fn):
        """``fn()`` retried with backoff; FileNotFoundError passes through; other failures
        end as OSError naming ``url`` (never the options)."""
        delay, last = 0.05, None
        for attempt in range(max(1, self.attempts)):
            if attempt:
                time.sleep(delay)
                delay = min(2 * delay, 2.0)
            try:
                return fn()
            except FileNotFoundError:
                raise
            except ImportError:
                raise
            except Exception as e:  # noqa: BLE001 - obstore's hierarchy
                last = e
                if type(e).__name__ in ("PermissionDeniedError", "UnauthenticatedError"):
                    break
        msg = str(last).splitlines()[0][:200] if str(last) else ""
        raise OSError(f"cannot {what} {url} ({type(last).__name__}: {msg})")

    def list_prefix(self, url: str, limit: Optional[int] = None) -> Tuple[List[str], List[str]]:
        """(object names, sub-prefix names) directly under ``url`` (a "directory")."""
        import obstore
        bucket, key = split_url(url)
        prefix = key.rstrip("/")
        r = self._retry(url, "list", lambda: obstore.list_with_delimiter(self.store(bucket),
                                                                        prefix or None))
        objs = [posixpath.basename(o["path"]) for o in r["objects"]]
        dirs = [posixpath.basename(p.rstrip("/")) for p in r["common_prefixes"]]
        return objs, dirs

    def get_range(self, url: str, start: int, end: int, etag: Optional[str] = None):
        """Bytes [start, end) of the object (If-Match ``etag`` when given)."""
        import obstore
        bucket, key = split_url(url)
        opts: Dict[str, Any] = {"range": (start, end)}
        if etag:
            opts["if_match"] = etag
        return obstore.get(self.store(bucket), key, options=opts).bytes()


def _key(options) -> Tuple:
    if not options:
        return ()
    return tuple(sorted((str(k), repr(v)) for k, v in dict(options).items()))


def session(options: Optional[Mapping[str, Any]] = None) -> S3Session:
    """The (cached) session for ``options``."""
    k = _key(options)
    with _LOCK:
        s = _SESSIONS.get(k)
        if s is None:
            s = _SESSIONS[k] = S3Session(options)
        return s


@contextlib.contextmanager
def using(options: Optional[Mapping[str, Any]]) -> Iterator[None]:
    """Parsers called inside see ``options`` for ``s3://`` paths."""
    tok = _CURRENT.set(dict(options) if options else None)
    tok2 = _OPENING.set(True)
    try:
        yield
    finally:
        _OPENING.reset(tok2)
        _CURRENT.reset(tok)


def current() -> S3Session:
    return session(_CURRENT.get())


def remote_meta(url: str) -> Tuple[S3Session, int, Optional[str]]:
    """(session, size, etag) recorded when a reader asked for ``url``'s size."""
    m = _META.get(url)
    if m is None:
        s = current()
        h = s.head(url)
        if h is None:
            raise FileNotFoundError(url)
        m = _META[url] = (s, int(h["size"]), h.get("e_tag"))
    return m


# ---------------------------------------------------------------- path operations
def exists(path: str) -> bool:
    if not is_remote(path):
        return os.path.exists(path)
    return isfile(path) or isdir(path)


def isfile(path: str) -> bool:
    if not is_remote(path):
        return os.path.isfile(path)
    if path.endswith("/") or not split_url(path)[1]:
        return False
    return current().head(path) is not None


def isdir(path: str) -> bool:
    if not is_remote(path):
        return os.path.isdir(path)
    objs, dirs = current().list_prefix(path.rstrip("/") + "/")
    return bool(objs or dirs)


def listdir(path: str) -> List[str]:
    if not is_remote(path):
        return os.listdir(path)
    objs, dirs = current().list_prefix(path.rstrip("/") + "/")
    return sorted(set(objs) | set(dirs))


def getsize(path: str) -> int:
    """Size in bytes; for an object, also records its ETag for the reads.

    Raises:
        FileNotFoundError, OSError.
    """
    if not is_remote(path):
        return os.stat(path).st_size
    known = _META.get(path)
    opening = _OPENING.get()
    s = known[0] if known is not None and not opening else current()
    h = s.head(path)
    if h is None:
        raise FileNotFoundError(path)
    if opening or known is None:
        _META[path] = (s, int(h["size"]), h.get("e_tag"))
    return int(h["size"])


def _split(path: str) -> Tuple[str, str]:
    bucket, key = split_url(path)
    return SCHEME + bucket, key


def join(a: str, *p: str) -> str:
    if not is_remote(a):
        return os.path.join(a, *p)
    return posixpath.join(a, *p)


def normpath(path: str) -> str:
    if not is_remote(path):
        return os.path.normpath(path)
    root, key = _split(path)
    key = posixpath.normpath("/" + key).lstrip("/")
    return root + "/" + key if key else root


def abspath(path: str) -> str:
    return normpath(path) if is_remote(path) else os.path.abspath(path)


def dirname(path: str) -> str:
    if not is_remote(path):
        return os.path.dirname(path)
    root, key = _split(path)
    d = posixpath.dirname(key)
    return root + "/" + d if d else root


def basename(path: str) -> str:
    return posixpath.basename(path) if is_remote(path) else os.path.basename(path)


# ---------------------------------------------------------------- metadata file objects
class S3File(io.RawIOBase):
    """A seekable read-only file over one object, for metadata parsing.

    Reads go through a small LRU of aligned blocks so a parser's many small reads cost few
    requests. Tensor data is not read through this (see :mod:`metamat.load.remote`).
    """

    BLOCK = 256 << 10

    def __init__(self, url: str, sess: S3Session, size: int, etag: Optional[str]) -> None:
        self.name = url
        self._s = sess
        self._size = size
        self._etag = etag
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
            from ..load.remote import fetch_range
            b = bytes(fetch_range(self._s, self.name, start, end, self._etag))
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
            from ..load.remote import fetch_range
            return bytes(fetch_range(self._s, self.name, off, end, self._etag))
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


def open_raw(path: str):
    """Open ``path`` for reading: a local binary file or an :class:`S3File`.

    Raises:
        FileNotFoundError, IsADirectoryError, OSError (as ``open``).
    """
    if not is_remote(path):
        return open(path, "rb")
    if path.endswith("/") or not split_url(path)[1]:
        raise IsADirectoryError(path)
    s = current()
    h = s.head(path)
    if h is None:
        if isdir(path):
            raise IsADirectoryError(path)
        raise FileNotFoundError(path)
    if _OPENING.get() or path not in _META:
        _META[path] = (s, int(h["size"]), h.get("e_tag"))
    return io.BufferedReader(S3File(path, s, int(h["size"]), h.get("e_tag")), 1 << 16)


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
