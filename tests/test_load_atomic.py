"""Loads into already-real models are all-or-nothing (issue: partial writes reported as
"nothing was registered").

By default the bytes of already-real tensors are read into shadow copies that are copied in
only after every rank succeeded, so a failure in a later read (an I/O error, a checksum
mismatch, Ctrl-C, another rank raising) leaves the model exactly as it was. With
``inplace=True`` there is no transient copy, and a failure after writes began raises
``PartialLoadError`` naming what may have changed. Eager TorchRec, DTensor (TP) and plain
models, 1 and 2 ranks.
"""
from __future__ import annotations

import os

import pytest
import torch
from torch import nn

from _dist import run_dist

import metamat
from metamat.checkpoint.checksum import write_manifest


def _bits(model) -> dict:
    out = {}
    for k, v in model.state_dict().items():
        x = v.full_tensor() if hasattr(v, "full_tensor") else v
        if hasattr(x, "local_shards"):
            x = torch.cat([s.tensor.flatten() for s in x.local_shards()]) \
                if x.local_shards() else torch.empty(0)
        out[k] = x.detach().clone()
    return out


def _same(a: dict, b: dict) -> bool:
    return a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


class Plain(nn.Module):
    def __init__(self, device="cpu"):
        super().__init__()
        self.a = nn.Linear(256, 256, device=device)
        self.b = nn.Linear(256, 256, device=device)
        self.register_buffer("steps", torch.zeros(3, device=device))


def _plain_ckpt(d) -> str:
    from safetensors.torch import save_file

    torch.manual_seed(5)
    sd = {k: v.detach() + 1.0 for k, v in Plain().state_dict().items()}
    path = os.path.join(d, "p.safetensors")
    save_file(sd, path)
    return path


@pytest.fixture
def fault(monkeypatch):
    def set_fault(spec):
        monkeypatch.setenv("METAMAT_IO_FAULT", spec)
    return set_fault


@pytest.mark.parametrize("kind", ["eio", "eof"])
def test_plain_eager_failure_leaves_model_unchanged(tmp_path, fault, kind):
    path = _plain_ckpt(tmp_path)
    m = Plain()
    before = _bits(m)
    fault(f"3:{kind}")  # the third pread fails: the first two already landed somewhere
    with pytest.raises(metamat.CheckpointError):
        metamat.materialize(m, path, io_threads=1)
    assert _same(before, _bits(m))
    # and the same load, untroubled, writes every tensor
    os.environ.pop("METAMAT_IO_FAULT")
    rep = metamat.materialize(m, path, io_threads=1)
    assert not _same(before, _bits(m)) and rep.bytes_transient >= rep.bytes_needed


def test_plain_eager_inplace_failure_says_partly_loaded(tmp_path, fault):
    path = _plain_ckpt(tmp_path)
    m = Plain()
    before = _bits(m)
    fault("3:eio")
    with pytest.raises(metamat.PartialLoadError) as ei:
        metamat.materialize(m, path, io_threads=1, inplace=True)
    assert isinstance(ei.value.__cause__, metamat.CheckpointError)
    assert "partly loaded" in str(ei.value) and set(ei.value.written) <= set(before)
    assert ei.value.written and not _same(before, _bits(m))  # it really wrote something


def test_plain_eager_checksum_mismatch_leaves_model_unchanged(tmp_path):
    path = _plain_ckpt(tmp_path)
    write_manifest(path)
    with open(path, "r+b") as f:  # flip one byte of the last tensor's data
        f.seek(os.path.getsize(path) - 5)
        b = f.read(1)
        f.seek(-1, 1)
        f.write(bytes([b[0] ^ 0xFF]))
    m = Plain()
    before = _bits(m)
    with pytest.raises(metamat.checkpoint.ChecksumMismatchError):
        metamat.materialize(m, path, verify=True, io_threads=1)
    assert _same(before, _bits(m))


# ------------------------------------------------------------------------------------------
# 2 ranks: DTensor (TP) and TorchRec eager models, one rank failing


def _tp(rank, world, d, inplace):
    from safetensors.torch import save_file
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor.parallel import (ColwiseParallel, RowwiseParallel,
                                                   parallelize_module)

    mesh = init_device_mesh("cpu", (world,))
    torch.manual_seed(0)
    m = parallelize_module(Plain(), mesh, {"a": ColwiseParallel(), "b": RowwiseParallel()})
    path = os.path.join(d, "tp.safetensors")
    if rank == 0:
        torch.manual_seed(5)
        save_file({k: v.detach() + 2.0 for k, v in Plain().state_dict().items()}, path)
    torch.distributed.barrier()
    before = _bits(m)
    if rank == 1:
        os.environ["METAMAT_IO_FAULT"] = "2:eio"  # only rank 1's read fails
    err = None
    try:
        metamat.materialize(m, path, io_threads=1, inplace=inplace)
    except Exception as e:  # noqa: BLE001
        err = type(e).__name__
    os.environ.pop("METAMAT_IO_FAULT", None)
    return {"err": err, "unchanged": _same(before, _bits(m))}


@pytest.mark.multiprocess
def test_tp_eager_one_rank_fails_both_unchanged(tmp_path):
    r0, r1 = run_dist(_tp, 2, str(tmp_path), False)
    assert r0["err"] == "PeerCheckpointError" and r1["err"] == "ReadError"
    assert r0["unchanged"] and r1["unchanged"]


@pytest.mark.multiprocess
def test_tp_eager_inplace_one_rank_fails_both_say_partial(tmp_path):
    r0, r1 = run_dist(_tp, 2, str(tmp_path), True)
    assert r0["err"] == r1["err"] == "PartialLoadError", (r0, r1)


def _torchrec(rank, world, d):
    import torch.distributed.checkpoint as dcp
    from test_load_torchrec import SAVE_KINDS, _eager, _step, kjt_batch

    eager = _eager(SAVE_KINDS, world)
    _step(eager, kjt_batch(5, batch=8, rows=40, seed=1 + rank))
    path = os.path.join(d, "trec")
    dcp.save({"model": eager.state_dict(), "optim": eager.fused_optimizer.state_dict()},
             checkpoint_id=path)
    torch.distributed.barrier()
    _step(eager, kjt_batch(5, batch=8, rows=40, seed=7 + rank))  # now differs from the file
    before = _bits(eager)
    if rank == 0:
        os.environ["METAMAT_IO_FAULT"] = "4:eof"
    err = None
    try:
        metamat.materialize(eager, path, io_threads=1)
    except Exception as e:  # noqa: BLE001
        err = type(e).__name__
    os.environ.pop("METAMAT_IO_FAULT", None)
    unchanged = _same(before, _bits(eager))
    rep = metamat.materialize(eager, path, io_threads=1)  # untroubled: loads
    return {"err": err, "unchanged": unchanged, "loaded": len(rep.loaded),
            "changed_after": not _same(before, _bits(eager))}


@pytest.mark.multiprocess
def test_torchrec_eager_one_rank_fails_both_unchanged(tmp_path):
    pytest.importorskip("torchrec")
    r0, r1 = run_dist(_torchrec, 2, str(tmp_path))
    assert r0["err"] == "ReadError" and r1["err"] == "PeerCheckpointError", (r0, r1)
    assert r0["unchanged"] and r1["unchanged"]
    assert r0["loaded"] > 0 and r0["changed_after"] and r1["changed_after"]
