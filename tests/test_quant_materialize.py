"""metamat.materialize(quantized TorchRec model on meta, training checkpoint): every byte equal
to TorchRec's own conversion of the same float tables (``quantize_embeddings`` /
``from_float``: fbgemm's op), every inference TBE laid out as TorchRec lays it out on the CPU,
outputs equal; unsharded and sharded with TorchRec's quant sharders (TW/RW/CW); float
checkpoints (torch.save, safetensors, DCP from a training DMP) and quantized ones.
"""
from __future__ import annotations

import os

import pytest
import torch

pytest.importorskip("torchrec")
pytest.importorskip("fbgemm_gpu")

import metamat  # noqa: E402
from metamat.checkpoint import ShapeMismatchError  # noqa: E402
from metamat.load.quantize import QuantizedCheckpointError, quantize_reference  # noqa: E402

from _dist import run_dist  # noqa: E402
from _quant_models import (Model, assert_same_quant_state, batch, ebc_tables, ec_tables,  # noqa: E402
                           feature_rows, float_model, forward, meta_quant, no_meta, quant_plan,
                           quantize, shard, sharder_for, state_bytes)


def save(model, path: str, fmt: str = "torch") -> str:
    sd = {k: v.detach().contiguous() for k, v in model.state_dict().items()}
    if fmt == "torch":
        torch.save(sd, path)
    elif fmt == "safetensors":
        from safetensors.torch import save_file
        save_file(sd, path)
    else:
        import torch.distributed.checkpoint as dcp
        dcp.save(sd, checkpoint_id=path, no_dist=True)
    return path


def check(ref, got, tables, what):
    assert_same_quant_state(ref, got, what)
    names, rows = feature_rows(tables)
    kjt = batch(names, rows)
    assert torch.equal(forward(ref, kjt), forward(got, kjt)), what
    assert no_meta(got), what


@pytest.mark.parametrize("split", [False, True], ids=["rows", "split"])
@pytest.mark.parametrize("qdtype", ["int8", "int4", "int2", "fp16", "fp32"])
def test_unsharded_every_type(tmp_path, qdtype, split):
    tables = ebc_tables()  # dims 8/16/40, a 1-row table
    f = float_model(tables)
    path = save(f, str(tmp_path / "f.pt"))
    q = meta_quant(tables, qdtype, split)
    r = metamat.materialize(q, path)
    check(quantize(f, qdtype, split), q, tables, qdtype)
    assert sorted(r.loaded) == sorted(f.state_dict())
    assert r.bytes_read >= sum(v.numel() * 4 for v in f.state_dict().values())


@pytest.mark.parametrize("qdtype", ["int8", "int4"])
def test_embedding_collection(tmp_path, qdtype):
    tables = ec_tables()
    f = float_model(tables, ec=True)
    path = save(f, str(tmp_path / "f.pt"))
    q = meta_quant(tables, qdtype, False, ec=True)
    metamat.materialize(q, path)
    check(quantize(f, qdtype, False), q, tables, qdtype)


@pytest.mark.parametrize("fmt", ["safetensors", "dcp"])
def test_other_formats(tmp_path, fmt):
    tables = ebc_tables()
    f = float_model(tables, seed=4)
    path = save(f, str(tmp_path / ("f.safetensors" if fmt == "safetensors" else "ck")), fmt)
    q = meta_quant(tables, "int4", True)
    metamat.materialize(q, path)
    check(quantize(f, "int4", True), q, tables, fmt)


def test_fp16_and_bf16_tables(tmp_path):
    """fp16 training tables quantize from fp16 as TorchRec does; bf16 ones (which TorchRec's
    quantization refuses) as their exact float32 values."""
    tables = ebc_tables(fp16=True)
    f = float_model(tables)
    assert f.coll.embedding_bags.t0.weight.dtype == torch.float16
    q = meta_quant(tables, "int8", False)
    metamat.materialize(q, save(f, str(tmp_path / "h.pt")))
    check(quantize(f, "int8", False), q, tables, "fp16")
    sd = {k: (v.to(torch.bfloat16) if "coll" in k else v) for k, v in f.state_dict().items()}
    torch.save(sd, str(tmp_path / "b.pt"))
    f32 = float_model(ebc_tables())
    f32.load_state_dict({k: v.float() for k, v in sd.items()})
    q = meta_quant(ebc_tables(), "int4", False)
    metamat.materialize(q, str(tmp_path / "b.pt"))
    check(quantize(f32, "int4", False), q, ebc_tables(), "bf16")


@pytest.mark.parametrize("kind", ["tw", "rw", "cw"])
@pytest.mark.parametrize("qdtype", ["int8", "int4", "int2"])
def test_sharded(tmp_path, kind, qdtype):
    tables = ebc_tables(dims=(16, 32, 48), rows=(37, 3, 100))
    f = float_model(tables, seed=1)
    path = save(f, str(tmp_path / "f.pt"))
    qref = quantize(f, qdtype, True)
    sharder = sharder_for(kind, tables)
    plan = quant_plan(qref, sharder, 2)
    ref = shard(qref, sharder, plan, 2, "cpu")
    ref.load_state_dict(qref.state_dict())  # TorchRec: the converted model's state, sharded
    got = shard(meta_quant(tables, qdtype, True), sharder, plan, 2, "meta")
    metamat.materialize(got, path)
    check(ref, got, tables, f"{kind} {qdtype}")


def test_sharded_ec(tmp_path):
    tables = ec_tables(dim=32)
    f = float_model(tables, seed=2, ec=True)
    path = save(f, str(tmp_path / "f.pt"))
    qref = quantize(f, "int8", True)
    sharder = sharder_for("rw", tables, ec=True)
    plan = quant_plan(qref, sharder, 2)
    ref = shard(qref, sharder, plan, 2, "cpu")
    ref.load_state_dict(qref.state_dict())
    got = shard(meta_quant(tables, "int8", True, ec=True), sharder, plan, 2, "meta")
    metamat.materialize(got, path)
    check(ref, got, tables, "ec rw")


def test_small_staging_many_rounds(tmp_path):
    """Pieces of a few rows through a 1 MiB budget: the same bytes."""
    tables = ebc_tables(dims=(1024, 8), rows=(3000, 5))
    f = float_model(tables)
    path = save(f, str(tmp_path / "f.pt"))
    q = meta_quant(tables, "int4", False)
    metamat.materialize(q, path, staging_bytes=1 << 20, io_threads=2)
    check(quantize(f, "int4", False), q, tables, "small staging")


def test_int8_odd_dims(tmp_path):
    """TorchRec builds INT8 tables of odd dims (the TBE holds them) but cannot convert floats
    into them (fbgemm's op wants an even row); metamat writes the reference's bytes."""
    from torchrec import EmbeddingBagConfig
    from torchrec.modules.embedding_configs import DataType

    tables = [EmbeddingBagConfig(name=f"t{i}", embedding_dim=d, num_embeddings=r,
                                 feature_names=[f"f{i}"]) for i, (d, r) in
              enumerate(((7, 11), (1, 1), (33, 5)))]
    f = float_model(tables)
    path = save(f, str(tmp_path / "f.pt"))
    qt = [EmbeddingBagConfig(name=t.name, embedding_dim=t.embedding_dim,
                             num_embeddings=t.num_embeddings, feature_names=t.feature_names,
                             data_type=DataType.INT8) for t in tables]
    from torchrec.quant.embedding_modules import EmbeddingBagCollection as QEBC
    q = Model(tables, torch.device("meta"))
    q.coll = QEBC(qt, is_weighted=False, device=torch.device("meta"))
    metamat.materialize(q, path)
    sd = q.coll.state_dict()
    for t in tables:
        w = f.coll.embedding_bags[t.name].weight.detach()
        want = quantize_reference(w.numpy(), 8)
        got = sd[f"embedding_bags.{t.name}.weight"][:, :want.shape[1]].numpy()
        assert (got == want).all(), t.name
    names, rows = feature_rows(tables)
    kjt = batch(names, rows)
    out, ref = forward(q, kjt), forward(f, kjt)
    assert torch.allclose(out, ref, atol=0.1)


def test_quantized_checkpoints_load(tmp_path):
    """A quantized model's own state_dict (split or whole rows, torch.save or safetensors)
    into a quantized model on meta, either format, sharded or not: the same bytes."""
    tables = ebc_tables(dims=(16, 32, 48), rows=(37, 3, 100))
    f = float_model(tables, seed=3)
    for split in (False, True):
        ref = quantize(f, "int8", split)
        sd = {k: v.contiguous() for k, v in ref.state_dict().items() if ".tbes." not in k}
        path = save(type("S", (), {"state_dict": lambda self: sd})(), str(tmp_path / f"q{split}.pt"))
        for into in (False, True):
            q = meta_quant(tables, "int8", into)
            metamat.materialize(q, path)
            check(quantize(f, "int8", into), q, tables, f"{split} -> {into}")
    q4 = quantize(f, "int4", True)
    sd = {k: (v.elem if hasattr(v, "elem") else v).contiguous()
          for k, v in q4.state_dict().items()}
    from safetensors.torch import save_file
    save_file(sd, str(tmp_path / "q4.safetensors"))
    sharder = sharder_for("cw", tables)
    plan = quant_plan(q4, sharder, 2)
    got = shard(meta_quant(tables, "int4", True), sharder, plan, 2, "meta")
    metamat.materialize(got, str(tmp_path / "q4.safetensors"))
    ref = shard(q4, sharder, plan, 2, "cpu")
    ref.load_state_dict(q4.state_dict())
    check(ref, got, tables, "int4 cw from quantized")


@pytest.mark.parametrize("kind", ["rw", "cw"])
def test_a_sharded_models_own_dcp_checkpoint_loads_back(tmp_path, kind):
    """A quant-sharded model's own state_dict saved by DCP (TorchRec's ShardedTensors say
    float32 in the metadata over uint8 rows and float16 scales; torch's dcp.load cannot load it
    back) into the same sharding on meta: the same bytes."""
    import torch.distributed.checkpoint as dcp

    tables = ebc_tables(dims=(16, 32, 48), rows=(37, 3, 100))
    sharder = sharder_for(kind, tables)
    q = meta_quant(tables, "int8", True)
    plan = quant_plan(q, sharder, 2)
    served = shard(q, sharder, plan, 2, "meta")
    metamat.materialize(served, seed=4)
    dcp.save(served.state_dict(), checkpoint_id=str(tmp_path / "own"))
    got = shard(q, sharder, plan, 2, "meta")
    report = metamat.materialize(got, str(tmp_path / "own"))
    assert report.unexpected == [] and report.initialized == []
    check(served, got, tables, f"own {kind} checkpoint")
    if kind == "cw":  # per-column-shard scales: another column split is refused, named
        wider = quant_plan(q, sharder, 2, min_partition=16)
        with pytest.raises(ShapeMismatchError, match=r"weight_qscale.<i>: the checkpoint's "
                           r"table is saved in 4 column shards, this model's in 2"):
            metamat.materialize(shard(q, sharder, wider, 2, "meta"), str(tmp_path / "own"))


def test_quantized_checkpoint_into_float_model_is_refused(tmp_path):
    tables = ebc_tables()
    f = float_model(tables)
    for split in (False, True):
        sd = {k: v.clone() for k, v in quantize(f, "int8", split).state_dict().items()}
        path = str(tmp_path / f"q{split}.pt")
        torch.save(sd, path)
        m = Model(tables, torch.device("meta"))
        with pytest.raises(QuantizedCheckpointError, match="does not dequantize"):
            metamat.materialize(m, path)
        assert m.coll.embedding_bags.t0.weight.is_meta


def test_init_is_the_float_init_quantized():
    """No checkpoint: each table's init drawn as metamat draws the float table of a sharded
    model (a pure function of seed, table name, global row and column), then quantized: equal
    to TorchRec converting those float tables, unsharded or CW-sharded."""
    from metamat.rules import default_table_dist

    tables = ebc_tables(dims=(16, 32, 48), rows=(37, 3, 100))
    f = float_model(tables)
    with torch.no_grad():  # the values a sharded training model gets from metamat (key: table)
        for t in tables:
            metamat.fill_(f.coll.embedding_bags[t.name].weight,
                          default_table_dist(t.num_embeddings), seed=7, key=t.name)
    q = meta_quant(tables, "int4", True)
    metamat.materialize(q, seed=7)
    qref = quantize(f, "int4", True)
    assert_same_quant_state(qref, q, "init", prefix="coll.")
    sharder = sharder_for("cw", tables)
    plan = quant_plan(qref, sharder, 2)
    got = shard(meta_quant(tables, "int4", True), sharder, plan, 2, "meta")
    metamat.materialize(got, seed=7)
    ref = shard(qref, sharder, plan, 2, "cpu")
    ref.load_state_dict(qref.state_dict())
    assert_same_quant_state(ref, got, "init cw", prefix="coll.")


def test_missing_table_and_bad_shapes(tmp_path):
    tables = ebc_tables()
    f = float_model(tables)
    sd = dict(f.state_dict())
    del sd["coll.embedding_bags.t1.weight"]
    torch.save(sd, str(tmp_path / "m.pt"))
    q = meta_quant(tables, "int8", False)
    with pytest.raises(metamat.CheckpointError, match="t1"):
        metamat.materialize(q, str(tmp_path / "m.pt"))
    assert not no_meta(q)
    r = metamat.materialize(q, str(tmp_path / "m.pt"), strict=False, seed=1)
    assert "coll.embedding_bags.t1.weight" not in r.loaded and no_meta(q)
    sd = dict(f.state_dict())
    sd["coll.embedding_bags.t2.weight"] = torch.zeros(100, 41)
    torch.save(sd, str(tmp_path / "s.pt"))
    q = meta_quant(tables, "int8", False)
    with pytest.raises(metamat.CheckpointError, match="shape"):
        metamat.materialize(q, str(tmp_path / "s.pt"))
    assert not no_meta(q)


# ------------------------------------------------------------------------------------------
# a DCP checkpoint of a training DMP (world 2, RW/CW/TW) into quantized models (one process)
# ------------------------------------------------------------------------------------------

def _train_and_save(rank, world_size, path):
    import torch.distributed as dist
    import torch.distributed.checkpoint as dcp
    from test_torchrec_materialize import fused_params, make_plan
    from torchrec import EmbeddingBagCollection
    from torchrec.distributed.embeddingbag import EmbeddingBagCollectionSharder

    tables = ebc_tables(dims=(16, 32, 48), rows=(37, 3, 100))
    ebc = EmbeddingBagCollection(tables=tables, device=torch.device("meta"))
    sharder = EmbeddingBagCollectionSharder(fused_params=fused_params())
    plan = make_plan(ebc, {"t0": "rw", "t1": "tw", "t2": "cw"}, "fused", world_size, sharder,
                     path="coll")
    m = Model(tables, torch.device("meta"))
    m.coll = ebc
    dmp = metamat.shard_on_meta(m, plan=plan, sharders=[sharder])
    metamat.materialize(dmp, seed=11)
    dcp.save(dmp.state_dict(), checkpoint_id=path)
    dist.barrier()
    return True


def test_dcp_of_a_training_dmp(tmp_path):
    path = str(tmp_path / "dcp")
    run_dist(_train_and_save, 2, path)
    tables = ebc_tables(dims=(16, 32, 48), rows=(37, 3, 100))
    f = Model(tables, torch.device("meta"))
    metamat.materialize(f, path)  # the float model, bit for bit (tested elsewhere)
    qref = quantize(f, "int8", True)
    q = meta_quant(tables, "int8", True)
    r = metamat.materialize(q, path)
    check(qref, q, tables, "dcp unsharded")
    assert r.read_amplification == pytest.approx(1.0)
    sharder = sharder_for("cw", tables)
    plan = quant_plan(qref, sharder, 2)
    got = shard(meta_quant(tables, "int8", True), sharder, plan, 2, "meta")
    metamat.materialize(got, path)
    ref = shard(qref, sharder, plan, 2, "cpu")
    ref.load_state_dict(qref.state_dict())
    check(ref, got, tables, "dcp cw")
    assert os.path.isdir(path) and state_bytes(got)


def test_verify_checks_the_quantized_reads(tmp_path):
    """verify=True: the float rows read into the scratch buffer are checked against the
    checkpoint's checksum sidecar like any read; a flipped byte fails the load before
    anything is registered."""
    from metamat.checkpoint.checksum import write_manifest

    tables = ebc_tables()
    f = float_model(tables)
    path = save(f, str(tmp_path / "f.pt"))
    write_manifest(path, block_bytes=4096)
    q = meta_quant(tables, "int4", True)
    r = metamat.materialize(q, path, verify=True)
    assert r.bytes_verified >= sum(v.numel() * 4 for v in f.state_dict().values())
    check(quantize(f, "int4", True), q, tables, "verified")
    with open(path, "r+b") as fh:  # a byte of the last table's rows
        fh.seek(os.path.getsize(path) - 4096)
        b = fh.read(1)
        fh.seek(-1, 1)
        fh.write(bytes([b[0] ^ 0x40]))
    q = meta_quant(tables, "int4", True)
    with pytest.raises(metamat.CheckpointError, match="the manifest says"):
        metamat.materialize(q, path, verify=True)
    assert not no_meta(q)
