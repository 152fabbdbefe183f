"""metamat.checkpoint.limits and .access: path containment, JSON, short reprs, limits."""
import os

import pytest

from metamat.checkpoint import (InvalidHeaderError, LimitExceededError, ReadError,
                                UnsafePathError)
from metamat.checkpoint.access import contained_path, open_regular, read_metadata_file
from metamat.checkpoint.limits import METADATA_BYTES, check, limit, loads_json, short_repr


@pytest.mark.parametrize("rel", ["a.bin", "sub/a.bin", "sub/../a.bin", "./a.bin"])
def test_contained_paths_accepted(tmp_path, rel):
    assert contained_path(str(tmp_path), rel, "entry", "idx") == os.path.normpath(
        os.path.join(str(tmp_path), rel))


@pytest.mark.parametrize("rel,why", [
    ("../a.bin", "leaves"), ("sub/../../a.bin", "leaves"), (".", "leaves"), ("..", "leaves"),
    ("/etc/passwd", "absolute"), ("a\0b", "NUL"), ("", "not a file name"),
    (7, "not a file name"), (None, "not a file name")])
def test_uncontained_paths_refused(tmp_path, rel, why):
    with pytest.raises(UnsafePathError, match=why) as ei:
        contained_path(str(tmp_path), rel, "entry", "idx.json", tensor="w")
    assert "idx.json" in str(ei.value) and "'w'" in str(ei.value)


def test_sibling_directory_with_common_prefix_is_outside(tmp_path):
    root = tmp_path / "ck"
    with pytest.raises(UnsafePathError):
        contained_path(str(root), "../ck2/a.bin", "entry", "idx")


def test_loads_json_errors():
    with pytest.raises(InvalidHeaderError, match="UTF-8 \\(at byte 1\\)") as ei:
        loads_json(b"{\xff}", "index", "f")
    assert "xff" not in str(ei.value)
    with pytest.raises(InvalidHeaderError, match="not valid JSON"):
        loads_json(b"{", "index", "f")
    with pytest.raises(InvalidHeaderError, match="nested more than 100 levels"):
        loads_json(b"[" * 100000 + b"]" * 100000, "index", "f")
    with pytest.raises(LimitExceededError, match="PYTHONINTMAXSTRDIGITS") as ei:
        loads_json(b"[" + b"1" * 4301 + b"]", "index", "f")
    assert ei.value.env == "PYTHONINTMAXSTRDIGITS"
    assert loads_json(b'{"a": [1, 2]}', "index", "f") == {"a": [1, 2]}


def test_json_depth_is_refused_alike_on_every_python(monkeypatch):
    """3.11's json parses 150 levels and raises near 1,000; 3.12's parses 5,000: the limit,
    not the interpreter, decides."""
    nest = lambda n: b'{"m": ' + b"[" * (n - 1) + b"]" * (n - 1) + b"}"  # noqa: E731
    assert loads_json(nest(100), "index", "f")["m"]
    for n in (101, 150, 900, 5000):
        with pytest.raises(InvalidHeaderError, match="nested more than 100 levels.*"
                           "METAMAT_MAX_JSON_DEPTH"):
            loads_json(nest(n), "index", "f")
    # brackets inside strings only raise the bound that decides whether to walk at all
    assert loads_json(b'{"k": "' + b"[" * 500 + b'"}', "index", "f") == {"k": "[" * 500}
    monkeypatch.setenv("METAMAT_MAX_JSON_DEPTH", "200")
    assert loads_json(nest(150), "index", "f")["m"]
    with pytest.raises(InvalidHeaderError, match="more than 200"):
        loads_json(nest(201), "index", "f")


def test_short_repr_bounds():
    assert short_repr("x" * 1000).endswith("...") and len(short_repr("x" * 1000)) < 100
    assert short_repr(10 ** 5000).startswith("<int of")
    deep = []
    for _ in range(10000):
        deep = [deep]
    assert short_repr(deep) == "<list>"
    assert short_repr("F32") == "'F32'"


def test_limit_variable(monkeypatch):
    assert limit(METADATA_BYTES) == METADATA_BYTES[2]
    monkeypatch.setenv("METAMAT_MAX_METADATA_BYTES", "10")
    assert limit(METADATA_BYTES) == 10
    with pytest.raises(LimitExceededError) as ei:
        check(METADATA_BYTES, 11, file="f", what="x size")
    e = ei.value
    assert (e.limit, e.value, e.maximum, e.env) == ("metadata bytes", 11, 10,
                                                    "METAMAT_MAX_METADATA_BYTES")
    assert "METAMAT_MAX_METADATA_BYTES=N" in str(e)
    monkeypatch.setenv("METAMAT_MAX_METADATA_BYTES", "ten")
    with pytest.raises(ValueError, match="positive integer"):
        limit(METADATA_BYTES)


def test_read_metadata_file_and_open_regular(tmp_path, monkeypatch):
    p = tmp_path / "m.json"
    p.write_bytes(b"{}" * 100)
    assert read_metadata_file(str(p), "index") == b"{}" * 100
    monkeypatch.setenv("METAMAT_MAX_METADATA_BYTES", "199")
    with pytest.raises(LimitExceededError, match="index size"):
        read_metadata_file(str(p), "index")
    with pytest.raises(ReadError, match="is a directory"):
        open_regular(str(tmp_path), "index")
    os.mkfifo(tmp_path / "fifo")
    with pytest.raises(ReadError, match="is a FIFO"):
        open_regular(str(tmp_path / "fifo"), "index")
    with pytest.raises(ReadError, match="character device"):
        open_regular("/dev/null", "index")
