"""Build metamat._C in place with CMake, using the running interpreter as it is.

For machines whose Python already has everything (a GPU box: CUDA torch, pybind11, no
network): no venv, no pip, nothing installed. Drives CMake directly (Ninja when found, else
Unix Makefiles) and copies the module next to metamat/__init__.py, so `python -m pytest` and
`PYTHONPATH=. python bench/...` from the repository root import it.

    python scripts/build_ext.py                 # CUDA backend when nvcc is found (AUTO)
    METAMAT_CUDA=ON METAMAT_CUDA_ARCHS=90 python scripts/build_ext.py
    python scripts/build_ext.py --no-copy       # build only: metamat/ keeps the module it has

Environment: METAMAT_CUDA (ON, OFF, AUTO), METAMAT_CUDA_ARCHS ("80;90" unless given),
METAMAT_BUILD_DIR (build/inplace).
"""
from __future__ import annotations

import os
import shutil
import subprocess
import sys
import sysconfig
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def _tool(name: str) -> str | None:
    """`name` on PATH or beside this interpreter (pip's cmake/ninja in an unactivated venv)."""
    found = shutil.which(name)
    if found:
        return found
    here = Path(sys.executable).parent / name
    return str(here) if here.exists() else None


def _nvcc() -> str | None:
    """nvcc on PATH, under CUDA_HOME, /usr/local/cuda, or from a pip wheel (nvidia/*/bin)."""
    cands = [shutil.which("nvcc"), os.path.join(os.environ.get("CUDA_HOME", ""), "bin", "nvcc"),
             "/usr/local/cuda/bin/nvcc"]
    for site in {sysconfig.get_paths()["purelib"], sysconfig.get_paths()["platlib"]}:
        cands += sorted(str(p) for p in Path(site).glob("nvidia/*/bin/nvcc"))
    for cand in cands:
        if cand and os.path.exists(cand):
            return cand
    return None


def main() -> int:
    try:
        import pybind11
    except ImportError:
        print(f"build_ext: pybind11 is not importable by {sys.executable}; install it "
              "(pip install pybind11) or use `make test` on a machine with network", file=sys.stderr)
        return 2
    cmake = _tool("cmake")
    if cmake is None:
        print("build_ext: cmake not found (PATH or beside the interpreter)", file=sys.stderr)
        return 2
    ninja = _tool("ninja")
    cuda = os.environ.get("METAMAT_CUDA", "AUTO").upper()
    nvcc = _nvcc()
    if cuda == "AUTO":
        cuda = "ON" if nvcc else "OFF"
    build = Path(os.environ.get("METAMAT_BUILD_DIR", ROOT / "build" / "inplace"))
    args = [cmake, "-S", str(ROOT), "-B", str(build),
            "-G", "Ninja" if ninja else "Unix Makefiles",
            f"-DPython_EXECUTABLE={sys.executable}",
            f"-Dpybind11_DIR={pybind11.get_cmake_dir()}",
            f"-DMETAMAT_CUDA={cuda}",
            f"-DMETAMAT_CUDA_ARCHS={os.environ.get('METAMAT_CUDA_ARCHS', '80;90')}"]
    if ninja:
        args.append(f"-DCMAKE_MAKE_PROGRAM={ninja}")
    if cuda == "ON" and nvcc:
        args.append(f"-DCMAKE_CUDA_COMPILER={nvcc}")
    print("build_ext:", " ".join(args), flush=True)
    subprocess.run(args, check=True)
    subprocess.run([cmake, "--build", str(build), "--parallel", str(os.cpu_count() or 2)],
                   check=True)
    if "--no-copy" in sys.argv[1:]:  # a build for later (a running test keeps its module)
        print(f"build_ext: built in {build}, not copied (--no-copy)")
        return 0
    suffix = sysconfig.get_config_var("EXT_SUFFIX") or ".so"
    built = build / f"_C{suffix}"
    if not built.exists():
        built = next(build.glob("_C*.so"))
    dest = ROOT / "metamat" / built.name
    shutil.copy2(built, dest)
    print(f"build_ext: {dest} (CUDA backend {cuda})")
    return 0


if __name__ == "__main__":
    sys.exit(main())
