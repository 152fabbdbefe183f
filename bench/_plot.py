"""PNG plot of GB/s against bytes, one line per (mode, method), from benchmark rows."""
from __future__ import annotations

from typing import List

from _common import Row


def plot(rows: List[Row], path: str) -> None:
    import matplotlib

    matplotlib.use("Agg")  # no display needed
    import matplotlib.pyplot as plt

    lines = {}
    for r in rows:
        lines.setdefault((r.mode, r.method), []).append((r.nbytes / 2**30, r.gbps))
    fig, ax = plt.subplots(figsize=(8, 5))
    for (mode, method), pts in sorted(lines.items()):
        pts.sort()
        style = "-o" if method.startswith("metamat") else "--s"
        ax.plot([p[0] for p in pts], [p[1] for p in pts], style, label=f"{mode}: {method}")
    ax.set_xscale("log", base=2)
    ax.set_yscale("log")
    ax.set_xlabel("bytes per rank (GiB)")
    ax.set_ylabel("GB/s (1e9 bytes/s)")
    ax.set_title("metamat vs baselines: throughput against size")
    ax.grid(True, which="both", alpha=0.3)
    ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
