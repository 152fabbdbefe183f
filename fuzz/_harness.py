"""Shared parts of the atheris harnesses: the contract every input must keep.

For any bytes, ``open_checkpoint`` either returns a checkpoint or raises a
:class:`metamat.CheckpointError`; a returned checkpoint then loads (every 0-2-D tensor, whole,
into poisoned CPU destinations) or raises a ``CheckpointError``, and a validation error leaves
every destination untouched. Anything else propagates and atheris reports it as a crash.
"""
from __future__ import annotations

import os
import sys
import tempfile

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
for p in (ROOT, os.path.join(ROOT, "tests")):
    if p not in sys.path:
        sys.path.insert(0, p)

import torch  # noqa: E402  (imported before instrumentation: it is not what we fuzz)

POISON = 0xA5
MAX_LOAD_BYTES = 64 << 20


def workdir() -> str:
    """A private scratch directory under $METAMAT_FUZZ_TMP, else /dev/shm (RAM), else $TMPDIR.

    libFuzzer leaves through C ``exit()``, so no Python cleanup runs: callers that care point
    METAMAT_FUZZ_TMP at a directory they remove (the tests and ``make fuzz`` do).
    """
    base = os.environ.get("METAMAT_FUZZ_TMP") or ("/dev/shm" if os.path.isdir("/dev/shm")
                                                   else None)
    if base:
        os.makedirs(base, exist_ok=True)
    return tempfile.mkdtemp(prefix="metamat_fuzz_", dir=base)


def write(path: str, data: bytes) -> None:
    with open(path, "wb") as f:
        f.write(data)


def check(path: str) -> None:
    """Open ``path`` and load all it holds, asserting the contract (see module docstring)."""
    from metamat import CheckpointError, open_checkpoint
    from metamat.checkpoint import ReadError
    from metamat.load import load_targets
    from metamat.plan import Target
    try:
        ck = open_checkpoint(path)
    except CheckpointError:
        return
    targets, total = [], 0
    for name, e in ck.tensors().items():
        if len(e.global_shape) > 2:
            continue
        nbytes = e.chunks[0].nbytes if e.chunks else 0
        n = 1
        for s in e.global_shape:
            n *= s
        total += n * e.dtype.itemsize
        if total > MAX_LOAD_BYTES:
            break
        t = torch.empty(tuple(e.global_shape), dtype=e.dtype)
        t.view(torch.uint8).fill_(POISON) if t.numel() else None
        targets.append(Target(name, name, tuple(e.global_shape), (0,) * len(e.global_shape),
                              tuple(e.global_shape), e.dtype, tensor=t))
        del nbytes
    try:
        load_targets(targets, ck, io_threads=2)
    except ReadError:
        pass
    except CheckpointError:
        for t in targets:
            if t.tensor.numel() and not bool((t.tensor.view(torch.uint8) == POISON).all()):
                raise AssertionError(f"validation error after writing {t.fqn}")


def run(test_one_input, argv) -> None:
    """atheris.Setup + Fuzz with the metamat parsers instrumented."""
    import atheris
    atheris.Setup(argv, test_one_input)
    atheris.Fuzz()
