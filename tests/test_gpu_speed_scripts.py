"""The GPU speed round's scripts run on CPU: bench_init_variants through the kernel's emulation,
bench_stage (read ceiling, conversion rows, --sweep) with the host sink, gpu_speed.sh's dry
run and its summary (at most 8 files), so a GPU session's one call does not fail on a typo."""
from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent


def _run(args, env=None, timeout=600):
    e = dict(os.environ, PYTHONPATH=str(ROOT), **(env or {}))
    r = subprocess.run(args, cwd=ROOT, env=e, capture_output=True, text=True, timeout=timeout)
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    return r.stdout


def test_init_variants_bench_emulated(tmp_path):
    out = tmp_path / "init.json"
    text = _run([sys.executable, "bench/bench_init_variants.py", "--emulate", "--size-gib",
                 "0.0005", "--rounds", "1", "--tables", "8", "--tiles", "1,3",
                 "--variants", "base,math,split,philoxbits", "--json", str(out)])
    rows = json.loads(out.read_text())
    init = [r for r in rows if r["kind"] == "init"]
    assert {(r["dtype"], r["dist"]) for r in init} >= {("float32", "Uniform"),
                                                       ("bfloat16", "TruncNormal"),
                                                       ("float16", "Uniform")}
    assert {r["variant"] for r in init} == {"base", "math", "split", "philoxbits"}
    assert all(r["x_fill"] > 0 for r in init)
    many = [r for r in rows if r["kind"] == "many"]
    assert {(r["variant"], r["tiles"]) for r in many} == {(v, t) for v in ("base", "math", "split")
                                                         for t in (1, 3)}
    assert "tables of" in text
    prof = _run([sys.executable, "bench/bench_init_variants.py", "--emulate", "--size-gib",
                 "0.0005", "--variants", "base,split", "--profile"])
    assert prof.count("profiled:") == 4


def test_stage_bench_ceiling_conversion_and_sweep(tmp_path):
    out = tmp_path / "stage.json"
    _run([sys.executable, "bench/bench_stage.py", "--device", "cpu", "--size-gib", "0.008",
          "--reps", "1", "--tensors", "2", "--sweep", "--json", str(out)])
    d = json.loads(out.read_text())
    names = [r["row"] for r in d["rows"]]
    assert any(n.startswith("read ceiling: same bytes") for n in names)
    staged = next(r for r in d["rows"] if r["row"] == "metamat staged fp32")
    assert staged["x_read"] > 0 and staged["threads"] >= 1
    conv = {r.get("convert"): r for r in d["rows"] if "fp32 -> bf16" in r["row"]}
    assert set(conv) == {"host", "device"}
    if "x_h2d" in conv["device"]:  # (a GPU) the device converts: fp32 bytes cross PCIe
        assert conv["device"]["x_h2d"] / conv["host"]["x_h2d"] == pytest.approx(
            2 * conv["host"]["seconds"] / conv["device"]["seconds"])
    assert any("bf16 checkpoint" in n for n in names)
    sweep = [r for r in d["rows"] if r["row"] == "sweep"]
    assert {r["ring_mib"] for r in sweep} == {8, 16, 32, 64, 96}
    assert all(r["x_read"] > 0 and r["first_gbps"] > 0 for r in sweep)


def test_gpu_check_through_the_emulation():
    # the GPU run's correctness step, its GPU replaced by the kernel's host emulation and the
    # host copy sink: every variant x tiles, and device vs host conversion
    text = _run([sys.executable, "scripts/gpu_speed_check.py", "--emulate"])
    assert "FAIL" not in text and text.strip().endswith("check: PASS")
    assert text.count("PASS variant") == 2 * sum(
        not v["diagnostic"] for v in __import__("metamat._ext", fromlist=["core"]).core()
        .fill_variants())
    assert text.count("device conversion == host") == 2


def test_gpu_speed_dry_run_and_summary(tmp_path):
    out = tmp_path / "out"
    before = set(Path("/tmp").glob("gpu_speed.*"))
    text = _run(["bash", "scripts/gpu_speed.sh", str(out)], env={"GPU_SPEED_DRY": "1"})
    assert set(Path("/tmp").glob("gpu_speed.*")) <= before  # its scratch folder is gone
    files = sorted(p.name for p in out.iterdir())
    assert len(files) <= 8, files
    assert {"summary.json", "summary.csv", "env.txt", "build.log", "check.log", "init.log",
            "stage.log"} <= set(files)
    s = json.loads((out / "summary.json").read_text())
    assert [x["step"] for x in s["steps"]][:4] == ["build", "check", "init", "stage"]
    assert s["overall"] == "PASS"
    assert "METAMAT_FILL_VARIANTS=1" in (out / "build.log").read_text()
    assert "gpu_speed:" in text


def test_summary_goals_from_bench_rows(tmp_path):
    work, out = tmp_path / "w", tmp_path / "o"
    work.mkdir(), out.mkdir()
    (work / "steps.tsv").write_text("init\tPASS\t0\t30\tinit.log\n")
    init = [{"kind": "init", "gpu": "H200", "dtype": "float32", "dist": "Uniform",
             "variant": v, "x_fill": x, "diagnostic": d}
            for v, x, d in (("base", 0.62, False), ("split", 0.8, False),
                            ("philoxbits", 0.97, True))]  # a diagnostic never meets a goal
    # many tables: the fastest many-table launch over the fastest one-table launch of any
    # variant (math's slow one table would flatter its own ratio)
    init += [{"kind": "many", "gpu": "H200", "variant": v, "tiles": t, "one_seconds": o,
              "many_seconds": m, "many_over_one": m / o}
             for v, t, o, m in (("base", 1, 1.0, 1.24), ("base", 4, 1.0, 1.10),
                                ("math", 1, 1.3, 1.20))]
    (work / "init.json").write_text(json.dumps(init))
    stage = {"gpu": "H200", "rows": [
        {"row": "metamat staged fp32", "gbps": 30, "x_read": 0.95, "x_h2d": 0.6},
        {"row": "metamat staged fp32 -> bf16, host conversion", "convert": "host", "gbps": 20},
        {"row": "metamat staged fp32 -> bf16, device conversion", "convert": "device",
         "gbps": 25},
        {"row": "sweep", "ring_mib": 64, "threads": 16, "gbps": 33, "first_gbps": 20,
         "x_read": 0.97}]}
    (work / "stage.json").write_text(json.dumps(stage))
    _run([sys.executable, "scripts/gpu_speed_summary.py", str(work), str(out), "100", "240"])
    s = json.loads((out / "summary.json").read_text())
    g = {x["goal"]: x for x in s["goals"]}
    assert s["gpu"] == "H200"
    u = g["init float32 Uniform >= 0.9x fill_"]
    assert (u["base"], u["best"], u["best_variant"], u["met"]) == (0.62, 0.8, "split", False)
    m = g["10,240 tables <= 1.15x one table"]
    assert (m["base"], m["best"], m["best_variant"], m["met"]) == (1.24, 1.1, "base tiles 4",
                                                                   True)
    assert g["fp32 -> bf16: faster of host/device conversion"]["best_variant"] == "device"
    assert g["staged load >= 0.9x read ceiling (same threads)"]["met"]
    assert not g["staged load >= 0.8x pinned H2D"]["met"]
    assert (out / "summary.csv").read_text().startswith("gpu,")


def test_gds_bench_rows_and_summary(tmp_path):
    # without a GPU: the O_DIRECT ceiling and metamat rows run into host memory, the GDS rows
    # say why they did not; the summary turns the JSON into its goal line
    out = tmp_path / "gds.json"
    d = tmp_path / "files"
    _run([sys.executable, "bench/bench_gds.py", "--device", "cpu", "--size-gib", "0.01",
          "--reps", "1", "--threads", "1,2", "--chunk-mib", "1", "--dir", str(d),
          "--json", str(out)])
    assert not d.exists() and not (ROOT / "cufile.log").exists()
    res = json.loads(out.read_text())
    names = [r["row"] for r in res["rows"]]
    assert "metamat staged, io=auto, cold" in names
    assert {"torch_gds", "nvidia_fs", "filesystem", "mode"} <= set(res["status"])
    assert next(r for r in res["rows"] if r["row"] == "gds")["skipped"] == "no CUDA device"
    work = tmp_path / "work"
    work.mkdir()
    (work / "gds.json").write_text(out.read_text())
    o = tmp_path / "o"
    o.mkdir()
    _run([sys.executable, "scripts/gpu_speed_summary.py", str(work), str(o), "1", "2"])
    s = json.loads((o / "summary.json").read_text())
    g = next(x for x in s["goals"] if x["goal"].startswith("cold load"))
    assert g["staged_gbps"] > 0 and g["gds"] == "no CUDA device"


def test_gds_bench_keeps_rows_and_cleans_up_when_killed(tmp_path):
    # gpu_speed.sh's `timeout` sends SIGTERM: the rows measured so far stay in the JSON and
    # the file the bench wrote is removed
    import signal
    import time

    out, d = tmp_path / "gds.json", tmp_path / "files"
    d.mkdir()
    p = subprocess.Popen([sys.executable, "bench/bench_gds.py", "--device", "cpu",
                          "--size-gib", "0.05", "--reps", "200", "--threads", "1",
                          "--dir", str(d), "--json", str(out)], cwd=ROOT,
                         env=dict(os.environ, PYTHONPATH=str(ROOT)), stdout=subprocess.PIPE,
                         stderr=subprocess.STDOUT, text=True)
    deadline = time.monotonic() + 120
    while time.monotonic() < deadline:
        if out.exists() and json.loads(out.read_text() or "{}").get("rows"):
            break
        time.sleep(0.2)
    p.send_signal(signal.SIGTERM)
    p.communicate(timeout=60)  # closes the pipe
    assert p.returncode != 0
    rows = json.loads(out.read_text())["rows"]
    assert rows and rows[0]["row"].startswith("O_DIRECT read ceiling")
    assert d.exists() and not list(d.iterdir())  # its file removed, the caller's folder kept
