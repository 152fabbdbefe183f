"""safetensors parsing: real files from the safetensors library, then hostile variants.

Pure Python (no extension needed): only headers are parsed.
"""
from __future__ import annotations

import json
import os
import struct

import pytest
import torch
from safetensors.torch import save_file

from metamat.checkpoint import (CheckpointError, DtypeMismatchError, HeaderTooLargeError,
                                InvalidHeaderError, InvalidOffsetError, MissingFileError,
                                MissingTensorError, TruncatedFileError, open_checkpoint)
from metamat.checkpoint.safetensors import read_header


def _write_raw(path, header: dict, data: bytes, pad: int = 0) -> str:
    h = json.dumps(header).encode() + b" " * pad
    with open(path, "wb") as f:
        f.write(struct.pack("<Q", len(h)) + h + data)
    return str(path)


@pytest.fixture
def st_file(tmp_path):
    sd = {
        "emb.weight": torch.randn(13, 7),
        "bias": torch.randn(7).to(torch.bfloat16),
        "ids": torch.arange(5, dtype=torch.int64),
        "scalar": torch.tensor(3.5),
        "empty": torch.empty(0, 4),
    }
    p = tmp_path / "m.safetensors"
    save_file(sd, str(p))
    return str(p), sd


def _bytes_at(path, off, n):
    with open(path, "rb") as f:
        f.seek(off)
        return f.read(n)


def test_single_file_offsets_point_at_the_data(st_file):
    path, sd = st_file
    ck = open_checkpoint(path)
    assert ck.format == "safetensors"
    ents = ck.tensors()
    assert set(ents) == set(sd)
    for k, v in sd.items():
        e = ents[k]
        assert e.dtype == v.dtype and e.global_shape == tuple(v.shape)
        (ch,) = e.chunks
        raw = _bytes_at(path, ch.byte_offset, ch.nbytes)
        assert raw == v.reshape(-1).contiguous().view(torch.uint8).numpy().tobytes()


def test_index_json_shard_set(tmp_path):
    a = {"x": torch.randn(4, 3), "y": torch.randn(2)}
    b = {"z": torch.randn(5, 5).half()}
    save_file(a, str(tmp_path / "model-00001-of-00002.safetensors"))
    save_file(b, str(tmp_path / "model-00002-of-00002.safetensors"))
    wm = {k: "model-00001-of-00002.safetensors" for k in a}
    wm.update({k: "model-00002-of-00002.safetensors" for k in b})
    (tmp_path / "model.safetensors.index.json").write_text(
        json.dumps({"metadata": {"total_size": 0}, "weight_map": wm}))
    for p in (tmp_path, tmp_path / "model.safetensors.index.json"):
        ck = open_checkpoint(p)
        assert set(ck.tensors()) == {"x", "y", "z"}
        assert len(ck.files) == 2
    # the index names a tensor its shard lacks
    wm["ghost"] = "model-00001-of-00002.safetensors"
    (tmp_path / "model.safetensors.index.json").write_text(json.dumps({"weight_map": wm}))
    with pytest.raises(MissingTensorError, match="ghost"):
        open_checkpoint(tmp_path)
    # the index names a shard that does not exist
    wm["ghost"] = "nope.safetensors"
    (tmp_path / "model.safetensors.index.json").write_text(json.dumps({"weight_map": wm}))
    with pytest.raises(MissingFileError, match="nope.safetensors"):
        open_checkpoint(tmp_path)


def test_directory_of_shards_without_index(tmp_path):
    save_file({"a": torch.zeros(2)}, str(tmp_path / "s1.safetensors"))
    save_file({"b": torch.zeros(3)}, str(tmp_path / "s2.safetensors"))
    assert set(open_checkpoint(tmp_path).tensors()) == {"a", "b"}
    save_file({"a": torch.zeros(2)}, str(tmp_path / "s3.safetensors"))
    with pytest.raises(InvalidHeaderError, match="'a'"):
        open_checkpoint(tmp_path)


# ---- hostile files: each malformation has its own named error naming the file ----

GOOD = {"t": {"dtype": "F32", "shape": [2, 2], "data_offsets": [0, 16]}}


@pytest.mark.parametrize("header,data,err,match", [
    ({"t": {"dtype": "F33", "shape": [2, 2], "data_offsets": [0, 16]}}, b"\0" * 16,
     DtypeMismatchError, "unknown dtype"),
    ({"t": {"dtype": "F32", "shape": [2, 3], "data_offsets": [0, 16]}}, b"\0" * 16,
     InvalidOffsetError, "needs 24"),
    ({"t": {"dtype": "F32", "shape": [2, 2], "data_offsets": [0, 16]}}, b"\0" * 8,
     TruncatedFileError, "needs 16"),
    ({"t": {"dtype": "F32", "shape": [2, 2], "data_offsets": [0, 16]}}, b"\0" * 20,
     InvalidOffsetError, "trailing"),
    ({"t": {"dtype": "F32", "shape": [2, 2], "data_offsets": [4, 20]}}, b"\0" * 20,
     InvalidOffsetError, "hole or overlap"),
    ({"t": {"dtype": "F32", "shape": [2], "data_offsets": [0, 8]},
      "u": {"dtype": "F32", "shape": [2], "data_offsets": [4, 12]}}, b"\0" * 12,
     InvalidOffsetError, "hole or overlap"),
    ({"t": {"dtype": "F32", "shape": [-2, 2], "data_offsets": [0, 16]}}, b"\0" * 16,
     InvalidHeaderError, "bad shape"),
    ({"t": {"dtype": "F32", "shape": [2, 2], "data_offsets": [16, 0]}}, b"\0" * 16,
     InvalidOffsetError, "bad data_offsets"),
    ({"t": {"dtype": "F32", "shape": [2, 2]}}, b"\0" * 16, InvalidOffsetError, "bad data_"),
    ({"__metadata__": {"a": 1}, **GOOD}, b"\0" * 16, InvalidHeaderError, "__metadata__"),
])
def test_hostile_headers(tmp_path, header, data, err, match):
    p = _write_raw(tmp_path / "bad.safetensors", header, data)
    with pytest.raises(err, match=match) as ei:
        open_checkpoint(p)
    assert "bad.safetensors" in str(ei.value)
    assert isinstance(ei.value, CheckpointError)


def test_header_length_past_end_and_too_large(tmp_path):
    p = tmp_path / "h.safetensors"
    p.write_bytes(struct.pack("<Q", 1000) + b'{"t": 1}')
    with pytest.raises(HeaderTooLargeError, match="past the end"):
        read_header(str(p))
    p.write_bytes(struct.pack("<Q", 10 ** 12) + b"{" + b" " * 10)
    with pytest.raises(HeaderTooLargeError, match="above the 100000000 B limit") as ei:
        read_header(str(p))
    assert str(10 ** 12) not in str(ei.value)


def test_header_length_of_a_foreign_file_is_not_printed(tmp_path):
    """The 8 length bytes of a file that is not safetensors are someone else's data."""
    secret = b"hunter2!"  # 8 bytes read as a little-endian length
    n = struct.unpack("<Q", secret)[0]
    for tail in (b"", b"x" * 100):
        p = tmp_path / "notes.safetensors"
        p.write_bytes(secret + tail)
        with pytest.raises(HeaderTooLargeError) as ei:
            open_checkpoint(str(p))
        assert "not a safetensors file" in str(ei.value)
        assert str(n) not in str(ei.value) and "hunter" not in str(ei.value)


def test_not_json_and_not_object(tmp_path):
    p = tmp_path / "j.safetensors"
    h = b"{not json"
    p.write_bytes(struct.pack("<Q", len(h)) + h)
    with pytest.raises(InvalidHeaderError, match="JSON"):
        open_checkpoint(p)
    h = b"[1, 2]"
    p.write_bytes(struct.pack("<Q", len(h)) + h)
    with pytest.raises(InvalidHeaderError):
        read_header(str(p))


def test_truncated_real_file(st_file, tmp_path):
    path, _ = st_file
    with open(path, "rb") as f:
        data = f.read()
    for cut in (4, 12, len(data) - 3):
        q = tmp_path / f"cut{cut}.safetensors"
        q.write_bytes(data[:cut])
        with pytest.raises(CheckpointError) as ei:
            open_checkpoint(q)
        assert f"cut{cut}.safetensors" in str(ei.value)


def test_padding_after_header_is_allowed(tmp_path):
    p = _write_raw(tmp_path / "pad.safetensors", GOOD, b"\1" * 16, pad=5)
    (ch,) = open_checkpoint(p).tensors()["t"].chunks
    assert ch.byte_offset == os.path.getsize(p) - 16
