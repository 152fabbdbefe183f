"""The Makefile's two paths, dry-run (make -n): a machine whose python3 imports a CUDA torch
uses that interpreter as it is (no venv, no pip, in-place CMake build); any other machine gets
the fresh-venv CPU path that CI runs."""
import os
import shutil
import subprocess
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
pytestmark = pytest.mark.skipif(shutil.which("make") is None, reason="make not installed")

FAKE = """#!/bin/sh
# claims a CUDA torch (and an sm_90 GPU) for the Makefile's probes; anything else: real python
if [ "$1" = "-c" ]; then
  case "$2" in
    *"torch.version.cuda else 1"*) exit 0 ;;
    *get_device_capability*) echo 90; exit 0 ;;
  esac
fi
exec "{python}" "$@"
"""


def dry_run(target, py, *extra):
    r = subprocess.run(["make", "-n", *extra, "-C", ROOT, target, f"PY={py}"], capture_output=True,
                       text=True, timeout=120)
    assert r.returncode == 0, r.stderr
    return [line for line in r.stdout.splitlines() if not line.startswith("make")]


def test_gpu_machine_uses_its_python_as_is(tmp_path):
    fake = tmp_path / "python3"
    fake.write_text(FAKE.format(python=sys.executable))
    fake.chmod(0o755)
    for target in ("test", "bench"):
        cmds = dry_run(target, str(fake))
        text = "\n".join(cmds)
        assert "venv" not in text and "pip" not in text, text
        assert f'METAMAT_CUDA_ARCHS="90" {fake} scripts/build_ext.py' in text
    assert dry_run("test", str(fake))[-1] == f"{fake} -m pytest -q --continue-on-collection-errors"
    assert dry_run("bench", str(fake))[-1].rstrip().endswith(f"{fake} bench/materialize.py")


def test_other_machines_get_the_fresh_venv_path():
    # -B: as on a fresh machine, even where this checkout's .venv is already set up
    cmds = dry_run("test", "/bin/false", "-B")  # a python3 without a (CUDA) torch
    assert cmds[0] == "test -x .venv/bin/python || /bin/false -m venv .venv"
    text = "\n".join(cmds)
    # the extension builds in the background while pip installs the stack, torch first
    assert ".venv/bin/python setup.py -q build_ext --inplace ) >" in text
    assert ".venv/bin/python -m pip install -q -c constraints.txt torch" in text
    assert text.index("build_ext --inplace") < text.index("-c constraints.txt torch")
    assert cmds[-2:] == [".venv/bin/python -m pip install -q --no-build-isolation --no-deps -e .",
                         ".venv/bin/python -m pytest -q -n auto"]
