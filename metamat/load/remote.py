"""Execute a load plan whose files are objects in an S3-compatible store.

The plan's ops become byte ranges (a strided op is one span when its row gaps are small, else
one range per row); ranges of one object closer than ``coalesce_gap`` are merged and long ones
cut into ``part_bytes`` parts, so a rank requests about the bytes it needs in requests big
enough to be efficient (ops staged through the buffer are first cut to about ``part_bytes``
of source each). Requests run ``max_concurrency`` at a time (ranged GETs pinned to the object
opened: ``If-Match: <ETag>``, else its version id, else ``If-Unmodified-Since``; see
:class:`~metamat.checkpoint.storage.Pin`) into a host buffer of at most ``staging_bytes`` (pinned
when a destination is on CUDA); each batch's bytes are then copied into the destinations by
torch (``copy_`` converts float32/float16/bfloat16, round to nearest even, as the file reader
does; CUDA copies are asynchronous from the pinned buffer, one batch in flight).

Throttling (503 SlowDown, 429) and transient failures (connection reset, a truncated body, a
timeout) are retried with exponential backoff by the client (``max_retries``) and again here
(``attempts``, also for short bodies the client accepted); when they run out a
:class:`~metamat.checkpoint.errors.ReadError` names the object and the byte range. An object
that changed since the checkpoint was opened (ETag, version or Last-Modified, or an answer
whose own ETag, Last-Modified or size differ) is a ReadError at once. The reads of one load
end within the session's deadline (``storage_options["deadline"]`` / ``METAMAT_S3_DEADLINE``,
300 s): a request still running then is cancelled and the load raises a ReadError naming the
object and range, on every rank (a slow or stuck store included).
"""
from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Callable, Dict, List, Optional, Sequence

import torch

from ..budget import groups_within
from ..checkpoint import storage as fs
from ..checkpoint.errors import ReadError
from ..checkpoint.storage import fetch_range
from ..dtypes import itemsize
from .execute import Executed
from .ops import ReadOp, split_ops
from .plan import ReadPlan

__all__ = ["execute_plan_remote", "plan_requests", "batch_requests", "RemoteStats"]


@dataclass
class _Piece:
    """Rows [r0, r0 + rows) of op ``op``: one contiguous source span."""

    op: int
    r0: int
    rows: int
    start: int
    end: int
    req: int = -1


@dataclass
class RemoteStats:
    requests: int = 0
    bytes_requested: int = 0


def plan_requests(ops: Sequence[ReadOp], gap: int, part: int,
                  direct: Optional[Sequence[bool]] = None):
    """Pieces (contiguous source spans of ops) and requests ``(file, start, end, direct)``.

    A strided op is one span when its row gap is at most ``gap``; ranges of one file at most
    ``gap`` apart are merged into one request (up to ``part`` bytes, or overlapping). An op
    with ``direct[i]`` (contiguous on both sides, no conversion, host memory, large) is its own
    request, read straight into the destination (the fetcher cuts long requests in parts).
    """
    pieces: List[_Piece] = []
    for i, o in enumerate(ops):
        if o.rows == 1 or o.src_stride - o.row_bytes <= gap:
            end = o.file_offset + (o.rows - 1) * o.src_stride + o.row_bytes
            pieces.append(_Piece(i, 0, o.rows, o.file_offset, end))
        else:
            for r in range(o.rows):
                s = o.file_offset + r * o.src_stride
                pieces.append(_Piece(i, r, 1, s, s + o.row_bytes))
    order = sorted(range(len(pieces)),
                   key=lambda k: (ops[pieces[k].op].file_index, pieces[k].start))
    reqs: List[List] = []  # [file, start, end, direct]
    for k in order:
        p = pieces[k]
        f = ops[p.op].file_index
        d = bool(direct[p.op]) if direct is not None else False
        if reqs and not d:
            r = reqs[-1]
            if (not r[3] and r[0] == f and p.start <= r[2] + gap
                    and (p.end - r[1] <= part or p.start < r[2])):
                r[2] = max(r[2], p.end)
                p.req = len(reqs) - 1
                continue
        reqs.append([f, p.start, p.end, d])
        p.req = len(reqs) - 1
    return pieces, [tuple(r) for r in reqs]


def batch_requests(reqs: Sequence[tuple], cap: int) -> List[List[int]]:
    """Indexes of ``(file, start, end, direct)`` requests in batches of whole requests, in
    order: each batch's staged ones fit the staging buffer, and a batch has at most ``cap``
    bytes in flight (progress and KeyboardInterrupt land between batches)."""
    return groups_within([(e - s + (s % 64) + 63) & ~63 for _, s, e, _d in reqs], cap)


def _split(reqs, part: int):
    """Cut each request into parts of at most ``part`` bytes: (request, start, end)."""
    out = []
    for i, (_, s, e, *_d) in enumerate(reqs):
        p = s
        while p < e:
            q = min(e, p + part)
            out.append((i, p, q))
            p = q
    return out


#: Ops at least this big that need no conversion and are contiguous on both sides are read
#: straight into host destinations (no staging copy).
DIRECT_BYTES = 1 << 20


def _direct_ok(op: ReadOp, t: torch.Tensor) -> bool:
    return (t.device.type == "cpu" and not op.converts and op.src_bytes >= DIRECT_BYTES
            and (op.rows == 1 or (op.src_stride == op.row_bytes
                                  and op.dst_stride == op.dst_row_bytes)))


def _cut(ops: Sequence[ReadOp], targets, part: int) -> List[ReadOp]:
    """Ops that go through the staging buffer cut so each spans at most about ``part`` source
    bytes (by rows, else inside a row): the buffer stays within ``max(staging_bytes, part)``.
    Direct ops stay whole (they are fetched in parts straight into place)."""
    out: List[ReadOp] = []
    for o in ops:
        if _direct_ok(o, targets[o.dst_index].tensor):
            out.append(o)
            continue
        if o.rows > 1:
            span = max(o.src_stride, o.row_bytes)
            cap = part * o.dst_row_bytes // span
        else:
            cap = part * o.dst_row_bytes // max(1, o.row_bytes)
        cap = max(cap, itemsize(o.dst_dtype))
        out.extend(split_ops([o], cap))
    return out


def _typed(u8: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    if dtype == torch.uint8:
        return u8
    isz = itemsize(dtype)
    if u8.storage_offset() % isz:
        u8 = u8.clone()
    return u8.view(dtype)


def _dst(t: torch.Tensor, op: ReadOp, r0: int, rows: int) -> torch.Tensor:
    """The destination elements of rows [r0, r0+rows) of ``op`` as a (rows, n) typed view."""
    dt = op.dst_dtype
    isz = itemsize(dt)
    n = op.dst_row_bytes // isz
    byte = t.storage_offset() * isz + op.dst_offset + r0 * op.dst_stride
    stride = op.dst_stride // isz if rows > 1 else n
    flat = torch.empty(0, dtype=dt, device=t.device).set_(
        t.untyped_storage(), 0, (t.untyped_storage().nbytes() // isz,), (1,))
    return flat.as_strided((rows, n), (stride, 1), byte // isz)


def _wait(gpus: Sequence[torch.device]) -> None:
    """Wait for the work queued on each of ``gpus`` (``torch.cuda.synchronize()`` with no
    device waits for the current one only)."""
    for d in gpus:
        torch.cuda.synchronize(d)


def execute_plan_remote(plan: ReadPlan, *, staging_bytes: int = 256 << 20,
                        progress: Optional[Callable[[int, int], None]] = None,
                        verify=None, stats: Optional[RemoteStats] = None) -> Executed:
    """Run ``plan`` (its files are ``s3://`` objects) into its targets' tensors (any device).

    Args:
        verify: None or the checkpoint's checksum ``Manifest``: every block the reads touch
            is hashed before its batch is copied into place (:mod:`.remote_verify`).

    Returns:
        :class:`~metamat.load.execute.Executed` (``bytes_read``: bytes requested;
        ``bytes_verified``/``bytes_reread``: with ``verify``; ``warnings``: objects nothing
        could pin, see :func:`~metamat.checkpoint.storage.unpinned`).

    Raises:
        ReadError: an object is gone, changed, or unreadable after retries, or the deadline
            passed (named); the destinations may be partly written (materialize writes into
            fresh memory).
        ChecksumMismatchError: with ``verify``, bytes that differ from the manifest, or an
            object it does not list or whose size differs (then before any read).
    """
    known = plan.pins or {}
    metas = [known.get(f) or fs.remote_meta(f) for f in plan.files]
    sess = metas[0][0] if metas else fs.current()
    dl = fs.Deadline(sess.deadline)  # every read of this load ends by then
    ops = _cut(plan.ops, plan.targets, sess.part_bytes)
    direct = [_direct_ok(o, plan.targets[o.dst_index].tensor) for o in ops]
    pieces, reqs = plan_requests(ops, sess.coalesce_gap, sess.part_bytes, direct)
    verifier = None
    if verify is not None:
        from .remote_verify import RemoteVerifier
        verifier = RemoteVerifier(verify, plan.files, [m[1] for m in metas], ops)
        reqs = verifier.with_block_edges(reqs)
    for (f, s, e, _d) in reqs:
        size = metas[f][1]
        if e > size:
            raise ReadError(f"read [{s}, {e}) past end of object ({size} B)",
                            file=plan.files[f])
    # the GPUs whose streams copy out of the pinned buffer (each copy runs on its
    # destination's stream, current device or not): all waited for before the buffer refills
    gpus = sorted({t.tensor.device for t in plan.targets if t.tensor.device.type == "cuda"},
                  key=str)
    pin = bool(gpus) and torch.cuda.is_available()
    cap = max(max((e - s for _, s, e, d in reqs if not d), default=0), int(staging_bytes))
    batches = batch_requests(reqs, cap)
    by_req: Dict[int, List[_Piece]] = {}
    for p in pieces:
        by_req.setdefault(p.req, []).append(p)
    out = Executed()
    loose = [f for f, m in zip(plan.files, metas) if m[2].by is None]
    if loose:
        out.warnings.append(
            f"{len(loose)} s3 object(s) read with nothing to pin them to the checkpoint opened "
            f"(the store gave no ETag, version id or Last-Modified): a rewrite between open and "
            f"read would go unseen: {', '.join(loose[:3])}{' ...' if len(loose) > 3 else ''}")
    total = plan.src_bytes
    done = 0
    st = stats if stats is not None else RemoteStats()
    buf_bytes = min(cap, sum((e - s + (s % 64) + 63) & ~63 for _, s, e, d in reqs if not d))
    buf = torch.empty(buf_bytes, dtype=torch.uint8, pin_memory=pin)
    mv = memoryview(buf.numpy()) if buf_bytes else None
    pool = ThreadPoolExecutor(max_workers=max(1, sess.max_concurrency),
                              thread_name_prefix="metamat-s3")
    try:
        for batch in batches:
            if pin:
                _wait(gpus)  # the previous batch's copies have left the buffer
            where: Dict[int, int] = {}
            off = 0
            for i in batch:
                _, s, e, d = reqs[i]
                if d:
                    continue
                where[i] = off + (s % 64)  # same alignment in the buffer as in the object
                off += ((e - s + (s % 64)) + 63) & ~63
            if off > buf.numel():
                buf = torch.empty(off, dtype=torch.uint8, pin_memory=pin)
                mv = memoryview(buf.numpy())
            jobs = []
            views: Dict[int, memoryview] = {}  # direct requests: their destination bytes
            for i in batch:
                f, s, e, d = reqs[i]
                url = plan.files[f]
                if d:
                    p = by_req[i][0]
                    op = ops[p.op]
                    dst = _dst(plan.targets[op.dst_index].tensor, op, 0, op.rows)
                    target = memoryview(dst.view(-1).view(torch.uint8).numpy())
                    base = s
                    views[i] = target
                else:
                    target, base = mv, s - where[i]
                for _, ps, pe in _split([reqs[i]], sess.part_bytes):
                    b = ps - base
                    jobs.append(pool.submit(fetch_range, sess, url, ps, pe, metas[f][2],
                                            into=target[b:b + (pe - ps)], what="data object",
                                            deadline=dl, size=metas[f][1]))
                st.requests += 1
                st.bytes_requested += e - s
            err = None
            for j in jobs:
                try:
                    j.result()
                except BaseException as e:  # noqa: BLE001 - first error wins, all joined
                    err = err or e
            if err is not None:
                raise err
            if verifier is not None:  # before a byte of the batch is copied into place
                verifier.check(
                    [(f, s, e, views[i], True) if d else
                     (f, s, e, mv[where[i]:where[i] + (e - s)], False)
                     for i in batch for f, s, e, d in [reqs[i]]], pool)
            for i in batch:
                _, s, _e, d = reqs[i]
                if d:
                    done += ops[by_req[i][0].op].src_bytes
                    continue
                for p in by_req.get(i, ()):
                    op = ops[p.op]
                    t = plan.targets[op.dst_index].tensor
                    b = where[i] + (p.start - s)
                    span = p.end - p.start
                    src = _typed(buf[b:b + span], op.src_dtype)
                    isz = src.element_size()
                    n = op.row_bytes // isz
                    stride = op.src_stride // isz if p.rows > 1 else n
                    src = src.as_strided((p.rows, n), (stride, 1), src.storage_offset())
                    dst = _dst(t, op, p.r0, p.rows)
                    with torch.no_grad():
                        dst.copy_(src, non_blocking=pin and t.device.type == "cuda")
                    done += op.row_bytes * p.rows
            out.bytes_read += sum(reqs[i][2] - reqs[i][1] for i in batch)
            if progress is not None:
                progress(done, total)
        if pin:
            _wait(gpus)
    finally:
        pool.shutdown(wait=True, cancel_futures=True)
    if verifier is not None:
        verifier.finish()
        out.bytes_verified, out.bytes_reread = verifier.bytes_verified, verifier.bytes_extra
    return out
