"""The GPU section of bench/bench_init.py (goal rows and the goals table) runs end to end;
without a GPU it runs on the CPU, so its code paths are exercised on every machine."""
import os
import sys

import torch

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def test_gpu_section_rows_and_goals(capsys):
    sys.path.insert(0, os.path.join(ROOT, "bench"))
    try:
        import bench_init
    finally:
        sys.path.remove(os.path.join(ROOT, "bench"))
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    rows = bench_init._gpu_rows(4 << 20, 1, device)
    names = [r.method for r in rows]
    for want in ("fp32 torch fill_", "fp32 metamat Uniform", "fp32 metamat Normal",
                 "bf16 torch fill_", "bf16 metamat Uniform", "bf16 metamat Normal",
                 "metamat 1 table", "metamat 4 x 1 MiB: one launch", "metamat 4 x 1 MiB: fill_many_"):
        assert want in names, names
    assert all(r.seconds > 0 for r in rows)
    out = capsys.readouterr().out
    assert "GPU goals" in out
    for goal in ("fp32 metamat Uniform", "fp32 metamat Normal", "bf16 metamat Uniform", "one launch"):
        assert any(goal in line and ("MET" in line or "MISSED" in line) for line in out.splitlines()), goal
