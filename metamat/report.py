"""Report: what a ``materialize`` call wrote (or loaded) and how fast; the load progress bar."""
from __future__ import annotations

import dataclasses
import sys
import time
from typing import Callable, Dict, List, Optional, Union

__all__ = ["Report", "make_progress"]

PHASES = ("plan", "allocate", "fill", "register")
LOAD_PHASES = ("open", "plan", "validate", "allocate", "fill", "read", "register")


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

    @property
    def total_seconds(self) -> float:
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
        return "\n".join(lines)


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
