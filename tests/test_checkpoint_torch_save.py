"""torch.save archives parsed without loading data (pure Python)."""
from __future__ import annotations

import collections
import io
import zipfile

import pytest
import torch

from metamat.checkpoint import (CheckpointError, InvalidHeaderError, UnsupportedFormatError,
                                open_checkpoint)
from metamat.checkpoint.torch_save import parse_torch_save


def _raw(path, ch):
    with open(path, "rb") as f:
        f.seek(ch.byte_offset)
        return f.read(ch.nbytes)


def test_state_dict_offsets_match_torch_load(tmp_path):
    m = torch.nn.Sequential(torch.nn.Linear(5, 3), torch.nn.Linear(3, 2).to(torch.bfloat16))
    sd = m.state_dict()
    sd["ids"] = torch.arange(7, dtype=torch.int32)
    p = tmp_path / "sd.pt"
    torch.save(sd, p)
    ck = open_checkpoint(p)
    assert ck.format == "torch_save"
    assert set(ck.tensors()) == set(sd)
    for k, v in sd.items():
        e = ck.tensors()[k]
        assert e.dtype == v.dtype and e.global_shape == tuple(v.shape)
        (ch,) = e.chunks
        assert ch.strides is None
        assert _raw(p, ch) == v.contiguous().view(torch.uint8).numpy().tobytes()


def test_views_shared_storage_and_nesting(tmp_path):
    base = torch.arange(60, dtype=torch.float32).reshape(6, 10)
    obj = {"model": collections.OrderedDict(a=base[1:4, 2:7], b=base[5], c=base),
           "step": 3, "param": torch.nn.Parameter(torch.ones(2, 2))}
    p = tmp_path / "v.pt"
    torch.save(obj, p)
    ents = open_checkpoint(p).tensors()
    assert set(ents) == {"model.a", "model.b", "model.c", "param"}
    a = ents["model.a"].chunks[0]
    assert a.strides == (10, 1) and a.sizes == (3, 5)
    assert a.byte_offset == ents["model.c"].chunks[0].byte_offset + (1 * 10 + 2) * 4
    assert ents["model.b"].chunks[0].strides is None


def test_refuses_arbitrary_globals(tmp_path):
    p = tmp_path / "evil.pt"
    torch.save({"x": torch.zeros(2), "f": collections.Counter("ab")}, p)
    with pytest.raises(UnsupportedFormatError, match="Counter"):
        open_checkpoint(p)


def test_corrupt_archives(tmp_path):
    buf = io.BytesIO()
    torch.save({"x": torch.zeros(100)}, buf)
    data = buf.getvalue()
    p = tmp_path / "cut.pt"
    p.write_bytes(data[: len(data) // 2])
    with pytest.raises(InvalidHeaderError, match="cut.pt"):
        open_checkpoint(p)
    # a compressed record
    q = tmp_path / "zipped.pt"
    with zipfile.ZipFile(io.BytesIO(data)) as zin, zipfile.ZipFile(q, "w") as zout:
        for info in zin.infolist():
            zout.writestr(info.filename, zin.read(info), compress_type=zipfile.ZIP_DEFLATED)
    with pytest.raises(UnsupportedFormatError, match="compressed"):
        open_checkpoint(q)
    # legacy (non-zip) format
    r = tmp_path / "legacy.pt"
    torch.save({"x": torch.zeros(2)}, r, _use_new_zipfile_serialization=False)
    with pytest.raises(UnsupportedFormatError, match="legacy"):
        open_checkpoint(r)


def test_blob_inside_a_larger_file(tmp_path):
    buf = io.BytesIO()
    t = torch.randn(3, 4)
    torch.save(t, buf)
    p = tmp_path / "cat.bin"
    p.write_bytes(b"x" * 37 + buf.getvalue() + b"y" * 11)
    arch = parse_torch_save(str(p), base=37, length=len(buf.getvalue()))
    off, n = arch.records[arch.obj.storage.key]
    assert n == 48
    assert p.read_bytes()[off:off + n] == t.numpy().tobytes()
    with pytest.raises(CheckpointError):
        parse_torch_save(str(p), base=36, length=len(buf.getvalue()))
