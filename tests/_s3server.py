"""A real S3-compatible server on loopback for tests and the S3 bench.

:class:`S3Server` starts moto's ``ThreadedMotoServer`` on a free port, creates a bucket and
puts a fault-injecting HTTP proxy (:class:`FaultProxy`) in front of it: clients talk HTTP to
the proxy, which forwards to moto, or, while faults are queued, answers the next matching
requests with a 503 SlowDown, drops the connection without answering, or sends the status
and full ``Content-Length`` but only half of the body. Hostile behaviours that last until
:meth:`FaultProxy.clear` (:meth:`FaultProxy.behave`): a listing that never ends (every page
says ``IsTruncated``), ranged bodies trickled at a few bytes per second, responses without
``ETag`` (and ``Last-Modified``).
"""
from __future__ import annotations

import http.client
import os
import socket
import threading
import time
import urllib.parse
from email.utils import formatdate
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Dict, List, Optional

__all__ = ["S3Server", "FaultProxy", "upload_dir"]

_SLOWDOWN = (b'<?xml version="1.0" encoding="UTF-8"?><Error><Code>SlowDown</Code>'
             b"<Message>Please reduce your request rate.</Message></Error>")


class _Handler(BaseHTTPRequestHandler):
    protocol_version = "HTTP/1.1"

    def log_message(self, *a) -> None:  # quiet
        pass

    def _serve(self) -> None:
        px: FaultProxy = self.server.proxy  # type: ignore[attr-defined]
        n = int(self.headers.get("Content-Length") or 0)
        body = self.rfile.read(n) if n else None
        fault = px.take(self.command, self.headers.get("Range") is not None)
        px.count(self.command, self.headers.get("Range"))
        query = urllib.parse.parse_qs(urllib.parse.urlsplit(self.path).query)
        if px.list_endless is not None and self.command == "GET" and "list-type" in query:
            self._endless_page(px, query)
            return
        if fault == "503":
            self.send_response(503)
            self.send_header("Content-Type", "application/xml")
            self.send_header("Content-Length", str(len(_SLOWDOWN)))
            self.end_headers()
            if self.command != "HEAD":
                self.wfile.write(_SLOWDOWN)
            return
        if fault == "drop":
            self.close_connection = True
            try:
                self.connection.shutdown(socket.SHUT_RDWR)
            except OSError:
                pass
            return
        conn = http.client.HTTPConnection(px.upstream_host, px.upstream_port, timeout=60)
        try:
            hdrs = {k: v for k, v in self.headers.items() if k.lower() != "connection"}
            conn.request(self.command, self.path, body=body, headers=hdrs)
            r = conn.getresponse()
            data = r.read()
        finally:
            conn.close()
        self.send_response(r.status, r.reason)
        drop = {"connection", "transfer-encoding", "content-length", "server", "date"}
        drop |= {h.lower() for h in px.strip}
        for k, v in r.getheaders():
            if k.lower() not in drop:
                self.send_header(k, v)
        if self.command == "HEAD":
            self.send_header("Content-Length", r.getheader("Content-Length", "0"))
        else:
            self.send_header("Content-Length", str(len(data)))
        if fault == "truncate":
            self.send_header("Connection", "close")
        self.end_headers()
        if self.command == "HEAD":
            return
        if fault == "truncate":
            self.wfile.write(data[:len(data) // 2])
            self.wfile.flush()
            self.close_connection = True
            try:
                self.connection.shutdown(socket.SHUT_RDWR)
            except OSError:
                pass
            return
        if px.slow and self.command == "GET" and self.headers.get("Range") is not None:
            self._trickle(px, data)
            return
        self.wfile.write(data)

    def _trickle(self, px: "FaultProxy", data: bytes) -> None:
        """The body at ``px.slow`` bytes per second, until done or the client goes away."""
        self.wfile.flush()
        try:
            for i in range(0, len(data), px.slow):
                if px.stopping:
                    break
                self.wfile.write(data[i:i + px.slow])
                self.wfile.flush()
                time.sleep(1.0)
        except OSError:  # the client gave up: what a deadline should make it do
            pass
        self.close_connection = True

    def _endless_page(self, px: "FaultProxy", query) -> None:
        """A ListObjectsV2 page that says there is always another one: ``px.list_endless``
        keys per page (0: empty pages), each page a new continuation token."""
        prefix = (query.get("prefix") or [""])[0]
        token = (query.get("continuation-token") or ["0"])[0]
        page = int(token) + 1 if token.isdigit() else 1
        with px._lock:
            px.list_pages += 1
        when = formatdate(usegmt=True)
        keys = "".join(
            f"<Contents><Key>{prefix}junk-{page}-{i:06d}.safetensors</Key>"
            f"<LastModified>2024-01-01T00:00:00.000Z</LastModified><ETag>&quot;x&quot;</ETag>"
            f"<Size>8</Size><StorageClass>STANDARD</StorageClass></Contents>"
            for i in range(px.list_endless))
        xml = ('<?xml version="1.0" encoding="UTF-8"?><ListBucketResult '
               'xmlns="http://s3.amazonaws.com/doc/2006-03-01/"><Name>b</Name>'
               f"<Prefix>{prefix}</Prefix><KeyCount>{px.list_endless}</KeyCount>"
               f"<MaxKeys>1000</MaxKeys><IsTruncated>true</IsTruncated>{keys}"
               f"<NextContinuationToken>{page}</NextContinuationToken></ListBucketResult>"
               ).encode()
        self.send_response(200)
        self.send_header("Content-Type", "application/xml")
        self.send_header("Content-Length", str(len(xml)))
        self.send_header("Last-Modified", when)
        self.end_headers()
        try:
            self.wfile.write(xml)
        except OSError:
            pass

    do_GET = do_HEAD = do_PUT = do_POST = do_DELETE = _serve


class FaultProxy:
    """HTTP proxy on 127.0.0.1 in front of ``upstream`` with a queue of faults.

    ``inject(mode, n, ranged_only=True)`` makes the next ``n`` GETs (with a Range header, by
    default) fail as ``mode``: ``"503"``, ``"drop"`` or ``"truncate"``. ``behave(...)`` sets
    lasting hostile behaviours (see there).
    """

    def __init__(self, upstream_host: str, upstream_port: int) -> None:
        self.upstream_host, self.upstream_port = upstream_host, upstream_port
        self._faults: List[str] = []
        self._ranged_only = True
        self._lock = threading.Lock()
        self.requests: List[tuple] = []
        self.list_endless: Optional[int] = None
        self.list_pages = 0
        self.slow = 0
        self.strip: tuple = ()
        self.stopping = False
        self.srv = ThreadingHTTPServer(("127.0.0.1", 0), _Handler)
        self.srv.daemon_threads = True
        self.srv.proxy = self  # type: ignore[attr-defined]
        self.port = self.srv.server_address[1]
        self._t = threading.Thread(target=self.srv.serve_forever, daemon=True)
        self._t.start()

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def inject(self, mode: str, n: int = 1, ranged_only: bool = True) -> None:
        with self._lock:
            self._faults.extend([mode] * n)
            self._ranged_only = ranged_only

    def behave(self, *, list_endless: Optional[int] = None, slow: int = 0,
               strip: tuple = ()) -> None:
        """Lasting hostile behaviours, until :meth:`clear`.

        Args:
            list_endless: every ListObjectsV2 request is answered by a page of this many new
                keys (0: none) that says another page follows (``IsTruncated``), forever.
            slow: ranged GET bodies are sent at this many bytes per second.
            strip: response headers left out (e.g. ``("ETag", "Last-Modified")``).
        """
        with self._lock:
            self.list_endless, self.slow, self.strip = list_endless, slow, tuple(strip)
            self.list_pages = 0

    def clear(self) -> None:
        with self._lock:
            self._faults.clear()
            self.requests.clear()
            self.list_endless, self.slow, self.strip, self.list_pages = None, 0, (), 0

    def pending(self) -> int:
        with self._lock:
            return len(self._faults)

    def take(self, method: str, ranged: bool) -> Optional[str]:
        with self._lock:
            if self._faults and method == "GET" and (ranged or not self._ranged_only):
                return self._faults.pop(0)
            return None

    def count(self, method: str, rng: Optional[str]) -> None:
        with self._lock:
            self.requests.append((method, rng))

    def stop(self) -> None:
        self.stopping = True
        self.srv.shutdown()
        self.srv.server_close()


_CHILD = r"""
import sys, time
from moto.server import ThreadedMotoServer
if sys.argv[2] == "1":
    # moto's FakeKey.value re-reads the whole object from its spooled temp file under a
    # per-key lock on every GET, so a ranged GET costs O(object) there and concurrent GETs of
    # one object are serialised. Keep the bytes once per write instead, so a range costs what
    # it costs on a real store (the bench measures the client, not moto).
    from moto.s3 import models as m
    prop = m.FakeKey.value
    def _get(self):
        c = getattr(self, "_mm_cache", None)
        if c is None or c[0] != self.contentsize:
            c = self._mm_cache = (self.contentsize, prop.fget(self))
        return c[1]
    def _set(self, v):
        self._mm_cache = None
        prop.fset(self, v)
    m.FakeKey.value = property(_get, _set)
srv = ThreadedMotoServer(ip_address="127.0.0.1", port=int(sys.argv[1]), verbose=False)
srv.start()
print("ready", flush=True)
sys.stdin.read()
srv.stop()
"""


class _ChildMoto:
    """moto in its own process (no GIL shared with the client being measured)."""

    def __init__(self, fast_ranges: bool) -> None:
        import subprocess
        import sys
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            self.port = s.getsockname()[1]
        self.p = subprocess.Popen([sys.executable, "-c", _CHILD, str(self.port),
                                   "1" if fast_ranges else "0"], stdin=subprocess.PIPE,
                                  stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True)
        line = self.p.stdout.readline()
        if "ready" not in line:
            raise RuntimeError("moto server did not start")

    def get_host_and_port(self):
        return "127.0.0.1", self.port

    def stop(self) -> None:
        try:
            self.p.stdin.close()
            self.p.wait(timeout=10)
        except Exception:  # noqa: BLE001
            self.p.kill()
            self.p.wait()


class S3Server:
    """moto on loopback with a bucket, and a :class:`FaultProxy` in front of it.

    Args:
        process: run moto in a child process (the bench) instead of a thread.
        fast_ranges: with ``process``, make moto's ranged GETs cost O(range) (see _CHILD).
    """

    def __init__(self, bucket: str = "ckpts", process: bool = False,
                 fast_ranges: bool = False) -> None:
        if process:
            self.moto = _ChildMoto(fast_ranges)
        else:
            from moto.server import ThreadedMotoServer
            self.moto = ThreadedMotoServer(ip_address="127.0.0.1", port=0, verbose=False)
            self.moto.start()
        host, port = self.moto.get_host_and_port()
        self.direct_url = f"http://{host}:{port}"
        self.proxy = FaultProxy(host, port)
        self.bucket = bucket
        self.options(direct=True)
        import obstore
        from obstore.store import S3Store
        self.store = S3Store(bucket, config={"aws_endpoint": self.direct_url,
                                             "aws_access_key_id": "testing",
                                             "aws_secret_access_key": "testing",
                                             "aws_region": "us-east-1"},
                             client_options={"allow_http": True})
        import urllib.request
        req = urllib.request.Request(f"{self.direct_url}/{bucket}", method="PUT")
        urllib.request.urlopen(req).read()
        self._obstore = obstore

    def options(self, direct: bool = False, **extra) -> Dict:
        """storage_options reaching the server through the proxy (or ``direct``)."""
        d = {"aws_endpoint": self.direct_url if direct else self.proxy.url,
             "aws_access_key_id": "testing", "aws_secret_access_key": "testing",
             "aws_region": "us-east-1", "allow_http": True}
        d.update(extra)
        return d

    def url(self, key: str) -> str:
        return f"s3://{self.bucket}/{key}"

    def put(self, key: str, data: bytes) -> None:
        self._obstore.put(self.store, key, data)

    def stop(self) -> None:
        self.proxy.stop()
        self.moto.stop()


def upload_dir(server: S3Server, local: str, prefix: str) -> str:
    """Upload every file under ``local`` to ``prefix``; returns the s3:// URL of the prefix
    (or of the file when ``local`` is a file)."""
    if os.path.isfile(local):
        with open(local, "rb") as f:
            server.put(prefix, f.read())
        return server.url(prefix)
    for root, _, files in os.walk(local):
        for fn in files:
            p = os.path.join(root, fn)
            rel = os.path.relpath(p, local).replace(os.sep, "/")
            with open(p, "rb") as f:
                server.put(f"{prefix}/{rel}", f.read())
    return server.url(prefix)
