"""torch.distributed.checkpoint (DCP) directories written by ``FileSystemWriter``.

``.metadata`` (a pickle, unpickled with an allow-list of what DCP writes, never running what
it names: :mod:`.unpickle`) maps each (fqn, chunk offsets) to (relative file, offset, length).
Two serialization formats exist:

* TORCH_SAVE (default): each chunk is a whole torch.save zip blob at that range; the raw
  row-major data sits inside it at an unaligned offset found from the zip headers
  (:mod:`.torch_save`).
* SAFETENSORS: each ``.distcp`` file ends with one safetensors blob holding every chunk the
  rank wrote, keyed by fqn, with the chunk offsets in ``__metadata__["DCP_SHARDING_INFO"]``;
  the metadata's per-chunk offsets/lengths do not locate the bytes, the blob's header does.
  (torch 2.13's own ``FileSystemReader`` cannot load these; metamat can.)
"""
from __future__ import annotations

import io
from typing import Dict, List, Optional, Tuple

import torch

from . import storage as fs
from .._gcpause import gc_paused
from .access import contained_path, read_metadata_file
from .base import Checkpoint, Chunk, TensorEntry, open_binary
from .errors import (CheckpointError, DtypeMismatchError, InvalidHeaderError,
                     InvalidOffsetError, ShapeMismatchError,
                     TruncatedFileError, UnsupportedFormatError)
from .limits import METADATA_BYTES, limit, loads_json
from .safetensors import read_header
from .torch_save import (RestrictedUnpickler, TensorRef, TorchSaveArchive, parse_torch_save,
                         tensor_chunk)
from .unpickle import load_dcp_metadata

__all__ = ["open_dcp", "is_dcp_dir"]


def is_dcp_dir(path: str) -> bool:
    """True if ``path`` is a directory holding a DCP ``.metadata`` file."""
    # lexists: a .metadata that is a FIFO or dangling link is refused by name, not skipped
    # (a file's "/.metadata" exists nowhere)
    return fs.lexists(fs.join(path, ".metadata"))


def _read_metadata(path: str, trust_pickles: bool = False):
    """The unpickled ``.metadata`` of ``path`` (local or in a store) and its size in bytes;
    what torch's ``FileSystemReader.read_metadata`` does, with the restricted unpickler."""
    meta = fs.join(path, ".metadata")
    # no FIFO, device, or multi-GiB file; one open, read whole (the opcode walk needs it)
    raw = read_metadata_file(meta, "DCP .metadata")
    md = load_dcp_metadata(raw, meta, trust_pickles=trust_pickles)
    if isinstance(md, _metadata_class()) and getattr(md, "storage_meta", None) is None:
        from torch.distributed.checkpoint.metadata import StorageMeta
        md.storage_meta = StorageMeta()
    return md, len(raw)


def _metadata_class():
    from torch.distributed.checkpoint.metadata import Metadata
    return Metadata


def open_dcp(path: str, *, trust_pickles: bool = False) -> Checkpoint:
    """Open a DCP checkpoint directory (metadata and chunk headers only).

    Args:
        trust_pickles: unpickle ``.metadata`` with plain ``pickle`` (it may then run any
            code it names), for a trusted checkpoint holding classes outside the allow-list
            (:mod:`.unpickle`).

    Raises:
        UnsafePickleError: ``.metadata`` names a global outside the allow-list, or is a
            pickle memory bomb (nothing it names was called).
        UnsupportedFormatError: not DCP, or chunks use storage transforms (compression...).
        InvalidHeaderError, MissingFileError, TruncatedFileError, ShapeMismatchError,
        DtypeMismatchError: the metadata and the files disagree.
    """
    with gc_paused():  # millions of live objects: collections would make this super-linear
        return _open_dcp(path, trust_pickles)


def _open_dcp(path: str, trust_pickles: bool = False) -> Checkpoint:
    """:func:`open_dcp` with the collector paused."""
    from torch.distributed.checkpoint.metadata import Metadata, TensorStorageMetadata

    path = fs.abspath(path)
    md, md_bytes = _read_metadata(path, trust_pickles)
    # getattr: a pickle can make a Metadata without calling __init__ (NEWOBJ, no BUILD)
    if not isinstance(md, Metadata) \
            or not isinstance(getattr(md, "state_dict_metadata", None), dict) \
            or not isinstance(getattr(md, "storage_data", None) or {}, dict):
        raise InvalidHeaderError(f".metadata holds {type(md).__name__}, not DCP Metadata",
                                 file=fs.join(path, ".metadata"))
    storage = md.storage_data or {}
    # file -> [(fqn, chunk offsets, chunk sizes, storage info)]
    per_file: Dict[str, List[Tuple[str, tuple, tuple, object]]] = {}
    entries: Dict[str, TensorEntry] = {}
    meta = fs.join(path, ".metadata")
    fqn = None
    files: Dict[object, str] = {}  # relative path -> checked absolute path
    try:
        # (fqn, chunk offsets) -> storage info: one pass, instead of building and hashing a
        # MetadataIndex per chunk (~10 µs each)
        storage_of = {(k.fqn, tuple(k.offset)): v for k, v in storage.items()
                      if getattr(k, "offset", None) is not None}
        # tensors may share one chunk list by pickle reference: 1 MB of metadata listing
        # 10**9 chunks. A genuine file spends bytes on every chunk it lists.
        listed = sum(len(t.chunks) for t in md.state_dict_metadata.values()
                     if isinstance(t, TensorStorageMetadata))
        if listed > md_bytes:
            raise InvalidHeaderError(f"metadata of {md_bytes} bytes lists {listed} chunks "
                                     "(chunk lists shared between tensors)", file=meta)
        for fqn, tmd in md.state_dict_metadata.items():
            if not isinstance(tmd, TensorStorageMetadata):
                continue  # bytes / non-tensor objects
            dtype = tmd.properties.dtype
            if not isinstance(dtype, torch.dtype):
                raise InvalidHeaderError(f"dtype {dtype!r} is not a torch.dtype", file=meta,
                                         tensor=fqn)
            entries[fqn] = TensorEntry(fqn, tuple(int(s) for s in tmd.size), dtype)
            for ch in tmd.chunks:
                offs = tuple(map(int, ch.offsets))
                info = storage_of.get((fqn, offs))
                if info is None:
                    raise InvalidHeaderError(f"no storage entry for chunk at {offs}",
                                             file=meta, tensor=fqn)
                # every field read below: a pickle can leave one out (NEWOBJ, partial BUILD)
                rel, _, _ = info.relative_path, info.offset, info.length
                f = files.get(rel) if isinstance(rel, str) else None
                if f is None:
                    f = files[rel] = _data_file(path, info, fqn)
                if getattr(info, "transform_descriptors", None):
                    raise UnsupportedFormatError(
                        f"chunk uses storage transforms {list(info.transform_descriptors)}",
                        file=f, tensor=fqn)
                per_file.setdefault(f, []).append(
                    (fqn, offs, tuple(map(int, ch.sizes)), info))
    except (TypeError, ValueError, AttributeError) as e:
        # a pickle that loads but is not DCP metadata (or holds the wrong field types)
        raise InvalidHeaderError(f"malformed DCP metadata ({type(e).__name__}: {e})",
                                 file=meta, tensor=fqn) from None

    fmt = None
    for f, items in sorted(per_file.items()):
        fh = open_binary(f, "DCP data file", tensor=items[0][0])
        with fh:
            fsize = fs.fsize(fh)
            for fqn, offs, _, info in items:
                o, n = info.offset, info.length
                if type(o) is not int or type(n) is not int or o < 0 or n < 0 \
                        or o + n > fsize:  # the common case inline; the check names it
                    _check_range(f, fsize, fqn, offs, info)
            first = fs.pread(fh, 4, items[0][3].offset)
            file_fmt = "dcp" if first == b"PK\x03\x04" else "dcp-safetensors"
            if fmt is not None and fmt != file_fmt:
                raise UnsupportedFormatError("mixed TORCH_SAVE and SAFETENSORS files", file=f)
            fmt = file_fmt
            if file_fmt == "dcp":
                _add_torch_save_chunks(entries, f, fh, fsize, items)
            else:
                _add_safetensors_chunks(entries, f, items)
    return Checkpoint(fmt or "dcp", path, entries)


def _data_file(path: str, info, fqn: str) -> str:
    """The data file of a storage entry; it must be a relative path inside ``path``."""
    return contained_path(path, info.relative_path, "storage relative_path",
                          fs.join(path, ".metadata"), tensor=fqn)


def _check_range(f: str, fsize: int, fqn: str, offs, info) -> None:
    """The metadata's (offset, length) of a chunk: non-negative ints inside the file."""
    o, n = info.offset, info.length
    if (not isinstance(o, int) or not isinstance(n, int) or isinstance(o, bool)
            or isinstance(n, bool) or o < 0 or n < 0):
        raise InvalidOffsetError(f"chunk at {offs}: bad storage offset {o!r} / length {n!r}",
                                 file=f, tensor=fqn)
    if o + n > fsize:
        raise TruncatedFileError(f"chunk at {offs} needs bytes [{o}, {o + n}) but the file "
                                 f"has {fsize}", file=f, tensor=fqn)


#: the dtypes of a quantized collection's sharded state (_check_chunk_dtype)
_SHARDED_QUANT_DTYPES = (torch.uint8, torch.float16)


def _check_chunk_dtype(entry: TensorEntry, dtype: torch.dtype, what: str, f: str) -> None:
    """A chunk's dtype is its tensor's. One exception, TorchRec's: the sharded state_dict of a
    quantized collection (ShardedTensors of uint8 rows, float16 scales and biases) keeps
    ShardedTensor's default float32 in its metadata, which DCP saves. A float32 tensor whose
    first chunk is uint8 or float16 is read as that dtype (as torch's dcp.load reads what the
    chunks hold), and every other chunk must be of it too."""
    if dtype == entry.dtype:
        return
    if entry.dtype == torch.float32 and dtype in _SHARDED_QUANT_DTYPES and not entry.chunks:
        entry.dtype = dtype
        return
    raise DtypeMismatchError(f"{what} is {dtype}, metadata says {entry.dtype}", file=f,
                             tensor=entry.name)


def _add_torch_save_chunks(entries: Dict[str, TensorEntry], f: str, fh, fsize: int,
                           items) -> None:
    """Locate every torch.save blob of one data file: every blob's zip records are found in
    one C pass (``_C.zip_blobs_fd``: no ``zipfile`` object, a few ``pread`` per 64 KiB of
    small blobs, ~2 µs per chunk); identical ``data.pkl`` records (chunks of one shape and
    dtype) are unpickled once. The file is read, never mapped: a data file that another job
    truncates meanwhile must give a named error, and a mapped page past the new end kills the
    process with SIGBUS. A blob the C pass does not accept (or cannot read: the file shrank)
    goes through :func:`parse_torch_save`, which accepts it or raises the named error. An
    object in a store (no file descriptor) goes that way too."""
    from .._ext import core

    try:
        fd = fh.fileno() if fsize else None
    except (OSError, ValueError):  # io.UnsupportedOperation: an S3File
        fd = None
    pickles: Dict[bytes, object] = {}
    # (id of a TensorRef, record size) -> (offset in record, Chunk); the refs live in
    # `pickles` until the end, so their ids stay theirs (hashing a TensorRef hashes its fields)
    located: Dict[tuple, tuple] = {}
    blobs = core().zip_blobs_fd(fd, fsize, [it[3].offset for it in items],
                                [it[3].length for it in items], limit(METADATA_BYTES)) \
        if fd is not None else [None] * len(items)
    for (fqn, offs, sizes, info), blob in zip(items, blobs):
        obj = _unpickled(f, blob[0], pickles) if blob is not None else None
        if obj is None:
            _add_torch_save_chunk(entries[fqn], f, fh, offs, sizes, info)
        else:
            _add_parsed_chunk(entries[fqn], f, obj, blob[1], offs, sizes, info, located)


def _unpickled(f: str, data: bytes, pickles: Dict[bytes, object]):
    """The object of a ``data.pkl`` record ``zip_blobs_fd`` read, or None if it does not
    load (the careful parser then says why)."""
    obj = pickles.get(data)
    if obj is None:
        try:
            obj = pickles[data] = RestrictedUnpickler(io.BytesIO(data), f).load()
        except Exception:  # noqa: BLE001 - anything odd: the careful parser decides
            return None
    return obj


def _add_torch_save_chunk(entry: TensorEntry, f: str, fh, offs, sizes, info) -> None:
    try:
        arch = parse_torch_save(f, base=info.offset, length=info.length, f=fh)
    except CheckpointError as e:
        raise e.with_tensor(entry.name) from e.__cause__
    _add_parsed_chunk(entry, f, arch.obj, arch.records, offs, sizes, info)


def _add_parsed_chunk(entry: TensorEntry, f: str, ref, records, offs, sizes, info,
                      located: Optional[Dict[tuple, tuple]] = None) -> None:
    """Append the chunk of a blob whose ``data.pkl`` gave ``ref`` and whose storage records
    are ``records`` (the archive is built only for the first chunk of each view)."""
    if not isinstance(ref, TensorRef):
        raise InvalidHeaderError(f"blob at {info.offset} holds {type(ref).__name__}, "
                                 "not a tensor", file=f, tensor=entry.name)
    _check_chunk_dtype(entry, ref.storage.dtype, f"chunk at {offs}", f)
    if ref.size != sizes:
        raise ShapeMismatchError(f"chunk at {offs} has shape {ref.size}, metadata says {sizes}",
                                 file=f, tensor=entry.name)
    rec = records.get(ref.storage.key)
    if located is not None and rec is not None:
        # chunks of one shape share one TensorRef (one data.pkl): check the view once
        known = located.get((id(ref), rec[1]))
        if known is not None:
            delta, ch = known
            entry.chunks.append(Chunk(f, rec[0] + delta, ch.nbytes, tuple(offs), ch.sizes,
                                      ch.strides))
            return
    ch = tensor_chunk(TorchSaveArchive(f, ref, records), ref, offs, entry.name)
    if located is not None:
        located[(id(ref), rec[1])] = (ch.byte_offset - rec[0], ch)
    entry.chunks.append(ch)


def _add_safetensors_chunks(entries: Dict[str, TensorEntry], f: str, items) -> None:
    bases = {info.offset for _, _, _, info in items}
    if len(bases) != 1:
        raise InvalidHeaderError(f"tensor items of one SAFETENSORS file start at {sorted(bases)}",
                                 file=f)
    h = read_header(f, base=bases.pop())
    raw = h.metadata.get("DCP_SHARDING_INFO", "{}").encode("utf-8", "surrogatepass")
    sharding = loads_json(raw, "DCP_SHARDING_INFO", f)
    if not isinstance(sharding, dict) or not all(
            isinstance(v, dict) and isinstance(v.get("saved_offsets", []), list)
            for v in sharding.values()):
        raise InvalidHeaderError("DCP_SHARDING_INFO is not {fqn: {saved_offsets: [...]}}",
                                 file=f)
    for fqn, offs, sizes, _ in items:
        e = entries[fqn]
        t = h.tensors.get(fqn)
        if t is None:
            raise InvalidHeaderError("chunk listed in .metadata is absent from the file",
                                     file=f, tensor=fqn)
        dtype, shape, b, end = t
        saved = tuple((sharding.get(fqn) or {}).get("saved_offsets", offs))
        if saved != offs:
            raise InvalidHeaderError(f"file holds the chunk at {saved}, metadata expects {offs}",
                                     file=f, tensor=fqn)
        _check_chunk_dtype(e, dtype, "chunk", f)
        if shape != sizes:
            raise ShapeMismatchError(f"chunk has shape {shape}, metadata says {sizes}",
                                     file=f, tensor=fqn)
        e.chunks.append(Chunk(f, h.data_start + b, end - b, offs, sizes))
