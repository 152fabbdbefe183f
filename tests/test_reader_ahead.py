"""The reader's pipelined direct path (csrc/io/io_ahead.h): a helper thread per reader thread reads
the next aligned window (the next one of the same piece, or the first one of the task the
thread claimed next) while the reader copies the previous one out. It must give the same bytes
as buffered reads and as the serial direct path (METAMAT_IO_OVERLAP=0) at every boundary
(window, task, alignment, end of file), count only the bytes it used, report every injected
fault (no window is read and dropped when the plan is followed), fall back to buffered reads
on EINVAL, and leave no thread behind on any path, including helper threads that cannot start.
"""
from __future__ import annotations

import os
import subprocess
import sys

import pytest

from reader_ops import POISON, addr, ops, os_threads, poisoned, random_file

HERE = os.path.dirname(os.path.abspath(__file__))
BOUNCE = 512 << 10  # two 256 KiB windows per reader thread
WIN = BOUNCE // 2
SIZE = 8 * WIN + 3 * 4096 + 777  # not a multiple of any alignment


@pytest.fixture(scope="module")
def data_file(tmp_path_factory):
    return random_file(tmp_path_factory, "ahead", SIZE, 11)


_threads = os_threads


# (file offset, length) of plain contiguous ops around every boundary: windows, pages, EOF.
def _ranges():
    out = []
    for off in (0, 1, 4095, 4096, 12345, WIN - 1, WIN, WIN + 1):
        for ln in (1, 4096, WIN - 1, WIN, WIN + 1, 2 * WIN, 2 * WIN + 4097, 3 * WIN - 5):
            if off + ln <= SIZE:
                out.append((off, ln))
    out.append((SIZE - 1, 1))
    out.append((SIZE - (2 * WIN + 3), 2 * WIN + 3))  # ends at EOF, unaligned
    out.append((0, SIZE))
    return out


def _plan(ranges, shift):
    """One op per range into its own poisoned buffer, data `shift` bytes past a page."""
    bufs, rows = [], []
    for off, ln in ranges:
        raw = poisoned(ln + 3 * 4096)
        base = (-raw.ctypes.data) % 4096 + shift
        bufs.append((raw, base))
        rows.append((0, off, ln, 1, 0, 0, addr(raw, base), 0, 0))
    return ops(*rows), bufs


def _check(ranges, bufs, body):
    for (off, ln), (raw, base) in zip(ranges, bufs):
        assert bytes(raw[base: base + ln]) == body[off: off + ln], (off, ln)
        assert (raw[:base] == POISON).all() and (raw[base + ln:] == POISON).all(), (off, ln)


def _read(reader, path, ranges, io, shift=1, **kw):
    arr, bufs = _plan(ranges, shift)
    r = reader.read_plan([path], arr.ctypes.data, len(arr), io=io, **kw)
    return r, bufs


@pytest.mark.parametrize("threads", [1, 2, 3])
@pytest.mark.parametrize("task", [4096 * 3 + 4, WIN - 4, WIN, 3 * WIN + 4, 8 << 20])
@pytest.mark.parametrize("shift", [0, 1, 4092])
def test_pipelined_equals_buffered_and_serial(reader, data_file, monkeypatch, threads, task,
                                              shift):
    path, body = data_file
    ranges = _ranges()
    kw = dict(threads=threads, task_bytes=task, bounce_bytes=BOUNCE)
    got = {}
    for label, io, overlap in (("buffered", "buffered", "1"), ("serial", "direct", "0"),
                               ("pipelined", "direct", "1")):
        monkeypatch.setenv("METAMAT_IO_OVERLAP", overlap)
        r, bufs = _read(reader, path, ranges, io, shift=shift, **kw)
        assert r["ok"], (label, r["error"])
        _check(ranges, bufs, body)
        got[label] = r
    # Every window read ahead was used, and no window twice: the serial path's exact bytes.
    assert got["pipelined"]["bytes_read"] == got["serial"]["bytes_read"]
    assert (got["pipelined"]["files"][0]["bytes_direct"] ==
            got["serial"]["files"][0]["bytes_direct"] > 0)
    assert got["pipelined"]["files"][0]["bytes_buffered"] == 0


def test_small_bounce_reads_serially_with_the_same_bytes(reader, data_file):
    """A bounce buffer too small for two windows: no helper (serial direct reads)."""
    path, body = data_file
    before = _threads()
    r, bufs = _read(reader, path, _ranges(), "direct", threads=2, task_bytes=WIN,
                    bounce_bytes=64 << 10)
    assert r["ok"], r["error"]
    _check(_ranges(), bufs, body)
    assert _threads(before) <= before


@pytest.mark.parametrize("mode", ["eio", "eof"])
def test_every_read_reports_its_fault(reader, data_file, monkeypatch, mode):
    """With one thread and a plan followed as announced, every window read ahead is used:
    a fault injected into any of the call's reads fails the call, naming the file, and leaves
    no thread running."""
    path, _ = data_file
    ranges = [(12345, 5 * WIN + 17), (6 * WIN + 3, WIN + 100)]
    task = WIN + 4096 + 4
    # reads the call makes: windows of each task (tasks split each op; the helper reads them)
    n_reads = 0
    for off, ln in ranges:
        for b in range(0, ln, task):
            p, q = off + b, off + min(ln, b + task)
            a0 = p // 4096 * 4096
            while a0 < q:
                n_reads += 1
                a0 = min((q + 4095) // 4096 * 4096, a0 + WIN)
    before = _threads()
    for nth in range(1, n_reads + 1):
        monkeypatch.setenv("METAMAT_IO_FAULT", f"{nth}:{mode}")
        r, _ = _read(reader, path, ranges, "direct", threads=1, task_bytes=task,
                     bounce_bytes=BOUNCE)
        assert not r["ok"] and r["wrote"] and path in r["error"], (nth, r)
        assert r["failed_op"] in (0, 1)
        assert _threads(before) <= before
    monkeypatch.setenv("METAMAT_IO_FAULT", f"{n_reads + 1}:{mode}")
    r, _ = _read(reader, path, ranges, "direct", threads=1, task_bytes=task,
                 bounce_bytes=BOUNCE)
    assert r["ok"], (n_reads, r["error"])


@pytest.mark.parametrize("nth", [1, 2, 3, 7])
def test_einval_mid_pipeline_falls_back(reader, data_file, monkeypatch, nth):
    path, body = data_file
    monkeypatch.setenv("METAMAT_IO_FAULT", f"{nth}:einval")
    ranges = _ranges()
    r, bufs = _read(reader, path, ranges, "direct", threads=2, task_bytes=WIN + 8,
                    bounce_bytes=BOUNCE)
    assert r["ok"], r["error"]
    _check(ranges, bufs, body)
    f = r["files"][0]
    assert f["direct_refused"] and "Invalid argument" in f["refuse_reason"], f


@pytest.mark.parametrize("mode", ["short", "eintr"])
def test_retried_faults_mid_pipeline(reader, data_file, monkeypatch, mode):
    path, body = data_file
    ranges = _ranges()
    for nth in (1, 2, 5, 9):
        monkeypatch.setenv("METAMAT_IO_FAULT", f"{nth}:{mode}")
        r, bufs = _read(reader, path, ranges, "direct", threads=2, task_bytes=WIN + 8,
                        bounce_bytes=BOUNCE)
        assert r["ok"], (nth, r["error"])
        _check(ranges, bufs, body)


def test_errors_with_several_threads_leave_no_thread(reader, data_file, monkeypatch):
    path, _ = data_file
    before = _threads()
    for nth in (1, 2, 4, 8, 16):
        monkeypatch.setenv("METAMAT_IO_FAULT", f"{nth}:eio")
        r, _ = _read(reader, path, _ranges(), "direct", threads=3, task_bytes=WIN - 4,
                     bounce_bytes=BOUNCE)
        assert not r["ok"] and "Input/output error" in r["error"], nth
        assert _threads(before) <= before


_CHILD = r"""
import os, sys
sys.path.insert(0, {here!r})
import numpy as np
from metamat._ext import core
from reader_ops import ops, os_threads, poisoned, addr
C = core()
path = {path!r}
data = open(path, "rb").read()
tasks = os_threads
base_threads = tasks()
for it in range({iters}):
    threads = 1 + it % 4
    if it % 3 == 2:
        os.environ["METAMAT_IO_FAULT"] = f"{{1 + it % 5}}:{{'eio' if it % 2 else 'short'}}"
    else:
        os.environ.pop("METAMAT_IO_FAULT", None)
    rows, bufs = [], []
    for k in range(6):
        off, ln = 4099 * k + 13, 300000 + 77777 * k
        raw = poisoned(ln + 8192)
        bufs.append((raw, off, ln))
        rows.append((0, off, ln, 1, 0, 0, addr(raw, 1), 0, 0))
    arr = ops(*rows)
    r = C.read_plan([path], arr.ctypes.data, len(arr), threads=threads, task_bytes=200000,
                    bounce_bytes=512 << 10, io="direct")
    if r["ok"]:
        for raw, off, ln in bufs:
            assert bytes(raw[1:1 + ln]) == data[off:off + ln], (it, off)
    else:
        assert "Input/output error" in r["error"], r["error"]
    assert tasks(base_threads) <= base_threads, (it, tasks(), base_threads)
print("OK")
"""


@pytest.mark.parametrize("every", [2, 3])
def test_helper_threads_that_cannot_start(data_file, every):
    """Every k-th thread start fails (reader threads and helpers alike): the call still reads
    every byte (serially where a helper is missing) and no thread outlives it."""
    path, _ = data_file
    env = dict(os.environ, METAMAT_THREAD_FAULT=str(every))
    env.pop("METAMAT_IO_FAULT", None)
    out = subprocess.run([sys.executable, "-c", _CHILD.format(here=HERE, path=path, iters=30)],
                         env=env, capture_output=True, text=True, timeout=300)
    assert out.returncode == 0 and "OK" in out.stdout, out.stderr[-3000:]
