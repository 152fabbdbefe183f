"""Issue 17: the work grows linearly with the count of things (tables, chunks, tensors), and
the chunk-overlap check is a sweep (n log n) that still finds every overlap.

Work is counted, not timed (tests/_work.py: Python lines, Python calls, calls into C), so the
checks are exact on a busy machine and need no repeats: every growth measured here is 1.000,
and a quadratic step reads as ~4. The timed sweeps are the bench's
(``python bench/materialize.py --mode scale``, ``bench_scale.measured_growth``)."""
from __future__ import annotations

import bisect
import tempfile
import types

import pytest
import torch

import metamat
from metamat.checkpoint.base import Chunk, TensorEntry
from metamat.checkpoint.errors import OverlappingChunksError
from metamat.load import plan as load_plan
from metamat.load.plan import _check_overlaps
from metamat.testing import ManyTensors, OneTensor, process_group, save_chunked, save_many

from _work import work_growth

# Counted work may grow at most this much faster per item at the largest count than at the
# smallest: measured 1.000 for every case; the old pairwise overlap check measures 2.9.
LINEAR = 1.05


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


def _shifting_bisect(shifted):
    """``bisect`` for _check_overlaps that adds up the elements each insert or delete at the
    position found moves (list.insert and del are one C call each: invisible to the line
    count, O(n) each when at the front)."""
    def bisect_left(a, x, *args):
        pos = bisect.bisect_left(a, x, *args)
        shifted[0] += len(a) - pos
        return pos
    return types.SimpleNamespace(bisect_left=bisect_left)


def test_overlap_check_is_not_quadratic(monkeypatch):
    """Column chunks (all crossing every row) and row chunks: the Python work per chunk stays
    the same from 1,000 to 16,000 chunks, and the active list's inserts and deletes land at
    its end (the elements they shift: at most one per chunk). The old pairwise check took
    minutes for 50,000 column chunks."""
    shifted = [0]
    monkeypatch.setattr(load_plan, "bisect", _shifting_bisect(shifted))
    counts = (1000, 4000, 16000)
    for layout in ("cols", "rows"):
        boxes = {n: _boxes([(0, 4, i, i + 1) if layout == "cols" else (i, i + 1, 0, 4)
                            for i in range(n)]) for n in counts}
        shifted[0] = 0
        g, work = work_growth(lambda n: _check_overlaps(_entry(), boxes[n]), counts)
        assert g["total"] <= LINEAR, (layout, g, work)
        assert shifted[0] <= 2 * (counts[0] + sum(counts)), (layout, shifted[0])
    n = 50_000
    bad = _boxes([(0, 4, i, i + 1) for i in range(n)] + [(2, 3, n - 1, n)])
    with pytest.raises(OverlappingChunksError):
        _check_overlaps(_entry(), bad)


def _pairwise_check(entry, boxes):
    """The old overlap check: every pair (quadratic)."""
    live = [b for b in boxes if b[0] < b[1] and b[2] < b[3]]
    for i, a in enumerate(live):
        for b in live[i + 1:]:
            if a[0] < b[1] and b[0] < a[1] and a[2] < b[3] and b[2] < a[3]:
                load_plan._overlap(entry, a, b)


def test_the_growth_check_sees_a_pairwise_overlap_check(monkeypatch):
    """The check can fail: the old pairwise overlap check put back into the load plan reads
    as 2.9 (lines; 800 column chunks, 4x steps), far over the bound; it still finds
    overlapping chunks (so the load measured is a real one)."""
    monkeypatch.setattr(load_plan, "_check_overlaps", _pairwise_check)
    with pytest.raises(OverlappingChunksError):
        load_plan._check_overlaps(_entry(), _boxes([(0, 2, 0, 10), (1, 3, 0, 10)]))
    g, work = _load_growth("cols", (50, 200, 800))
    assert g["materialize(load)"]["lines"] > 2.0, (g, work)
    assert g["materialize(load)"]["total"] > LINEAR, (g, work)
    assert g["open_checkpoint"]["total"] <= LINEAR  # the open has no overlap check


def _load_growth(case: str, counts):
    """Counted work of open_checkpoint and of materialize(load) of ``case``'s checkpoint
    ("rows" / "cols": one tensor of n chunks; "tensors": n tensors) at each count."""
    with process_group(), tempfile.TemporaryDirectory() as root:
        dirs, make = {}, {}
        for n in counts:
            dirs[n] = f"{root}/{n}"
            if case == "tensors":
                save_many(dirs[n], n)
                make[n] = lambda n=n: ManyTensors(n)
            else:
                shape = save_chunked(dirs[n], n, case)
                make[n] = lambda shape=shape: OneTensor(shape)
        g_open, w_open = work_growth(metamat.open_checkpoint, counts, prepare=dirs.get)
        g_load, w_load = work_growth(
            lambda a: metamat.materialize(a[0], a[1], device="cpu"), counts,
            prepare=lambda n: (make[n](), dirs[n]))
    return ({"open_checkpoint": g_open, "materialize(load)": g_load},
            {"open_checkpoint": w_open, "materialize(load)": w_load})


@pytest.mark.parametrize("case,counts", [("rows", (100, 400, 1600)),
                                         ("cols", (100, 400, 1600)),
                                         ("tensors", (100, 400, 1600))])
def test_chunks_and_tensors_scale_linearly(case, counts):
    """Work per chunk / tensor (open_checkpoint, materialize-load) at the largest count stays
    within LINEAR of the smaller counts' marginal work (fixed work removed); a quadratic step
    reads as 4x."""
    g, work = _load_growth(case, counts)
    for method, growth in g.items():
        assert growth["total"] <= LINEAR and growth["lines"] <= LINEAR, (method, g, work)


def test_tables_scale_linearly(world1_env):
    """Work per table (shard_on_meta, the plan phase of materialize, the whole materialize)
    at 320 tables stays within LINEAR of the smaller counts' marginal work. The tables'
    EmbeddingBagCollections and plans are built outside the counted calls."""
    from metamat.models import find_parts
    from metamat.models.torchrec.testing import ebc, sharder_and_plan
    from metamat.rules import check_init_map

    counts = (20, 80, 320)
    plans = {n: sharder_and_plan(ebc(n)) for n in counts}

    def shard_prepared(a):
        model, (sharder, plan) = a
        return metamat.shard_on_meta(model, env=world1_env, plan=plan, sharders=[sharder])

    def shard(n):
        return shard_prepared((ebc(n), plans[n]))

    g = {"shard_on_meta": work_growth(shard_prepared, counts,
                                      prepare=lambda n: (ebc(n), plans[n]))[0],
         "plan phase": work_growth(
             lambda dmp: find_parts(dmp, torch.device("cpu"), check_init_map(None),
                                    loading=False), counts, prepare=shard)[0],
         "materialize": work_growth(lambda dmp: metamat.materialize(dmp, device="cpu"),
                                    counts, prepare=shard)[0]}
    for method, growth in g.items():
        assert growth["total"] <= LINEAR and growth["lines"] <= LINEAR, (method, g)


# --- the bench's scale mode (bench/bench_scale.py), run as a program -------------------------

_BENCH_CHILD = r"""
import json, math, os, sys
bench, out = sys.argv[1], sys.argv[2]
sys.path.insert(0, bench)
os.environ["METAMAT_SCALE_CLOCK"] = "cpu"
import bench_scale
import materialize as bench_main
bench_scale.QUICK_TABLE_COUNTS = (10, 40)
bench_scale.QUICK_CHUNK_COUNTS = (100, 400)
bench_scale.QUICK_RANK_COUNTS = (16,)  # a process per world size and method
bench_scale.QUICK_MODULE_COUNTS = (2, 4)
rc = bench_main.main(["--mode", "scale", "--quick", "--out", out])
with bench_scale.process_group():
    growth = bench_scale.measured_growth("rows", (100, 200, 400), rounds=1)
    parts = bench_scale.plan_parts(30, reps=2)
print(json.dumps({"rc": rc, "growth": growth, "parts": parts}))
"""


@pytest.fixture(scope="module")
def bench_scale_run(tmp_path_factory):
    """One child process runs the bench's scale mode (--quick, smaller counts), its timed
    growth measure and its plan timing; the tests below check what it wrote and returned
    (times are reported, never asserted)."""
    import json
    import os
    import subprocess
    import sys

    pytest.importorskip("torchrec")
    out = tmp_path_factory.mktemp("scale")
    bench = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "bench")
    r = subprocess.run([sys.executable, "-W", "ignore", "-c", _BENCH_CHILD, bench, str(out)],
                       capture_output=True, text=True, timeout=900)
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    return out, json.loads(r.stdout.strip().splitlines()[-1])


def test_bench_scale_mode_quick(bench_scale_run):
    """bench/materialize.py --mode scale --quick runs end to end and writes its CSV."""
    out, res = bench_scale_run
    assert res["rc"] == 0
    lines = (out / "scale.csv").read_text().splitlines()
    assert lines[0] == "case,method,count,seconds,us_per_item"
    assert len(lines) > 10
    assert sum(line.startswith("ranks,") for line in lines) == 2  # 1 world size x 2 methods
    assert sum(line.startswith("modules,") for line in lines) == 6  # 2 counts x 3 rows


def test_bench_measured_growth_reports_every_method(bench_scale_run):
    """bench_scale.measured_growth (the timed growth, now the bench's) reports a growth for
    each method; whether a growth is linear is the counted tests' above. The value itself is
    timed, so not asserted: on a busy machine the smaller counts' marginal time can come out
    zero or negative, which the bench reports as inf (seen once in CI)."""
    import math

    growth = bench_scale_run[1]["growth"]
    assert set(growth) == {"metamat open_checkpoint", "metamat materialize(load)"}
    assert all(isinstance(v, float) and not math.isnan(v) for v in growth.values()), growth


def test_plan_parts_reports_the_walk_and_the_plan(bench_scale_run):
    """bench_scale.plan_parts (the plan timing behind docs/PERFORMANCE.md's eighth round)
    runs the walk and the whole plan on a real sharded model and reports both (times are
    reported, not asserted)."""
    import math

    r = bench_scale_run[1]["parts"]
    assert set(r) == {"scan", "find_parts"}
    assert all(v > 0 and math.isfinite(v) for v in r.values())
