"""The zip container of a torch.save blob, read guardedly: :class:`ZipBlob`.

torch.save writes a zip archive (its records stored, ``data.pkl`` maybe compressed); DCP's
TORCH_SAVE format writes one per chunk inside a ``.distcp`` file, so a blob is a byte range
``[base, base + length)`` of an open file. The central directory is bounded like any metadata
record, the zip64 end record checked, names must be unique, each record must end before the
next entry (overlapping entries are a zip-bomb pattern) and inside the blob, and metadata
records inflate at most to the metadata size limit.
"""
from __future__ import annotations

import collections
import io
import struct
import zipfile
import zlib
from typing import Dict, Tuple

from . import storage as fs
from .errors import InvalidHeaderError, TruncatedFileError, UnsupportedFormatError
from .limits import METADATA_BYTES, check, limit, short_repr

__all__ = ["ZipBlob", "ZIP_ERRORS"]

# What zipfile / struct raise on damaged archives (beyond BadZipFile).
ZIP_ERRORS = (zipfile.BadZipFile, zlib.error, EOFError, OSError, ValueError, struct.error,
               NotImplementedError, UnicodeDecodeError, OverflowError, KeyError,
               RuntimeError)  # RuntimeError: "File ... is encrypted, password required"


class ZipBlob:
    """The records of the torch.save zip at ``[base, base + length)`` of the open file ``f``
    (``path`` names it in errors), validated as it is opened.

    Attributes:
        names: record name -> its ``ZipInfo``.
        pkl: the one ``<prefix>/data.pkl`` record.
        prefix: the archive's ``<prefix>/``.

    Raises:
        InvalidHeaderError: not a zip, duplicate names, no single ``data.pkl``, a central
            directory or zip64 record out of bounds (and, from the zip module, the
            :data:`ZIP_ERRORS` a damaged archive raises: callers name them).
    """

    def __init__(self, f, path: str, base: int, length: int) -> None:
        self.f, self.path, self.base, self.length = f, path, base, length
        buf = io.BufferedReader(_Window(f, base, length), 1 << 16)
        _check_central_directory(buf, path)
        try:
            self.zf = zipfile.ZipFile(buf)
        except zipfile.BadZipFile as e:
            raise InvalidHeaderError(f"not a torch.save zip archive at {base} ({e})",
                                     file=path) from None
        infos = self.zf.infolist()
        self.names = {i.filename: i for i in infos}
        if len(self.names) != len(infos):
            counts = collections.Counter(i.filename for i in infos)
            dup = sorted(k for k, c in counts.items() if c > 1)
            raise InvalidHeaderError(f"zip archive holds {dup[:3]} more than once", file=path)
        pkl = [i for i in infos
               if i.filename.endswith("/data.pkl") and i.filename.count("/") == 1]
        if len(pkl) != 1:
            raise InvalidHeaderError("zip archive has no single <prefix>/data.pkl", file=path)
        self.pkl = pkl[0]
        self.prefix = self.pkl.filename[: -len("data.pkl")]
        # Each record read must end before the next entry's local header (the directory for
        # the last): overlapping entries are a zip-bomb pattern that zipfile refuses on opening
        # a record in newer Pythons (the GPU host's 3.12.3; not 3.11.7); here on every Python,
        # and for the tensor records too, which are located, not opened.
        by_offset = sorted(infos, key=lambda i: i.header_offset)
        self._room = {id(a): b.header_offset for a, b in zip(by_offset, by_offset[1:])}
        self._room[id(by_offset[-1])] = self.zf.start_dir

    def data_start(self, info: zipfile.ZipInfo, size: int, stored: bool = False) -> int:
        """Where ``info``'s data starts in the blob, after its local header (``size`` bytes of
        it must fit the blob and end before the next entry; ``stored``: it must not be
        compressed)."""
        path = self.path
        hdr = fs.pread(self.f, 30, self.base + info.header_offset)
        if len(hdr) != 30 or hdr[:4] != b"PK\x03\x04":
            raise InvalidHeaderError(f"bad local header for record {info.filename}", file=path)
        if stored and struct.unpack("<H", hdr[8:10])[0] != 0:
            raise UnsupportedFormatError(f"record {info.filename} is compressed", file=path)
        nlen, elen = struct.unpack("<HH", hdr[26:30])
        start = info.header_offset + 30 + nlen + elen
        if start + size > self.length:
            raise TruncatedFileError(
                f"record {info.filename} runs past the end of the blob", file=path)
        if start + size > self._room[id(info)]:
            raise InvalidHeaderError(
                f"record {info.filename} overlaps the next entry of the zip archive "
                "(possible zip bomb)", file=path)
        return start

    def read(self, info: zipfile.ZipInfo) -> bytes:
        """A metadata record (data.pkl, byteorder), located and inflated (bounded)."""
        self.data_start(info, info.compress_size)
        return _read_record(self.zf, info, self.path)

    def storage_records(self) -> Dict[str, Tuple[int, int]]:
        """Storage key -> (absolute data offset in the file, record size) of every stored
        ``<prefix>/data/<key>`` record.

        Raises:
            UnsupportedFormatError: a compressed record.
        """
        records: Dict[str, Tuple[int, int]] = {}
        dprefix = self.prefix + "data/"
        for name, info in self.names.items():
            if not name.startswith(dprefix) or "/" in name[len(dprefix):]:
                continue
            if info.compress_type != zipfile.ZIP_STORED:
                raise UnsupportedFormatError(f"record {name} is compressed", file=self.path)
            records[name[len(dprefix):]] = (
                self.base + self.data_start(info, info.file_size, stored=True), info.file_size)
        return records


class _Window(io.RawIOBase):
    """A read-only, seekable view of bytes [base, base+length) of an open file."""

    def __init__(self, f, base: int, length: int) -> None:
        self._f, self._base, self._len, self._pos = f, base, length, 0

    def readable(self) -> bool:
        return True

    def seekable(self) -> bool:
        return True

    def tell(self) -> int:
        return self._pos

    def seek(self, pos: int, whence: int = 0) -> int:
        self._pos = {0: pos, 1: self._pos + pos, 2: self._len + pos}[whence]
        if self._pos < 0:
            raise OSError("negative seek")
        return self._pos

    def readinto(self, b) -> int:
        n = max(0, min(len(b), self._len - self._pos))
        if n == 0:
            return 0
        data = fs.pread(self._f, n, self._base + self._pos)
        b[:len(data)] = data
        self._pos += len(data)
        return len(data)


def _check_central_directory(buf, path: str) -> None:
    """The central directory zipfile would parse into one object per entry: its declared
    size is bounded like any metadata record (a huge one costs ~10x its size in memory)."""
    end = zipfile._EndRecData(buf)  # None: not a zip, which ZipFile() then reports
    if end is not None:
        check(METADATA_BYTES, end[zipfile._ECD_SIZE], file=path,
              what="zip central directory size")
        _check_zip64_end(buf, end[zipfile._ECD_LOCATION], path)
    buf.seek(0)


def _check_zip64_end(buf, at: int, path: str) -> None:
    """The zip64 end record (torch writes one) must end where its locator says and the
    central directory must end at it, as zipfile checks in newer Pythons (the GPU host's
    3.12.3; not 3.11.7), so the check is here for every Python."""
    if at < 76:
        return
    buf.seek(at - 76)
    raw = buf.read(76)
    if len(raw) != 76 or raw[56:60] != b"PK\x06\x07" or raw[:4] != b"PK\x06\x06":
        return  # no zip64 records before the end record: zipfile uses the end record alone
    _, size, _, _, _, _, _, _, dir_size, dir_offset = struct.unpack("<4sQ2H2L4Q", raw[:56])
    reloff, = struct.unpack("<Q", raw[64:72])
    if reloff != at - 76 or dir_offset + dir_size != reloff or size != 44:
        raise InvalidHeaderError("corrupt zip64 end of central directory record", file=path)


def _read_record(zf: zipfile.ZipFile, info: zipfile.ZipInfo, path: str) -> bytes:
    """A metadata record (data.pkl, byteorder), inflated (deflate, bzip2, ...) at most to
    the metadata size limit: the declared size is checked first, and zipfile stops
    inflating at the declared size (a record inflating past it fails its CRC check)."""
    check(METADATA_BYTES, info.file_size, file=path,
          what=f"inflated size record {short_repr(info.filename)} declares")
    with zf.open(info) as r:
        data = r.read(limit(METADATA_BYTES) + 1)
    check(METADATA_BYTES, len(data), file=path,
          what=f"bytes record {short_repr(info.filename)} inflates to")
    return data
