"""Execute a load plan: the C++ reader fills host destinations in place, batch by batch.

The ops of a :class:`~metamat.load.plan.ReadPlan` whose destinations are host memory go to
``metamat._C.read_plan`` (a thread pool writing straight into the destination memory,
converting fp32 <-> fp16/bf16 in the copy loop, buffered or ``O_DIRECT`` reads, checking each
file's identity against what the checkpoint recorded when it was opened) in batches of
:data:`~metamat.load.ops.BATCH_BYTES`, so a KeyboardInterrupt lands between batches with no
reader thread left. With a checksum manifest every block the reads touch is hashed by the
reader as it streams (:mod:`metamat.load.verify`).
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Callable, List, Optional, Sequence

from .._ext import core
from ..budget import StagingBudget
from ..checkpoint.errors import ReadError
from . import ops as _ops
from .ops import ReadOp, batches, op_array
from .plan import ReadPlan
from .verify import block_index

__all__ = ["Executed", "StageProfile", "execute_plan", "run_reader", "IO_MODES"]

#: ``io=`` values: ``"auto"`` reads large ranges of files that are not in the page cache
#: buffered with sequential readahead and drops their pages behind the reader (cold stays
#: cold, as with O_DIRECT; measured faster than O_DIRECT on this project's virtio disk, see
#: csrc/include/metamat/io_reader.h; ``METAMAT_IO_AUTO=direct``: O_DIRECT instead), the rest plain
#: buffered; ``"buffered"`` always uses the page cache and keeps what it read; ``"direct"`` always
#: O_DIRECT, pipelined (falling back to buffered per file where the file system refuses it).
IO_MODES = ("auto", "buffered", "direct")
#: Work is cut into reader tasks of about this many bytes so threads balance.
TASK_BYTES = 8 << 20


@dataclass
class StageProfile:
    """Where a staged load's time went (the C++ pipeline's report, summed over its calls).

    Attributes:
        wait_seconds: the pipeline thread waiting for a ring buffer's earlier copies to leave.
        read_seconds: reading chunks into the ring (all reader threads at work).
        queue_seconds: queueing the copies out of the ring.
        chunks: ring buffers filled.
        reader_threads: most reader threads one read call had (the calling one included).
    """

    wait_seconds: float = 0.0
    read_seconds: float = 0.0
    queue_seconds: float = 0.0
    chunks: int = 0
    reader_threads: int = 0

    def merge(self, o: "StageProfile") -> None:
        self.wait_seconds += o.wait_seconds
        self.read_seconds += o.read_seconds
        self.queue_seconds += o.queue_seconds
        self.chunks += o.chunks
        self.reader_threads = max(self.reader_threads, o.reader_threads)


@dataclass
class Executed:
    """What an executor did.

    Attributes:
        bytes_read: bytes read from files (gaps of coalesced strided reads included).
        bytes_verified: checkpoint bytes hashed against the checksum manifest.
        bytes_reread: of those, block bytes no op needed, read only to complete a hash.
        bytes_direct: bytes read with O_DIRECT (the rest through the page cache).
        staging_seconds: staged loads: time to allocate the staging ring (page-locking it for
            CUDA destinations: on an H100 VM ~0.5 s per GiB, a large part of a small load).
        stage: where a staged load's time went (:class:`StageProfile`).
        warnings: what the report should say (e.g. s3 objects nothing could pin).
    """

    bytes_read: int = 0
    bytes_verified: int = 0
    bytes_reread: int = 0
    bytes_direct: int = 0
    staging_seconds: float = 0.0
    stage: StageProfile = field(default_factory=StageProfile)
    warnings: List[str] = field(default_factory=list)

    def merge(self, o: "Executed") -> None:
        """Add another executor's counters to these (a load run in several parts)."""
        self.bytes_read += o.bytes_read
        self.bytes_verified += o.bytes_verified
        self.bytes_reread += o.bytes_reread
        self.bytes_direct += o.bytes_direct
        self.staging_seconds += o.staging_seconds
        self.stage.merge(o.stage)
        self.warnings += o.warnings

    def add(self, r: dict) -> None:
        """Add the counters of one C++ reader result (its dict)."""
        self.bytes_read += r["bytes_read"]
        self.bytes_verified += r.get("bytes_hashed", 0)
        self.bytes_reread += r.get("bytes_reread", 0)
        self.bytes_direct += sum(f.get("bytes_direct", 0) for f in r.get("files", ()))
        self.stage.merge(StageProfile(r.get("wait_seconds", 0.0), r.get("read_seconds", 0.0),
                                      r.get("queue_seconds", 0.0), r.get("chunks", 0),
                                      r.get("threads", 0)))


def run_reader(plan: ReadPlan, ops: Sequence[ReadOp], ptrs: Sequence[int],
               budget: StagingBudget, name_of: Callable[[int], str], *, io: str = "auto",
               coalesce_gap: Optional[int] = None, blocks=None) -> dict:
    """Run ``ops`` on the C++ reader; ``ptrs[op.dst_index]`` is each destination's base
    address. Returns the reader's result dict (bytes read, hashed, per-file modes).

    Args:
        blocks: None, or a :class:`~metamat.load.verify.BlockIndex` to verify against.

    Raises:
        ReadError: an I/O error, a short read, or a file that changed since the checkpoint
            was opened, naming the file and ``name_of(i)`` for the failing op ``i``.
        ChecksumMismatchError: ``blocks`` and a block's digest differs.
    """
    if io not in IO_MODES:
        raise ValueError(f"io must be one of {IO_MODES}, got {io!r}")
    arr = op_array(ops, ptrs)
    kw = {}
    if blocks is not None:
        vb = blocks.blocks(ops)
        kw = {"verify_addr": vb.ctypes.data, "verify_count": len(vb)}
    r = core().read_plan(list(plan.files), arr.ctypes.data, len(arr), threads=budget.threads,
                         task_bytes=TASK_BYTES, bounce_bytes=budget.bounce_bytes,
                         coalesce_gap=coalesce_gap, identities=plan.identities, io=io, **kw)
    if not r["ok"]:
        if r.get("mismatch") is not None and blocks is not None:
            raise blocks.mismatch_error(r["mismatch"])
        failed = r["failed_op"]
        raise ReadError(r["error"], tensor=name_of(failed) if failed >= 0 else None)
    return r


def execute_plan(plan: ReadPlan, budget: StagingBudget, *,
                 progress: Optional[Callable[[int, int], None]] = None,
                 verify=None, io: str = "auto", coalesce_gap: Optional[int] = None) -> Executed:
    """Run ``plan``'s reads into its targets' (host) tensors.

    Args:
        plan: a validated plan whose targets hold allocated host tensors.
        budget: reader threads and their bounce buffers.
        progress: called as ``progress(bytes_done, bytes_total)`` (source bytes) between
            batches.
        verify: None, or a :class:`metamat.checkpoint.checksum.Manifest` every block the
            reads touch is checked against while streaming.
        io: ``"auto"``, ``"buffered"`` or ``"direct"`` (:data:`IO_MODES`).
        coalesce_gap: None: the reader's measured rule for reading strided rows as one span;
            an int: rows at most this many bytes apart are (``< 0``: never).

    Returns:
        :class:`Executed`.

    Raises:
        ReadError: an I/O error or short read (destinations may be partly written).
        ChecksumMismatchError: ``verify`` and a block differs.
        KeyboardInterrupt: between batches; no reader thread is left running.
    """
    ptrs = [t.tensor.data_ptr() for t in plan.targets]
    index = block_index(verify, plan.files)
    total = plan.src_bytes
    done = 0
    out = Executed()
    for ops in batches(plan.ops, _ops.BATCH_BYTES):  # read at call time (tests patch it)
        out.add(run_reader(plan, ops, ptrs, budget,
                           lambda i, ops=ops: plan.targets[ops[i].dst_index].fqn,
                           io=io, coalesce_gap=coalesce_gap, blocks=index))
        done += sum(o.src_bytes for o in ops)
        if progress is not None:
            progress(done, total)
    return out
