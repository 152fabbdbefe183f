"""Hostile checkpoints: corrupted variants of valid DCP, safetensors and torch.save files.

Each :class:`Variant` copies a valid checkpoint (written by torch / safetensors) and damages it
in one way. :func:`check_variant` then drives it through ``metamat.open_checkpoint`` and
``metamat.load.load_targets`` into poisoned CPU destinations and asserts the contract:

* only :class:`metamat.CheckpointError` (or a subclass) comes out, never another exception,
  a crash or a hang;
* the message names the damaged file (and the tensor, where the variant has one);
* destinations are unchanged bit for bit, also when the checkpoint was opened *before* the
  damage (a plan made on the good file, then the file changed under it).

Run as a script (``python tests/hostile_gen.py``) it checks every variant and prints a
summary; ``tests/test_hostile.py`` runs the same checks in-process and in a subprocess.
"""
from __future__ import annotations

import collections
import dataclasses
import json
import os
import pickle
import shutil
import struct
import sys
import tempfile
import warnings
import zipfile
from dataclasses import dataclass
from typing import Callable, Dict, List, Optional, Tuple

import torch

# ---------------------------------------------------------------------------------------------
# the valid checkpoints


def state() -> Dict[str, torch.Tensor]:
    """The tensors every valid checkpoint holds (0-, 1- and 2-D, several dtypes)."""
    g = torch.Generator().manual_seed(6)
    return {
        "emb": torch.randn(13, 6, generator=g),
        "vec": torch.randn(9, generator=g),
        "ids": torch.randint(0, 1 << 40, (5, 3), generator=g),
        "half": torch.randn(4, 8, generator=g).half(),
    }


def _dcp_save(sd, path: str, fmt: str) -> None:
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint import FileSystemWriter
    from torch.distributed.checkpoint.filesystem import SerializationFormat
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # "no process group": a one-process save is the point
        dcp.save(sd, storage_writer=FileSystemWriter(
            path, serialization_format=SerializationFormat(fmt)))


def make_bases(root: str) -> Dict[str, str]:
    """Write one valid checkpoint of each kind under ``root``; returns kind -> path."""
    from safetensors.torch import save_file
    sd = state()
    os.makedirs(root, exist_ok=True)
    out = {}
    out["st"] = os.path.join(root, "model.safetensors")
    save_file(sd, out["st"])
    hf = os.path.join(root, "hf")
    os.makedirs(hf)
    save_file({k: sd[k] for k in ("emb", "vec")}, os.path.join(hf, "m-00001.safetensors"))
    save_file({k: sd[k] for k in ("ids", "half")}, os.path.join(hf, "m-00002.safetensors"))
    wm = {"emb": "m-00001.safetensors", "vec": "m-00001.safetensors",
          "ids": "m-00002.safetensors", "half": "m-00002.safetensors"}
    with open(os.path.join(hf, "m.safetensors.index.json"), "w") as f:
        json.dump({"metadata": {}, "weight_map": wm}, f)
    out["hf"] = hf
    out["ts"] = os.path.join(root, "model.pt")
    torch.save(sd, out["ts"])
    out["dcp"] = os.path.join(root, "dcp")
    _dcp_save(sd, out["dcp"], "torch_save")
    out["dcpst"] = os.path.join(root, "dcpst")
    _dcp_save(sd, out["dcpst"], "safetensors")
    return out


# ---------------------------------------------------------------------------------------------
# byte-level helpers


def _read(p: str) -> bytes:
    with open(p, "rb") as f:
        return f.read()


def _write(p: str, b: bytes) -> None:
    with open(p, "wb") as f:
        f.write(b)


def truncate(p: str, n: int) -> None:
    with open(p, "r+b") as f:
        f.truncate(n)


class during_zip_pass:  # noqa: N801 - a context manager, used like a function
    """While active, ``fn()`` runs once, just before metamat's C pass starts reading the
    torch.save blobs of a DCP data file (``_C.zip_blobs*``): e.g. truncating the file, as
    another job rewriting the checkpoint would while it is being opened. ``self.ran``: it did.
    (A file read through a mapping then killed the process with SIGBUS.)"""

    def __init__(self, fn: Callable[[], object]) -> None:
        self.fn, self.ran, self.result = fn, False, None

    def run(self) -> None:
        """``fn()`` now, unless it ran already."""
        if not self.ran:
            self.ran, self.result = True, self.fn()

    def __enter__(self) -> "during_zip_pass":
        import metamat._ext as ext
        self._ext, self._real = ext, ext.core
        outer = self

        class _Core:
            def __getattr__(self, name):
                attr = getattr(outer._real(), name)
                if not name.startswith("zip_blobs"):
                    return attr

                def first_damage(*a, **kw):
                    outer.run()
                    return attr(*a, **kw)
                return first_damage

        ext.core = lambda: _Core()
        return self

    def __exit__(self, *exc) -> None:
        self._ext.core = self._real


def patch(p: str, off: int, b: bytes) -> None:
    with open(p, "r+b") as f:
        f.seek(off)
        f.write(b)


def st_split(p: str) -> Tuple[bytes, bytes]:
    raw = _read(p)
    n = struct.unpack("<Q", raw[:8])[0]
    return raw[8:8 + n], raw[8 + n:]


def st_write(p: str, header: bytes, data: bytes, n: Optional[int] = None) -> None:
    _write(p, struct.pack("<Q", len(header) if n is None else n) + header + data)


def st_edit(p: str, fn: Callable[[dict], None]) -> None:
    """Rewrite a safetensors header through ``fn(header_dict)`` keeping the data bytes."""
    h, data = st_split(p)
    d = json.loads(h)
    fn(d)
    st_write(p, json.dumps(d).encode(), data)


def _zip_entries(raw: bytes, base: int = 0, length: Optional[int] = None):
    """(name, local header offset, central header offset) of each record of a stored zip."""
    end = len(raw) if length is None else base + length
    out = []
    i = raw.find(b"PK\x01\x02", base, end)
    while i >= 0:
        nlen, = struct.unpack("<H", raw[i + 28:i + 30])
        lho, = struct.unpack("<I", raw[i + 42:i + 46])
        out.append((raw[i + 46:i + 46 + nlen].decode(), base + lho, i))
        i = raw.find(b"PK\x01\x02", i + 46, end)
    return out


def zip_record(p: str, suffix: str, base: int = 0, length: Optional[int] = None):
    """(local header offset, central header offset) of the record whose name ends in suffix."""
    for name, lho, cho in _zip_entries(_read(p), base, length):
        if name.endswith(suffix):
            return lho, cho
    raise KeyError(suffix)


def rezip(p: str, fn: Callable[[List[Tuple[str, bytes]]], List[Tuple[str, bytes, int]]]) -> None:
    """Rewrite a zip: ``fn`` maps [(name, data)] to [(name, data, compress_type)]."""
    with zipfile.ZipFile(p) as z:
        items = [(i.filename, z.read(i)) for i in z.infolist()]
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # duplicate names are the point of some variants
        with zipfile.ZipFile(p, "w") as z:
            for name, data, ct in fn(items):
                z.writestr(zipfile.ZipInfo(name), data, compress_type=ct)


class _Storage:
    def __init__(self, key: str, cls: str, numel: int) -> None:
        self.key, self.cls, self.numel = key, cls, numel


class _View:
    """Pickles as torch's ``_rebuild_tensor_v2(storage, offset, size, stride, ...)``."""

    def __init__(self, storage, offset, size, stride) -> None:
        self.args = (storage, offset, tuple(size), tuple(stride))

    def __reduce__(self):
        return (torch._utils._rebuild_tensor_v2,
                self.args + (False, collections.OrderedDict()))


class _Pickler(pickle.Pickler):
    def persistent_id(self, obj):
        if isinstance(obj, _Storage):
            return ("storage", getattr(torch, obj.cls), obj.key, "cpu", obj.numel)
        return None


def craft_torch_save(p: str, views: Dict[str, _View], records: Dict[str, bytes]) -> None:
    """Write a torch.save-layout zip whose data.pkl holds exactly ``views``."""
    import io
    buf = io.BytesIO()
    _Pickler(buf, protocol=2).dump(collections.OrderedDict(views))
    with zipfile.ZipFile(p, "w") as z:
        z.writestr("archive/data.pkl", buf.getvalue())
        z.writestr("archive/byteorder", b"little")
        for k, v in records.items():
            z.writestr(f"archive/data/{k}", v)
        z.writestr("archive/version", b"3\n")


def craft_view(p: str, size, stride, offset=0, numel=24, rec_bytes=None, cls="FloatStorage"):
    """A one-tensor ('w') crafted torch.save file with the given view of storage '0'."""
    rec = b"\0" * (numel * 4 if rec_bytes is None else rec_bytes)
    craft_torch_save(p, {"w": _View(_Storage("0", cls, numel), offset, size, stride)},
                     {"0": rec})


def dcp_md_edit(d: str, fn) -> None:
    """Rewrite ``d/.metadata`` through ``fn(metadata)`` (DCP pickles it)."""
    from torch.distributed.checkpoint import FileSystemReader
    md = FileSystemReader(d).read_metadata()
    fn(md)
    with open(os.path.join(d, ".metadata"), "wb") as f:
        pickle.dump(md, f)


def dcp_storage(md, fqn: str):
    """(key, _StorageInfo) of the first chunk of ``fqn``."""
    for k, v in md.storage_data.items():
        if k.fqn == fqn:
            return k, v
    raise KeyError(fqn)


def dcp_file_of(d: str, fqn: str) -> str:
    from torch.distributed.checkpoint import FileSystemReader
    md = FileSystemReader(d).read_metadata()
    return dcp_storage(md, fqn)[1].relative_path


def dcp_blob(d: str, fqn: str) -> Tuple[str, int, int]:
    """(file path, offset, length) of fqn's first chunk blob."""
    from torch.distributed.checkpoint import FileSystemReader
    md = FileSystemReader(d).read_metadata()
    info = dcp_storage(md, fqn)[1]
    return os.path.join(d, info.relative_path), info.offset, info.length


def to_fifo(p: str) -> None:
    """Replace ``p`` by a FIFO with no writer (a blocking open would wait forever)."""
    os.remove(p)
    os.mkfifo(p)


def to_dev_zero(p: str) -> None:
    """Replace ``p`` by a symlink to /dev/zero (a read would never end)."""
    os.remove(p)
    os.symlink("/dev/zero", p)


def to_sparse(p: str, size: int = 4 << 30) -> None:
    """Grow ``p`` to a sparse ``size`` bytes (above the metadata size limit)."""
    truncate(p, size)


BIG_INT = b"9" * 5000  # above Python's 4,300-digit int conversion limit


def deep_json(depth: int = 5000) -> bytes:
    return b"[" * depth + b"]" * depth


def laughs_pickle(levels: int = 40) -> bytes:
    """~1.3 KB pickle of nested dicts sharing each level twice: 2**levels entries."""
    d: dict = {}
    for _ in range(levels):
        d = {"a": d, "b": d}
    return pickle.dumps(d, protocol=2)


def self_ref_pickle() -> bytes:
    d: dict = {}
    d["emb"] = d
    return pickle.dumps(d, protocol=2)


def deep_pickle(depth: int = 5000) -> bytes:
    """{"x": {"x": ... {}}} nested ``depth`` deep, written without recursion."""
    return (b"\x80\x02" + b"}X\x01\x00\x00\x00x" * depth + b"}" + b"s" * depth + b".")


def build_marker_pickle() -> bytes:
    """BUILD on the torch.device class stand-in: would rename it for every later load."""
    return (b"\x80\x02ctorch\ndevice\n}X\x04\x00\x00\x00nameX\x0c\x00\x00\x00FloatStorage"
            b"sb.")


def device_laughs_pickle(levels: int = 40) -> bytes:
    """torch.device(x) where x is a shared-reference DAG of 2**levels lists: its repr would
    never finish."""
    x: list = []
    for _ in range(levels):
        x = [x, x]

    class Dev:
        def __reduce__(self):
            return (torch.device, (x,))
    return pickle.dumps({"emb": Dev()}, protocol=2)


class _BuildView(_View):
    """A tensor view followed by a BUILD op overwriting its storage offset."""

    def __reduce__(self):
        return super().__reduce__() + ({"storage_offset": 5},)


def zip_set_size(p: str, suffix: str, usize: int) -> None:
    """Patch the central directory's uncompressed size of the record ending in ``suffix``."""
    _, cho = zip_record(p, suffix)
    patch(p, cho + 24, struct.pack("<I", usize))


def ts_compress_pkl(ct: int):
    """Re-zip with data.pkl compressed by ``ct`` (deflate, bzip2), the rest stored."""
    return lambda p: rezip(p, lambda items: [
        (n, d, ct if n.endswith("/data.pkl") else zipfile.ZIP_STORED) for n, d in items])


# ---------------------------------------------------------------------------------------------
# the variants


@dataclass
class Variant:
    """One way to damage a checkpoint.

    Attributes:
        name: unique id.
        base: which valid checkpoint it starts from (``st``, ``hf``, ``ts``, ``dcp``, ``dcpst``,
            or ``none`` for files crafted from scratch).
        mutate: ``mutate(path) -> file`` damages the copy at ``path`` and returns the file the
            error must name (a basename is enough).
        stage: ``"open"``: ``open_checkpoint`` must raise; ``"load"``: it may succeed and then
            ``load_targets`` must raise; ``"during_open"``: ``mutate`` runs while
            ``open_checkpoint`` reads the data files (:class:`during_zip_pass`), which must
            raise.
        tensor: the fqn the message must name, if any.
        exc: the expected error class name (checked with isinstance), if any.
    """

    name: str
    base: str
    mutate: Callable[[str], str]
    stage: str = "open"
    tensor: Optional[str] = None
    exc: Optional[str] = None


def _st_var(name, fn, tensor=None, exc=None, stage="open") -> Variant:
    def m(p):
        fn(p)
        return os.path.basename(p)
    return Variant(f"st_{name}", "st", m, stage, tensor, exc)


def _st_offsets(name: str, new):
    def fn(h):
        h[name]["data_offsets"] = new(h[name]["data_offsets"])
    return fn


def _st_dup(p: str) -> None:
    h, data = st_split(p)
    d = json.loads(h)
    # "vec" twice, identical: the tiling stays valid, so only duplicate detection catches it.
    vec = json.dumps(d["vec"])
    st_write(p, h.rstrip().replace(b'"vec":', f'"vec":{vec},"vec":'.encode(), 1), data)


def _st_big_int(p: str) -> None:
    h, data = st_split(p)
    d = json.loads(h)
    d["vec"]["shape"] = ["@@"]
    st_write(p, json.dumps(d).encode().replace(b'"@@"', BIG_INT), data)


def _st_deep(p: str) -> None:
    h, data = st_split(p)
    d = json.loads(h)
    d["vec"]["shape"] = ["@@"]
    st_write(p, json.dumps(d).encode().replace(b'"@@"', deep_json()), data)


def safetensors_variants() -> List[Variant]:
    H = lambda p: len(st_split(p)[0])  # noqa: E731
    v = [
        _st_var("trunc_5", lambda p: truncate(p, 5), exc="TruncatedFileError"),
        _st_var("trunc_8", lambda p: truncate(p, 8), exc="HeaderTooLargeError"),
        _st_var("trunc_mid_header", lambda p: truncate(p, 8 + H(p) // 2),
                exc="HeaderTooLargeError"),
        _st_var("trunc_end_header", lambda p: truncate(p, 8 + H(p)), exc="TruncatedFileError"),
        _st_var("trunc_mid_data", lambda p: truncate(p, 8 + H(p) + 100),
                exc="TruncatedFileError"),
        _st_var("trunc_last_byte", lambda p: truncate(p, os.path.getsize(p) - 1),
                exc="TruncatedFileError"),
        _st_var("hdr_len_past_end", lambda p: patch(p, 0, struct.pack("<Q", os.path.getsize(p))),
                exc="HeaderTooLargeError"),
        _st_var("hdr_len_huge", lambda p: patch(p, 0, struct.pack("<Q", (1 << 64) - 1)),
                exc="HeaderTooLargeError"),
        _st_var("hdr_len_2e63", lambda p: patch(p, 0, struct.pack("<Q", 1 << 63)),
                exc="HeaderTooLargeError"),
        _st_var("hdr_len_zero", lambda p: patch(p, 0, struct.pack("<Q", 0)),
                exc="InvalidHeaderError"),
        _st_var("invalid_json", lambda p: patch(p, 8 + H(p) // 2, b"}}\x00{"),
                exc="InvalidHeaderError"),
        _st_var("invalid_utf8", lambda p: patch(p, 9, b"\xff\xfe"), exc="InvalidHeaderError"),
        _st_var("not_object", lambda p: st_write(p, b"[1, 2]", st_split(p)[1]),
                exc="InvalidHeaderError"),
        _st_var("entry_not_object", lambda p: st_edit(p, lambda h: h.update(vec=[1])),
                tensor="vec", exc="InvalidHeaderError"),
        _st_var("offsets_overlap",
                lambda p: st_edit(p, _st_offsets("vec", lambda o: [o[0] - 4, o[1] - 4])),
                exc="InvalidOffsetError"),
        _st_var("offsets_outside_file",
                lambda p: st_edit(p, _st_offsets("emb", lambda o: [o[0] + 10**6,
                                                                    o[1] + 10**6])),
                tensor="emb", exc="CheckpointError"),
        _st_var("offsets_negative",
                lambda p: st_edit(p, _st_offsets("vec", lambda o: [-36, 0])),
                tensor="vec", exc="InvalidOffsetError"),
        _st_var("offsets_reversed",
                lambda p: st_edit(p, _st_offsets("vec", lambda o: [o[1], o[0]])),
                tensor="vec", exc="InvalidOffsetError"),
        _st_var("offsets_2e64",
                lambda p: st_edit(p, _st_offsets("vec", lambda o: [o[0], o[0] + (1 << 64)])),
                tensor="vec", exc="InvalidOffsetError"),
        _st_var("offsets_float",
                lambda p: st_edit(p, _st_offsets("vec", lambda o: [float(o[0]), o[1]])),
                tensor="vec", exc="InvalidOffsetError"),
        _st_var("shape_negative", lambda p: st_edit(p, lambda h: h["vec"].update(shape=[-9])),
                tensor="vec", exc="InvalidHeaderError"),
        _st_var("shape_bool", lambda p: st_edit(p, lambda h: h["vec"].update(shape=[True])),
                tensor="vec", exc="InvalidHeaderError"),
        # rows x cols x itemsize = 2^64: past int64 everywhere a C++ or numpy int would hold it
        _st_var("shape_overflow",
                lambda p: st_edit(p, lambda h: (h["emb"].update(shape=[1 << 31, 1 << 31]),
                                                h["emb"].update(data_offsets=[
                                                    h["emb"]["data_offsets"][0],
                                                    h["emb"]["data_offsets"][0] + (1 << 64)]))),
                tensor="emb", exc="CheckpointError"),
        _st_var("dtype_vs_bytes", lambda p: st_edit(p, lambda h: h["emb"].update(dtype="F64")),
                tensor="emb", exc="InvalidOffsetError"),
        _st_var("shape_vs_bytes", lambda p: st_edit(p, lambda h: h["emb"].update(shape=[13, 7])),
                tensor="emb", exc="InvalidOffsetError"),
        _st_var("dtype_unknown", lambda p: st_edit(p, lambda h: h["emb"].update(dtype="F31")),
                tensor="emb", exc="DtypeMismatchError"),
        # found by fuzz/fuzz_safetensors.py: an unhashable dtype raised TypeError
        _st_var("dtype_not_string", lambda p: st_edit(p, lambda h: h["emb"].update(dtype={})),
                tensor="emb", exc="DtypeMismatchError"),
        _st_var("metadata_not_strings",
                lambda p: st_edit(p, lambda h: h.update(__metadata__={"a": 1})),
                exc="InvalidHeaderError"),
        _st_var("trailing_bytes", lambda p: _write(p, _read(p) + b"\0" * 16),
                exc="InvalidOffsetError"),
        _st_var("duplicate_names", _st_dup, tensor="vec", exc="InvalidHeaderError"),
        # reliability round 2: limits and special files
        _st_var("int_5000_digits", _st_big_int, exc="LimitExceededError"),
        _st_var("json_5000_deep", _st_deep, exc="InvalidHeaderError"),
        _st_var("fifo", to_fifo, exc="ReadError"),
        _st_var("dev_zero_symlink", to_dev_zero, exc="ReadError"),
    ]
    return v


def _named(fn, name: str):
    """``fn`` damaging the checkpoint, with the error expected to name ``name`` instead."""
    def m(p):
        fn(p)
        return name
    return m


def hf_variants() -> List[Variant]:
    idx = "m.safetensors.index.json"

    def wm_edit(fn):
        def m(d):
            p = os.path.join(d, idx)
            with open(p) as f:
                j = json.load(f)
            fn(j["weight_map"])
            with open(p, "w") as f:
                json.dump(j, f)
            return idx
        return m

    def missing_shard(d):
        os.remove(os.path.join(d, "m-00002.safetensors"))
        return "m-00002.safetensors"

    def bad_json(d):
        patch(os.path.join(d, idx), 3, b"\x00")
        return idx

    def dup_tensor(d):
        # a second shard file holding "emb" too, listed through the directory (no index)
        os.remove(os.path.join(d, idx))
        shutil.copy(os.path.join(d, "m-00001.safetensors"), os.path.join(d, "m-00003.safetensors"))
        return "m-00003.safetensors"

    def dup_key(d):
        p = os.path.join(d, idx)
        raw = _read(p)
        _write(p, raw.replace(b'"emb": "m-00001.safetensors"',
                              b'"emb": "m-00001.safetensors", "emb": "m-00002.safetensors"'))
        return idx

    def on_index(fn):
        def m(d):
            fn(os.path.join(d, idx))
            return idx
        return m

    def shard_trunc(d):
        p = os.path.join(d, "m-00001.safetensors")
        truncate(p, os.path.getsize(p) - 3)
        return "m-00001.safetensors"

    return [
        Variant("hf_missing_shard", "hf", missing_shard, exc="MissingFileError"),
        Variant("hf_index_not_json", "hf", bad_json, exc="InvalidHeaderError"),
        Variant("hf_weight_map_wrong_shard", "hf",
                _named(wm_edit(lambda w: w.update(emb="m-00002.safetensors")),
                       "m-00002.safetensors"), exc="MissingTensorError"),
        Variant("hf_weight_map_duplicate_key", "hf", dup_key, tensor="emb",
                exc="InvalidHeaderError"),
        Variant("hf_weight_map_not_strings", "hf", wm_edit(lambda w: w.update(emb=7)),
                exc="InvalidHeaderError"),
        Variant("hf_duplicate_tensor", "hf", dup_tensor, tensor="emb",
                exc="InvalidHeaderError"),
        Variant("hf_shard_truncated", "hf", shard_trunc, exc="TruncatedFileError"),
        # reliability round 2: containment, special files, limits
        Variant("hf_weight_map_dotdot", "hf", wm_edit(lambda w: w.update(
            emb="../m-00001.safetensors")), tensor="emb", exc="UnsafePathError"),
        Variant("hf_weight_map_absolute", "hf", wm_edit(lambda w: w.update(
            emb="/etc/passwd")), tensor="emb", exc="UnsafePathError"),
        Variant("hf_weight_map_nul", "hf", wm_edit(lambda w: w.update(
            emb="m-00001.safetensors\0x")), tensor="emb", exc="UnsafePathError"),
        Variant("hf_index_fifo", "hf", on_index(to_fifo), exc="ReadError"),
        Variant("hf_index_dev_zero", "hf", on_index(to_dev_zero), exc="ReadError"),
        Variant("hf_index_sparse_4gib", "hf", on_index(to_sparse), exc="LimitExceededError"),
        Variant("hf_index_int_5000_digits", "hf", on_index(lambda p: _write(
            p, _read(p).replace(b'"metadata": {}', b'"metadata": {"total_size": ' + BIG_INT
                                + b'}'))), exc="LimitExceededError"),
        Variant("hf_index_5000_deep", "hf", on_index(lambda p: _write(
            p, _read(p).replace(b'"metadata": {}', b'"metadata": ' + deep_json()))),
            exc="InvalidHeaderError"),
        Variant("hf_shard_fifo", "hf", _named(
            lambda d: to_fifo(os.path.join(d, "m-00002.safetensors")), "m-00002.safetensors"),
            exc="ReadError"),
    ]


def _ts_var(name, fn, tensor=None, exc=None, stage="open") -> Variant:
    def m(p):
        fn(p)
        return os.path.basename(p)
    return Variant(f"ts_{name}", "ts", m, stage, tensor, exc)


def _ts_trunc(frac: float):
    return lambda p: truncate(p, int(os.path.getsize(p) * frac))


def _ts_compress(p):
    rezip(p, lambda items: [(n, d, zipfile.ZIP_DEFLATED if "/data/" in n else zipfile.ZIP_STORED)
                            for n, d in items])


def _ts_local_method(p):
    lho, _ = zip_record(p, "/data/0")
    patch(p, lho + 8, struct.pack("<H", 8))  # local header says deflate, central says stored


def _ts_local_sig(p):
    lho, _ = zip_record(p, "/data/0")
    patch(p, lho, b"XXXX")


def _ts_local_namelen(p):
    lho, _ = zip_record(p, "/data/0")
    patch(p, lho + 26, struct.pack("<H", 0xFFFF))


def _ts_central_size(p):
    _, cho = zip_record(p, "/data/0")
    raw = _read(p)
    csize, usize = struct.unpack("<II", raw[cho + 20:cho + 28])
    patch(p, cho + 20, struct.pack("<II", csize - 4, usize - 4))


def _ts_drop_record(p):
    rezip(p, lambda items: [(n, d, zipfile.ZIP_STORED) for n, d in items
                            if not n.endswith("/data/0")])


def _ts_dup_record(p):
    # an identical second copy: the data would read the same, only the name check sees it
    rezip(p, lambda items: [(n, d, zipfile.ZIP_STORED) for n, d in items]
          + [(n, d, zipfile.ZIP_STORED) for n, d in items if n.endswith("/data/0")])


def _ts_pickle(new: bytes):
    return lambda p: rezip(p, lambda items: [
        (n, new if n.endswith("/data.pkl") else d, zipfile.ZIP_STORED) for n, d in items])


def _evil_pickle() -> bytes:
    class Evil:
        def __reduce__(self):
            return (os.system, ("echo pwned",))
    return pickle.dumps({"emb": Evil()}, protocol=2)


def torch_save_variants() -> List[Variant]:
    v = [_ts_var(f"trunc_{int(f * 100)}pct", _ts_trunc(f), exc="CheckpointError")
         for f in (0.0, 0.01, 0.2, 0.5, 0.8, 0.97, 0.995)]
    v += [
        _ts_var("records_compressed", _ts_compress, exc="UnsupportedFormatError"),
        _ts_var("local_header_says_deflate", _ts_local_method, exc="UnsupportedFormatError"),
        _ts_var("local_header_signature", _ts_local_sig, exc="InvalidHeaderError"),
        _ts_var("local_name_length_huge", _ts_local_namelen, exc="CheckpointError"),
        _ts_var("central_size_short", _ts_central_size, tensor="emb", exc="InvalidOffsetError"),
        _ts_var("record_missing", _ts_drop_record, tensor="emb", exc="InvalidHeaderError"),
        _ts_var("record_duplicate", _ts_dup_record, exc="InvalidHeaderError"),
        _ts_var("pickle_garbage", _ts_pickle(b"\x80\x02}q\x00(X\x03\x00\x00\x00emb\xff\xff"),
                exc="InvalidHeaderError"),
        _ts_var("pickle_empty", _ts_pickle(b""), exc="InvalidHeaderError"),
        _ts_var("pickle_evil_global", _ts_pickle(_evil_pickle()), exc="UnsupportedFormatError"),
        _ts_var("no_data_pkl", lambda p: rezip(p, lambda items: [
            (n.replace("data.pkl", "dota.pkl"), d, zipfile.ZIP_STORED) for n, d in items]),
            exc="InvalidHeaderError"),
        _ts_var("big_endian", lambda p: rezip(p, lambda items: [
            (n, b"big" if n.endswith("/byteorder") else d, zipfile.ZIP_STORED)
            for n, d in items]), exc="UnsupportedFormatError"),
        _ts_var("eocd_smashed", lambda p: patch(p, os.path.getsize(p) - 22, b"\0" * 22),
                exc="InvalidHeaderError"),
        # crafted views (data.pkl written by hand)
        _ts_var("view_outside_storage", lambda p: craft_view(p, (5, 5), (5, 1)),
                tensor="w", exc="InvalidOffsetError"),
        _ts_var("view_negative_offset", lambda p: craft_view(p, (2, 2), (2, 1), offset=-1),
                tensor="w", exc="InvalidOffsetError"),
        _ts_var("view_negative_size", lambda p: craft_view(p, (-1, 4), (4, 1)),
                tensor="w", exc="CheckpointError"),
        _ts_var("view_negative_stride", lambda p: craft_view(p, (3, 4), (-4, 1)),
                tensor="w", exc="InvalidOffsetError"),
        _ts_var("view_size_overflow", lambda p: craft_view(p, (1 << 40, 1 << 40), (1 << 40, 1)),
                tensor="w", exc="InvalidOffsetError"),
        _ts_var("view_rank_mismatch", lambda p: craft_view(p, (2, 2), (2,)),
                tensor="w", exc="InvalidHeaderError"),
        _ts_var("storage_numel_vs_record", lambda p: craft_view(p, (2, 2), (2, 1), rec_bytes=7),
                tensor="w", exc="InvalidOffsetError"),
        _ts_var("storage_numel_2e62", lambda p: craft_view(p, (2, 2), (2, 1), numel=1 << 62,
                                                                    rec_bytes=16),
                tensor="w", exc="InvalidOffsetError"),
        _ts_var("storage_class_unknown", lambda p: craft_view(p, (2, 2), (2, 1),
                                                              cls="UntypedStorage"),
                exc="UnsupportedFormatError"),
        # reliability round 2: pickle limits, BUILD ops, key collisions, zip record sizes
        _ts_var("pickle_billion_laughs", _ts_pickle(laughs_pickle()), exc="LimitExceededError"),
        _ts_var("pickle_self_reference", _ts_pickle(self_ref_pickle()),
                exc="InvalidHeaderError"),
        _ts_var("pickle_5000_deep", _ts_pickle(deep_pickle()), exc="LimitExceededError"),
        _ts_var("pickle_int_5000_digits", _ts_pickle(
            b"\x80\x02}X\x03\x00\x00\x00embI" + BIG_INT + b"\ns."), exc="InvalidHeaderError"),
        _ts_var("pickle_build_marker", _ts_pickle(build_marker_pickle()),
                exc="InvalidHeaderError"),
        _ts_var("pickle_device_laughs", _ts_pickle(device_laughs_pickle()),
                exc="InvalidHeaderError"),
        _ts_var("pickle_build_tensor_ref", lambda p: craft_torch_save(
            p, {"w": _BuildView(_Storage("0", "FloatStorage", 24), 0, (2, 2), (2, 1))},
            {"0": b"\0" * 96}), exc="InvalidHeaderError"),
        _ts_var("keys_collide", lambda p: craft_torch_save(
            p, {"0.weight": _View(_Storage("0", "FloatStorage", 4), 0, (4,), (1,)),
                "0": {"weight": _View(_Storage("1", "FloatStorage", 4), 0, (4,), (1,))}},
            {"0": b"\0" * 16, "1": b"\0" * 16}), tensor="0.weight", exc="KeyCollisionError"),
        _ts_var("pkl_deflate_declares_4gib", lambda p: (
            ts_compress_pkl(zipfile.ZIP_DEFLATED)(p),
            zip_set_size(p, "/data.pkl", 0xFFFFFFFF)), exc="LimitExceededError"),
        _ts_var("pkl_bzip2_declares_4gib", lambda p: (
            ts_compress_pkl(zipfile.ZIP_BZIP2)(p),
            zip_set_size(p, "/data.pkl", 0xFFFFFFFF)), exc="LimitExceededError"),
        _ts_var("pkl_deflate_inflates_past_declared", lambda p: (
            ts_compress_pkl(zipfile.ZIP_DEFLATED)(p), zip_set_size(p, "/data.pkl", 16)),
            exc="InvalidHeaderError"),
        _ts_var("view_expanded_rows", lambda p: craft_view(p, (4, 3), (0, 1), numel=3),
                tensor="w", exc="UnsupportedFormatError"),
        _ts_var("view_expanded_scalar", lambda p: craft_view(p, (2, 2), (0, 0), numel=1),
                tensor="w", exc="UnsupportedFormatError"),
        _ts_var("fifo", to_fifo, exc="ReadError"),
        _ts_var("dev_zero_symlink", to_dev_zero, exc="ReadError"),
    ]
    return v


def _dcp_var(name, fn, base="dcp", tensor=None, exc=None, stage="open") -> Variant:
    return Variant(f"{base}_{name}", base, fn, stage, tensor, exc)


def _dcp_trunc(frac: float, fqn: str = "emb"):
    def m(d):
        f, off, ln = dcp_blob(d, fqn)
        truncate(f, off + int(ln * frac))
        return os.path.basename(f)
    return m


def _dcp_missing_md(d):
    os.remove(os.path.join(d, ".metadata"))
    return os.path.basename(d)


def _dcp_md_bytes(fn):
    def m(d):
        p = os.path.join(d, ".metadata")
        _write(p, fn(_read(p)))
        return ".metadata"
    return m


def _dcp_md_special(fn):
    def m(d):
        fn(os.path.join(d, ".metadata"))
        return ".metadata"
    return m


def _dcp_rm_chunk(d):
    rel = dcp_file_of(d, "emb")
    os.remove(os.path.join(d, rel))
    return rel


def _dcp_blob_patch(fqn: str, rel_off: int, data: bytes):
    def m(d):
        f, off, _ = dcp_blob(d, fqn)
        patch(f, off + rel_off, data)
        return os.path.basename(f)
    return m


def _dcp_blob_record_method(d):
    f, off, ln = dcp_blob(d, "emb")
    lho, _ = zip_record(f, "/data/0", off, ln)
    patch(f, lho + 8, struct.pack("<H", 8))
    return os.path.basename(f)


def _md(fn, names: str = "emb"):
    """Edit the metadata; the error names the data file of ``names`` (or .metadata)."""
    def m(d):
        rel = dcp_file_of(d, names) if names != ".metadata" else ".metadata"
        dcp_md_edit(d, fn)
        return rel
    return m


def _md_storage(fqn: str, **kw):
    def fn(md):
        k, info = dcp_storage(md, fqn)
        md.storage_data[k] = dataclasses.replace(info, **kw)
    return fn


def _md_chunk(fqn: str, **kw):
    def fn(md):
        t = md.state_dict_metadata[fqn]
        t.chunks[0] = dataclasses.replace(t.chunks[0], **kw)
    return fn


def _md_dtype(md):
    md.state_dict_metadata["emb"].properties.dtype = torch.float64


def _md_dtype_str(md):
    md.state_dict_metadata["emb"].properties.dtype = "float32"


def _md_global(md):
    md.state_dict_metadata["emb"].size = torch.Size([14, 6])


def _md_dup_chunk(md):
    t = md.state_dict_metadata["emb"]
    t.chunks.append(t.chunks[0])


def _md_no_storage(md):
    k, _ = dcp_storage(md, "emb")
    del md.storage_data[k]


def dcp_variants() -> List[Variant]:
    v = [_dcp_var(f"chunk_trunc_{int(f * 100)}pct", _dcp_trunc(f), exc="CheckpointError")
         for f in (0.0, 0.3, 0.6, 0.99)]
    v += [
        _dcp_var("metadata_missing", _dcp_missing_md, exc="UnsupportedFormatError"),
        _dcp_var("metadata_garbage", _dcp_md_bytes(lambda b: b"\x80\x04garbage" * 7),
                 exc="InvalidHeaderError"),
        _dcp_var("metadata_truncated", _dcp_md_bytes(lambda b: b[:len(b) // 2]),
                 exc="InvalidHeaderError"),
        _dcp_var("metadata_empty", _dcp_md_bytes(lambda b: b""), exc="InvalidHeaderError"),
        _dcp_var("chunk_file_missing", _dcp_rm_chunk, tensor="emb", exc="MissingFileError"),
        _dcp_var("blob_zeroed", _dcp_blob_patch("emb", 0, b"\0" * 64), exc="CheckpointError"),
        _dcp_var("blob_pk_then_garbage", _dcp_blob_patch("emb", 4, b"\xff" * 60),
                 tensor="emb", exc="CheckpointError"),
        _dcp_var("blob_record_deflate", _dcp_blob_record_method, tensor="emb",
                 exc="UnsupportedFormatError"),
        _dcp_var("md_offset_negative", _md(_md_storage("emb", offset=-1)), tensor="emb",
                 exc="InvalidOffsetError"),
        _dcp_var("md_offset_past_end", _md(_md_storage("emb", offset=1 << 40)), tensor="emb",
                 exc="CheckpointError"),
        _dcp_var("md_length_2e64", _md(_md_storage("emb", length=1 << 64)), tensor="emb",
                 exc="CheckpointError"),
        _dcp_var("md_length_negative", _md(_md_storage("emb", length=-5)), tensor="emb",
                 exc="CheckpointError"),
        _dcp_var("md_relpath_missing", _named(_md(_md_storage(
            "emb", relative_path="nope.distcp")), "nope.distcp"),
            tensor="emb", exc="MissingFileError"),
        _dcp_var("md_relpath_escapes", _named(_md(_md_storage(
            "emb", relative_path="../model.safetensors")), ".metadata"),
            tensor="emb", exc="InvalidHeaderError"),
        _dcp_var("md_relpath_not_str", _named(_md(_md_storage(
            "emb", relative_path=7)), ".metadata"), tensor="emb", exc="InvalidHeaderError"),
        _dcp_var("md_relpath_nul", _named(_md(_md_storage(
            "emb", relative_path="__0_0.distcp\0x")), ".metadata"), tensor="emb",
            exc="UnsafePathError"),
        _dcp_var("md_relpath_absolute", _named(_md(_md_storage(
            "emb", relative_path="/etc/passwd")), ".metadata"), tensor="emb",
            exc="UnsafePathError"),
        _dcp_var("metadata_fifo", _dcp_md_special(to_fifo), exc="ReadError"),
        _dcp_var("metadata_dev_zero", _dcp_md_special(to_dev_zero), exc="ReadError"),
        _dcp_var("metadata_sparse_4gib", _dcp_md_special(to_sparse), exc="LimitExceededError"),
        _dcp_var("md_not_metadata", _dcp_md_bytes(lambda b: pickle.dumps(42)),
                 exc="InvalidHeaderError"),
        _dcp_var("md_dtype_not_dtype", _named(_md(_md_dtype_str), ".metadata"), tensor="emb",
                 exc="InvalidHeaderError"),
        _dcp_var("md_chunk_shape", _md(_md_chunk("emb", sizes=torch.Size([12, 6]))),
                 tensor="emb", exc="ShapeMismatchError"),
        _dcp_var("md_dtype", _md(_md_dtype), tensor="emb", exc="DtypeMismatchError"),
        _dcp_var("md_no_storage_entry", _md(_md_no_storage, ".metadata"), tensor="emb",
                 exc="InvalidHeaderError"),
        _dcp_var("md_global_shape", _named(_md(_md_global), "dcp"), tensor="emb",
                 exc="ShapeMismatchError", stage="load"),
        _dcp_var("md_duplicate_chunk", _md(_md_dup_chunk), tensor="emb",
                 exc="OverlappingChunksError", stage="load"),
    ]
    # the data file shrinks while open_checkpoint reads it (another job rewriting it)
    v += [_dcp_var(f"shrinks_while_open_{int(f * 100)}pct", _dcp_trunc(f), tensor="emb",
                   exc="CheckpointError", stage="during_open") for f in (0.0, 0.5, 0.99)]
    # SAFETENSORS serialization: one safetensors blob per file
    def st_in_dcp(fn):
        def m(d):
            rel = dcp_file_of(d, "emb")
            fn(os.path.join(d, rel))
            return rel
        return m

    def sharding(value):
        def fn(h):
            h["__metadata__"]["DCP_SHARDING_INFO"] = value
        return lambda p: st_edit(p, fn)

    v += [
        _dcp_var("trunc_header", st_in_dcp(lambda p: truncate(p, 20)), "dcpst",
                 exc="CheckpointError"),
        _dcp_var("trunc_data", st_in_dcp(lambda p: truncate(p, os.path.getsize(p) - 8)),
                 "dcpst", exc="TruncatedFileError"),
        _dcp_var("header_json", st_in_dcp(lambda p: patch(p, 12, b"\x00")), "dcpst",
                 exc="InvalidHeaderError"),
        _dcp_var("sharding_not_json", st_in_dcp(sharding("{nope")), "dcpst",
                 exc="InvalidHeaderError"),
        _dcp_var("sharding_wrong_offsets",
                 st_in_dcp(sharding(json.dumps({"emb": {"saved_offsets": [1, 0]}}))), "dcpst",
                 tensor="emb", exc="InvalidHeaderError"),
        _dcp_var("sharding_not_object", st_in_dcp(sharding(json.dumps([1]))), "dcpst",
                 exc="InvalidHeaderError"),
        _dcp_var("sharding_int_5000_digits", st_in_dcp(sharding(
            '{"emb": {"saved_offsets": [' + BIG_INT.decode() + ', 0]}}')), "dcpst",
            exc="LimitExceededError"),
        _dcp_var("tensor_absent", st_in_dcp(lambda p: st_edit(
            p, lambda h: h.update(emb2=h.pop("emb")))), "dcpst", tensor="emb",
            exc="InvalidHeaderError"),
        _dcp_var("md_dtype", _md(_md_dtype), "dcpst", tensor="emb", exc="DtypeMismatchError"),
    ]
    return v


def all_variants() -> List[Variant]:
    import hostile_pickle  # round 3: pickles that run code, change globals, bomb memory
    vs = (safetensors_variants() + hf_variants() + torch_save_variants() + dcp_variants()
          + hostile_pickle.variants())
    names = [v.name for v in vs]
    assert len(names) == len(set(names)), "duplicate variant names"
    return vs


# ---------------------------------------------------------------------------------------------
# the checks


POISON_BYTE = 0xA5


def targets_for(sd: Dict[str, torch.Tensor]):
    """A whole-tensor target per tensor plus a row block of 'emb', poisoned."""
    from metamat.plan import Target
    out = []
    for k, t in sd.items():
        dst = torch.empty_like(t)
        dst.view(torch.uint8).fill_(POISON_BYTE)
        out.append(Target(k, k, tuple(t.shape), (0,) * t.dim(), tuple(t.shape), t.dtype,
                          tensor=dst))
    dst = torch.empty(5, 6)
    dst.view(torch.uint8).fill_(POISON_BYTE)
    out.append(Target("emb", "emb", (13, 6), (4, 0), (5, 6), torch.float32, tensor=dst))
    return out


def _untouched(targets) -> bool:
    return all(bool((t.tensor.view(torch.uint8) == POISON_BYTE).all()) for t in targets)


def _copy_base(bases: Dict[str, str], base: str, work: str) -> str:
    src = bases[base]
    dst = os.path.join(work, os.path.basename(src))
    if os.path.isdir(src):
        shutil.copytree(src, dst)
    else:
        shutil.copy(src, dst)
    return dst


def _targets_for_variant(path: str, base: str):
    if base == "ts" and not os.path.exists(path):
        return targets_for(state())
    return targets_for(state())


def _check_error(v: Variant, e: BaseException, named: str, where: str) -> None:
    import metamat.checkpoint as mc
    from metamat import CheckpointError
    if not isinstance(e, CheckpointError):
        raise AssertionError(f"{v.name} ({where}): {type(e).__name__} is not a CheckpointError:"
                             f" {e}") from e
    if v.exc and not isinstance(e, getattr(mc, v.exc)):
        raise AssertionError(f"{v.name} ({where}): expected {v.exc}, got "
                             f"{type(e).__name__}: {e}") from e
    msg = str(e)
    if named not in msg:
        raise AssertionError(f"{v.name} ({where}): message does not name {named!r}: {msg}")
    if v.tensor is not None and f"'{v.tensor}'" not in msg:
        raise AssertionError(f"{v.name} ({where}): message does not name tensor "
                             f"{v.tensor!r}: {msg}")


def check_variant(v: Variant, bases: Dict[str, str], work: str) -> str:
    """Damage a copy of ``v.base`` and check the contract; returns the error's class name.

    Raises:
        AssertionError: the contract is broken (message says how).
    """
    from metamat import CheckpointError, open_checkpoint
    from metamat.checkpoint import ReadError
    from metamat.load import load_targets

    os.makedirs(work, exist_ok=True)
    path = _copy_base(bases, v.base, work)
    stale = open_checkpoint(path)  # opened while good: the plan is made before the damage
    damage = during_zip_pass(lambda: v.mutate(path))
    if v.stage != "during_open":
        damage.run()

    # 1. open, then load: CheckpointError, named, destinations untouched
    targets = targets_for(state())
    ck = None
    err: Optional[BaseException] = None
    try:
        if v.stage == "during_open":
            with damage:
                ck = open_checkpoint(path)
        else:
            ck = open_checkpoint(path)
    except Exception as e:  # noqa: BLE001 - anything but CheckpointError is a failure
        err = e
    if not damage.ran:
        raise AssertionError(f"{v.name}: the damage was never done (no C pass?)")
    named = damage.result
    if v.stage in ("open", "during_open") and err is None:
        raise AssertionError(f"{v.name}: open_checkpoint accepted the damaged checkpoint "
                             f"({ck!r})")
    if err is None:
        try:
            load_targets(targets, ck, io_threads=2)
        except Exception as e:  # noqa: BLE001
            err = e
        if err is None:
            raise AssertionError(f"{v.name}: load_targets accepted the damaged checkpoint")
    _check_error(v, err, named, "open+load")
    if not _untouched(targets):
        raise AssertionError(f"{v.name}: a destination was written")

    # 2. the plan made on the good file, executed on the damaged one
    targets = targets_for(state())
    need_fail = False
    for e in stale.tensors().values():
        for c in e.chunks:
            if not os.path.exists(c.file) or c.byte_offset + c.nbytes > os.path.getsize(c.file):
                need_fail = True
    try:
        load_targets(targets, stale, io_threads=2)
    except CheckpointError as e:
        if not isinstance(e, ReadError) and not _untouched(targets):
            raise AssertionError(f"{v.name} (stale plan): {type(e).__name__} after writing a "
                                 "destination") from e
    except Exception as e:  # noqa: BLE001
        raise AssertionError(f"{v.name} (stale plan): {type(e).__name__} is not a "
                             f"CheckpointError: {e}") from e
    else:
        if need_fail:
            raise AssertionError(f"{v.name} (stale plan): load succeeded though data bytes are "
                                 "gone")
    return type(err).__name__


def run_all(root: Optional[str] = None, only: Optional[List[str]] = None) -> Dict[str, str]:
    """Check every variant (each under SIGALRM); returns name -> error class or 'FAIL: ...'."""
    import signal

    def on_alarm(*_):
        raise TimeoutError("variant took more than 30 s")

    root = root or tempfile.mkdtemp(prefix="metamat_hostile_")
    bases = make_bases(os.path.join(root, "bases"))
    out = {}
    old = signal.signal(signal.SIGALRM, on_alarm)
    try:
        for v in all_variants():
            if only and v.name not in only:
                continue
            signal.alarm(30)
            try:
                out[v.name] = check_variant(v, bases, os.path.join(root, v.name))
            except (AssertionError, TimeoutError) as e:
                out[v.name] = f"FAIL: {e}"
            finally:
                signal.alarm(0)
    finally:
        signal.signal(signal.SIGALRM, old)
    return out


if __name__ == "__main__":
    res = run_all(only=sys.argv[1:] or None)
    bad = {k: v for k, v in res.items() if v.startswith("FAIL")}
    for k, r in res.items():
        print(f"{k:40s} {r}")
    print(f"{len(res)} variants, {len(bad)} failures")
    sys.exit(1 if bad else 0)
