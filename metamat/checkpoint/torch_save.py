"""torch.save zip archives, read without loading tensor data.

``data.pkl`` is unpickled by a restricted Unpickler (:mod:`.unpickle`: its opcodes walked
first, then only a whitelist of globals resolved: tensor rebuild functions, storage classes,
OrderedDict, dtypes; anything else is an ``UnsafePickleError`` and nothing it names is called)
and every storage becomes a ``StorageRef`` (key, dtype, numel) instead of bytes;
``_rebuild_tensor_v2`` becomes a ``TensorRef`` (storage, storage_offset, size, stride). The
byte offset of each storage record ``<prefix>/data/<key>`` comes from the zip's central
directory plus the record's local header (records must be stored, not compressed), read by
:class:`~.zip_blob.ZipBlob`. The same parser reads the torch.save blobs DCP writes inside
``.distcp`` files (``base``/``length`` select the blob).
"""
from __future__ import annotations

import collections
import io
import pickle
from dataclasses import dataclass
from typing import Any, Dict, Optional, Tuple

import torch

from . import storage as fs
from .base import Checkpoint, Chunk, TensorEntry, itemsize, numel, open_binary
from .errors import (CheckpointError, InvalidHeaderError, InvalidOffsetError,
                     KeyCollisionError, LimitExceededError, TruncatedFileError,
                     UnsafePickleError, UnsupportedFormatError)
from .limits import METADATA_BYTES, PICKLE_DEPTH, PICKLE_OBJECTS, check, limit, short_repr
from .unpickle import Call, refuse, scan
from .zip_blob import ZIP_ERRORS, ZipBlob

__all__ = ["StorageRef", "TensorRef", "TorchSaveArchive", "RestrictedUnpickler",
           "parse_torch_save", "open_torch_save", "tensor_chunk"]

_STORAGE_DTYPES = {
    "DoubleStorage": torch.float64, "FloatStorage": torch.float32,
    "HalfStorage": torch.float16, "BFloat16Storage": torch.bfloat16,
    "LongStorage": torch.int64, "IntStorage": torch.int32, "ShortStorage": torch.int16,
    "CharStorage": torch.int8, "ByteStorage": torch.uint8, "BoolStorage": torch.bool,
    "ComplexFloatStorage": torch.complex64, "ComplexDoubleStorage": torch.complex128,
}


def _no_setstate(self, state) -> None:
    # A pickle BUILD op would otherwise write straight into __dict__ (frozen or not),
    # e.g. moving a TensorRef's storage_offset after it was validated, or renaming a
    # shared _Marker for every later load.
    raise InvalidHeaderError(f"data.pkl sets the state of a {type(self).__name__} "
                             "(BUILD on a tensor, storage or class reference)")


@dataclass(frozen=True)
class StorageRef:
    key: str
    dtype: torch.dtype
    numel: int

    __setstate__ = _no_setstate


@dataclass(frozen=True)
class TensorRef:
    storage: StorageRef
    storage_offset: int
    size: Tuple[int, ...]
    stride: Tuple[int, ...]

    __setstate__ = _no_setstate


def _rebuild_tensor_v2(storage, storage_offset, size, stride, requires_grad=False,
                       backward_hooks=None, metadata=None):
    if not isinstance(storage, StorageRef):
        raise InvalidHeaderError(f"tensor rebuilt from {type(storage).__name__}, not a storage")
    return TensorRef(storage, int(storage_offset), tuple(int(s) for s in size),
                     tuple(int(s) for s in stride))


def _rebuild_parameter(data, requires_grad=False, backward_hooks=None, state=None):
    return data


def _rebuild_from_type_v2(func, new_type, args, state):
    return func(*args)


class _Marker:
    """Stands for a whitelisted class that only appears as an argument (e.g. Parameter)."""

    def __init__(self, name: str) -> None:
        self.name = name

    def __call__(self, *a, **k):  # e.g. torch.device('cpu'): keep as a string
        # only short scalars: the repr of a shared or deep argument could be exponential
        if k or len(a) > 4 or not all(isinstance(x, (str, int)) and len(short_repr(x)) < 80
                                      for x in a):
            raise InvalidHeaderError(f"data.pkl calls {self.name} with unexpected arguments")
        return f"{self.name}{a}"

    __setstate__ = _no_setstate


_GLOBALS = {
    ("collections", "OrderedDict"): collections.OrderedDict,
    ("builtins", "dict"): dict,
    ("builtins", "list"): list,
    ("builtins", "tuple"): tuple,
    ("builtins", "set"): set,
    # functions behind Call: a BUILD on a plain function could set its __defaults__ for
    # every later load in the process
    ("torch._utils", "_rebuild_tensor_v2"): Call(_rebuild_tensor_v2, "_rebuild_tensor_v2"),
    ("torch._utils", "_rebuild_parameter"): Call(_rebuild_parameter, "_rebuild_parameter"),
    ("torch._utils", "_rebuild_parameter_with_state"): Call(_rebuild_parameter,
                                                            "_rebuild_parameter_with_state"),
    ("torch._tensor", "_rebuild_from_type_v2"): Call(_rebuild_from_type_v2,
                                                     "_rebuild_from_type_v2"),
    ("torch.nn.parameter", "Parameter"): _Marker("Parameter"),
    ("torch", "Tensor"): _Marker("Tensor"),
    ("torch", "device"): _Marker("device"),
    ("torch", "Size"): tuple,
}


class RestrictedUnpickler(pickle.Unpickler):
    """The ``data.pkl`` unpickler. ``f`` is a ``BytesIO`` over the pickle: :meth:`load` walks
    its opcodes (:func:`.unpickle.scan`) before running any. ``trust``: globals outside the
    whitelist resolve as plain ``pickle`` does (``trust_pickles=True``, for a trusted file
    holding custom classes); tensors and storages are still only located."""

    def __init__(self, f, where: str, *, trust: bool = False) -> None:
        super().__init__(f)
        self._f, self._where, self._trust = f, where, trust

    def load(self) -> Any:
        f = self._f
        if isinstance(f, io.BytesIO):
            with f.getbuffer() as whole, whole[f.tell():] as rest:
                scan(rest, self._where, "data.pkl", persistent_ids=True)
        return super().load()

    def find_class(self, module: str, name: str) -> Any:
        fn = _GLOBALS.get((module, name))
        if fn is not None:
            return fn
        if module == "torch" and name in _STORAGE_DTYPES:
            return _Marker(name)
        if module == "torch" and isinstance(getattr(torch, name, None), torch.dtype):
            return getattr(torch, name)
        if self._trust:
            return super().find_class(module, name)
        raise refuse("data.pkl", module, name, self._where)

    def persistent_load(self, pid: Any) -> Any:
        if (not isinstance(pid, tuple) or len(pid) != 5 or pid[0] != "storage"
                or not isinstance(pid[1], _Marker) or pid[1].name not in _STORAGE_DTYPES):
            what = (tuple(short_repr(x) for x in pid[:5]) if isinstance(pid, tuple)
                    else short_repr(pid))
            raise UnsafePickleError(f"unsupported persistent id {what}", file=self._where)
        return StorageRef(str(pid[2]), _STORAGE_DTYPES[pid[1].name], int(pid[4]))


_RestrictedUnpickler = RestrictedUnpickler  # the former name, as tests import it


@dataclass
class TorchSaveArchive:
    """A parsed torch.save blob.

    Attributes:
        path: the file.
        obj: the unpickled object, with ``TensorRef`` leaves.
        records: storage key -> (absolute data offset in ``path``, record size in bytes).
    """

    path: str
    obj: Any
    records: Dict[str, Tuple[int, int]]


def parse_torch_save(path: str, base: int = 0, length: Optional[int] = None,
                     f=None, *, trust_pickles: bool = False) -> TorchSaveArchive:
    """Parse the torch.save zip at ``[base, base+length)`` of ``path`` (metadata only).

    Args:
        trust_pickles: ``data.pkl`` may name globals outside the whitelist (plain pickle).

    Raises:
        MissingFileError, TruncatedFileError, InvalidHeaderError, UnsupportedFormatError
        (``UnsafePickleError``: ``data.pkl`` names a global outside the whitelist).
    """
    path = str(path)
    limit(METADATA_BYTES)  # a bad METAMAT_MAX_METADATA_BYTES: ValueError, not "damaged zip"
    own = f is None
    if own:
        f = open_binary(path, "torch.save file")
    try:
        fsize = fs.fsize(f)
        if length is None:
            length = fsize - base
        if base + length > fsize:
            raise TruncatedFileError(
                f"torch.save blob [{base}, {base + length}) past end of file ({fsize} B)",
                file=path)
        try:
            z = ZipBlob(f, path, base, length)
            bo = z.names.get(z.prefix + "byteorder")
            if bo is not None and z.read(bo).strip() not in (b"little",):
                raise UnsupportedFormatError("big-endian torch.save archive", file=path)
            try:
                raw = z.read(z.pkl)
                obj = RestrictedUnpickler(io.BytesIO(raw), path, trust=trust_pickles).load()
            except CheckpointError as e:  # raised in a pickle callback, without the file
                if e.file is None and type(e).__init__ is CheckpointError.__init__:
                    raise type(e)(e.detail, file=path, tensor=e.tensor) from None
                if e.file is None and isinstance(e, UnsafePickleError):
                    raise UnsafePickleError(e.detail, name=e.name, file=path) from None
                raise
            except Exception as e:  # malformed pickle stream: any of a dozen exception types
                raise InvalidHeaderError(
                    f"data.pkl does not unpickle ({type(e).__name__}: {e})", file=path) from None
            records = z.storage_records()
        except CheckpointError:
            raise
        except ZIP_ERRORS as e:  # a damaged archive: zipfile raises many types
            raise InvalidHeaderError(f"damaged zip archive at {base} ({type(e).__name__}: {e})",
                                     file=path) from None
        return TorchSaveArchive(path, obj, records)
    finally:
        if own:
            f.close()


def tensor_chunk(arch: TorchSaveArchive, ref: TensorRef, offsets: Tuple[int, ...],
                 name: str) -> Chunk:
    """The ``Chunk`` locating tensor ``ref`` of ``arch`` (placed at ``offsets``).

    Raises:
        InvalidOffsetError: the storage record is missing or too small for the view.
    """
    rec = arch.records.get(ref.storage.key)
    if rec is None:
        raise InvalidHeaderError(f"storage record data/{ref.storage.key} missing",
                                 file=arch.path, tensor=name)
    isz = itemsize(ref.storage.dtype)
    if rec[1] != ref.storage.numel * isz:
        raise InvalidOffsetError(
            f"storage {ref.storage.key} record holds {rec[1]} B, expected "
            f"{ref.storage.numel} x {isz}", file=arch.path, tensor=name)
    size, stride = ref.size, ref.stride
    if len(size) != len(stride):
        raise InvalidHeaderError(f"size {size} and stride {stride} differ in rank",
                                 file=arch.path, tensor=name)
    n = numel(size)
    span = 0 if n == 0 else 1 + sum((s - 1) * st for s, st in zip(size, stride))
    if ref.storage_offset < 0 or any(st < 0 for st in stride) or (
            n and ref.storage_offset + span > ref.storage.numel):
        raise InvalidOffsetError(
            f"view (offset {ref.storage_offset}, size {size}, stride {stride}) lies outside "
            f"its storage of {ref.storage.numel} elements", file=arch.path, tensor=name)
    if any(st == 0 and sz > 1 for sz, st in zip(size, stride)):
        # an expand()ed tensor: one saved row stands for many; the reader copies file bytes
        # as laid out, so say so now rather than fail (or mis-read) at load time
        raise UnsupportedFormatError(
            f"expanded view (size {size}, stride {stride}: stride 0 over a dim of size > 1); "
            "re-save it with .contiguous()", file=arch.path, tensor=name)
    contiguous = all(
        sz <= 1 or st == numel(size[i + 1:]) for i, (sz, st) in enumerate(zip(size, stride)))
    return Chunk(arch.path, rec[0] + ref.storage_offset * isz, span * isz, tuple(offsets),
                 tuple(size), None if contiguous else tuple(stride))


def _measure(obj: Any, depth: int, memo: Dict[int, Tuple[int, int]], active: set,
             where: str) -> Tuple[int, int]:
    """(entries, height) of the dict tree ``_flatten`` would walk, in time linear in the
    *distinct* dicts: a pickle can reference one dict many times (memo), so 1 KB of
    pickle can expand to 2**30 entries ("billion laughs"), or contain itself."""
    if not isinstance(obj, dict):
        return 1, 0
    key = id(obj)
    if key in active:
        raise InvalidHeaderError("data.pkl holds a dict that contains itself", file=where)
    got = memo.get(key)
    if got is None:
        active.add(key)
        n, h = 1, 0
        for v in obj.values():
            check(PICKLE_DEPTH, depth + 1, file=where, what="state dict nesting depth")
            cn, ch = _measure(v, depth + 1, memo, active, where)
            n, h = n + cn, max(h, ch + 1)
            check(PICKLE_OBJECTS, n, file=where,
                  what="state dict entries (counting shared references)")
        active.discard(key)
        got = memo[key] = (n, h)
    check(PICKLE_DEPTH, depth + got[1], file=where, what="state dict nesting depth")
    return got


def _key(k: Any, where: str) -> str:
    if isinstance(k, (str, int, float)) or k is None:
        return str(k)
    raise InvalidHeaderError(f"state dict key of type {type(k).__name__}", file=where)


def _flatten(obj: Any, prefix: str, out: Dict[str, TensorRef], where: str) -> None:
    if isinstance(obj, TensorRef):
        if prefix in out:
            raise KeyCollisionError("two entries of the nested state dict flatten to this key",
                                    file=where, tensor=prefix)
        out[prefix] = obj
    elif isinstance(obj, dict):
        for k, v in obj.items():
            k = _key(k, where)
            _flatten(v, f"{prefix}.{k}" if prefix else k, out, where)


def open_torch_save(path: str, *, trust_pickles: bool = False) -> Checkpoint:
    """Open a torch.save'd state dict (nested dicts are flattened with ``.``).

    Non-tensor values are ignored. ``trust_pickles``: see :func:`parse_torch_save`. Raises
    the errors of :func:`parse_torch_save`.
    """
    path = fs.abspath(path)
    arch = parse_torch_save(path, trust_pickles=trust_pickles)
    refs: Dict[str, TensorRef] = {}
    try:
        _measure(arch.obj, 0, {}, set(), path)  # bounds _flatten's work and recursion
    except RecursionError:
        raise LimitExceededError(
            "state dict nesting is deeper than Python's recursion limit allows (lower "
            "METAMAT_MAX_PICKLE_DEPTH or raise sys.setrecursionlimit)", limit="recursion",
            file=path) from None
    _flatten(arch.obj, "", refs, path)
    if isinstance(arch.obj, TensorRef):
        refs = {"": arch.obj}
    entries = {}
    for name, ref in refs.items():
        ch = tensor_chunk(arch, ref, (0,) * len(ref.size), name)
        entries[name] = TensorEntry(name, ref.size, ref.storage.dtype, [ch])
    return Checkpoint("torch_save", path, entries)
