"""scripts/gpu_check.sh's control flow, on any machine (no GPU needed): its dry mode
(GPU_CHECK_DRY=1: steps only say what they would run, pytest steps run a stand-in test file
with real pytest and JUnit) and two real steps on this CPU.

* a failing step is recorded (FAIL, its failing tests named from the JUnit XML) and every later
  step still runs, in the script's order (the TorchRec GPU and quant tests, the benches of
  those paths, then the other cuda tests);
* a step that hangs is stopped at what is left of the budget (TIMEOUT) and the steps after it
  are SKIPPED for lack of time;
* the output folder holds few files (the device tool returns at most 8, 16 MiB each, 2 folders
  deep), summary.json with every step's status, seconds, tests and log, and logs.tar.gz with
  every log;
* summary.json is rewritten after every step (a stopped run still leaves one).
"""
from __future__ import annotations

import importlib.util
import json
import os
import re
import shutil
import subprocess
import sys
import tarfile

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
SCRIPT = os.path.join(ROOT, "scripts", "gpu_check.sh")
ORDER = ["env", "stack", "fbgemm_smoke", "build", "backend", "variants", "torchrec_gpu",
         "torchrec_layout", "quant_gpu", "bench_dmp", "bench_load", "bench_quant", "cuda",
         "bench_init",
         "bench_stage", "bench_tp", "torchrec_emulated", "memcheck", "racecheck"]
STATUSES = {"PASS", "FAIL", "SKIPPED", "TIMEOUT"}


def run_check(tmp_path, env: dict, timeout: int = 240):
    out, work = tmp_path / "out", tmp_path / "work"
    full = dict(os.environ, PYTHON=sys.executable, SUMMARY_PYTHON=sys.executable,
                GPU_CHECK_WORK=str(work), SITE=str(tmp_path / "no_site"), **env)
    full.pop("PYTHONPATH", None)
    p = subprocess.run(["bash", SCRIPT, str(out)], cwd=ROOT, env=full, capture_output=True,
                       text=True, timeout=timeout)
    summary = json.loads((out / "summary.json").read_text())
    return p, out, summary


def check_outdir(out):
    """The device tool's rule: at most 8 files, 16 MiB each, at most 2 folders down, plain
    names; here: no folders at all."""
    files = []
    for dirpath, dirnames, names in os.walk(out):
        for n in names:
            files.append(os.path.join(dirpath, n))
    assert len(files) <= 8, files
    for f in files:
        rel = os.path.relpath(f, out)
        assert rel.count(os.sep) == 0, rel
        assert re.fullmatch(r"[A-Za-z0-9._-]+", rel), rel
        assert os.path.getsize(f) <= 16 << 20, rel
    return sorted(os.path.relpath(f, out) for f in files)


def by_name(summary):
    return {s["name"]: s for s in summary["steps"]}


def test_dry_run_records_a_failing_step_and_runs_the_later_ones(tmp_path):
    selected = "env stack build backend torchrec_gpu quant_gpu bench_dmp cuda"
    p, out, summary = run_check(tmp_path, {
        "GPU_CHECK_DRY": "1", "STEPS": selected, "GPU_CHECK_FAIL": "build torchrec_gpu",
        "BUDGET_S": "300"})
    assert p.returncode == 1, p.stdout + p.stderr
    names = check_outdir(out)
    assert {"summary.json", "logs.tar.gz", "gpu_check.log"} <= set(names), names
    # every step, in the script's order: TorchRec's GPU tests and benches before the other
    # cuda tests
    assert [s["name"] for s in summary["steps"]] == ORDER
    assert summary["overall"] == "FAIL" and summary["final"] is True
    assert summary["failed_steps"] == ["build", "torchrec_gpu"]
    assert summary["budget_s"] == 300 and summary["dry"] is True
    steps = by_name(summary)
    for s in summary["steps"]:
        assert s["status"] in STATUSES
        assert isinstance(s["seconds"], (int, float)) and s["cap_s"] > 0
        if s["name"] in selected.split():
            assert s["log"] == f"logs/{s['name']}.log", s
        else:
            assert s["status"] == "SKIPPED" and s["note"].startswith("not selected"), s
    assert steps["build"]["status"] == "FAIL" and steps["build"]["rc"] == 3
    # the steps after a failure ran
    for name in ("backend", "quant_gpu", "bench_dmp", "cuda"):
        assert steps[name]["status"] == "PASS", steps[name]
    # a failing pytest step names its failing tests (JUnit), with the message
    t = steps["torchrec_gpu"]
    assert t["status"] == "FAIL" and t["junit"] == "logs/torchrec_gpu.xml"
    assert t["tests"] == {"total": 2, "passed": 1, "failed": 1, "errors": 0, "skipped": 0}
    assert [x.split("::")[-1] for x in t["failing_tests"]] == ["test_fails"]
    assert "this step fails here" in t["failures"][0]["message"]
    assert steps["cuda"]["tests"]["passed"] == 1 and not steps["cuda"]["failing_tests"]
    # every log is in logs.tar.gz; the printed summary names the failing test
    with tarfile.open(out / "logs.tar.gz") as tar:
        members = set(tar.getnames())
    for name in selected.split():
        assert f"logs/{name}.log" in members, members
    assert "logs/torchrec_gpu.xml" in members and "logs/steps.tsv" in members
    assert "test_fails" in p.stdout and "== summary: FAIL" in p.stdout
    # run in this order: TorchRec's GPU tests, quantized ones, the benches, the other cuda tests
    started = [line[3:].split(" ")[0] for line in p.stdout.splitlines()
               if line.startswith("== ") and "(at most" in line]
    assert started == ["env", "build", "stack", "backend", "torchrec_gpu", "quant_gpu",
                       "bench_dmp", "cuda"]
    assert "== summary: FAIL" in (out / "gpu_check.log").read_text()


def test_dry_run_stops_a_hanging_step_and_skips_what_the_budget_leaves_out(tmp_path):
    p, out, summary = run_check(tmp_path, {
        "GPU_CHECK_DRY": "1", "STEPS": "env bench_dmp bench_load", "GPU_CHECK_HANG": "bench_dmp",
        "BUDGET_S": "6", "RESERVE_S": "0", "MIN_STEP_S": "2"})
    assert p.returncode == 1, p.stdout + p.stderr
    check_outdir(out)
    steps = by_name(summary)
    assert steps["env"]["status"] == "PASS"
    assert steps["bench_dmp"]["status"] == "TIMEOUT", steps["bench_dmp"]
    # stopped by its cap (what the 6 s budget left), not by its own end (a 100000 s sleep);
    # its seconds are not compared with a clock bound (a busy machine stretches them)
    assert steps["bench_dmp"]["cap_s"] <= 6
    assert "stopped at its" in steps["bench_dmp"]["note"], steps["bench_dmp"]
    assert steps["bench_load"]["status"] == "SKIPPED"
    assert "no time left" in steps["bench_load"]["note"]
    assert summary["overall"] == "FAIL" and summary["failed_steps"] == ["bench_dmp"]


def test_dry_run_stops_the_background_variants_build_before_the_benches(tmp_path):
    """The init kernel's variants build in the background while the tests run; one still
    running when the benches start is stopped there (nothing compiles under a bench) and, being
    optional, fails nothing."""
    p, out, summary = run_check(tmp_path, {
        "GPU_CHECK_DRY": "1", "STEPS": "env backend variants cuda bench_dmp",
        "GPU_CHECK_HANG": "variants", "BUDGET_S": "120"})
    assert p.returncode == 0, p.stdout + p.stderr
    steps = by_name(summary)
    v = steps["variants"]
    assert v["status"] == "TIMEOUT" and v["note"] == "stopped before the benches", v
    assert v["seconds"] < 100, v  # stopped, not run to its cap
    assert steps["cuda"]["status"] == "PASS" and steps["bench_dmp"]["status"] == "PASS"
    assert summary["overall"] == "PASS" and summary["failed_steps"] == []
    started = [line[3:].split(" ")[0] for line in p.stdout.splitlines()
               if line.startswith("== ") and "(at most" in line]
    assert started == ["env", "backend", "variants", "bench_dmp", "cuda"]
    assert p.stdout.index("== variants: still running") < p.stdout.index("== bench_dmp (at most")


def test_real_steps_on_this_cpu(tmp_path):
    """Not dry: `backend` fails here (no GPU / no CUDA backend), the TorchRec GPU tests all
    skip (SKIPPED with pytest's reason, or not run when torchrec is missing): overall FAIL."""
    # two pytest-xdist workers, not the GPU box's four: each imports torch and TorchRec
    p, out, summary = run_check(tmp_path, {"STEPS": "backend torchrec_gpu", "BUDGET_S": "200",
                                           "XDIST_N": "2"})
    assert p.returncode == 1, p.stdout + p.stderr
    check_outdir(out)
    steps = by_name(summary)
    assert steps["backend"]["status"] == "FAIL", steps["backend"]
    t = steps["torchrec_gpu"]
    assert t["status"] == "SKIPPED", t
    if t.get("junit"):  # torchrec importable here: pytest ran and skipped every test
        assert t["tests"]["passed"] == 0 and t["tests"]["skipped"] >= 1, t
        assert "all tests skipped" in t["note"], t
    assert summary["overall"] == "FAIL" and summary["failed_steps"] == ["backend"]


def _summary_module():
    spec = importlib.util.spec_from_file_location(
        "gpu_check_summary", os.path.join(ROOT, "scripts", "gpu_check_summary.py"))
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def test_summary_of_a_pytest_step_stopped_before_its_xml(tmp_path):
    """A pytest step stopped at its cap writes no JUnit XML: the failing tests and the one that
    was running come from its -v log."""
    S = _summary_module()
    work, out = tmp_path / "work", tmp_path / "out"
    work.mkdir()
    out.mkdir()
    (work / "cuda.log").write_text(
        "tests/test_a.py::test_ok PASSED                     [ 25%]\n"
        "tests/test_a.py::test_bad[x-1] FAILED               [ 50%]\n"
        "tests/test_b.py::test_skip SKIPPED (no GPU)         [ 75%]\n"
        "tests/test_b.py::test_hangs \n")
    (work / "torchrec_gpu.log").write_text(  # pytest-xdist's -v lines
        "[gw1] [ 50%] PASSED tests/test_t.py::test_a[device] \n"
        "[gw0] [100%] FAILED tests/test_t.py::test_a[mixed-dmp] \n")
    (work / "meta.json").write_text(json.dumps({
        "budget_s": 540, "order": ["torchrec_gpu", "cuda", "bench_dmp", "memcheck"],
        "optional_steps": ["memcheck"]}))
    (work / "steps.tsv").write_text("memcheck\tTIMEOUT\t124\t20\t20\tcmd\t\n"
                                    "cuda\tTIMEOUT\t124\t150\t150\tpytest\tstopped\n"
                                    "torchrec_gpu\tFAIL\t1\t9\t150\tpytest\t\n"
                                    "bench_dmp\tPASS\t0\t3\t100\tcmd\t\n")
    (work / "bench_dmp").mkdir()
    (work / "bench_dmp" / "results.csv").write_text("method,seconds\neager,1.5\nmetamat,0.5\n")
    s = S.write(str(work), str(out), final=True)
    # in the script's order; an optional step's TIMEOUT (time ran out) is no failure
    assert [x["name"] for x in s["steps"]] == ["torchrec_gpu", "cuda", "bench_dmp", "memcheck"]
    assert s["failed_steps"] == ["torchrec_gpu", "cuda"]
    cuda = s["steps"][1]
    assert cuda["status"] == "TIMEOUT"
    assert cuda["failing_tests"] == ["tests/test_a.py::test_bad[x-1]", "tests/test_b.py::test_hangs"]
    assert cuda["failures"][1]["kind"] == "stopped"
    assert cuda["tests"]["passed"] == 1 and cuda["tests"]["skipped"] == 1
    assert s["steps"][0]["failing_tests"] == ["tests/test_t.py::test_a[mixed-dmp]"]
    assert s["steps"][0]["tests"]["passed"] == 1
    assert s["overall"] == "FAIL"
    # the benches' rows in one CSV, the step first
    rows = (out / "benches.csv").read_text().splitlines()
    assert rows == ["step,method,seconds", "bench_dmp,eager,1.5", "bench_dmp,metamat,0.5"]
    assert "benches.csv" in s["files"]
    assert S.nodeid("tests.test_gpu_check_script", "test_x[1]") == \
        "tests/test_gpu_check_script.py::test_x[1]"
    assert S.nodeid("tests.test_gpu_check_script.TestY", "test_z") == \
        "tests/test_gpu_check_script.py::TestY::test_z"
    assert S.nodeid("", "tests.test_gpu_check_script") == "tests/test_gpu_check_script.py"


@pytest.mark.parametrize("script", ["gpu_check.sh", "gpu_torchrec_stack.sh",
                                    "gpu_torchrec_install.sh"])
def test_scripts_parse(script):
    subprocess.run(["bash", "-n", os.path.join(ROOT, "scripts", script)], check=True)


def _keep_arch_module():
    spec = importlib.util.spec_from_file_location(
        "fatbin_keep_arch", os.path.join(ROOT, "scripts", "fatbin_keep_arch.py"))
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def _cubins(K, path):
    """[(arch, kernel names, payload bytes)] of a library's fatbin entries."""
    import mmap

    out = []
    with open(path, "rb") as f, mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ) as m:
        for e, kind, eh, payload, arch, flags in K.entries(m):
            data = K._payload(m, e, eh, payload, flags)
            out.append((arch, K.base_names(K.cubin_kernels(data)), data))
    return out


@pytest.mark.skipif(shutil.which("nvcc") is None, reason="needs nvcc")
def test_fatbin_keep_arch_on_a_built_library(tmp_path):
    """scripts/fatbin_keep_arch.py on a library nvcc builds for sm_80 and sm_90a: the sm_90a
    cubin of a kept kernel is untouched, a dropped kernel's has no code for sm_90 any more,
    every other entry is a valid empty cubin, the file keeps its size and still loads."""
    import ctypes

    (tmp_path / "a.cu").write_text("__global__ void keep_me(float *x) { x[threadIdx.x] += 1.f; }\n")
    (tmp_path / "b.cu").write_text("__global__ void drop_me_vbe(float *x) { x[threadIdx.x] *= 2.f; }\n")
    lib = tmp_path / "lib.so"
    subprocess.run(["nvcc", "-shared", "-Xcompiler", "-fPIC", "-gencode",
                    "arch=compute_80,code=sm_80", "-gencode", "arch=compute_90a,code=sm_90a",
                    "a.cu", "b.cu", "-o", str(lib)], cwd=tmp_path, check=True, timeout=300)
    K = _keep_arch_module()
    before, size = _cubins(K, lib), lib.stat().st_size
    assert {a for a, _, _ in before} == {80, 90}
    report = tmp_path / "dropped.tsv"
    subprocess.run([sys.executable, os.path.join(ROOT, "scripts", "fatbin_keep_arch.py"),
                    "--drop", "_vbe$", "--empty-dir", str(tmp_path / "empty"), "--report",
                    str(report), "90", str(lib)], check=True, timeout=300)
    after = _cubins(K, lib)
    assert lib.stat().st_size == size and len(after) == len(before)
    for (a0, k0, d0), (a1, k1, d1) in zip(before, after):
        if a0 == 90 and "keep_me" in k0:
            assert (a1, k1, d1) == (a0, k0, d0)  # untouched
        elif a0 == 90 and "drop_me_vbe" in k0:
            assert a1 == 80 and k1 == [] and d1[:4] == b"\x7fELF"  # no sm_90 code left
        else:
            assert a1 == a0 and k1 == [] and (d1[:4] == b"\x7fELF" or not d1.strip(b"\0"))
    assert any(a == 90 and "keep_me" in k for a, k, _ in after)
    assert not any(a == 90 and "drop_me_vbe" in k for a, k, _ in after)
    assert "drop_me_vbe" in report.read_text()
    ctypes.CDLL(str(lib))  # loads (static cudart registers the fatbin at load)


def test_fbgemm_smoke_runs_its_checks_on_fbgemm_cpu():
    """The GPU check's smoke step is the same script on the CPU ops (fbgemm-gpu-cpu): every
    check that has a CPU kernel passes, the CUDA-only ones say so, nothing fails to import."""
    pytest.importorskip("fbgemm_gpu")
    p = subprocess.run([sys.executable, os.path.join(ROOT, "scripts", "gpu_fbgemm_smoke.py"),
                        "--device", "cpu"], cwd=ROOT, capture_output=True, text=True,
                       timeout=240)
    assert p.returncode == 0, p.stdout[-3000:] + p.stderr[-3000:]
    lines = p.stdout.splitlines()
    assert not [ln for ln in lines if ln.startswith("FAIL")], p.stdout
    for name in ("zero_collision_hash", "reset_weight_momentum", "MANAGED_CACHING"):
        assert any(ln.startswith("skip") and name in ln and ln.endswith("CUDA only")
                   for ln in lines), (name, p.stdout)
    assert any(ln.startswith("ok    inference tbe INT4") for ln in lines), p.stdout
