"""``verify=True``: every byte a load reads is checked against the checksum sidecar while it
streams. A clean checkpoint loads bit-exactly; one flipped byte in a tensor's data raises
ChecksumMismatchError (a CheckpointError) and leaves a meta model on meta; no manifest raises
before anything is allocated, naming the path it was expected at."""
from __future__ import annotations

import os
import shutil

import pytest
import torch
from torch import nn

pytest.importorskip("xxhash")

import metamat  # noqa: E402
from metamat.load import ops as fill_load  # noqa: E402
from metamat.checkpoint import (CheckpointError, ChecksumMismatchError,  # noqa: E402
                                MissingFileError, open_checkpoint)
from metamat.checkpoint.checksum import read_manifest, sidecar_path, write_manifest  # noqa: E402
from metamat.load import load_targets  # noqa: E402
from metamat.plan import Target  # noqa: E402

from conftest import bits  # noqa: E402


class Net(nn.Module):
    def __init__(self):
        super().__init__()
        self.emb = nn.Embedding(3000, 48)
        self.lin = nn.Linear(48, 16)


def _meta_net() -> Net:
    with torch.device("meta"):
        return Net()


def _state() -> dict:
    g = torch.Generator().manual_seed(0)
    return {"emb.weight": torch.randn(3000, 48, generator=g),
            "lin.weight": torch.randn(16, 48, generator=g),
            "lin.bias": torch.randn(16, generator=g)}


def _save(kind: str, root) -> str:
    sd = _state()
    if kind == "dcp":
        import torch.distributed.checkpoint as dcp
        path = os.path.join(str(root), "dcp")
        with pytest.warns(UserWarning):  # single process, no group: DCP warns
            dcp.save(sd, checkpoint_id=path)
        return path
    from safetensors.torch import save_file
    path = os.path.join(str(root), "m.safetensors")
    save_file(sd, path)
    return path


def _flip(path: str, off: int) -> None:
    with open(path, "r+b") as f:
        f.seek(off)
        b = f.read(1)
        f.seek(off)
        f.write(bytes([b[0] ^ 0x04]))


def _chunk(path: str, name: str):
    return open_checkpoint(path).tensors()[name].chunks[0]


def _all_meta(model) -> bool:
    return all(t.is_meta for t in list(model.parameters()) + list(model.buffers()))


KINDS = ["dcp", "safetensors"]
# rename= sends a plain model down the DTensor path; without it, the TorchRec path
PATHS = {"torchrec": {}, "dtensor": {"rename": {}}}


@pytest.mark.parametrize("via", sorted(PATHS))
@pytest.mark.parametrize("kind", KINDS)
def test_verify_loads_bit_exact(tmp_path, kind, via):
    path = _save(kind, tmp_path)
    write_manifest(path, block_bytes=4096)  # small blocks: partial blocks at every edge
    model = _meta_net()
    rep = metamat.materialize(model, path, device="cpu", verify=True, **PATHS[via])
    sd = _state()
    for k, v in model.state_dict().items():
        assert torch.equal(bits(v), bits(sd[k])), k
    assert rep.bytes_verified == rep.bytes_needed == sum(v.numel() * 4 for v in sd.values())
    assert "checksum-verified" in str(rep)


@pytest.mark.parametrize("via", sorted(PATHS))
@pytest.mark.parametrize("kind", KINDS)
def test_flipped_byte_raises_and_model_stays_meta(tmp_path, kind, via):
    path = _save(kind, tmp_path)
    write_manifest(path)
    ch = _chunk(path, "emb.weight")
    _flip(ch.file, ch.byte_offset + ch.nbytes // 2 + 3)
    model = _meta_net()
    with pytest.raises(ChecksumMismatchError) as ei:
        metamat.materialize(model, path, device="cpu", verify=True, **PATHS[via])
    assert isinstance(ei.value, CheckpointError)
    assert "'emb.weight'" in str(ei.value) and ch.file in str(ei.value)
    assert _all_meta(model)
    # without verify the damaged byte is loaded as it is (the check is what catches it)
    metamat.materialize(model, path, device="cpu", **PATHS[via])
    assert not torch.equal(bits(model.emb.weight), bits(_state()["emb.weight"]))


@pytest.mark.parametrize("via", sorted(PATHS))
def test_no_manifest_names_the_expected_path(tmp_path, via):
    path = _save("safetensors", tmp_path)
    model = _meta_net()
    with pytest.raises(MissingFileError) as ei:
        metamat.materialize(model, path, device="cpu", verify=True, **PATHS[via])
    assert sidecar_path(path) in str(ei.value) and "checksum" in str(ei.value)
    assert _all_meta(model)


def test_manifest_of_another_checkpoint_raises(tmp_path):
    path = _save("safetensors", tmp_path)
    write_manifest(path)
    from safetensors.torch import save_file
    sd = _state()
    sd["extra"] = torch.zeros(10)  # another layout: offsets and file size change
    save_file(sd, path)
    model = _meta_net()
    with pytest.raises(ChecksumMismatchError):
        metamat.materialize(model, path, device="cpu", verify=True, ignore_unexpected=["extra"])
    assert _all_meta(model)


# ------------------------------------------------------------------------------------------
# load_targets: row blocks, column slices, dtype conversion, batches, the staging ring


def _targets(dtype=torch.float32):
    """Rows 1000..2199 (a row block), columns 8..29 of rows 100..399 (strided), a bias."""
    return [Target("emb.weight", "emb.weight", (3000, 48), (1000, 0), (1200, 48), dtype,
                   tensor=torch.empty(1200, 48, dtype=dtype)),
            Target("lin.weight", "lin.weight", (16, 48), (0, 8), (16, 22), dtype,
                   tensor=torch.empty(16, 22, dtype=dtype)),
            Target("lin.bias", "lin.bias", (16,), (4,), (12,), dtype,
                   tensor=torch.empty(12, dtype=dtype))]


def _expected(t: Target) -> torch.Tensor:
    v = _state()[t.fqn]
    for d, (o, n) in enumerate(zip(t.offsets, t.local_shape)):
        v = v.narrow(d, o, n)
    return v.to(t.dtype)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("staged", [False, True])
@pytest.mark.parametrize("batch", [64 << 20, 40000])  # 40 kB: many batches, split ops
def test_load_targets_verify(tmp_path, monkeypatch, dtype, staged, batch):
    monkeypatch.setattr(fill_load, "BATCH_BYTES", batch)
    path = _save("safetensors", tmp_path)
    write_manifest(path, block_bytes=3008)  # row 1000 starts inside block 63
    ck = open_checkpoint(path)
    tg = _targets(dtype)
    st = load_targets(tg, ck, verify=True, staged=staged, staging_bytes=1 << 19)
    for t in tg:
        assert torch.equal(bits(t.tensor), bits(_expected(t))), t.fqn
    assert st.bytes_verified >= st.bytes_needed
    if dtype == torch.float32 and not staged:
        # the row block is hashed in place: only block ends and the column slice re-read
        assert st.bytes_reread < 0.1 * st.bytes_verified
    # a byte the targets do not need, in a block they touch: caught (whole blocks are checked)
    ch = _chunk(path, "emb.weight")
    _flip(ch.file, ch.byte_offset + 1000 * 48 * 4 - 10)  # row 999, same block as row 1000
    with pytest.raises(ChecksumMismatchError, match="'emb.weight'"):
        load_targets(_targets(dtype), open_checkpoint(path), verify=True, staged=staged,
                     staging_bytes=1 << 19)
    _flip(ch.file, ch.byte_offset + 1000 * 48 * 4 - 10)
    # a byte in no block the load touches (row 5): not read, not checked
    _flip(ch.file, ch.byte_offset + 5 * 48 * 4)
    load_targets(_targets(dtype), open_checkpoint(path), verify=True, staged=staged,
                 staging_bytes=1 << 19)


def test_verify_argument_forms(tmp_path):
    path = _save("safetensors", tmp_path)
    ck = open_checkpoint(path)
    with pytest.raises(MissingFileError, match="checksum manifest"):
        load_targets(_targets(), ck, verify=True)
    write_manifest(path)
    m = read_manifest(path)
    assert load_targets(_targets(), ck, verify=m).bytes_verified > 0
    assert load_targets(_targets(), ck).bytes_verified == 0
    with pytest.raises(TypeError):
        load_targets(_targets(), ck, verify="yes")
    with pytest.raises(ValueError, match="needs a checkpoint"):
        metamat.materialize(_meta_net(), verify=True)


# ------------------------------------------------------------------------------------------
# a TorchRec DMP on meta, DCP written by an eager DMP


def _worker_torchrec(rank, world_size, tmp):
    import torch.distributed.checkpoint as dcp

    from test_load_torchrec import _eager, _on_meta
    from test_torchrec_materialize import assemble, ebc_tables, local_blocks, meta_bytes_of

    kinds = {"t0": "rw", "t1": "tw", "t2": "cw"}
    tables = ebc_tables(n=3, rows=4000, dim=16)
    eager = _eager(kinds, world_size, tables)
    ckpt = os.path.join(tmp, "ckpt")
    dcp.save({"model": eager.state_dict(), "optim": eager.fused_optimizer.state_dict()},
             checkpoint_id=ckpt)
    saved = local_blocks(eager.state_dict())
    write_manifest(ckpt, block_bytes=8192)
    res = {}
    meta = _on_meta({"t0": "tw", "t1": "rw", "t2": "rw"}, world_size, tables)
    rep = metamat.materialize(meta, ckpt, device="cpu", verify=True)
    loaded = local_blocks(meta.state_dict())
    res["clean_equal"] = all(
        torch.equal(assemble([saved], k, (4000 + 3 * i, 16)).view(torch.int32),
                    assemble([loaded], k, (4000 + 3 * i, 16)).view(torch.int32))
        for i, k in enumerate(sorted(saved)))
    res["keys"] = sorted(saved)
    res["verified"] = (rep.bytes_verified, rep.bytes_needed)
    # flip a byte inside table t1's data
    e = open_checkpoint(ckpt).tensors()["model.embedding_bags.t1.weight"]
    ch = e.chunks[0]
    _flip(ch.file, ch.byte_offset + ch.nbytes // 3)
    meta2 = _on_meta({"t0": "tw", "t1": "rw", "t2": "rw"}, world_size, tables)
    try:
        metamat.materialize(meta2, ckpt, device="cpu", verify=True)
        res["err"] = None
    except CheckpointError as err:
        res["err"] = f"{type(err).__name__}: {err}"
    res["meta_after"] = meta_bytes_of(meta2)
    return res


@pytest.mark.multiprocess
def test_torchrec_dcp_verify(tmp_path):
    pytest.importorskip("torchrec")
    from _dist import run_dist

    (r,) = run_dist(_worker_torchrec, 1, str(tmp_path))
    assert r["clean_equal"] and len(r["keys"]) == 3
    assert r["verified"][0] >= r["verified"][1] > 0
    assert r["err"] is not None and r["err"].startswith("ChecksumMismatchError")
    assert "embedding_bags.t1.weight" in r["err"]
    assert r["meta_after"][1] < 1024  # nothing real allocated: the model is still on meta
