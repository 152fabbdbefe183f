"""Thread starts that fail never abort the process: "terminate called without an active
exception" is a std::thread destroyed while joinable, e.g. a vector of started threads unwound
because starting the next one threw (EAGAIN at the process's thread limit). The stress runs
many reads and fills in a subprocess with small thread counts, every k-th thread start failing
(METAMAT_THREAD_FAULT) and I/O faults injected; the child must exit cleanly with exact values.
"""
from __future__ import annotations

import os
import subprocess
import sys

import pytest

HERE = os.path.dirname(os.path.abspath(__file__))

_CHILD = r"""
import os, sys
sys.path.insert(0, {here!r})
import numpy as np
import torch
import metamat
from metamat._ext import core
from reader_ops import ops, poisoned, addr, F32, BF16
C = core()
path = {path!r}
data = open(path, "rb").read()
want = {{}}
for it in range({iters}):
    threads = 2 + it % 4
    # fills: several threads per call (>= 256K elements each)
    torch.set_num_threads(threads)
    t = torch.empty(1_300_000)  # up to 4 fill threads (>= 256K elements each)
    metamat.fill_(t, metamat.Normal(0.0, 1.0), key="stress")
    ref = want.setdefault("fill", t.clone())
    assert torch.equal(t, ref), "fill differs when some threads did not start"
    # reads: contiguous, strided, converting; sometimes an injected I/O fault
    if it % 3 == 2:
        os.environ["METAMAT_IO_FAULT"] = f"{{1 + it % 5}}:{{'eio' if it % 2 else 'short'}}"
    else:
        os.environ.pop("METAMAT_IO_FAULT", None)
    d1, d2, d3 = poisoned(1 << 20), poisoned(64 * 2000), poisoned(1 << 19)
    arr = ops((0, 5, 1 << 20, 1, 0, 0, addr(d1), 0, 0),
              (0, 7, 64, 2000, 256, 64, addr(d2), 0, 0),
              (0, 0, 1 << 20, 1, 0, 0, addr(d3), F32, BF16))
    io = ("buffered", "direct", "auto")[it % 3]
    r = C.read_plan([path], arr.ctypes.data, 3, threads=threads, task_bytes=64 << 10,
                    bounce_bytes=64 << 10, io=io)
    fault = os.environ.get("METAMAT_IO_FAULT", "")
    if r["ok"]:
        assert bytes(d1) == data[5:5 + (1 << 20)]
        assert bytes(d2) == b"".join(data[7 + 256 * i: 71 + 256 * i] for i in range(2000))
    else:
        assert "eio" in fault and "Input/output error" in r["error"], (fault, r["error"])
print("OK", len(os.listdir("/proc/self/task")))
"""


@pytest.mark.parametrize("every", [2, 3, 7])
def test_thread_start_failures_never_abort(tmp_path, every):
    p = tmp_path / "d.bin"
    p.write_bytes(os.urandom(2 << 20))
    code = _CHILD.format(here=HERE, path=str(p), iters=40)
    env = dict(os.environ, METAMAT_THREAD_FAULT=str(every),
               PYTHONPATH=os.pathsep.join(sys.path))
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                       timeout=300, env=env)
    assert "terminate called" not in r.stderr, r.stderr[-3000:]
    assert r.returncode == 0 and "OK" in r.stdout, (r.returncode, r.stderr[-3000:])


_REAL_LIMIT = r"""
import resource, sys
sys.path.insert(0, {here!r})
import numpy as np
import torch
import metamat
from metamat._ext import core
from reader_ops import ops, poisoned, addr
C = core()
torch.set_num_threads(8)
ref = torch.empty(4_000_000)
metamat.fill_(ref, metamat.Uniform(), key="limit")  # all threads: the reference values
t = torch.empty(4_000_000)
path = {path!r}
d = poisoned(4 << 20)
arr = ops((0, 0, 4 << 20, 1, 0, 0, addr(d), 0, 0))
C.read_plan([path], arr.ctypes.data, 1, threads=8, task_bytes=64 << 10)  # warm everything up
vm = next(int(l.split()[1]) for l in open("/proc/self/status") if l.startswith("VmSize")) << 10
# Room for about one more 8 MiB thread stack: later thread starts fail with EAGAIN.
resource.setrlimit(resource.RLIMIT_AS, (vm + (12 << 20), resource.RLIM_INFINITY))
for i in range(5):
    metamat.fill_(t, metamat.Uniform(), key="limit")
    assert np.array_equal(t.numpy(), ref.numpy())  # numpy: no OpenMP threads to start
    d[:] = 0
    r = C.read_plan([path], arr.ctypes.data, 1, threads=8, task_bytes=64 << 10,
                    bounce_bytes=64 << 10)
    assert r["ok"], r["error"]
    assert bytes(d) == open(path, "rb").read()
print("OK")
"""


@pytest.mark.skipif("libasan" in os.environ.get("LD_PRELOAD", ""),
                    reason="AddressSanitizer's allocator cannot run under RLIMIT_AS")
def test_real_thread_limit_never_aborts(tmp_path):
    """A real limit (RLIMIT_AS leaves no room for more thread stacks): thread starts fail with
    EAGAIN; fills and reads still finish on the threads that started."""
    p = tmp_path / "d.bin"
    p.write_bytes(os.urandom(4 << 20))
    r = subprocess.run([sys.executable, "-c", _REAL_LIMIT.format(here=HERE, path=str(p))],
                       capture_output=True, text=True, timeout=300,
                       env=dict(os.environ, PYTHONPATH=os.pathsep.join(sys.path)))
    assert "terminate called" not in r.stderr, r.stderr[-3000:]
    assert r.returncode == 0 and "OK" in r.stdout, (r.returncode, r.stderr[-3000:])
