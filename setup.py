"""Build metamat._C with CMake + ninja.

Environment: METAMAT_CUDA=0|1|auto (default auto: build the CUDA backend when nvcc exists),
METAMAT_CUDA_ARCHS (default "80;90"), METAMAT_SANITIZE=1 (ASan + UBSan build).
"""
import os
import shutil
import subprocess
import sys
from pathlib import Path

from setuptools import Extension, setup
from setuptools.command.build_ext import build_ext

ROOT = Path(__file__).resolve().parent


class CMakeExtension(Extension):
    def __init__(self, name: str):
        super().__init__(name, sources=[])


class CMakeBuild(build_ext):
    def build_extension(self, ext: Extension) -> None:
        import pybind11

        out = Path(self.get_ext_fullpath(ext.name)).resolve()
        build_dir = ROOT / "build" / ("sanitize" if os.environ.get("METAMAT_SANITIZE") == "1" else "cmake")
        build_dir.mkdir(parents=True, exist_ok=True)
        cuda = os.environ.get("METAMAT_CUDA", "auto").upper()
        if cuda == "AUTO" and shutil.which("nvcc") is None and not Path("/usr/local/cuda/bin/nvcc").exists():
            cuda = "OFF"
        args = [
            "cmake", "-S", str(ROOT), "-B", str(build_dir), "-G", "Ninja",
            f"-DPython_EXECUTABLE={sys.executable}",
            f"-Dpybind11_DIR={pybind11.get_cmake_dir()}",
            f"-DMETAMAT_CUDA={cuda}",
            f"-DMETAMAT_CUDA_ARCHS={os.environ.get('METAMAT_CUDA_ARCHS', '80;90')}",
            f"-DMETAMAT_SANITIZE={'ON' if os.environ.get('METAMAT_SANITIZE') == '1' else 'OFF'}",
        ]
        if shutil.which("nvcc") is None and Path("/usr/local/cuda/bin/nvcc").exists():
            args.append("-DCMAKE_CUDA_COMPILER=/usr/local/cuda/bin/nvcc")
        subprocess.run(args, check=True)
        subprocess.run(["cmake", "--build", str(build_dir)], check=True)
        built = next(build_dir.glob("_C*.so"))
        out.parent.mkdir(parents=True, exist_ok=True)
        shutil.copy2(built, out)


setup(
    ext_modules=[CMakeExtension("metamat._C")],
    cmdclass={"build_ext": CMakeBuild},
)
