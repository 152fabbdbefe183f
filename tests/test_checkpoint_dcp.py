"""DCP checkpoints written by 2 gloo processes with DTensor Shard(0)/Shard(1) (several chunks
per tensor, in several files), then loaded into arbitrary blocks in this process."""
from __future__ import annotations

import os

import pytest
import torch

from metamat.checkpoint import open_checkpoint
from metamat.load import load_targets
from metamat.plan import Target

from _dist import run_dist


def full_state():
    g = torch.Generator().manual_seed(1234)
    return {
        "rw": torch.randn(301, 17, generator=g),        # uneven row shards
        "cw": torch.randn(40, 63, generator=g),         # uneven column shards
        "vec": torch.randn(101, generator=g),           # 1-D sharded
        "rep": torch.randn(9, 4, generator=g),          # replicated: one chunk
        "bf": torch.randn(64, 10, generator=g).bfloat16(),
    }


def _save(rank, world, path, fmt):
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint import FileSystemWriter
    from torch.distributed.checkpoint.filesystem import SerializationFormat
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Replicate, Shard, distribute_tensor
    mesh = init_device_mesh("cpu", (world,))
    sd = full_state()
    place = {"rw": Shard(0), "cw": Shard(1), "vec": Shard(0), "rep": Replicate(), "bf": Shard(1)}
    dsd = {k: distribute_tensor(v, mesh, [place[k]]) for k, v in sd.items()}
    dcp.save(dsd, storage_writer=FileSystemWriter(
        path, serialization_format=SerializationFormat(fmt)))
    return sorted(os.listdir(path))


@pytest.fixture(scope="module", params=["torch_save", "safetensors"])
def dcp_dir(request, tmp_path_factory):
    path = str(tmp_path_factory.mktemp(f"dcp2_{request.param}"))
    run_dist(_save, 2, path, request.param)
    return path


@pytest.mark.multiprocess
def test_two_rank_chunks_are_indexed(dcp_dir):
    ck = open_checkpoint(dcp_dir)
    ents = ck.tensors()
    assert len(ck.files) == 2
    assert [c.offsets for c in sorted(ents["rw"].chunks, key=lambda c: c.offsets)] == [
        (0, 0), (151, 0)]
    assert sorted(c.offsets for c in ents["cw"].chunks) == [(0, 0), (0, 32)]
    assert len(ents["rep"].chunks) == 1


BLOCKS = {
    "rw": [((0, 0), (301, 17)), ((100, 0), (100, 17)), ((140, 0), (30, 17)), ((150, 3), (3, 9)),
           ((300, 16), (1, 1))],
    "cw": [((0, 0), (40, 63)), ((0, 32), (40, 31)), ((5, 20), (30, 20)), ((0, 31), (40, 2))],
    "vec": [((0,), (101,)), ((50,), (2,)), ((13,), (77,))],
    "rep": [((1, 1), (7, 2))],
    "bf": [((0, 0), (64, 10)), ((3, 4), (50, 3))],
}


@pytest.mark.multiprocess
@pytest.mark.parametrize("dst_dtype", [None, torch.float16])
def test_two_rank_blocks_bit_exact(dcp_dir, reader, dst_dtype):
    ck = open_checkpoint(dcp_dir)
    sd = full_state()
    targets, want = [], []
    for name, blocks in BLOCKS.items():
        for offs, shape in blocks:
            dt = dst_dtype or sd[name].dtype
            t = Target(name, name, tuple(sd[name].shape), offs, shape, dt,
                       tensor=torch.full(shape, float("nan"), dtype=dt))
            targets.append(t)
            idx = tuple(slice(o, o + s) for o, s in zip(offs, shape))
            want.append(sd[name][idx].to(dt))
    stats = load_targets(targets, ck, io_threads=2)
    for t, w in zip(targets, want):
        assert torch.equal(t.tensor.view(torch.int16 if w.element_size() == 2 else torch.int32),
                           w.view(torch.int16 if w.element_size() == 2 else torch.int32)), (
            t.fqn, t.offsets)
    assert stats.loaded == len(targets)


@pytest.mark.multiprocess
def test_two_rank_row_blocks_amplification(dcp_dir, reader):
    ck = open_checkpoint(dcp_dir)
    sd = full_state()
    t = Target("rw", "rw", (301, 17), (100, 0), (120, 17), torch.float32,
               tensor=torch.empty(120, 17))
    stats = load_targets([t], ck)
    assert torch.equal(t.tensor, sd["rw"][100:220])
    assert stats.read_amplification <= 1.05


@pytest.mark.parametrize("saved,readable", [(torch.uint8, True), (torch.float16, True),
                                            (torch.int64, False), (torch.bfloat16, False)])
def test_float32_metadata_over_quantized_chunks(tmp_path, saved, readable):
    """TorchRec's quantized ShardedTensors keep ShardedTensor's default float32 in the DCP
    metadata over uint8 rows and float16 scales: read as what the chunks hold. Any other
    disagreement is refused, naming the tensor."""
    import torch.distributed.checkpoint as dcp

    from hostile_gen import dcp_md_edit
    from metamat.checkpoint import DtypeMismatchError

    x = torch.arange(24).reshape(4, 6).to(saved)
    dcp.save({"q": x}, checkpoint_id=str(tmp_path))

    def relabel(md):
        md.state_dict_metadata["q"].properties.dtype = torch.float32
    dcp_md_edit(str(tmp_path), relabel)
    if not readable:
        with pytest.raises(DtypeMismatchError, match="metadata says torch.float32"):
            open_checkpoint(str(tmp_path))
        return
    ck = open_checkpoint(str(tmp_path))
    assert ck.tensors()["q"].dtype == saved
    out = torch.empty(4, 6, dtype=saved)
    load_targets([Target("q", "q", (4, 6), (0, 0), (4, 6), saved, tensor=out)], ck)
    assert torch.equal(out, x)
