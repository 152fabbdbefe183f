"""Version and kernel checks: fail before anything is allocated."""
from __future__ import annotations

from ...errors import UnsupportedError

__all__ = ["UnsupportedError", "check_versions", "SUPPORTED_TORCHREC", "SUPPORTED_FBGEMM"]

# Versions whose internals (TBE attribute names, lookup layout) the adapter was checked against,
# each by running the TorchRec tests on it: 1.9 (torch 2.14) and 1.8 (torch 2.13) in CI
# (`make test`, `make test-compat`); 1.7 (torch 2.12) once on the CPU (2026-11-27); 1.6 (torch
# 2.11) on the GPU hosts (README, "On a GPU"). Add a minor here only after its tests ran.
SUPPORTED_TORCHREC = ("1.6", "1.7", "1.8", "1.9")
SUPPORTED_FBGEMM = ("1.6", "1.7", "1.8", "1.9")


def _minor(version: str) -> str:
    return ".".join(version.split("+")[0].split(".")[:2])


def check_versions() -> None:
    """Raise ``UnsupportedError`` if torchrec or fbgemm_gpu is missing or unsupported."""
    try:
        import torchrec
        import fbgemm_gpu
    except ImportError as e:  # pragma: no cover - environment dependent
        raise UnsupportedError(f"metamat's TorchRec support needs torchrec and fbgemm_gpu: {e}") from e
    tv = getattr(torchrec, "__version__", "unknown")
    fv = getattr(fbgemm_gpu, "__version__", "unknown")
    if _minor(tv) not in SUPPORTED_TORCHREC:
        raise UnsupportedError(
            f"torchrec {tv} is not supported (supported minors: {', '.join(SUPPORTED_TORCHREC)})"
        )
    if _minor(fv) not in SUPPORTED_FBGEMM:
        raise UnsupportedError(
            f"fbgemm_gpu {fv} is not supported (supported minors: {', '.join(SUPPORTED_FBGEMM)})"
        )
