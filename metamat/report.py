"""Report: what a ``materialize`` call wrote (or loaded) and how fast; the load progress bar."""
from __future__ import annotations

import dataclasses
import sys
import time
from typing import Callable, Dict, List, Optional, Union

__all__ = ["Report", "RankSummary", "JobSummary", "make_progress"]

PHASES = ("plan", "allocate", "fill", "register")
LOAD_PHASES = ("open", "plan", "validate", "allocate", "fill", "read", "register")

#: Names per rank and list a :class:`RankSummary` carries (the rest are counted in
#: ``left_out``): what every rank gathers stays small whatever the model.
SUMMARY_NAMES = 1000


@dataclasses.dataclass
class RankSummary:
    """One rank's part of a ``materialize`` call, gathered by every rank in the agreement the
    call makes anyway (no extra collective). Names are capped at :data:`SUMMARY_NAMES` per
    list; ``left_out`` counts the rest.

    Attributes:
        rank: the rank.
        bytes_written, bytes_allocated, bytes_needed, bytes_read: as the rank's Report.
        seconds: the rank's phases up to the read (register comes after the gathering).
        loaded: number of tensors (names) it loaded.
        initialized, unchanged, unexpected, warnings: as the rank's Report.
        sources: value source (the part of ``Report.sources`` before ":") -> number of its
            tensors.
        left_out: names not listed because of the cap.
        device: the device the rank materialized on (``"cuda:3"``; as ``Report.device``).
    """

    rank: int
    bytes_written: int = 0
    bytes_allocated: int = 0
    bytes_needed: int = 0
    bytes_read: int = 0
    seconds: Dict[str, float] = dataclasses.field(default_factory=dict)
    loaded: int = 0
    initialized: List[str] = dataclasses.field(default_factory=list)
    unchanged: List[str] = dataclasses.field(default_factory=list)
    unexpected: List[str] = dataclasses.field(default_factory=list)
    warnings: List[str] = dataclasses.field(default_factory=list)
    sources: Dict[str, int] = dataclasses.field(default_factory=dict)
    left_out: int = 0
    device: str = ""


@dataclasses.dataclass
class JobSummary:
    """The whole job's ``materialize`` call, from every rank's :class:`RankSummary`.

    Attributes:
        world_size: ranks.
        bytes_written, bytes_allocated, bytes_needed, bytes_read: summed over ranks.
        seconds: per phase, the slowest rank's.
        loaded: tensors loaded, summed over ranks (a sharded tensor counts once per rank).
        initialized, unchanged, unexpected, warnings: name or message -> the ranks it
            concerns.
        left_out: names the ranks did not list (``RankSummary.left_out`` summed).
    """

    world_size: int
    bytes_written: int
    bytes_allocated: int
    bytes_needed: int
    bytes_read: int
    seconds: Dict[str, float]
    loaded: int
    initialized: Dict[str, List[int]]
    unchanged: Dict[str, List[int]]
    unexpected: Dict[str, List[int]]
    warnings: Dict[str, List[int]]
    left_out: int

    @classmethod
    def of(cls, ranks: List[RankSummary]) -> "JobSummary":
        """The job's summary from every rank's :class:`RankSummary` (any order)."""
        def union(attr: str) -> Dict[str, List[int]]:
            out: Dict[str, List[int]] = {}
            for r in ranks:
                for n in getattr(r, attr):
                    out.setdefault(n, []).append(r.rank)
            return dict(sorted(out.items()))

        seconds: Dict[str, float] = {}
        for r in ranks:
            for k, v in r.seconds.items():
                seconds[k] = max(seconds.get(k, 0.0), v)
        return cls(len(ranks), sum(r.bytes_written for r in ranks),
                   sum(r.bytes_allocated for r in ranks), sum(r.bytes_needed for r in ranks),
                   sum(r.bytes_read for r in ranks), seconds, sum(r.loaded for r in ranks),
                   union("initialized"), union("unchanged"), union("unexpected"),
                   union("warnings"), sum(r.left_out for r in ranks))


@dataclasses.dataclass
class Report:
    """Outcome of ``metamat.materialize``.

    Attributes:
        bytes_written: bytes of model memory written (each allocated byte once; on the load
            path also the bytes the loader wrote).
        bytes_allocated: bytes of new storage allocated on ``device``.
        seconds: wall seconds per phase (init: plan, allocate, fill, register; load: open,
            plan, validate, allocate, fill, read, register).
        device: where the tensors now live.
        num_targets: checkpointable blocks planned (table shards, optimizer state, dense).
        num_tensors: meta tensor objects replaced.
        source: "init" or "checkpoint".
        warnings: messages (e.g. tables with custom init callables).
        checkpoint: the checkpoint's path (load path).
        bytes_needed: checkpoint bytes this rank's blocks need (saved dtype).
        bytes_read: bytes read from files (gaps of coalesced strided reads included).
        read_amplification: ``bytes_read / bytes_needed``.
        loaded: fqns (model ``state_dict`` / fused-optimizer keys) filled from the checkpoint.
        initialized: fqns of meta tensors initialised as in the init path because the
            checkpoint lacks them (non-strict, or optimizer state absent altogether).
        unchanged: fqns of already-real tensors the checkpoint lacks (left as they were).
        key_prefixes: the checkpoint key prefix chosen for model and optimizer tensors.
        bytes_verified: checkpoint bytes checked against the checksum manifest
            (``verify=True``; the blocks the reads touched), else 0.
        unexpected: checkpoint tensors that matched nothing in the model (``strict=False``
            or ``ignore_unexpected``); like ``load_state_dict``'s ``unexpected_keys``.
        buffers: buffer fqn -> where its value came from ("checkpoint", "rule",
            "reset", "init= ...", "recorded", "kept (real)", "moved to ...").
        bytes_direct: checkpoint bytes read with O_DIRECT (``io="direct"``, or ``"auto"`` with
            ``METAMAT_IO_AUTO=direct``), the rest
            through the page cache.
        bytes_transient: host/device bytes of shadow copies the load used to keep the model
            unchanged until every rank succeeded (already-real tensors; 0 with
            ``inplace=True``), freed before returning.
        bytes_by_memory: bytes allocated per kind of memory: ``"device"`` (the device's own,
            or host memory on the CPU), ``"uvm"`` / ``"uvm_host_mapped"`` (fbgemm's unified
            memory, for UVM tables).
        sources: every parameter and buffer of the ordinary (plain, TP, FSDP2) modules ->
            where its value came from and by which rule, e.g. ``"checkpoint"``,
            ``"checkpoint: 8 checkpoint tensors stacked on dim 0 ..."``, ``"model init:
            BertForMaskedLM._init_weights: Normal(mean=0.0, std=0.02)"``, ``"rule:
            Linear.reset_parameters: Uniform(...)"``, ``"reset: ..."``, ``"init= ..."``,
            ``"kept (real)"``. The same on every rank (decided from global shapes).
        ranks: every rank's :class:`RankSummary`, in rank order, on every rank (one entry
            without a process group); :attr:`job` sums them up.
    """

    bytes_written: int = 0
    bytes_allocated: int = 0
    seconds: Dict[str, float] = dataclasses.field(default_factory=lambda: {p: 0.0 for p in PHASES})
    device: str = "cpu"
    num_targets: int = 0
    num_tensors: int = 0
    source: str = "init"
    warnings: List[str] = dataclasses.field(default_factory=list)
    checkpoint: Optional[str] = None
    bytes_needed: int = 0
    bytes_read: int = 0
    read_amplification: float = 1.0
    loaded: List[str] = dataclasses.field(default_factory=list)
    initialized: List[str] = dataclasses.field(default_factory=list)
    unchanged: List[str] = dataclasses.field(default_factory=list)
    key_prefixes: Dict[str, str] = dataclasses.field(default_factory=dict)
    bytes_verified: int = 0
    unexpected: List[str] = dataclasses.field(default_factory=list)
    buffers: Dict[str, str] = dataclasses.field(default_factory=dict)
    bytes_transient: int = 0
    bytes_direct: int = 0
    bytes_by_memory: Dict[str, int] = dataclasses.field(default_factory=dict)
    sources: Dict[str, str] = dataclasses.field(default_factory=dict)
    ranks: List[RankSummary] = dataclasses.field(default_factory=list)

    @property
    def job(self) -> Optional[JobSummary]:
        """The whole job: what every rank loaded, initialised, found unexpected or warned
        about, and the totals (None before the ranks' summaries were gathered)."""
        return JobSummary.of(self.ranks) if self.ranks else None

    def rank_summary(self, rank: int) -> RankSummary:
        """This rank's :class:`RankSummary` (names capped at :data:`SUMMARY_NAMES`)."""
        left = 0

        def cap(names: List[str]) -> List[str]:
            nonlocal left
            left += max(0, len(names) - SUMMARY_NAMES)
            return list(names[:SUMMARY_NAMES])

        kinds: Dict[str, int] = {}
        for how in self.sources.values():
            k = how.split(":", 1)[0]
            kinds[k] = kinds.get(k, 0) + 1
        return RankSummary(rank, self.bytes_written, self.bytes_allocated, self.bytes_needed,
                           self.bytes_read, dict(self.seconds), len(self.loaded),
                           cap(self.initialized), cap(self.unchanged), cap(self.unexpected),
                           cap(self.warnings), kinds, left, self.device)

    @property
    def total_seconds(self) -> float:
        """Wall seconds of the whole call: the sum of :attr:`seconds` over the phases."""
        return sum(self.seconds.values())

    @property
    def gbps(self) -> float:
        """Bytes written (init) or checkpoint bytes loaded (load) per second of the whole
        call, in GB/s (1e9)."""
        t = self.total_seconds
        n = self.bytes_needed if self.source == "checkpoint" else self.bytes_written
        return n / t / 1e9 if t > 0 else 0.0

    @property
    def fill_gbps(self) -> float:
        """Bytes written per second of the fill phase, in GB/s (1e9); 0 without a fill."""
        t = self.seconds.get("fill", 0.0)
        return self.bytes_written / t / 1e9 if t > 0 else 0.0

    @property
    def read_gbps(self) -> float:
        """Checkpoint bytes needed per second of the read phase, in GB/s (1e9)."""
        t = self.seconds.get("read", 0.0)
        return self.bytes_needed / t / 1e9 if t > 0 else 0.0

    def summary(self) -> str:
        """One line: what was done, how much, how fast (the INFO log line)."""
        what = (f"loaded {self.bytes_needed / 1e9:.3f} GB from {self.checkpoint} "
                f"(read amplification {self.read_amplification:.3f}, "
                f"{len(self.initialized)} initialised, {len(self.unexpected)} unexpected)"
                if self.source == "checkpoint"
                else f"initialised {self.bytes_written / 1e9:.3f} GB")
        return f"{what} on {self.device} in {self.total_seconds:.3f} s ({self.gbps:.2f} GB/s)"

    def __str__(self) -> str:
        if self.source == "checkpoint":
            head = (f"metamat.materialize (checkpoint {self.checkpoint}) on {self.device}: "
                    f"{self.bytes_needed / 1e9:.3f} GB needed, {self.bytes_read / 1e9:.3f} GB "
                    f"read (amplification {self.read_amplification:.3f}), "
                    f"{len(self.loaded)} tensors loaded, {len(self.initialized)} initialised, "
                    f"{len(self.unchanged)} unchanged, {len(self.unexpected)} unexpected")
        else:
            head = (f"metamat.materialize ({self.source}) on {self.device}: "
                    f"{self.bytes_written / 1e9:.3f} GB written, {self.num_targets} targets, "
                    f"{self.num_tensors} tensors")
        if self.bytes_verified:
            head += f", {self.bytes_verified / 1e9:.3f} GB checksum-verified"
        lines = [head, f"  {'phase':<10}{'seconds':>10}"]
        for p, s in self.seconds.items():
            lines.append(f"  {p:<10}{s:>10.4f}")
        tail = f"{self.gbps:.2f} GB/s overall, "
        tail += (f"{self.read_gbps:.2f} GB/s read" if self.source == "checkpoint"
                 else f"{self.fill_gbps:.2f} GB/s fill")
        lines.append(f"  {'total':<10}{self.total_seconds:>10.4f}   {tail}")
        for name in self.initialized[:20]:
            lines.append(f"  initialised (not in checkpoint): {name}")
        if len(self.initialized) > 20:
            lines.append(f"  ... and {len(self.initialized) - 20} more initialised")
        for name in self.unchanged[:20]:
            lines.append(f"  unchanged (not in checkpoint): {name}")
        for name in self.unexpected[:20]:
            lines.append(f"  unexpected (in checkpoint, not in model): {name}")
        if len(self.unexpected) > 20:
            lines.append(f"  ... and {len(self.unexpected) - 20} more unexpected")
        for name, how in list(self.buffers.items())[:20]:
            lines.append(f"  buffer {name}: {how}")
        for w in self.warnings:
            lines.append(f"  warning: {w}")
        job = self.job
        if job is not None and job.world_size > 1:
            lines.append(f"  job ({job.world_size} ranks): {job.bytes_written / 1e9:.3f} GB "
                         f"written, {job.bytes_needed / 1e9:.3f} GB needed, "
                         f"{job.bytes_read / 1e9:.3f} GB read, slowest rank "
                         f"{sum(job.seconds.values()):.4f} s before register")
            for what, table in (("initialised", job.initialized),
                                ("unchanged", job.unchanged),
                                ("unexpected", job.unexpected), ("warning", job.warnings)):
                for name, ranks in list(table.items())[:20]:
                    lines.append(f"  job {what} on ranks {_ranks(ranks, job.world_size)}: {name}")
                if len(table) > 20:
                    lines.append(f"  job: ... and {len(table) - 20} more {what}")
            if job.left_out:
                lines.append(f"  job: {job.left_out} names not gathered (over "
                             f"{SUMMARY_NAMES} per rank and list)")
        return "\n".join(lines)


def _ranks(ranks: List[int], world: int) -> str:
    if len(ranks) == world:
        return "all"
    if len(ranks) > 8:
        return f"{ranks[:4]} ... ({len(ranks)} ranks)"
    return str(ranks)


class _Bar:
    """A tqdm bar that appears only once the load has run for ``delay`` seconds."""

    def __init__(self, delay: float = 1.0) -> None:
        self.t0 = time.perf_counter()
        self.delay = delay
        self.bar = None

    def __call__(self, done: int, total: int) -> None:
        if self.bar is None:
            if time.perf_counter() - self.t0 < self.delay:
                return
            from tqdm import tqdm

            self.bar = tqdm(total=total, initial=0, unit="B", unit_scale=True,
                            desc="metamat load", leave=False)
        self.bar.update(done - self.bar.n)

    def close(self) -> None:
        if self.bar is not None:
            self.bar.close()


def make_progress(progress: Union[None, bool, Callable[[int, int], None]], rank: int
                  ) -> Optional[Callable[[int, int], None]]:
    """Progress callback for the loader.

    ``None`` (auto): a tqdm bar on rank 0 when stderr is a TTY, shown once the load has run
    for a second; ``True``: the bar on rank 0 regardless of the TTY; ``False``: none; a
    callable: called as ``progress(bytes_done, bytes_total)`` on every rank.
    """
    if callable(progress):
        return progress
    if progress is False or rank != 0:
        return None
    if progress is None and not (hasattr(sys.stderr, "isatty") and sys.stderr.isatty()):
        return None
    return _Bar(delay=1.0 if progress is None else 0.0)
