"""S3 sessions: an obstore ``S3Store`` per bucket for one set of storage options, the open in
progress (its options and deadline), and what pins an object to the one opened.

S3 access uses ``obstore`` (Rust ``object_store``), imported only when an ``s3://`` path is
opened (``pip install metamat[s3]``). Credentials, region and endpoint come from the usual
environment (``AWS_ACCESS_KEY_ID``, ``AWS_SECRET_ACCESS_KEY``, ``AWS_SESSION_TOKEN``,
``AWS_REGION``, ``AWS_ENDPOINT_URL``; ``AWS_PROFILE`` through boto3 when it is installed) or
an explicit ``storage_options`` dict (obstore S3 config keys such as ``aws_endpoint``,
``aws_access_key_id``, ``aws_region``, plus ``allow_http``); they are never logged or put in
error messages.

Bounded, whatever the store does:

* **Time.** Every store call runs on one background event loop until a deadline
  (:mod:`.s3_deadline`: ``storage_options["deadline"]``, else ``METAMAT_S3_DEADLINE``, else
  300 s), then is cancelled: opening a checkpoint and a load's reads each end within it, also
  against a server that trickles bytes or answers a listing forever.
* **Listings.** A prefix is a "directory" if one object is under it (the first answer of a
  streamed listing); listing one streams it and stops at ``METAMAT_MAX_LIST_ENTRIES``
  entries (:class:`~metamat.checkpoint.errors.LimitExceededError`). Nothing collects a whole
  listing.
* **Identity.** Each object is pinned at open on what the store gives (:class:`Pin`): its
  ETag (``If-Match``), else its version id (that version is read), else its Last-Modified
  time (``If-Unmodified-Since``, one-second resolution); each answer's own ETag,
  Last-Modified and size must agree.
"""
from __future__ import annotations

import contextlib
import contextvars
import os
import threading
import time
from typing import Any, Dict, Iterator, List, Mapping, NamedTuple, Optional, Tuple

from ..errors import CheckpointError
from ..limits import LIST_ENTRIES, check
from .s3_deadline import Deadline, DeadlineExceeded, deadline_seconds, run

__all__ = ["SCHEME", "split_url", "S3Session", "session", "using", "current", "opening",
           "deadline", "Pin", "PinMismatch"]

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
_LOCK = threading.Lock()


def deadline(sess: Optional["S3Session"] = None) -> Deadline:
    """The deadline of the open in progress, else a new one of ``sess``'s length."""
    d = _DEADLINE.get()
    return d if d is not None else Deadline((sess or current()).deadline)


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
        deadline_seconds(self._deadline)  # a bad value fails here, at open
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
        return deadline_seconds(self._deadline)

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


def opening() -> bool:
    """True while a checkpoint is being opened (inside :func:`using`)."""
    return _OPENING.get()
