"""safetensors files: one file, an HF shard set with an index json, or a directory of shards.

The header is parsed and validated per the published spec (8-byte little-endian header
length N, N bytes of JSON, then the byte buffer); no tensor data is read. Rules enforced, each
with its own error: N within bounds and inside the file, JSON object, known dtype names,
shapes of non-negative ints, offsets ``[begin, end]`` with ``end - begin = numel × itemsize``,
the entries tile the byte buffer contiguously from 0 without holes or overlaps, and the buffer
ends exactly at the end of the blob.
"""
from __future__ import annotations

import struct
from dataclasses import dataclass
from typing import Dict, List, Optional, Tuple

import torch

from . import storage as fs
from .access import contained_path, open_regular, read_metadata_file
from .base import Checkpoint, Chunk, TensorEntry, itemsize, numel, open_binary
from .errors import (CheckpointError, DtypeMismatchError, HeaderTooLargeError,
                     InvalidHeaderError, InvalidOffsetError, MissingFileError,
                     MissingTensorError, ReadError, TruncatedFileError, UnsupportedFormatError)
from .limits import loads_json, short_repr

__all__ = ["MAX_HEADER_SIZE", "SAFETENSORS_DTYPES", "SafetensorsHeader", "read_header",
           "open_safetensors_file", "open_safetensors_index", "open_safetensors_dir",
           "looks_like_safetensors"]

#: Same bound as the reference implementation (100 MB).
MAX_HEADER_SIZE = 100_000_000

SAFETENSORS_DTYPES: Dict[str, torch.dtype] = {
    "F64": torch.float64, "F32": torch.float32, "F16": torch.float16, "BF16": torch.bfloat16,
    "I64": torch.int64, "I32": torch.int32, "I16": torch.int16, "I8": torch.int8,
    "U8": torch.uint8, "BOOL": torch.bool,
    "U16": torch.uint16, "U32": torch.uint32, "U64": torch.uint64,
    "F8_E4M3": torch.float8_e4m3fn, "F8_E5M2": torch.float8_e5m2,
    "C64": torch.complex64,
}


@dataclass
class SafetensorsHeader:
    """A validated header.

    Attributes:
        path: the file.
        data_start: absolute file offset of the byte buffer.
        tensors: name -> (dtype, shape, begin, end), offsets relative to ``data_start``.
        metadata: the ``__metadata__`` string map (empty when absent).
    """

    path: str
    data_start: int
    tensors: Dict[str, Tuple[torch.dtype, Tuple[int, ...], int, int]]
    metadata: Dict[str, str]


class _DuplicateKey(Exception):
    pass


def _no_duplicates(pairs):
    """JSON object hook: a repeated key (json keeps the last silently) is an error."""
    d = {}
    for k, v in pairs:
        if k in d:
            raise _DuplicateKey(k)
        d[k] = v
    return d


def _short_list(x) -> str:
    """A header value for a message: short lists of scalars shown, anything else by type."""
    if isinstance(x, list) and len(x) <= 8:
        return "[" + ", ".join(short_repr(v) for v in x) + "]"
    return short_repr(x)


def looks_like_safetensors(path: str, base: int = 0) -> bool:
    """True if the bytes at ``base`` start like a safetensors header (size, then ``{``)."""
    try:
        with open_regular(path) as f:  # a FIFO or device is not safetensors (and must not hang)
            f.seek(base)
            head = f.read(9)
    except (CheckpointError, OSError):
        return False
    if len(head) < 9:
        return False
    n = struct.unpack("<Q", head[:8])[0]
    return head[8:9] == b"{" and 2 <= n <= MAX_HEADER_SIZE


def read_header(path: str, base: int = 0, blob_len: Optional[int] = None) -> SafetensorsHeader:
    """Parse and validate the safetensors blob starting at byte ``base`` of ``path``.

    Args:
        path: the file.
        base: where the blob starts (non-zero inside DCP files holding byte items first).
        blob_len: blob length; default: up to the end of the file.

    Returns:
        The validated header.

    Raises:
        MissingFileError, HeaderTooLargeError, InvalidHeaderError, InvalidOffsetError,
        TruncatedFileError, DtypeMismatchError (unknown dtype name).
    """
    path = str(path)
    # The length field is not printed: for a file that is not safetensors at all it is
    # 8 bytes of someone else's data.
    with open_binary(path, "safetensors file") as f:
        fsize = fs.fsize(f)
        if blob_len is None:
            blob_len = fsize - base
        if base + blob_len > fsize:
            raise TruncatedFileError(
                f"blob [{base}, {base + blob_len}) past end of file ({fsize} B)", file=path)
        if blob_len < 8:
            raise TruncatedFileError(f"{blob_len} bytes, too short for a safetensors header",
                                     file=path)
        f.seek(base)
        n = struct.unpack("<Q", f.read(8))[0]
        if n > MAX_HEADER_SIZE:
            raise HeaderTooLargeError(
                "not a safetensors file: its header length field is above the "
                f"{MAX_HEADER_SIZE} B limit of the format", file=path)
        if 8 + n > blob_len:
            raise HeaderTooLargeError(
                "not a safetensors file (or truncated): its header length field runs past "
                f"the end of the file ({blob_len} B)", file=path)
        raw = f.read(n)
    if len(raw) != n:
        raise TruncatedFileError("short read of header", file=path)
    if not raw.startswith(b"{"):
        raise InvalidHeaderError("not a safetensors file: header does not start with '{'",
                                 file=path)
    try:
        # no depth walk: the checks below refuse any value nested deeper than the format's
        hdr = loads_json(raw, "header", path, object_pairs_hook=_no_duplicates,
                         check_depth=False)
    except _DuplicateKey as e:
        raise InvalidHeaderError("name appears twice in the header", file=path,
                                 tensor=e.args[0]) from None
    if not isinstance(hdr, dict):
        raise InvalidHeaderError("header is not a JSON object", file=path)
    meta = hdr.pop("__metadata__", None) or {}
    if not isinstance(meta, dict) or not all(
            isinstance(k, str) and isinstance(v, str) for k, v in meta.items()):
        raise InvalidHeaderError("__metadata__ must map strings to strings", file=path)

    buf_len = blob_len - 8 - n
    tensors: Dict[str, Tuple[torch.dtype, Tuple[int, ...], int, int]] = {}
    for name, info in hdr.items():
        if not isinstance(info, dict):
            raise InvalidHeaderError("entry is not an object", file=path, tensor=name)
        dt_name, shape, offs = info.get("dtype"), info.get("shape"), info.get("data_offsets")
        if not isinstance(dt_name, str) or dt_name not in SAFETENSORS_DTYPES:
            raise DtypeMismatchError(f"unknown dtype {short_repr(dt_name)}", file=path, tensor=name)
        if (not isinstance(shape, list)
                or not all(isinstance(s, int) and not isinstance(s, bool) and s >= 0
                           for s in shape)):
            raise InvalidHeaderError(f"bad shape {_short_list(shape)}", file=path, tensor=name)
        if (not isinstance(offs, list) or len(offs) != 2
                or not all(isinstance(o, int) and not isinstance(o, bool) and o >= 0
                           for o in offs) or offs[0] > offs[1]):
            raise InvalidOffsetError(f"bad data_offsets {_short_list(offs)}", file=path,
                                     tensor=name)
        dtype = SAFETENSORS_DTYPES[dt_name]
        want = numel(shape) * itemsize(dtype)
        if offs[1] - offs[0] != want:
            raise InvalidOffsetError(
                f"data_offsets {offs} hold {offs[1] - offs[0]} B, shape {shape} {dt_name} "
                f"needs {want}", file=path, tensor=name)
        if offs[1] > buf_len:
            # checked per entry (not only by the tiling below) so the message names it
            raise TruncatedFileError(
                f"data_offsets {offs} end past the byte buffer: it needs {offs[1]} B, the "
                f"file holds {buf_len}", file=path, tensor=name)
        tensors[name] = (dtype, tuple(shape), offs[0], offs[1])

    # The entries must tile [0, buffer_len) without holes or overlaps (spec rule).
    end = 0
    for name, (_, _, b, e) in sorted(tensors.items(), key=lambda kv: (kv[1][2], kv[1][3])):
        if b != end:
            raise InvalidOffsetError(
                f"data_offsets start at {b}, expected {end} (hole or overlap)",
                file=path, tensor=name)
        end = e
    if end > buf_len:
        raise TruncatedFileError(f"byte buffer needs {end} B, the file holds {buf_len}",
                                 file=path)
    if end < buf_len:
        raise InvalidOffsetError(f"{buf_len - end} trailing bytes after the last tensor",
                                 file=path)
    return SafetensorsHeader(path, base + 8 + n, tensors, meta)


def header_to_entries(h: SafetensorsHeader, names=None) -> Dict[str, TensorEntry]:
    """One single-chunk ``TensorEntry`` per tensor of the header (optionally only ``names``)."""
    out = {}
    for name, (dtype, shape, b, e) in h.tensors.items():
        if names is not None and name not in names:
            continue
        ch = Chunk(h.path, h.data_start + b, e - b, (0,) * len(shape), shape)
        out[name] = TensorEntry(name, shape, dtype, [ch])
    return out


def open_safetensors_file(path: str) -> Checkpoint:
    """Open one ``.safetensors`` file."""
    path = fs.abspath(path)
    return Checkpoint("safetensors", path, header_to_entries(read_header(path)))


def _merge(entries: Dict[str, TensorEntry], new: Dict[str, TensorEntry], where: str) -> None:
    for k, v in new.items():
        if k in entries:
            raise InvalidHeaderError(
                f"tensor appears in both {entries[k].chunks[0].file} and {v.chunks[0].file}",
                file=where, tensor=k)
        entries[k] = v


def open_safetensors_index(index_path: str) -> Checkpoint:
    """Open an HF shard set through its ``*.safetensors.index.json``.

    Every tensor the ``weight_map`` lists must be in the shard it names.
    """
    index_path = fs.abspath(index_path)
    try:
        idx = loads_json(read_metadata_file(index_path, "index file"), "index", index_path,
                         object_pairs_hook=_no_duplicates)
    except _DuplicateKey as e:
        raise InvalidHeaderError("name appears twice in the index", file=index_path,
                                 tensor=e.args[0]) from None
    wm = idx.get("weight_map") if isinstance(idx, dict) else None
    if not isinstance(wm, dict) or not all(isinstance(v, str) for v in wm.values()):
        raise InvalidHeaderError("index has no 'weight_map' of name -> file", file=index_path)
    root = fs.dirname(index_path)
    by_file: Dict[str, List[str]] = {}
    for name, fn in wm.items():
        p = contained_path(root, fn, "weight_map entry", index_path, tensor=name)
        by_file.setdefault(p, []).append(name)
    entries: Dict[str, TensorEntry] = {}
    for p, names in sorted(by_file.items()):
        if not fs.exists(p):
            raise MissingFileError(f"shard listed in {fs.basename(index_path)} is missing",
                                   file=p)
        h = read_header(p)
        absent = [n for n in names if n not in h.tensors]
        if absent:
            raise MissingTensorError(
                f"index maps {absent[:5]} to this shard but it does not hold them",
                names=absent, file=p)
        _merge(entries, header_to_entries(h, set(names)), index_path)
    return Checkpoint("safetensors", index_path, entries)


def open_safetensors_dir(dirpath: str) -> Checkpoint:
    """Open a directory: through its index json if there is one, else every ``*.safetensors``."""
    dirpath = fs.abspath(dirpath)
    try:
        names = fs.listdir(dirpath)
    except OSError as e:  # unreadable directory
        raise ReadError(f"cannot list checkpoint directory ({e.strerror or e})",
                        file=dirpath) from None
    idx = sorted(f for f in names if f.endswith(".safetensors.index.json"))
    if len(idx) == 1:
        return open_safetensors_index(fs.join(dirpath, idx[0]))
    if len(idx) > 1:
        raise UnsupportedFormatError(f"several index files {idx}; open one of them", file=dirpath)
    files = sorted(f for f in names if f.endswith(".safetensors"))
    if not files:
        raise UnsupportedFormatError("no .safetensors files", file=dirpath)
    entries: Dict[str, TensorEntry] = {}
    for fn in files:
        _merge(entries, header_to_entries(read_header(fs.join(dirpath, fn))), dirpath)
    return Checkpoint("safetensors", dirpath, entries)
