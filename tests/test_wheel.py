"""The built wheel is complete: installed into a fresh venv (not the source tree), every
subpackage imports and a small materialize and load run from the installed copy."""
from __future__ import annotations

import glob
import os
import subprocess
import sys
import sysconfig
import textwrap

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

SCRIPT = textwrap.dedent("""
    import importlib, os, pkgutil, sys, tempfile
    import torch
    import metamat
    assert metamat.__file__.startswith(sys.prefix), metamat.__file__
    names = [m.name for m in pkgutil.walk_packages(metamat.__path__, "metamat.")
             if not m.name.endswith("__main__")]
    for n in names:
        importlib.import_module(n)
    for pkg in ("metamat.load", "metamat.models", "metamat.models.torchrec", "metamat.checkpoint"):
        assert pkg in names, (pkg, names)
    m = torch.nn.Linear(4, 3, device="meta")
    metamat.materialize(m, device="cpu", seed=1)
    d = tempfile.mkdtemp()
    from safetensors.torch import save_file
    save_file({k: v.detach() + 1 for k, v in m.state_dict().items()}, os.path.join(d, "m.safetensors"))
    n = torch.nn.Linear(4, 3, device="meta")
    metamat.materialize(n, os.path.join(d, "m.safetensors"), device="cpu")
    assert torch.equal(n.weight, m.weight + 1)
    print("OK", len(names))
""")


def test_wheel_installs_and_runs(tmp_path):
    import shutil

    # setuptools' staging dirs from earlier builds would hide a package left out of the wheel
    for stale in glob.glob(os.path.join(ROOT, "build", "lib*")) + \
            glob.glob(os.path.join(ROOT, "build", "bdist*")):
        shutil.rmtree(stale, ignore_errors=True)
    wheels = tmp_path / "wheels"
    build = subprocess.run([sys.executable, "-m", "pip", "wheel", "--no-build-isolation",
                            "--no-deps", "-v", "-w", str(wheels), ROOT], cwd=ROOT,
                           capture_output=True, text=True)
    assert build.returncode == 0, build.stderr[-3000:]
    # setuptools ships undeclared subpackages as data with this warning (older ones drop
    # them): every package must be declared
    assert "importable" not in build.stdout + build.stderr, "a subpackage is not declared"
    (whl,) = glob.glob(str(wheels / "metamat-*.whl"))
    venv = tmp_path / "venv"
    subprocess.run([sys.executable, "-m", "venv", "--without-pip", str(venv)], check=True)
    py = str(venv / "bin" / "python")
    site = subprocess.run([py, "-c", "import sysconfig; print(sysconfig.get_path('purelib'))"],
                          check=True, capture_output=True, text=True).stdout.strip()
    # The dependencies (torch, numpy, ...) come from this environment's site-packages as a
    # plain path entry: its .pth files (the editable metamat) are not processed.
    with open(os.path.join(site, "deps.pth"), "w") as f:
        f.write(sysconfig.get_path("purelib") + "\n")
    subprocess.run([sys.executable, "-m", "pip", "install", "-q", "--no-deps",
                    "--target", site, whl], check=True)
    out = subprocess.run([py, "-c", SCRIPT], capture_output=True, text=True, cwd=str(tmp_path),
                         env={k: v for k, v in os.environ.items() if k != "PYTHONPATH"})
    assert out.returncode == 0, out.stderr[-3000:]
    assert out.stdout.startswith("OK")
