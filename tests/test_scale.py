"""Issue 17: time grows linearly with the count of things (tables, chunks, tensors), and the
chunk-overlap check is a sweep (n log n) that still finds every overlap."""
from __future__ import annotations

import json
import os
import subprocess
import sys
import time

import pytest
import torch

from metamat.checkpoint.base import Chunk, TensorEntry
from metamat.checkpoint.errors import OverlappingChunksError
from metamat.load.plan import _check_overlaps

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "bench"))


@pytest.fixture(autouse=True)
def _cpu_clock(monkeypatch):
    # wall time on a shared, overloaded box is mostly waiting: measure CPU time
    monkeypatch.setenv("METAMAT_SCALE_CLOCK", "cpu")


def _boxes(spec):
    return [(r0, r1, c0, c1, Chunk("/f", 0, 0, (r0, c0), (r1 - r0, c1 - c0)))
            for r0, r1, c0, c1 in spec]


def _entry():
    return TensorEntry("w", (100, 100), torch.float32)


@pytest.mark.parametrize("spec", [
    [(0, 1, 0, 10), (1, 2, 0, 10), (2, 3, 0, 10)],                    # rows, adjacent
    [(0, 4, 0, 1), (0, 4, 1, 2), (0, 4, 2, 3)],                       # columns, adjacent
    [(0, 2, 0, 2), (0, 2, 2, 4), (2, 4, 0, 2), (2, 4, 2, 4)],         # a grid
    [(0, 4, 0, 2), (0, 2, 2, 4), (2, 4, 2, 4)],                       # mixed bands
    [(0, 1, 0, 10), (0, 0, 0, 10), (5, 5, 0, 3)],                     # empty boxes ignored
    [(0, 3, 0, 1), (3, 6, 0, 1), (0, 6, 1, 2)],                       # touching at a corner
])
def test_overlap_check_accepts_adjacent(spec):
    _check_overlaps(_entry(), _boxes(spec))
    _check_overlaps(_entry(), _boxes(list(reversed(spec))))


@pytest.mark.parametrize("spec", [
    [(0, 2, 0, 10), (1, 3, 0, 10)],                                   # rows overlap by one
    [(0, 10, 0, 10), (3, 4, 0, 10)],                                  # a row inside another
    [(0, 4, 0, 2), (0, 4, 1, 3)],                                     # columns overlap by one
    [(0, 2, 0, 2), (1, 3, 1, 3)],                                     # corners overlap
    [(0, 2, 0, 2), (0, 2, 2, 4), (1, 2, 3, 5)],                       # overlaps a non-first
    [(0, 10, 5, 6), (0, 1, 0, 1), (1, 2, 0, 1), (9, 10, 0, 10)],      # long box crossed late
    [(0, 1, 0, 1), (0, 1, 0, 1)],                                     # identical
])
def test_overlap_check_finds_overlaps(spec):
    for s in (spec, list(reversed(spec))):
        with pytest.raises(OverlappingChunksError) as ei:
            _check_overlaps(_entry(), _boxes(s))
        assert "w" in str(ei.value) and "overlap" in str(ei.value)


def test_overlap_check_is_not_quadratic():
    """50,000 column chunks (all crossing every row) and 50,000 row chunks in well under a
    second each; the old pairwise check took minutes for the columns."""
    n = 50_000
    for spec in ([(0, 4, i, i + 1) for i in range(n)], [(i, i + 1, 0, 4) for i in range(n)]):
        boxes = _boxes(spec)
        t0 = time.process_time()
        _check_overlaps(_entry(), boxes)
        assert time.process_time() - t0 < 5.0  # ~0.1 s on a loaded 2-core Zen 3
    bad = _boxes([(0, 4, i, i + 1) for i in range(n)] + [(2, 3, n - 1, n)])
    with pytest.raises(OverlappingChunksError):
        _check_overlaps(_entry(), bad)


def _growth_in_fresh_process(case: str, counts) -> dict:
    """bench_scale.measured_growth of `case` in a fresh interpreter: inside the whole suite's
    process (a heap of everything the earlier tests left) the ratio is far noisier. Row
    chunks' materialize(load), Xeon: 2.4 and 2.8 in a fresh-clone CI run, 0.8-1.3 in a fresh
    interpreter, 0.9-2.5 in one holding 3M extra small objects (collector passes over a big
    heap landing in some timings, probably)."""
    bench = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "bench")
    code = (
        "import json, os, sys\n"
        f"sys.path.insert(0, {bench!r}); os.environ['METAMAT_SCALE_CLOCK'] = 'cpu'\n"
        "import bench_scale as bs\n"
        "with bs.process_group():\n"
        f"    print(json.dumps(bs.measured_growth({case!r}, {tuple(counts)!r})))\n")
    out = subprocess.run([sys.executable, "-W", "ignore", "-c", code], capture_output=True,
                         text=True, timeout=900)
    assert out.returncode == 0, out.stderr[-3000:]
    return json.loads(out.stdout.strip().splitlines()[-1])


def _assert_linear(case: str, counts) -> None:
    """Growth <= 2 for every method; a case over the bound is measured once more (one
    interrupted measurement can exceed it), and super-linear growth fails both times."""
    tries = []
    for _ in range(2):
        tries.append(_growth_in_fresh_process(case, counts))
        if max(tries[-1].values()) <= 2.0:
            return
    assert max(tries[-1].values()) <= 2.0, (case, tries)


@pytest.mark.parametrize("case,counts", [("rows", (500, 2000, 8000)),
                                         ("cols", (500, 2000, 8000)),
                                         ("tensors", (250, 1000, 4000))])
def test_chunks_and_tensors_scale_linearly(case, counts):
    """Time per chunk / tensor (open_checkpoint, materialize-load) at the largest count stays
    within 2x of the smaller counts' marginal cost (fixed overhead removed). The counts are
    timed in alternation and each keeps its fastest call, so this box's drift lands on all
    of them; a quadratic step reads as 4x."""
    _assert_linear(case, counts)


def test_tables_scale_linearly():
    """Time per table at 800 tables (shard_on_meta + materialize, and the plan phase) stays
    within 2x of the smaller counts' marginal cost. Measured as the chunks above: in a fresh
    interpreter, counts in alternation, fastest call of each."""
    pytest.importorskip("torchrec")
    _assert_linear("tables", (50, 200, 800))


def test_measured_growth_sees_quadratic_time(monkeypatch):
    """The check can fail: open_checkpoint given an extra CPU burn of 0.1 µs x count² per
    call measures a growth of ~3.5 (linear cost ~10 µs per chunk), over the bound of 2."""
    import bench_scale
    import metamat

    count_of = {}  # checkpoint directory -> its chunk count
    real_save, real_open = bench_scale.save_chunked, metamat.open_checkpoint

    def save_chunked(path, n, layout, width=16):
        count_of[path] = n
        return real_save(path, n, layout, width)

    def quadratic_open(path, *a, **k):
        until = time.process_time() + 1e-7 * count_of[path] ** 2
        while time.process_time() < until:
            pass
        return real_open(path, *a, **k)

    monkeypatch.setattr(bench_scale, "save_chunked", save_chunked)
    monkeypatch.setattr(metamat, "open_checkpoint", quadratic_open)
    with bench_scale.process_group():
        g = bench_scale.measured_growth("rows", (100, 400, 1600), rounds=2)
    assert g["metamat open_checkpoint"] > 2.0, g


@pytest.mark.filterwarnings("ignore::FutureWarning")
def test_bench_scale_mode_quick(tmp_path, monkeypatch):
    """bench/materialize.py --mode scale --quick runs end to end and writes its CSV."""
    import bench_scale
    import materialize as bench_main

    monkeypatch.setattr(bench_scale, "QUICK_TABLE_COUNTS", (10, 40))
    monkeypatch.setattr(bench_scale, "QUICK_CHUNK_COUNTS", (100, 400))
    monkeypatch.setattr(bench_scale, "QUICK_RANK_COUNTS", (16, 64))
    monkeypatch.setattr(bench_scale, "QUICK_MODULE_COUNTS", (2, 4))
    assert bench_main.main(["--mode", "scale", "--quick", "--out", str(tmp_path)]) == 0
    lines = (tmp_path / "scale.csv").read_text().splitlines()
    assert lines[0] == "case,method,count,seconds,us_per_item"
    assert len(lines) > 10
    assert sum(line.startswith("ranks,") for line in lines) == 4  # 2 world sizes x 2 methods
    assert sum(line.startswith("modules,") for line in lines) == 6  # 2 counts x 3 rows


def test_plan_parts_reports_the_walk_and_the_plan(world1_env):
    """bench_scale.plan_parts (the plan timing behind docs/PERFORMANCE.md's eighth round)
    runs the walk and the whole plan on a real sharded model and reports both (times are
    reported, not asserted)."""
    pytest.importorskip("torchrec")
    import math

    import bench_scale

    r = bench_scale.plan_parts(30, reps=2)
    assert set(r) == {"scan", "find_parts"}
    assert all(v > 0 and math.isfinite(v) for v in r.values())
