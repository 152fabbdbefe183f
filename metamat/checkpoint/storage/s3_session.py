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

Bounded, whatever the store does:

* **Time.** Every store call runs as a task on one background event loop and is waited for
  until a deadline (:class:`Deadline`: ``storage_options["deadline"]``, else
  ``METAMAT_S3_DEADLINE``, else 300 s), then cancelled, which drops its request: opening a
  checkpoint and a load's reads each end within it, also against a server that trickles
  bytes or answers a listing forever.
* **Listings.** A prefix is a "directory" if one object is under it (the first answer of a
  streamed listing); listing one streams it and stops at ``METAMAT_MAX_LIST_ENTRIES``
  entries (:class:`~.errors.LimitExceededError`). Nothing collects a whole listing.
* **Identity.** Each object is pinned at open on what the store gives (:class:`Pin`): its
  ETag (``If-Match``), else its version id (that version is read), else its Last-Modified
  time (``If-Unmodified-Since``, one-second resolution); each answer's own ETag,
  Last-Modified and size must agree. An object with none of the three cannot be pinned:
  :func:`unpinned` names it and the load's report warns.
"""
from __future__ import annotations

import asyncio
import concurrent.futures
import contextlib
import contextvars
import io
import os
import posixpath
import threading
import time
from collections import OrderedDict
from typing import Any, Callable, Dict, Iterator, List, Mapping, NamedTuple, Optional, Tuple

__all__ = ["is_remote", "split_url", "S3Session", "session", "using", "current",
           "exists", "isdir", "isfile", "listdir", "getsize", "join", "normpath", "abspath",
           "dirname", "basename", "open_raw", "remote_meta", "Pin", "Deadline",
           "DeadlineExceeded", "deadline", "unpinned", "DEFAULT_DEADLINE", "DEADLINE_ENV"]

SCHEME = "s3://"

#: storage_options of the open call in progress (parsers see it through :func:`current`).
_CURRENT: contextvars.ContextVar = contextvars.ContextVar("metamat_storage_options",
                                                         default=None)
#: True while a checkpoint is being opened: sizes looked up then record the ETag the reads
#: will require (later look-ups, e.g. the planner's re-check, keep it).
_OPENING: contextvars.ContextVar = contextvars.ContextVar("metamat_opening", default=False)
#: The deadline of the remote operation in progress (an open), see :func:`deadline`.
_DEADLINE: contextvars.ContextVar = contextvars.ContextVar("metamat_deadline", default=None)
_SESSIONS: Dict[Tuple, "S3Session"] = {}
#: url -> (session, size, pin) of every object whose size a checkpoint reader asked for.
_META: Dict[str, Tuple["S3Session", int, "Pin"]] = {}
_LOCK = threading.Lock()

#: Seconds a remote operation (an open, a load's reads) may take, unless
#: ``storage_options["deadline"]`` or the environment variable says otherwise. Below the ranks'
#: agreement timeout (``METAMAT_TIMEOUT``, 600 s): a rank whose store stalls raises its
#: ReadError in time for its peers to raise one naming it, rather than time out themselves.
DEFAULT_DEADLINE = 300.0
DEADLINE_ENV = "METAMAT_S3_DEADLINE"


class DeadlineExceeded(TimeoutError):
    """A store call did not finish before the operation's deadline (it was cancelled).
    An ``OSError``: callers turn it into a :class:`~.errors.ReadError` naming the object."""


class Deadline:
    """The end of one remote operation, ``seconds`` from now (monotonic clock)."""

    def __init__(self, seconds: float) -> None:
        self.seconds = float(seconds)
        self.end = time.monotonic() + self.seconds

    def left(self) -> float:
        return self.end - time.monotonic()

    def exceeded(self, what: str) -> DeadlineExceeded:
        return DeadlineExceeded(
            f"{what}: no answer within the deadline of {self.seconds:g} s (raise it with "
            f"storage_options={{'deadline': seconds}} or {DEADLINE_ENV})")


def deadline(sess: Optional["S3Session"] = None) -> Deadline:
    """The deadline of the open in progress, else a new one of ``sess``'s length."""
    d = _DEADLINE.get()
    return d if d is not None else Deadline((sess or current()).deadline)


def _deadline_seconds(raw: Any) -> float:
    """``raw`` (a ``deadline`` storage option) as seconds, else the environment's, else the
    default."""
    where = "storage_options['deadline']"
    if raw is None:
        raw, where = os.environ.get(DEADLINE_ENV), DEADLINE_ENV
    if raw is None:
        return DEFAULT_DEADLINE
    try:
        v = float(raw)
    except (TypeError, ValueError):
        v = float("nan")
    if not v > 0:  # also NaN
        raise ValueError(f"{where} must be a positive number of seconds, got {raw!r}")
    return v


# -- one background event loop runs every store call (obstore's async API): a call that
# outlives its deadline is cancelled there, which drops the request (a blocking call in a
# thread could only be abandoned, still reading or listing)
_LOOP: Optional[asyncio.AbstractEventLoop] = None
_LOOP_LOCK = threading.Lock()


def _loop() -> asyncio.AbstractEventLoop:
    global _LOOP
    with _LOOP_LOCK:
        if _LOOP is None or _LOOP.is_closed():
            loop = asyncio.new_event_loop()
            threading.Thread(target=loop.run_forever, name="metamat-s3-loop",
                             daemon=True).start()
            _LOOP = loop
        return _LOOP


def _after_fork_in_child() -> None:
    """A forked child has the loop object but not its thread: it makes its own."""
    global _LOOP, _LOOP_LOCK
    _LOOP, _LOOP_LOCK = None, threading.Lock()


if hasattr(os, "register_at_fork"):
    os.register_at_fork(after_in_child=_after_fork_in_child)


def run(make: Callable[[], Any], dl: Deadline, what: str):
    """``await make()`` on the store loop, waited for until ``dl``; cancelled after it.

    Raises:
        DeadlineExceeded: ``dl`` passed (``what`` names the object and request).
        Whatever the call raises.
    """
    left = dl.left()
    if left <= 0:
        raise dl.exceeded(what)

    async def call():  # obstore's awaitables are made on the loop that awaits them
        return await make()
    fut = asyncio.run_coroutine_threadsafe(call(), _loop())
    try:
        return fut.result(timeout=min(left, threading.TIMEOUT_MAX))
    except concurrent.futures.TimeoutError:
        fut.cancel()
        raise dl.exceeded(what) from None
    except BaseException:  # KeyboardInterrupt while waiting: stop the request too
        fut.cancel()
        raise


class Pin(NamedTuple):
    """What an object was at open, as far as the store tells (from HEAD): the reads require
    the same object through the strongest conditional the store offers."""

    etag: Optional[str] = None
    version: Optional[str] = None
    modified: Optional[Any] = None  # datetime; None: the store gave no Last-Modified

    @classmethod
    def of(cls, meta: Mapping[str, Any]) -> "Pin":
        lm = meta.get("last_modified")
        if lm is not None and lm.timestamp() <= 0:  # obstore's stand-in when the header is absent
            lm = None
        return cls(meta.get("e_tag") or None, meta.get("version") or None, lm)

    @property
    def by(self) -> Optional[str]:
        """What pins the object: "ETag", "version id", "Last-Modified", or None."""
        return ("ETag" if self.etag else "version id" if self.version
                else "Last-Modified" if self.modified is not None else None)

    def options(self) -> Dict[str, Any]:
        """The GET options that make a read of another object fail (or read this version)."""
        if self.etag:
            return {"if_match": self.etag}
        if self.version:
            return {"version": self.version}
        if self.modified is not None:
            return {"if_unmodified_since": self.modified}
        return {}

    def differs(self, meta: Mapping[str, Any], size: int) -> Optional[str]:
        """Why an answer's own metadata says it is not the object pinned, or None."""
        if meta.get("size") is not None and int(meta["size"]) != size:
            return f"its size is {meta['size']}, not {size}"
        tag = meta.get("e_tag")
        if self.etag and tag and tag != self.etag:
            return f"its ETag is {tag}, not {self.etag}"
        lm = meta.get("last_modified")
        if self.modified is not None and lm is not None and lm.timestamp() > 0 \
                and lm != self.modified:
            return f"it was modified at {lm.isoformat()}, not {self.modified.isoformat()}"
        return None

    def describe(self) -> str:
        return {"ETag": f"ETag {self.etag}", "version id": f"version {self.version}",
                "Last-Modified": f"Last-Modified {self.modified.isoformat()}"
                if self.modified is not None else ""}.get(self.by or "", "nothing")


def unpinned(urls) -> List[str]:
    """Those of ``urls`` (opened objects) that nothing pins: no ETag, version id or
    Last-Modified, so a rewrite between open and read would go unseen."""
    return [u for u in urls if u in _META and _META[u][2].by is None]


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
_OWN_KEYS = {"max_concurrency", "part_bytes", "coalesce_gap", "attempts", "max_retries",
             "deadline"}


class S3Session:
    """One set of storage options: an obstore S3Store per bucket, and read settings.

    Args:
        options: None (environment only) or a dict: obstore S3 config keys (``aws_endpoint``,
            ``aws_region``, ``aws_access_key_id``, ``aws_secret_access_key``,
            ``aws_session_token``, ...), client keys (``allow_http``, ``timeout``), and
            metamat's read settings (``max_concurrency``, ``part_bytes``, ``coalesce_gap``,
            ``attempts``, ``max_retries``, ``deadline``: seconds an open, or a load's reads,
            may take in all, default ``METAMAT_S3_DEADLINE`` else 300).

    Raises:
        ValueError: a ``deadline`` (or ``METAMAT_S3_DEADLINE``) that is not a positive number.
    """

    def __init__(self, options: Optional[Mapping[str, Any]] = None) -> None:
        opts = dict(options or {})
        self.max_concurrency = int(opts.pop("max_concurrency", 16))
        self.part_bytes = int(opts.pop("part_bytes", 8 << 20))
        self.coalesce_gap = int(opts.pop("coalesce_gap", 64 << 10))
        self.attempts = int(opts.pop("attempts", 4))
        self.max_retries = int(opts.pop("max_retries", 3))
        self._deadline = opts.pop("deadline", None)
        _deadline_seconds(self._deadline)  # a bad value fails here, at open
        self._client = {k: opts.pop(k) for k in list(opts) if k in _CLIENT_KEYS}
        self._config = opts
        self._stores: Dict[str, Any] = {}
        self._lock = threading.Lock()

    def __repr__(self) -> str:  # never the options: they may hold secrets
        return "S3Session(...)"

    @property
    def deadline(self) -> float:
        """Seconds an open, or a load's reads, may take (the environment is read each time,
        as the limits are)."""
        return _deadline_seconds(self._deadline)

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
                 "retry_timeout": timedelta(seconds=min(60.0, self.deadline))}
        return S3Store(bucket, config=cfg, client_options=client, retry_config=retry, **kw)

    # -- object operations (errors are obstore's; callers name them) --
    def head(self, url: str) -> Optional[dict]:
        """The object's metadata (size, e_tag, last_modified, version), None if there is
        none; retried, within the deadline.

        Raises:
            OSError: access denied, the store unreachable after retries, or the deadline
                passed (:class:`DeadlineExceeded`); no secrets in the message.
        """
        import obstore
        bucket, key = split_url(url)
        store = self.store(bucket)
        try:
            return self._retry(url, "stat", lambda: obstore.head_async(store, key))
        except FileNotFoundError:
            return None

    def _retry(self, url: str, what: str, make):
        """``await make()`` retried with backoff, all within the deadline; FileNotFoundError
        and LimitExceededError pass through; other failures end as OSError naming ``url``
        (never the options)."""
        from .errors import CheckpointError
        dl = deadline(self)
        delay, last = 0.05, None
        for attempt in range(max(1, self.attempts)):
            if attempt:
                time.sleep(max(0.0, min(delay, dl.left())))
                delay = min(2 * delay, 2.0)
            try:
                return run(make, dl, f"{what} {url}")
            except (FileNotFoundError, ImportError, DeadlineExceeded, CheckpointError):
                raise
            except Exception as e:  # noqa: BLE001 - obstore's hierarchy
                last = e
                if type(e).__name__ in ("PermissionDeniedError", "UnauthenticatedError"):
                    break
        msg = str(last).splitlines()[0][:200] if str(last) else ""
        raise OSError(f"cannot {what} {url} ({type(last).__name__}: {msg})")

    def any_under(self, url: str) -> bool:
        """Whether an object's key starts with ``url``'s key (a "directory" when it ends in
        "/"): the first answer of a streamed listing, never the whole listing."""
        import obstore
        bucket, key = split_url(url)
        store = self.store(bucket)

        async def first() -> bool:
            async for chunk in obstore.list(store, key.rstrip("/") or None, chunk_size=1):
                if len(chunk):
                    return True
            return False
        return self._retry(url, "list", first)

    def names_under(self, url: str) -> List[str]:
        """The names directly under the prefix ``url`` (objects and sub-prefixes), from a
        streamed listing of everything under it, stopped at ``METAMAT_MAX_LIST_ENTRIES``.

        Raises:
            LimitExceededError: more entries than the limit (a listing that never ends).
            OSError: as :meth:`head`.
        """
        import obstore

        from .limits import LIST_ENTRIES, check
        bucket, key = split_url(url)
        store = self.store(bucket)
        prefix = key.rstrip("/")
        base = prefix + "/" if prefix else ""

        async def collect() -> List[str]:
            names, seen = set(), 0
            async for chunk in obstore.list(store, prefix or None, chunk_size=1000):
                seen += len(chunk)
                check(LIST_ENTRIES, seen, file=url, what="entries listed under the prefix")
                for meta in chunk:
                    path = meta["path"]
                    if path.startswith(base) and len(path) > len(base):
                        names.add(path[len(base):].split("/", 1)[0])
            return sorted(names)
        return self._retry(url, "list", collect)

    def get_range(self, url: str, start: int, end: int, pin: Optional["Pin"] = None,
                  dl: Optional[Deadline] = None, size: Optional[int] = None):
        """Bytes [start, end) of the object, within the deadline ``dl``: the read requires
        the object ``pin`` names (:meth:`Pin.options`), and an answer whose own metadata
        differs (ETag, Last-Modified, or total ``size``) raises ``PinMismatch``.

        Raises:
            DeadlineExceeded, PinMismatch, and obstore's errors.
        """
        import obstore
        bucket, key = split_url(url)
        store = self.store(bucket)
        opts: Dict[str, Any] = {"range": (start, end)}
        if pin is not None:
            opts.update(pin.options())

        async def get():
            r = await obstore.get_async(store, key, options=opts)
            if pin is not None and size is not None:
                why = pin.differs(r.meta, size)
                if why:
                    raise PinMismatch(why)
            return await r.bytes_async()
        return run(get, dl or deadline(self), f"read bytes [{start}, {end}) of {url}")


class PinMismatch(Exception):
    """An answer's own metadata says the object is no longer the one opened."""


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
    tok3 = _DEADLINE.set(Deadline(session(options).deadline))  # the whole open
    try:
        yield
    finally:
        _DEADLINE.reset(tok3)
        _OPENING.reset(tok2)
        _CURRENT.reset(tok)


def current() -> S3Session:
    return session(_CURRENT.get())


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
    """A local directory, or a prefix with at least one object under it (one listing
    answer, however long the listing)."""
    if not is_remote(path):
        return os.path.isdir(path)
    return current().any_under(path.rstrip("/") + "/")


def listdir(path: str) -> List[str]:
    """Names in a local directory or directly under a prefix.

    Raises:
        LimitExceededError: a prefix with more than ``METAMAT_MAX_LIST_ENTRIES`` objects
            under it (the listing is streamed and stopped there).
    """
    if not is_remote(path):
        return os.listdir(path)
    return current().names_under(path.rstrip("/") + "/")


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
        _META[path] = (s, int(h["size"]), Pin.of(h))
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
            from ..load.remote import fetch_range
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
            from ..load.remote import fetch_range
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
    pin = Pin.of(h)
    if _OPENING.get() or path not in _META:
        _META[path] = (s, int(h["size"]), pin)
    return io.BufferedReader(S3File(path, s, int(h["size"]), pin), 1 << 16)


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
