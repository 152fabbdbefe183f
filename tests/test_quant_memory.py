"""Peak host memory of a quantized load, measured in a separate process: the quantized bytes of
the tables plus the staging budget (the float table never exists in memory). The peak is the
process's VmHWM, reset (``/proc/self/clear_refs`` 5) after the model is built on meta; page
cache is not process memory."""
from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest
import torch

pytest.importorskip("torchrec")
pytest.importorskip("fbgemm_gpu")

ROWS, DIM = 65536, 512  # 128 MiB of fp32 rows; INT8: 528-byte rows, 33 MiB
STAGING = 16 << 20
MIB = 1 << 20

CHILD = r"""
import json, sys, torch
sys.path.insert(0, sys.argv[3])
import metamat
from _quant_models import ebc_tables, meta_quant

def status(key):
    for line in open("/proc/self/status"):
        if line.startswith(key):
            return int(line.split()[1]) * 1024

q = meta_quant(ebc_tables(dims=(int(sys.argv[2]),), rows=(int(sys.argv[4]),)), "int8", False)
metamat.materialize  # imported
open("/proc/self/clear_refs", "w").write("5")  # VmHWM := VmRSS
before = status("VmRSS:")
r = metamat.materialize(q, sys.argv[1], staging_bytes=int(sys.argv[5]), io_threads=2)
print(json.dumps({"before": before, "peak": status("VmHWM:"), "allocated": r.bytes_allocated}))
"""


def _hwm_resettable() -> bool:
    try:
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")
        return True
    except OSError:
        return False


@pytest.mark.skipif(not _hwm_resettable(), reason="cannot reset VmHWM (/proc/self/clear_refs)")
def test_peak_is_quantized_bytes_plus_staging(tmp_path):
    path = str(tmp_path / "f.pt")
    torch.save({"coll.embedding_bags.t0.weight": torch.randn(ROWS, DIM),
                "dense.weight": torch.randn(2, 4), "dense.bias": torch.randn(2)}, path)
    here = os.path.dirname(os.path.abspath(__file__))
    out = subprocess.run([sys.executable, "-c", CHILD, path, str(DIM), here, str(ROWS),
                          str(STAGING)], capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr[-3000:]
    r = json.loads(out.stdout.strip().splitlines()[-1])
    quant = ROWS * 528
    assert r["allocated"] >= quant
    grew = r["peak"] - r["before"]
    # the quantized table + the staging budget, and 8 MiB for the interpreter's own growth
    assert grew <= quant + STAGING + 8 * MIB, (grew / MIB, quant / MIB)
    assert grew < ROWS * DIM * 4 * 0.5  # far below the float table
