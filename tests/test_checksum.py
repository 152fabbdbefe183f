"""Checksum sidecars (metamat.checkpoint.checksum): round trip on every format, and a flipped
byte detected naming the file, the tensor and the chunk, by full and by range verification."""
from __future__ import annotations

import json
import os

import pytest
import torch

pytest.importorskip("xxhash")

from metamat.checkpoint import (ChecksumMismatchError, InvalidHeaderError, MissingFileError,
                                open_checkpoint)
from metamat.checkpoint.checksum import (Manifest, build_manifest, read_manifest,
                                         reads_from_plan, sidecar_path, verify_manifest,
                                         verify_ranges, write_manifest)
from metamat.load import plan_load
from metamat.plan import Target

import hostile_gen


@pytest.fixture(scope="module")
def bases(tmp_path_factory):
    return hostile_gen.make_bases(str(tmp_path_factory.mktemp("bases")))


@pytest.fixture(params=["st", "hf", "ts", "dcp", "dcpst"])
def ckpt(request, bases, tmp_path):
    """A private copy of each kind of checkpoint: (path, kind)."""
    import shutil
    src = bases[request.param]
    dst = str(tmp_path / os.path.basename(src))
    (shutil.copytree if os.path.isdir(src) else shutil.copy)(src, dst)
    if request.param == "hf":
        dst = os.path.join(dst, "m.safetensors.index.json")
    return dst, request.param


def _flip(path: str, off: int) -> None:
    with open(path, "r+b") as f:
        f.seek(off)
        b = f.read(1)
        f.seek(off)
        f.write(bytes([b[0] ^ 0x10]))


def test_round_trip_every_format(ckpt):
    path, kind = ckpt
    side = write_manifest(path, block_bytes=64)
    assert side == sidecar_path(path) and os.path.exists(side)
    m = read_manifest(path)
    assert m.to_json() == build_manifest(path, block_bytes=64).to_json()
    ck = open_checkpoint(path)
    assert len(m.chunks) == sum(len(e.chunks) for e in ck.tensors().values())
    assert {c.tensor for c in m.chunks} == set(ck.tensors())
    r = verify_manifest(m)
    assert r.bytes_hashed == sum(c.nbytes for c in m.chunks)
    # the sidecar is itself never mistaken for a checkpoint file
    assert open_checkpoint(path).tensors().keys() == ck.tensors().keys()


def test_flipped_byte_names_file_tensor_chunk(ckpt):
    path, _ = ckpt
    write_manifest(path, block_bytes=32)
    m = read_manifest(path)
    c = next(c for c in m.chunks if c.tensor == "emb")
    f = m.abspath(c.file)
    bad = c.byte_offset + 100  # inside block 3 of emb's chunk
    _flip(f, bad)
    with pytest.raises(ChecksumMismatchError) as ei:
        verify_manifest(m)
    e = ei.value
    assert f in str(e) and "'emb'" in str(e) and str(tuple(c.offsets)) in str(e)
    assert e.chunk == tuple(c.offsets) and e.byte_range == (c.byte_offset + 96,
                                                            c.byte_offset + 128)
    # a read over the damaged block fails, one elsewhere in the same chunk passes
    with pytest.raises(ChecksumMismatchError):
        verify_ranges(m, [(f, bad, 1)])
    ok = verify_ranges(m, [(f, c.byte_offset, 64), (f, c.byte_offset + 160, 40)])
    assert ok.blocks == 4 and ok.uncovered_bytes == 0
    other = next(c2 for c2 in m.chunks if c2.tensor == "vec")
    assert verify_ranges(m, [(other.file, other.byte_offset, other.nbytes)]).blocks == len(
        other.blocks)


def test_verify_ranges_of_a_load_plan(ckpt):
    path, _ = ckpt
    write_manifest(path, block_bytes=48)
    m = read_manifest(path)
    ck = open_checkpoint(path)
    t = Target("emb", "emb", (13, 6), (4, 2), (5, 3), torch.float32,
               tensor=torch.empty(5, 3))
    plan = plan_load([t], ck)
    reads = reads_from_plan(plan)
    r = verify_ranges(m, reads)
    assert r.blocks >= 1 and r.uncovered_bytes == 0
    c = next(c for c in m.chunks if c.tensor == "emb")
    _flip(m.abspath(c.file), c.byte_offset)  # row 0: not read by a block of rows 4-8
    if c.byte_offset + 48 <= reads[0][1]:
        verify_ranges(m, reads)
    _flip(m.abspath(c.file), reads[0][1])
    with pytest.raises(ChecksumMismatchError, match="'emb'"):
        verify_ranges(m, reads)


def test_size_change_and_missing_file(ckpt):
    path, _ = ckpt
    write_manifest(path)
    m = read_manifest(path)
    f = m.abspath(m.chunks[0].file)
    with open(f, "ab") as fh:
        fh.write(b"\0")
    with pytest.raises(ChecksumMismatchError, match="recorded"):
        verify_manifest(m)
    os.remove(f)
    with pytest.raises(MissingFileError):
        verify_manifest(m)


def test_uncovered_bytes_are_counted_not_verified(ckpt):
    path, _ = ckpt
    write_manifest(path)
    m = read_manifest(path)
    c = m.chunks[0]
    r = verify_ranges(m, [(c.file, 0, 8), ("elsewhere.bin", 0, 10)])
    assert r.uncovered_bytes >= 10


@pytest.mark.parametrize("damage", [
    lambda d: "not json",
    lambda d: json.dumps([1]),
    lambda d: json.dumps({**d, "version": 99}),
    lambda d: json.dumps({**d, "block_bytes": 0}),
    lambda d: json.dumps({**d, "chunks": [{"file": "x"}]}),
    lambda d: json.dumps({**d, "chunks": [{**d["chunks"][0], "blocks": []}]}),
])
def test_malformed_manifest(ckpt, damage):
    path, _ = ckpt
    side = write_manifest(path)
    with open(side) as f:
        d = json.load(f)
    with open(side, "w") as f:
        f.write(damage(d))
    with pytest.raises(InvalidHeaderError) as ei:
        read_manifest(path)
    assert side in str(ei.value)


def test_no_sidecar(tmp_path):
    with pytest.raises(MissingFileError):
        read_manifest(str(tmp_path))


def test_manifest_is_plain_json(ckpt):
    path, _ = ckpt
    m = build_manifest(open_checkpoint(path))
    again = Manifest.from_json(json.loads(json.dumps(m.to_json())), m.root, "mem")
    assert again == m


# --- reliability round 2: hostile sidecars, failed writes ------------------------------------

@pytest.fixture
def dcp_copy(bases, tmp_path):
    import shutil
    dst = str(tmp_path / "ck" / "dcp")
    shutil.copytree(bases["dcp"], dst)
    return dst


SECRET = b"top secret bytes outside the checkpoint\n"


@pytest.mark.parametrize("rel", ["../secret.bin", "/etc/passwd", "sub/../../secret.bin",
                                 "__0_0.distcp\0", ""])
def test_sidecar_cannot_name_files_outside(dcp_copy, rel):
    """A hostile sidecar naming ../x, an absolute path or a NUL byte fails before anything is
    hashed, and the error shows neither the file's bytes nor their hash."""
    import xxhash
    from metamat.checkpoint import UnsafePathError
    secret = os.path.join(os.path.dirname(dcp_copy), "secret.bin")
    with open(secret, "wb") as f:
        f.write(SECRET)
    side = write_manifest(dcp_copy)
    with open(side) as f:
        d = json.load(f)
    c = d["chunks"][0]
    d["files"][rel] = d["files"].pop(c["file"])
    c.update(file=rel, byte_offset=0, nbytes=len(SECRET), blocks=["0" * 16])
    with open(side, "w") as f:
        json.dump(d, f)
    with pytest.raises(UnsafePathError) as ei:
        read_manifest(dcp_copy)
    msg = str(ei.value)
    assert side in msg and "secret bytes" not in msg
    assert xxhash.xxh3_64(SECRET).hexdigest() not in msg


def test_sidecar_limits(dcp_copy, monkeypatch):
    from metamat.checkpoint import LimitExceededError
    side = write_manifest(dcp_copy)
    monkeypatch.setenv("METAMAT_MAX_METADATA_BYTES", "100")
    with pytest.raises(LimitExceededError, match="METAMAT_MAX_METADATA_BYTES"):
        read_manifest(dcp_copy)
    monkeypatch.delenv("METAMAT_MAX_METADATA_BYTES")
    with open(side) as f:
        raw = f.read()
    with open(side, "w") as f:
        f.write(raw.replace('"block_bytes":', '"block_bytes":' + "9" * 5000 + ',"x":', 1))
    with pytest.raises(LimitExceededError, match="PYTHONINTMAXSTRDIGITS"):
        read_manifest(dcp_copy)


def _leftovers(d):
    return [f for f in os.listdir(d) if ".tmp" in f]


def test_write_manifest_onto_a_directory(dcp_copy):
    from metamat.checkpoint import WriteError
    os.mkdir(sidecar_path(dcp_copy))
    with pytest.raises(WriteError) as ei:
        write_manifest(dcp_copy)
    assert sidecar_path(dcp_copy) in str(ei.value)
    assert _leftovers(dcp_copy) == []


def test_write_manifest_into_a_read_only_directory(dcp_copy, monkeypatch):
    """Not writable: a WriteError and no temporary file left (as root, where permissions do
    not stop writes, the rename is made to fail instead)."""
    from metamat.checkpoint import WriteError
    if os.geteuid() == 0:
        def refuse(src, dst):
            raise PermissionError(13, "Permission denied")
        monkeypatch.setattr(os, "replace", refuse)
    else:
        os.chmod(dcp_copy, 0o555)
    try:
        with pytest.raises(WriteError, match="Permission denied"):
            write_manifest(dcp_copy)
        assert _leftovers(dcp_copy) == []
    finally:
        os.chmod(dcp_copy, 0o755)


# --- reliability round 3: the sidecar is never written through a planted name ----------------

def _planted(tmp_path, name="victim.txt"):
    victim = tmp_path / name
    victim.write_bytes(b"precious")
    return victim


def test_symlink_at_the_old_temp_name_is_not_followed(dcp_copy, tmp_path):
    """``<sidecar>.tmp<PID>`` (the name used before) is a symlink to a file outside the
    checkpoint: the write must neither follow nor remove it."""
    victim = _planted(tmp_path)
    side = sidecar_path(dcp_copy)
    link = f"{side}.tmp{os.getpid()}"
    os.symlink(victim, link)
    assert write_manifest(dcp_copy) == side
    assert victim.read_bytes() == b"precious"
    assert os.path.islink(link) and not os.path.islink(side)
    assert read_manifest(dcp_copy).chunks


def test_symlink_at_the_sidecar_is_replaced_not_followed(dcp_copy, tmp_path):
    victim = _planted(tmp_path)
    side = sidecar_path(dcp_copy)
    os.symlink(victim, side)
    write_manifest(dcp_copy)
    assert victim.read_bytes() == b"precious"
    assert not os.path.islink(side) and read_manifest(dcp_copy).chunks


def test_sidecar_mode_follows_the_umask(dcp_copy):
    old = os.umask(0o027)
    try:
        side = write_manifest(dcp_copy)
    finally:
        os.umask(old)
    assert os.stat(side).st_mode & 0o777 == 0o640
    assert _leftovers(dcp_copy) == []


def test_cli_checksum_with_symlinks_at_the_next_pids(dcp_copy, tmp_path):
    """The same through ``python -m metamat checksum``, whose PID is not known in advance:
    a symlink at ``<sidecar>.tmp<PID>`` for each of the next 300 PIDs."""
    import subprocess
    import sys
    try:
        with open("/proc/sys/kernel/ns_last_pid") as f:
            last = int(f.read())
    except (OSError, ValueError):
        pytest.skip("no /proc/sys/kernel/ns_last_pid")
    victim = _planted(tmp_path)
    side = sidecar_path(dcp_copy)
    for pid in range(last + 1, last + 301):
        os.symlink(victim, f"{side}.tmp{pid}")
    r = subprocess.run([sys.executable, "-m", "metamat", "checksum", dcp_copy],
                       capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stderr
    assert victim.read_bytes() == b"precious"
    assert read_manifest(dcp_copy).chunks


def test_atomic_write_never_opens_an_existing_name(tmp_path, monkeypatch):
    """The temporary file is created O_EXCL|O_NOFOLLOW (mkstemp): even a temp name that is
    guessed and planted is never opened; the write retries another random name."""
    import tempfile

    from metamat.checkpoint.atomic import atomic_write
    victim = _planted(tmp_path)
    out = str(tmp_path / "d" / "out.json")
    os.mkdir(tmp_path / "d")
    names = iter(["guessed", "fresh"])
    monkeypatch.setattr(tempfile, "_get_candidate_names", lambda: names)
    os.symlink(victim, tmp_path / "d" / ".out.json.guessed.tmp")
    atomic_write(out, b"{}", "test file")
    assert victim.read_bytes() == b"precious"
    with open(out, "rb") as f:
        assert f.read() == b"{}"
    assert sorted(os.listdir(tmp_path / "d")) == [".out.json.guessed.tmp", "out.json"]


def test_a_checkpoint_directory_named_like_a_sidecar(bases, tmp_path):
    """A DCP directory whose name ends in ``.xxh3.json`` is a checkpoint, not a sidecar: its
    manifest is the one inside it."""
    import shutil
    path = str(tmp_path / "run.xxh3.json")
    shutil.copytree(bases["dcp"], path)
    written = write_manifest(path)
    assert written == os.path.join(path, ".metamat-checksums.json")
    assert read_manifest(path).chunks == read_manifest(written).chunks
