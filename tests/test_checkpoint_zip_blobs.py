"""DCP's torch.save blobs located in C (``_C.zip_blobs``, used by ``open_checkpoint``) against
the careful parser (``parse_torch_save``: zipfile and every check), its reference: on real
blobs both give the same records and pickle; on every single-byte damage of a blob the C
pass either declines (None: the careful parser then decides) or agrees with the careful
parser's records."""
from __future__ import annotations

import io
import os
import struct

import pytest
import torch

from metamat._ext import core
from metamat.checkpoint import CheckpointError, open_checkpoint
from metamat.checkpoint.errors import InvalidHeaderError
from metamat.checkpoint.limits import METADATA_BYTES, limit
from metamat.checkpoint.torch_save import _RestrictedUnpickler, parse_torch_save


@pytest.fixture(scope="module")
def dcp_blobs(tmp_path_factory):
    """A DCP checkpoint written by torch (one process) and its chunks' (file, offset, length)."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint import FileSystemReader

    path = str(tmp_path_factory.mktemp("zipblobs"))
    g = torch.Generator().manual_seed(7)
    sd = {"w": torch.randn(33, 5, generator=g), "b": torch.randn(7, generator=g).bfloat16(),
          "i": torch.arange(12, dtype=torch.int64).reshape(3, 4), "s": torch.tensor(2.5),
          "e": torch.empty(0, 3)}
    dcp.save(sd, checkpoint_id=path, no_dist=True)
    md = FileSystemReader(path).read_metadata()
    blobs = sorted((os.path.join(path, v.relative_path), v.offset, v.length)
                   for v in md.storage_data.values())
    return path, sd, blobs


def _read(f: str) -> bytes:
    with open(f, "rb") as fh:
        return fh.read()


def _c_records(data: bytes, base: int, length: int):
    (got,) = core().zip_blobs(data, [base], [length], limit(METADATA_BYTES))
    if got is None:
        return None
    pkl, records = got
    obj = _RestrictedUnpickler(io.BytesIO(pkl), "x").load()
    return obj, records


def test_c_pass_equals_the_careful_parser_on_real_blobs(dcp_blobs):
    _, _, blobs = dcp_blobs
    assert len(blobs) == 5
    for f, base, length in blobs:
        data = _read(f)
        got = _c_records(data, base, length)
        want = parse_torch_save(f, base=base, length=length)
        assert got is not None, (f, base)
        assert got[1] == want.records and repr(got[0]) == repr(want.obj)


def test_every_single_byte_damage_is_declined_or_read_alike(dcp_blobs, tmp_path):
    _, _, blobs = dcp_blobs
    f, base, length = blobs[0]
    blob = bytearray(_read(f)[base:base + length])
    p = str(tmp_path / "blob")
    accepted = declined = 0
    for i in range(len(blob)):
        for flip in (0x01, 0xFF):
            bad = bytearray(blob)
            bad[i] ^= flip
            got = _c_records(bytes(bad), 0, len(bad))
            if got is None:
                declined += 1
                continue
            accepted += 1
            with open(p, "wb") as fh:
                fh.write(bad)
            try:
                want = parse_torch_save(p)
            except CheckpointError as e:
                pytest.fail(f"byte {i} ^ {flip:#x}: C accepted what the parser refuses: {e}")
            assert got[1] == want.records and repr(got[0]) == repr(want.obj), (i, flip)
    # tensor bytes and unchecked header fields (times, attributes) are read alike; the
    # structure, names, sizes and both CRC-checked records are declined
    assert accepted > 100 and declined > 1000, (accepted, declined)


def test_a_record_running_into_the_next_entry_is_refused_by_both(dcp_blobs, tmp_path):
    """A tensor record grown (both sizes in its directory entry) to end one byte into the next
    entry's local header still fits in the blob: the careful parser refuses it on every
    Python (zipfile checks only the records it opens, and only in newer Pythons), the C
    pass declines it."""
    _, _, blobs = dcp_blobs
    f, base, length = blobs[0]
    good = _read(f)[base:base + length]
    blob = bytearray(good)
    central = []  # (offset of the directory entry, name, local header offset)
    at = blob.find(b"PK\x01\x02")
    while at >= 0:
        nlen = struct.unpack_from("<H", blob, at + 28)[0]
        central.append((at, bytes(blob[at + 46:at + 46 + nlen]).decode(),
                        struct.unpack_from("<I", blob, at + 42)[0]))
        at = blob.find(b"PK\x01\x02", at + 46)
    at, name, lho = next(c for c in central if "/data/" in c[1])
    nlen, elen = struct.unpack_from("<HH", blob, lho + 26)
    start = lho + 30 + nlen + elen
    nxt = min(c[2] for c in central if c[2] > lho)
    struct.pack_into("<II", blob, at + 20, nxt + 1 - start, nxt + 1 - start)
    p = str(tmp_path / "blob")
    with open(p, "wb") as fh:
        fh.write(blob)
    with pytest.raises(InvalidHeaderError, match=f"{name} overlaps the next entry"):
        parse_torch_save(p)
    assert _c_records(bytes(blob), 0, len(blob)) is None
    # one byte less ends at the next header: read alike by both
    struct.pack_into("<II", blob, at + 20, nxt - start, nxt - start)
    with open(p, "wb") as fh:
        fh.write(blob)
    assert _c_records(bytes(blob), 0, len(blob))[1] == parse_torch_save(p).records


@pytest.mark.parametrize("field,at_end", [("zip64 record size", 98 - 4),
                                           ("locator's record offset", 20 + 22 - 8)])
def test_a_zip64_end_record_out_of_place_is_refused_by_both(dcp_blobs, tmp_path, field, at_end):
    """torch writes a zip64 end record and locator; Python 3.12.3's zipfile refuses the
    archive when the record's size field or the locator's offset is off (3.11.7 read it):
    the careful parser refuses it on every Python, the C pass declines it."""
    _, _, blobs = dcp_blobs
    f, base, length = blobs[0]
    blob = bytearray(_read(f)[base:base + length])
    assert blob[-98:-94] == b"PK\x06\x06" and blob[-42:-38] == b"PK\x06\x07"
    blob[-at_end] ^= 0x01
    p = str(tmp_path / "blob")
    with open(p, "wb") as fh:
        fh.write(blob)
    with pytest.raises(InvalidHeaderError, match="zip64 end"):
        parse_torch_save(p)
    assert _c_records(bytes(blob), 0, len(blob)) is None, field


def test_open_checkpoint_is_the_same_with_and_without_the_c_pass(dcp_blobs, monkeypatch):
    path, sd, _ = dcp_blobs
    fast = open_checkpoint(path)

    class NoFastPath:
        def __getattr__(self, name):
            return getattr(core(), name)

        @staticmethod
        def zip_blobs_fd(fd, size, offsets, lengths, max_metadata):
            return [None] * len(offsets)

    monkeypatch.setattr("metamat._ext.core", lambda: NoFastPath())
    slow = open_checkpoint(path)
    assert set(fast.tensors()) == set(sd) == set(slow.tensors())
    for name in sd:
        a, b = fast.tensors()[name], slow.tensors()[name]
        assert (a.dtype, a.global_shape) == (b.dtype, b.global_shape)
        assert [c._asdict() for c in a.chunks] == [c._asdict() for c in b.chunks]


def test_metadata_limit_declines_the_blob(dcp_blobs):
    _, _, blobs = dcp_blobs
    f, base, length = blobs[0]
    data = _read(f)
    assert core().zip_blobs(data, [base], [length], 1 << 20)[0] is not None
    assert core().zip_blobs(data, [base], [length], 16)[0] is None  # data.pkl is larger
    assert core().zip_blobs(data, [base, 0], [length, 3], 1 << 20)[1] is None  # too short
    with pytest.raises(ValueError):
        core().zip_blobs(data, [0], [], 1 << 20)


_SHRINK_CHILD = r"""
import os, sys
sys.path.insert(0, sys.argv[2])
import torch
import hostile_gen
from metamat.checkpoint import CheckpointError, open_checkpoint
from metamat.load import load_targets
from metamat.plan import Target

path, data = sys.argv[1], os.path.join(sys.argv[1], "__0_0.distcp")
size = os.path.getsize(data)
with hostile_gen.during_zip_pass(lambda: hostile_gen.truncate(data, size // 2)) as d:
    try:
        open_checkpoint(path)
    except CheckpointError as e:
        assert data in str(e), e
        print("open:", type(e).__name__)
assert d.ran
# opened whole, then truncated before the load: the readers pread too
ck = open_checkpoint(sys.argv[3])
hostile_gen.truncate(os.path.join(sys.argv[3], "__0_0.distcp"), 0)
e = ck.tensors()["w"]
t = Target("w", "w", e.global_shape, (0, 0), e.global_shape, e.dtype,
           tensor=torch.empty(e.global_shape, dtype=e.dtype))
try:
    load_targets([t], ck, io_threads=2)
except CheckpointError as e:
    print("load:", type(e).__name__)
"""


def test_a_data_file_that_shrinks_while_open_is_a_named_error_not_sigbus(tmp_path):
    """open_checkpoint read DCP data files through a mapping: a file truncated meanwhile (by
    another job rewriting the checkpoint) killed the process with SIGBUS (rc -7) in the C pass
    or a slice of the mapping. Now every byte is pread: the blobs the file no longer has go
    to the careful parser, which names the error. In a child, so a crash fails only this."""
    import subprocess
    import sys

    import torch.distributed.checkpoint as dcp

    g = torch.Generator().manual_seed(3)
    sd = {f"t{i}": torch.randn(50, 40, generator=g) for i in range(8)}
    sd["w"] = torch.randn(300, 200, generator=g)  # a blob larger than the C pass's window
    for name in ("a", "b"):
        dcp.save(sd, checkpoint_id=str(tmp_path / name), no_dist=True)
    tests = os.path.dirname(os.path.abspath(__file__))
    r = subprocess.run([sys.executable, "-c", _SHRINK_CHILD, str(tmp_path / "a"), tests,
                        str(tmp_path / "b")], capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, (r.returncode, r.stderr[-3000:])
    assert "open: TruncatedFileError" in r.stdout and "load: " in r.stdout, r.stdout
