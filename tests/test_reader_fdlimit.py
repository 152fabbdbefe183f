"""The C++ reader opens data files lazily through a bounded descriptor cache: a valid shard
set of more files than `ulimit -n` allows still loads, and every file is validated before the
first destination byte is written. Each case runs in a subprocess with RLIMIT_NOFILE lowered."""
from __future__ import annotations

import os
import subprocess
import sys

import pytest

HERE = os.path.dirname(os.path.abspath(__file__))

_CHILD = r"""
import os, resource, sys
sys.path.insert(0, {here!r})
import numpy as np
from metamat._ext import core
from reader_ops import ops, poisoned, addr, POISON
C = core()
resource.setrlimit(resource.RLIMIT_NOFILE, ({limit}, {limit}))
d = {root!r}
files = sorted(os.path.join(d, f) for f in os.listdir(d))
n = len(files)
per = 64
dst = poisoned(n * per)
# every file: a contiguous op and a strided op (rows of 8 bytes every 16), in reverse file order
rows = []
for i in reversed(range(n)):
    rows.append((i, 0, 32, 1, 0, 0, addr(dst, i * per), 0, 0))
    rows.append((i, 32, 8, 4, 16, 8, addr(dst, i * per + 32), 0, 0))
arr = ops(*rows)
ok, err, failed, nread, wrote = C.read_ops(files, arr.ctypes.data, len(arr), {threads},
                                           max_open_files={max_open})
mode = {mode!r}
if mode == "ok":
    assert ok, err
    for i, f in enumerate(files):
        data = open(f, "rb").read()
        want = data[:32] + b"".join(data[32 + 16 * r: 40 + 16 * r] for r in range(4))
        assert bytes(dst[i * per: i * per + 64]) == want, i
else:
    assert not ok and not wrote, (ok, err, wrote)
    assert mode in err and files[0] in err, err
    assert (dst == POISON).all()
fds = len(os.listdir("/proc/self/fd"))
assert fds < 16, fds
print("OK", nread)
"""


def _shards(tmp_path, n):
    d = tmp_path / "shards"
    d.mkdir()
    for i in range(n):
        (d / f"s{i:05d}.bin").write_bytes(os.urandom(96))
    return str(d)


def _run(root, limit, threads=4, max_open=0, mode="ok"):
    code = _CHILD.format(here=HERE, root=root, limit=limit, threads=threads,
                         max_open=max_open, mode=mode)
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                       timeout=120, env=dict(os.environ, PYTHONPATH=os.pathsep.join(sys.path)))
    assert r.returncode == 0 and "OK" in r.stdout, r.stdout + r.stderr[-3000:]


def test_1100_files_under_ulimit_1024(tmp_path):
    _run(_shards(tmp_path, 1100), 1024)


@pytest.mark.parametrize("threads,max_open", [(1, 2), (4, 2), (8, 5), (3, 0)])
def test_tiny_descriptor_budgets(tmp_path, threads, max_open):
    """More threads than the cache holds: readers still make progress (an entry in use is
    never evicted; at most one extra descriptor per thread)."""
    _run(_shards(tmp_path, 200), 64, threads=threads, max_open=max_open)


def test_every_file_validated_before_any_write(tmp_path):
    """The first file (read last: ops run in reverse order) is a FIFO: the error comes before
    any of the 1099 good files is read."""
    root = _shards(tmp_path, 1100)
    first = sorted(os.listdir(root))[0]
    os.remove(os.path.join(root, first))
    os.mkfifo(os.path.join(root, first))
    _run(root, 1024, mode="not a regular file")
