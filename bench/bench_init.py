"""--mode init: the fused engine against torch's uniform_/normal_ and the fill_ ceiling."""
from __future__ import annotations

from typing import List

import torch

import metamat
from _common import Row, finish, peak_rss_gib, print_table, timeit


def run_init(total_bytes: int, reps: int, device: torch.device, dtype: torch.dtype) -> List[Row]:
    """Fill one pre-touched ~total_bytes buffer (rows of 128) every way, same run."""
    cols = 128
    rows_n = max(1, total_bytes // (cols * torch.empty((), dtype=dtype).element_size()))
    buf = torch.empty(rows_n, cols, dtype=dtype, device=device)
    buf.fill_(1.0)  # pre-touch: every method writes into resident pages
    n = buf.numel() * buf.element_size()
    cases = [
        ("torch fill_ (write ceiling)", lambda: buf.fill_(0.5)),
        ("torch uniform_", lambda: buf.uniform_(-0.1, 0.1)),
        ("torch normal_", lambda: buf.normal_(0.0, 0.1)),
        ("metamat Uniform", lambda: metamat.fill_(buf, metamat.Uniform(-0.1, 0.1), key="t")),
        ("metamat Normal", lambda: metamat.fill_(buf, metamat.Normal(0.0, 0.1), key="t")),
        ("metamat TruncatedNormal", lambda: metamat.fill_(buf, metamat.TruncatedNormal(0, 0.1, -0.2, 0.2), key="t")),
    ]
    rows = [Row("init", name, n, timeit(fn, reps, device), reps, extra=str(dtype).replace("torch.", ""))
            for name, fn in cases]
    if device.type == "cuda":
        rows += _many_small_vs_one_big(total_bytes, reps, device)
    for r in rows:
        r.peak_rss_gib = peak_rss_gib()  # the buffer is shared: process peak
    finish(rows, "torch uniform_", "torch fill_ (write ceiling)")
    print_table(f"init: {n / 2**30:.2f} GiB {dtype} on {device}", rows,
                "torch uniform_", "torch fill_ (write ceiling)")
    return rows


def _many_small_vs_one_big(total_bytes: int, reps: int, device: torch.device) -> List[Row]:
    """GPU goal: N tables of 1 MiB in <= 1.2x the time of one table of N MiB (one launch)."""
    n_tables = max(1, total_bytes >> 20)
    big = torch.empty(n_tables * 2048, 128, device=device)
    small = list(big.view(n_tables, 2048, 128).unbind(0))
    items = [(t, metamat.Uniform(-0.1, 0.1), f"t{i}", 0, 0) for i, t in enumerate(small)]
    one = timeit(lambda: metamat.fill_(big, metamat.Uniform(-0.1, 0.1), key="big"), reps, device)
    many = timeit(lambda: metamat.fill_many_(items), reps, device)
    nb = big.numel() * 4
    return [Row("init", "metamat 1 table", nb, one, reps),
            Row("init", f"metamat {n_tables} x 1 MiB tables", nb, many, reps,
                extra=f"time vs 1 table: {many / one:.2f}x")]
