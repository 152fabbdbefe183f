"""``verify=True`` on checkpoints in S3 (a real moto server behind the fault proxy, as in
test_s3.py): the sidecar written next to the local checkpoint and uploaded with it; every
block a load's ranged GETs touch is hashed before it is copied into place. A clean
checkpoint loads bit-exactly; a flipped byte in a block the load touches raises
ChecksumMismatchError naming the object and tensor, with the model left on meta; a missing
sidecar fails before anything is allocated; ``checksum --verify`` checks an S3 checkpoint."""
from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest
import torch

pytest.importorskip("obstore")
pytest.importorskip("moto.server")
pytest.importorskip("xxhash")

import metamat  # noqa: E402
from metamat.checkpoint import (ChecksumMismatchError, MissingFileError,  # noqa: E402
                                open_checkpoint)
from metamat.checkpoint.checksum import write_manifest  # noqa: E402
from metamat.load import load_targets  # noqa: E402

from _s3server import S3Server, upload_dir  # noqa: E402
from conftest import bits  # noqa: E402
from test_load_verify import (_all_meta, _chunk, _expected, _flip, _meta_net,  # noqa: E402
                              _save, _state, _targets)


@pytest.fixture(scope="module")
def s3():
    srv = S3Server()
    yield srv
    srv.stop()


def _upload(s3, path: str, prefix: str) -> str:
    """The checkpoint (file or directory) and its sidecar under ``prefix``; its URL."""
    if os.path.isdir(path):
        return upload_dir(s3, path, prefix)  # the sidecar sits inside the directory
    name = os.path.basename(path)
    upload_dir(s3, path + ".xxh3.json", f"{prefix}/{name}.xxh3.json")
    return upload_dir(s3, path, f"{prefix}/{name}")


@pytest.mark.parametrize("kind", ["dcp", "safetensors"])
def test_verify_loads_bit_exact(s3, tmp_path, kind):
    path = _save(kind, tmp_path)
    write_manifest(path, block_bytes=4096)  # small blocks: partial blocks at every edge
    url = _upload(s3, path, f"ok-{kind}")
    model = _meta_net()
    rep = metamat.materialize(model, url, device="cpu", verify=True,
                              storage_options=s3.options())
    sd = _state()
    for k, v in model.state_dict().items():
        assert torch.equal(bits(v), bits(sd[k])), k
    assert rep.bytes_verified == rep.bytes_needed == sum(v.numel() * 4 for v in sd.values())
    assert "checksum-verified" in str(rep)


@pytest.mark.parametrize("kind", ["dcp", "safetensors"])
def test_flipped_byte_raises_and_model_stays_meta(s3, tmp_path, kind):
    path = _save(kind, tmp_path)
    write_manifest(path)
    ch = _chunk(path, "emb.weight")
    _flip(ch.file, ch.byte_offset + ch.nbytes // 2 + 3)
    url = _upload(s3, path, f"flip-{kind}")
    obj = url if kind == "safetensors" else f"{url}/{os.path.basename(ch.file)}"
    model = _meta_net()
    with pytest.raises(ChecksumMismatchError) as ei:
        metamat.materialize(model, url, device="cpu", verify=True,
                            storage_options=s3.options())
    assert "'emb.weight'" in str(ei.value) and obj in str(ei.value)
    assert _all_meta(model)


def test_no_manifest_names_the_expected_object(s3, tmp_path):
    url = upload_dir(s3, _save("safetensors", tmp_path), "nomanifest/m.safetensors")
    model = _meta_net()
    with pytest.raises(MissingFileError) as ei:
        metamat.materialize(model, url, device="cpu", verify=True,
                            storage_options=s3.options())
    assert url + ".xxh3.json" in str(ei.value) and "checksum" in str(ei.value)
    assert _all_meta(model)


def test_manifest_of_another_checkpoint_raises_before_reading(s3, tmp_path):
    path = _save("safetensors", tmp_path)
    write_manifest(path)
    from safetensors.torch import save_file
    sd = _state()
    sd["extra"] = torch.zeros(10)  # another layout: the object's size differs
    upload_dir(s3, path + ".xxh3.json", "other/m.safetensors.xxh3.json")
    save_file(sd, path)
    url = upload_dir(s3, path, "other/m.safetensors")
    s3.proxy.clear()
    model = _meta_net()
    with pytest.raises(ChecksumMismatchError, match="manifest recorded"):
        metamat.materialize(model, url, device="cpu", verify=True,
                            ignore_unexpected=["extra"], storage_options=s3.options())
    assert _all_meta(model)


def test_row_block_and_column_slice_verify_whole_blocks(s3, tmp_path):
    """Rank-local reads check whole blocks (their outside parts fetched too): a flipped byte
    the targets do not need, in a block they touch, is caught; one in a block they do not
    touch is never read."""
    path = _save("safetensors", tmp_path)
    write_manifest(path, block_bytes=3008)  # row 1000 starts inside block 63
    url = _upload(s3, path, "rows")
    opts = s3.options()
    tg = _targets()
    st = load_targets(tg, open_checkpoint(url, storage_options=opts), verify=True)
    for t in tg:
        assert torch.equal(bits(t.tensor), bits(_expected(t))), t.fqn
    assert st.bytes_verified >= st.bytes_needed
    assert 0 < st.bytes_reread < 2 * 3 * 3008  # block ends only
    ch = _chunk(path, "emb.weight")
    _flip(ch.file, ch.byte_offset + 1000 * 48 * 4 - 10)  # row 999, the block of row 1000
    url = _upload(s3, path, "rows-999")
    with pytest.raises(ChecksumMismatchError, match="'emb.weight'"):
        load_targets(_targets(), open_checkpoint(url, storage_options=opts), verify=True)
    _flip(ch.file, ch.byte_offset + 1000 * 48 * 4 - 10)
    _flip(ch.file, ch.byte_offset + 5 * 48 * 4)  # row 5: no block the load touches
    url = _upload(s3, path, "rows-5")
    load_targets(_targets(), open_checkpoint(url, storage_options=opts), verify=True)


def test_manifest_of_a_checkpoint_only_in_s3(s3, tmp_path):
    """A checkpoint written straight to S3 gets its manifest from there: ``checksum s3://...
    --out FILE`` (the same digests as one built locally), uploaded as the sidecar, then a
    verified load; metamat itself never writes into the store."""
    path = _save("dcp", tmp_path)
    url = upload_dir(s3, path, "only-s3")
    out = str(tmp_path / "manifest.json")
    env = _cli_env(s3)
    run = [sys.executable, "-m", "metamat", "checksum", url]
    r = subprocess.run(run, capture_output=True, text=True, env=env, timeout=120)
    assert r.returncode == 2 and "--out" in r.stderr
    r = subprocess.run(run + ["--out", f"{url}/m.json"], capture_output=True, text=True,
                       env=env, timeout=120)
    assert r.returncode == 2 and "local path" in r.stderr
    r = subprocess.run(run + ["--out", out, "--block-bytes", "4096"], capture_output=True,
                       text=True, env=env, timeout=120)
    assert r.returncode == 0, r.stderr
    local = str(tmp_path / "local.json")
    write_manifest(path, out=local, block_bytes=4096)
    with open(out) as a, open(local) as b:
        assert json.load(a)["chunks"] == json.load(b)["chunks"]
    with pytest.raises(ValueError, match="does not write into S3"):
        write_manifest(open_checkpoint(url, storage_options=s3.options()))
    upload_dir(s3, out, "only-s3/.metamat-checksums.json")
    model = _meta_net()
    rep = metamat.materialize(model, url, device="cpu", verify=True,
                              storage_options=s3.options())
    assert rep.bytes_verified == rep.bytes_needed > 0


def _cli_env(s3) -> dict:
    return dict(os.environ, AWS_ACCESS_KEY_ID="testing", AWS_SECRET_ACCESS_KEY="testing",
                AWS_ENDPOINT_URL=s3.proxy.url, AWS_REGION="us-east-1", AWS_ALLOW_HTTP="true")


def test_cli_checksum_verify(s3, tmp_path):
    path = _save("dcp", tmp_path)
    write_manifest(path)
    url = _upload(s3, path, "cli-ok")
    ch = _chunk(path, "lin.weight")
    _flip(ch.file, ch.byte_offset + 7)
    bad = _upload(s3, path, "cli-bad")
    env = _cli_env(s3)
    run = [sys.executable, "-m", "metamat", "checksum", "--verify"]
    r = subprocess.run(run + [url], capture_output=True, text=True, env=env, timeout=120)
    assert r.returncode == 0, r.stderr
    assert f"verified {url}/.metamat-checksums.json" in r.stdout
    r = subprocess.run(run + [bad], capture_output=True, text=True, env=env, timeout=120)
    assert r.returncode == 1 and "checksum mismatch" in r.stderr and "'lin.weight'" in r.stderr


def _big(tmp_path, block_bytes=100_000):
    """A 4096 x 256 fp32 tensor (1 KiB rows) in a safetensors file with its manifest; the
    tensor, the path and its chunk."""
    from safetensors.torch import save_file

    big = torch.randn(4096, 256, generator=torch.Generator().manual_seed(3))
    path = str(tmp_path / "big.safetensors")
    save_file({"big": big}, path)
    write_manifest(path, block_bytes=block_bytes)
    return big, path, _chunk(path, "big")


def _rows(r0, n, dtype=torch.float32):
    from metamat.plan import Target

    return Target("big", "big", (4096, 256), (r0, 0), (n, 256), dtype,
                  tensor=torch.empty(n, 256, dtype=dtype))


@pytest.mark.parametrize("order", ["direct-first", "buffered-first"])
def test_a_block_shared_by_a_direct_and_a_buffered_read(s3, tmp_path, order):
    """Rows 0-1999 read straight into place (2 MB fp32) and rows 2000-2099 converted to bf16
    through the buffer share block 20: it is hashed once, from both requests' bytes."""
    big, path, _ = _big(tmp_path)
    url = _upload(s3, path, f"shared-{order}")
    tg = [_rows(0, 2000), _rows(2000, 100, torch.bfloat16)]
    tg = tg if order == "direct-first" else tg[::-1]
    st = load_targets(tg, open_checkpoint(url, storage_options=s3.options()), verify=True)
    by_rows = {t.offsets[0]: t.tensor for t in tg}
    assert torch.equal(by_rows[0], big[:2000])
    assert torch.equal(by_rows[2000], big[2000:2100].bfloat16())
    assert st.bytes_verified == 22 * 100_000  # blocks 0..21
    assert st.bytes_reread == 2_200_000 - 2100 * 1024  # the rest of block 21 only


def test_long_buffered_reads_fetch_no_block_twice(s3, tmp_path):
    """A converting load cut into many 250 kB requests (100 kB blocks straddle their ends):
    each block is assembled from the requests that read it; only the two end blocks' outside
    parts are extra."""
    big, path, _ = _big(tmp_path)
    url = _upload(s3, path, "long")
    t = _rows(1001, 1999, torch.bfloat16)  # bytes [1,025,024, 3,072,000)
    ck = open_checkpoint(url, storage_options=s3.options(part_bytes=250_000))
    st = load_targets([t], ck, verify=True)
    assert torch.equal(t.tensor, big[1001:3000].bfloat16())
    assert st.bytes_verified == 21 * 100_000  # blocks 10..30
    extra = (1001 * 1024 - 1_000_000) + (3_100_000 - 3000 * 1024)
    assert st.bytes_reread == extra
    assert st.bytes_read == st.bytes_needed + extra


def test_direct_reads_hash_in_place_and_fetch_the_cut_blocks_edges(s3, tmp_path):
    """A large contiguous op is read straight into its destination (not widened): the blocks
    inside it are hashed there, and the two blocks its ends cut get their outside parts by
    extra requests; a flipped byte in either part is caught."""
    big, path, ch = _big(tmp_path)

    def load(prefix):
        url = _upload(s3, path, prefix)
        t = _rows(1001, 2000)  # rows 1001..3000: 2 MB, one direct op
        return t, load_targets([t], open_checkpoint(url, storage_options=s3.options()),
                               verify=True)

    t, st = load("direct")
    assert torch.equal(t.tensor, big[1001:3001])
    # blocks 10..30 of the chunk; the cut parts: [1,000,000, 1001 rows) and [3001 rows, 3.1 MB)
    assert st.bytes_verified == 21 * 100_000
    assert st.bytes_reread == (1001 * 1024 - 1_000_000) + (3_100_000 - 3001 * 1024)
    for at in (1_000_010, 2_000_000, 3_099_990):  # edge part before, inside, edge part after
        _flip(ch.file, ch.byte_offset + at)
        with pytest.raises(ChecksumMismatchError, match="'big'"):
            load(f"direct-{at}")
        _flip(ch.file, ch.byte_offset + at)
    _flip(ch.file, ch.byte_offset + 500_000)  # a block the load does not touch
    t, _ = load("direct-untouched")
    assert torch.equal(t.tensor, big[1001:3001])


def test_two_targets_of_the_same_rows(s3, tmp_path):
    """The same rows read twice, straight into place (fp32) and converted through the buffer
    (bf16): overlapping requests; each block is verified once."""
    big, path, _ = _big(tmp_path)
    url = _upload(s3, path, "twice")
    a, b = _rows(1001, 2000), _rows(1501, 1000, torch.bfloat16)
    st = load_targets([a, b], open_checkpoint(url, storage_options=s3.options()), verify=True)
    assert torch.equal(a.tensor, big[1001:3001])
    assert torch.equal(b.tensor, big[1501:2501].bfloat16())
    assert st.bytes_verified == 21 * 100_000  # blocks 10..30, once each
