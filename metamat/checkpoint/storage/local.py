"""Local files: the :class:`~.base.Storage` of OS paths."""
from __future__ import annotations

import contextlib
import os
import stat
from typing import Any, BinaryIO, Dict, Iterator, List, Mapping, Optional

from ..errors import MissingFileError, ReadError
from .base import FileStat

__all__ = ["LocalStorage", "LOCAL"]

_KINDS = [(stat.S_ISDIR, "a directory"), (stat.S_ISFIFO, "a FIFO"),
          (stat.S_ISCHR, "a character device"), (stat.S_ISBLK, "a block device"),
          (stat.S_ISSOCK, "a socket")]


class LocalStorage:
    """Files the operating system opens; the C++ reader reads their tensor data."""

    name = "local"
    sep = os.sep
    os_files = True

    # each looked up when called (not bound here): a patched os function is the one used
    def join(self, a: str, *p: str) -> str:
        return os.path.join(a, *p)

    def normpath(self, path: str) -> str:
        return os.path.normpath(path)

    def abspath(self, path: str) -> str:
        return os.path.abspath(path)

    def dirname(self, path: str) -> str:
        return os.path.dirname(path)

    def basename(self, path: str) -> str:
        return os.path.basename(path)

    def exists(self, path: str) -> bool:
        return os.path.exists(path)

    def lexists(self, path: str) -> bool:
        return os.path.lexists(path)

    def isfile(self, path: str) -> bool:
        return os.path.isfile(path)

    def isdir(self, path: str) -> bool:
        return os.path.isdir(path)

    def listdir(self, path: str) -> List[str]:
        return os.listdir(path)

    def getsize(self, path: str) -> int:
        return os.stat(path).st_size

    def stat(self, path: str) -> FileStat:
        st = os.stat(path)
        # what the reader later checks, so a same-size rewrite after open is refused
        return FileStat(st.st_size, (st.st_dev, st.st_ino, st.st_size, st.st_mtime_ns))

    def require(self, path: str) -> None:
        try:
            os.stat(path)
        except FileNotFoundError:
            raise MissingFileError("checkpoint path does not exist", file=path) from None
        except (OSError, ValueError) as e:  # symlink loop, permission, NUL byte
            raise ReadError("cannot access checkpoint path "
                            f"({getattr(e, 'strerror', None) or e})", file=path) from None

    def open_regular(self, path: str, what: str = "file",
                     tensor: Optional[str] = None) -> BinaryIO:
        """Open ``path`` for binary reading, never blocking, and only if it is a regular file
        (symlinks are followed first).

        ``O_NONBLOCK`` makes opening a FIFO return at once instead of waiting for a writer;
        the ``fstat`` of the opened descriptor then refuses it (and character devices such as
        a symlink to ``/dev/zero``, which would read forever).
        """
        try:
            fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK | os.O_CLOEXEC)
        except FileNotFoundError:
            raise MissingFileError(f"{what} does not exist", file=path, tensor=tensor) from None
        except ValueError:  # embedded NUL byte
            raise ReadError(f"{what} path holds a NUL byte", file=repr(path),
                            tensor=tensor) from None
        except OSError as e:
            raise ReadError(f"cannot open {what} ({e.strerror or e})", file=path,
                            tensor=tensor) from None
        try:
            mode = os.fstat(fd).st_mode
            if not stat.S_ISREG(mode):
                kind = next((k for test, k in _KINDS if test(mode)), "not a regular file")
                raise ReadError(f"{what} is {kind}, not a regular file", file=path,
                                tensor=tensor)
            return os.fdopen(fd, "rb")
        except BaseException:
            os.close(fd)
            raise

    @contextlib.contextmanager
    def opening(self, path: str,
                options: Optional[Mapping[str, Any]] = None) -> Iterator[None]:
        yield  # nothing to set up: file identities are taken by stat()

    def pins(self, files: List[str]) -> Optional[Dict[str, Any]]:
        return None


LOCAL = LocalStorage()
