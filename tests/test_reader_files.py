"""The C++ reader opens data files safely: regular files only (a FIFO or a device never blocks
the open, it fails with a named error), and checks each file's identity (dev, ino, size,
mtime) against the one recorded when the checkpoint was opened, before writing anything."""
from __future__ import annotations

import os
import subprocess
import sys

import numpy as np
import pytest

from reader_ops import POISON, addr, ops, poisoned

HERE = os.path.dirname(os.path.abspath(__file__))


def _data(tmp_path, name="d.bin", n=4096):
    p = tmp_path / name
    p.write_bytes(bytes(range(256)) * (n // 256))
    return str(p)


def test_fifo_as_data_file_fails_without_blocking(tmp_path):
    """A FIFO with no writer: a plain open(O_RDONLY) would block forever. Run in a
    subprocess so a regression hangs the child, not the test run."""
    good = _data(tmp_path)
    fifo = str(tmp_path / "pipe")
    os.mkfifo(fifo)
    code = f"""
import sys; sys.path.insert(0, {HERE!r})
import numpy as np
from metamat._ext import core
from reader_ops import ops, poisoned, addr, POISON
C = core()
dst = poisoned(200)
arr = ops((0, 0, 100, 1, 0, 0, addr(dst), 0, 0), (1, 0, 100, 1, 0, 0, addr(dst, 100), 0, 0))
ok, err, failed, nread, wrote = C.read_ops([{good!r}, {fifo!r}], arr.ctypes.data, 2, 2)
assert not ok and not wrote and failed == 1, (ok, err, failed, wrote)
assert {fifo!r} in err and "not a regular file (a FIFO)" in err and "read op 1" in err, err
assert (dst == POISON).all()
print("OK")
"""
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert r.returncode == 0 and "OK" in r.stdout, r.stdout + r.stderr


@pytest.mark.parametrize("path,kind", [("/dev/zero", "a character device"),
                                       ("/dev/null", "a character device"),
                                       ("DIR", "a directory")])
def test_device_or_directory_as_data_file(reader, tmp_path, path, kind):
    path = str(tmp_path) if path == "DIR" else path
    dst = poisoned(100)
    arr = ops((0, 0, 0, 1, 0, 0, addr(dst), 0, 0), (0, 0, 100, 1, 0, 0, addr(dst), 0, 0))
    ok, err, failed, _, wrote = reader.read_ops([path], arr.ctypes.data, 2, 1)
    assert not ok and not wrote and failed == 0
    assert path in err and f"not a regular file ({kind})" in err, err
    assert (dst == POISON).all()


def test_descriptors_are_closed(reader, tmp_path):
    good = _data(tmp_path)
    before = len(os.listdir("/proc/self/fd"))
    dst = poisoned(4096)
    arr = ops((0, 0, 4096, 1, 0, 0, addr(dst), 0, 0))
    ok, err, *_ = reader.read_ops([good], arr.ctypes.data, 1, 2)
    assert ok, err
    assert len(os.listdir("/proc/self/fd")) == before
    with open(good, "rb") as f:
        assert bytes(dst) == f.read()


def _identity(path):
    st = os.stat(path)
    return (st.st_dev, st.st_ino, st.st_size, st.st_mtime_ns)


def test_identity_match_reads(reader, tmp_path):
    good = _data(tmp_path)
    dst = poisoned(4096)
    arr = ops((0, 0, 4096, 1, 0, 0, addr(dst), 0, 0))
    ok, err, *_ = reader.read_ops([good], arr.ctypes.data, 1, 2, identities=[_identity(good)])
    assert ok, err
    ok, err, *_ = reader.read_ops([good], arr.ctypes.data, 1, 2, identities=[(-1, -1, -1, -1)])
    assert ok, err


def test_rewritten_same_size_other_layout_is_refused(reader, tmp_path):
    """Same size, other bytes (another layout): only the identity can tell."""
    a = _data(tmp_path, "a.bin")
    b = _data(tmp_path, "b.bin")
    ids = [_identity(a), _identity(b)]
    # rewrite b in place with other content and a later mtime, same size
    with open(b, "r+b") as f:
        f.write(bytes(reversed(range(256))) * 16)
    st = os.stat(b)
    os.utime(b, ns=(st.st_atime_ns, st.st_mtime_ns + 5_000_000_000))
    dst = poisoned(8192)
    arr = ops((0, 0, 4096, 1, 0, 0, addr(dst), 0, 0), (1, 0, 4096, 1, 0, 0, addr(dst, 4096), 0, 0))
    ok, err, failed, _, wrote = reader.read_ops([a, b], arr.ctypes.data, 2, 2, identities=ids)
    assert not ok and not wrote and failed == 1
    assert "file changed since the checkpoint was opened" in err and "mtime_ns" in err, err
    assert b in err and "size" not in err.split("opened:")[1]
    assert (dst == POISON).all()


def test_replaced_file_is_refused_by_inode(reader, tmp_path):
    a = _data(tmp_path, "a.bin")
    ids = [_identity(a)]
    tmp = tmp_path / "new.bin"
    tmp.write_bytes(b"\0" * 4096)
    os.replace(tmp, a)  # same path, another inode
    st = os.stat(a)
    ids_same_mtime = [(ids[0][0], ids[0][1], ids[0][2], st.st_mtime_ns)]
    dst = poisoned(4096)
    arr = ops((0, 0, 4096, 1, 0, 0, addr(dst), 0, 0))
    ok, err, failed, _, wrote = reader.read_ops([a], arr.ctypes.data, 1, 2,
                                                identities=ids_same_mtime)
    assert not ok and not wrote and failed == 0 and "st_ino" in err, err
    assert (dst == POISON).all()


def test_identity_count_must_match_files(reader, tmp_path):
    a = _data(tmp_path)
    dst = poisoned(16)
    arr = ops((0, 0, 16, 1, 0, 0, addr(dst), 0, 0))
    ok, err, failed, _, wrote = reader.read_ops([a], arr.ctypes.data, 1, 1,
                                                identities=[_identity(a)] * 2)
    assert not ok and not wrote and "identities" in err
