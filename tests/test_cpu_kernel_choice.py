"""METAMAT_CPU_KERNEL names the CPU kernel fill_ uses (or ``measure``: time the SIMD kernels
and take the faster, what AMD Zen 4 gets by default); a name this CPU cannot run, or no
kernel's name, is an error that says where the name came from."""
import os
import subprocess
import sys

import pytest
import torch

import metamat
from metamat._ext import core
from metamat.reference import reference_block
from conftest import bits

_FILL = """
import sys, torch, metamat
from metamat._ext import core
t = torch.empty(3, 200)
metamat.fill_(t, metamat.Normal(0.5, 2.0), key="k", seed=9, row_offset=5, col_offset=7)
torch.save(t, sys.argv[1])
print(core().cpu_kernel_choice())
print(core().cpu_kernel())
"""


def _run(value: str, out: str) -> subprocess.CompletedProcess:
    env = dict(os.environ, METAMAT_CPU_KERNEL=value)
    return subprocess.run([sys.executable, "-c", _FILL, out], env=env, capture_output=True,
                          text=True, timeout=300)


@pytest.mark.parametrize("isa", ["avx512", "avx2", "x86-64"])
def test_the_named_kernel_is_used_and_values_do_not_change(isa, tmp_path):
    if isa not in core().cpu_kernels():
        pytest.skip(f"this CPU cannot run the {isa} kernel")
    r = _run(isa, str(tmp_path / "t.pt"))
    assert r.returncode == 0, r.stderr[-2000:]
    assert r.stdout.split()[-1] == isa
    ref = reference_block((3, 200), metamat.Normal(0.5, 2.0), seed=9, key="k", row_offset=5,
                          col_offset=7, dtype=torch.float32)
    assert torch.equal(bits(torch.load(tmp_path / "t.pt")), bits(ref))


def _amd_family_19h() -> bool:
    """AMD family 0x19 (Zen 3, Zen 4): with AVX-512 (Zen 4) its kernel is chosen by timing."""
    with open("/proc/cpuinfo") as f:
        info = f.read()
    return "AuthenticAMD" in info and "\ncpu family\t: 25\n" in info


def test_measure_picks_a_runnable_kernel_with_the_same_values(tmp_path):
    r = _run("measure", str(tmp_path / "t.pt"))
    assert r.returncode == 0, r.stderr[-2000:]
    why, isa = r.stdout.splitlines()[-2:]
    assert isa in core().cpu_kernels() and isa != "x86-64" or core().cpu_kernels() == ["x86-64"]
    if "avx512" in core().cpu_kernels():  # both SIMD kernels timed, in microseconds
        assert why.startswith("measured: ") and "avx512 " in why and "avx2 " in why
        assert " us" in why
    else:  # one SIMD kernel at most: nothing to compare
        assert why == f"measure: only {isa} runs here, nothing timed"
    ref = reference_block((3, 200), metamat.Normal(0.5, 2.0), seed=9, key="k", row_offset=5,
                          col_offset=7, dtype=torch.float32)
    assert torch.equal(bits(torch.load(tmp_path / "t.pt")), bits(ref))


def test_the_default_choice_says_why(tmp_path):
    r = _run("", str(tmp_path / "t.pt"))
    assert r.returncode == 0, r.stderr[-2000:]
    why, isa = r.stdout.splitlines()[-2:]
    assert isa == core().cpu_kernel()
    if "avx512" in core().cpu_kernels() and _amd_family_19h():
        assert why.startswith("measured: ")
    else:  # the widest kernel this CPU runs, by the fixed rule
        assert why.startswith("CPUID: ") and isa == core().cpu_kernels()[0]


def test_unknown_or_unrunnable_names_are_errors(tmp_path):
    r = _run("sse9", str(tmp_path / "t.pt"))
    assert r.returncode != 0
    assert "METAMAT_CPU_KERNEL: unknown CPU kernel 'sse9' (avx512, avx2, x86-64, measure)" \
        in r.stderr
    missing = [k for k in ("avx512", "avx2") if k not in core().cpu_kernels()]
    if missing:  # a CPU without AVX-512 (or AVX2) refuses it by name
        r = _run(missing[0], str(tmp_path / "t.pt"))
        assert r.returncode != 0 and "cannot run the" in r.stderr
    assert not (tmp_path / "t.pt").exists()  # nothing was written
