"""Report: what a ``materialize`` call wrote and how fast."""
from __future__ import annotations

import dataclasses
from typing import Dict, List

__all__ = ["Report"]

PHASES = ("plan", "allocate", "fill", "register")


@dataclasses.dataclass
class Report:
    """Outcome of ``metamat.materialize``.

    Attributes:
        bytes_written: bytes of model memory written (each allocated byte once).
        bytes_allocated: bytes of new storage allocated on ``device``.
        seconds: wall seconds per phase (plan, allocate, fill, register).
        device: where the tensors now live.
        num_targets: checkpointable blocks planned (table shards, optimizer state, dense).
        num_tensors: meta tensor objects replaced.
        source: "init" or "checkpoint".
        warnings: messages (e.g. tables with custom init callables).
    """

    bytes_written: int = 0
    bytes_allocated: int = 0
    seconds: Dict[str, float] = dataclasses.field(default_factory=lambda: {p: 0.0 for p in PHASES})
    device: str = "cpu"
    num_targets: int = 0
    num_tensors: int = 0
    source: str = "init"
    warnings: List[str] = dataclasses.field(default_factory=list)

    @property
    def total_seconds(self) -> float:
        return sum(self.seconds.values())

    @property
    def gbps(self) -> float:
        """Bytes written per second of the whole call, in GB/s (1e9)."""
        t = self.total_seconds
        return self.bytes_written / t / 1e9 if t > 0 else 0.0

    @property
    def fill_gbps(self) -> float:
        t = self.seconds.get("fill", 0.0)
        return self.bytes_written / t / 1e9 if t > 0 else 0.0

    def __str__(self) -> str:
        lines = [
            f"metamat.materialize ({self.source}) on {self.device}: "
            f"{self.bytes_written / 1e9:.3f} GB written, {self.num_targets} targets, "
            f"{self.num_tensors} tensors",
            f"  {'phase':<10}{'seconds':>10}",
        ]
        for p in PHASES:
            lines.append(f"  {p:<10}{self.seconds.get(p, 0.0):>10.4f}")
        lines.append(f"  {'total':<10}{self.total_seconds:>10.4f}   "
                     f"{self.gbps:.2f} GB/s overall, {self.fill_gbps:.2f} GB/s fill")
        for w in self.warnings:
            lines.append(f"  warning: {w}")
        return "\n".join(lines)
