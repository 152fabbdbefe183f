"""The one way metamat writes a file (the checksum sidecar): all of it or none, and never
through a name someone else could have planted.

The bytes go to a temporary file that :func:`tempfile.mkstemp` creates in the destination's
directory (a random name, opened ``O_CREAT | O_EXCL | O_NOFOLLOW``: a file or symlink already
at that name is never opened, let alone followed), are flushed to disk, and the file is renamed
over the destination (``os.replace`` replaces a symlink sitting there, not its target). A
predictable name such as ``<out>.tmp<PID>`` opened with ``open(..., "wb")`` would follow a
symlink planted at it and overwrite a file outside the checkpoint.
"""
from __future__ import annotations

import os
import tempfile

from .errors import WriteError

__all__ = ["atomic_write"]


def _umask() -> int:
    """The process umask, read without changing it (``os.umask`` sets it: racy in threads)."""
    try:
        with open("/proc/self/status", "rb") as f:
            for line in f:
                if line.startswith(b"Umask:"):
                    return int(line.split()[1], 8)
    except (OSError, ValueError, IndexError):
        pass
    return 0o022


def atomic_write(out: str, data: bytes, what: str) -> None:
    """Write ``data`` to ``out`` atomically (see the module docstring). The file gets the
    permissions ``open(out, "wb")`` would give it (``0o666`` less the umask).

    Raises:
        WriteError: naming ``out`` and ``what``; no temporary file is left behind.
    """
    tmp = None
    try:
        fd, tmp = tempfile.mkstemp(prefix=f".{os.path.basename(out)}.", suffix=".tmp",
                                   dir=os.path.dirname(os.path.abspath(out)))
        with os.fdopen(fd, "wb") as f:
            os.fchmod(f.fileno(), 0o666 & ~_umask())  # mkstemp makes it 0600
            f.write(data)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, out)
    except OSError as e:
        if tmp is not None:
            try:
                os.unlink(tmp)
            except OSError:
                pass
        raise WriteError(f"cannot write the {what} ({e.strerror or e})", file=out) from None
