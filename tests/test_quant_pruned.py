"""Pruned quantized tables (TorchRec's ``num_embeddings_post_pruning``: the quantized table
keeps the first N rows of the float one, its ids remapped upstream): from a float training
checkpoint each pruned table reads only those rows and equals TorchRec's conversion byte for
byte, outputs equal; without a checkpoint its rows are those of the float table's init
(TorchRec's default bound follows the float table's rows); the quantized model's own
checkpoint reloads; inference-sharded (TW/RW/CW) over the kept rows as TorchRec shards
them; into CUDA inference TBEs on the emulated device."""
from __future__ import annotations

import copy

import pytest
import torch

pytest.importorskip("torchrec")
pytest.importorskip("fbgemm_gpu")

import metamat  # noqa: E402

from _quant_models import (QDTYPES, Model, assert_same_quant_state, batch,  # noqa: E402
                           ebc_tables, float_model, forward, no_meta)

PRUNED = {"t0": 20, "t2": 1}  # of t0's 37 rows and t2's (t1 keeps its one row)


def _quantize(model, qdtype: str, split: bool = False):
    """TorchRec's conversion with its pruning attribute on the collection (of a copy)."""
    from torchrec.distributed.test_utils.infer_utils import quantize as trec_quantize
    from torchrec.quant.embedding_modules import (
        MODULE_ATTR_EMB_CONFIG_NAME_TO_NUM_ROWS_POST_PRUNING_DICT as PRUNE)

    model = copy.deepcopy(model)
    setattr(model.coll, PRUNE, dict(PRUNED))
    return trec_quantize(model, inplace=True, weight_dtype=QDTYPES[qdtype],
                         quant_state_dict_split_scale_bias=split)


def _check(ref, got, tables, what):
    assert_same_quant_state(ref, got, what)
    names = [t.feature_names[0] for t in tables]
    rows = [PRUNED.get(t.name, t.num_embeddings) for t in tables]  # ids of the kept rows
    kjt = batch(names, rows)
    assert torch.equal(forward(ref, kjt), forward(got, kjt)), what
    assert no_meta(got), what


@pytest.mark.parametrize("qdtype,split", [("int8", False), ("int4", True), ("fp16", False)])
def test_from_float_training_checkpoint(tmp_path, qdtype, split):
    tables = ebc_tables(dims=(8, 16, 64), rows=(37, 1, 20_000))  # t2: 5 MB, 1 row kept
    f = float_model(tables, seed=3)
    path = str(tmp_path / "f.pt")
    torch.save({k: v.clone() for k, v in f.state_dict().items()}, path)
    got = _quantize(Model(tables, torch.device("meta")), qdtype, split)
    report = metamat.materialize(got, path)
    _check(_quantize(f, qdtype, split), got, tables, qdtype)
    assert report.initialized == []
    # the pruned rows were not read: of t2's 5 MB, one row
    full = sum(v.numel() * 4 for v in f.state_dict().values())
    assert full > 5_000_000 and report.bytes_read < 1_000_000, report.bytes_read


def test_init_is_the_float_tables_init():
    tables = ebc_tables()
    f = Model(tables, torch.device("meta"))
    metamat.materialize(f, device="cpu", seed=11)
    got = _quantize(Model(tables, torch.device("meta")), "int8")
    metamat.materialize(got, device="cpu", seed=11)
    _check(_quantize(f, "int8"), got, tables, "init")


def test_own_checkpoint_reloads(tmp_path):
    tables = ebc_tables()
    want = _quantize(float_model(tables, seed=5), "int8")
    path = str(tmp_path / "q.pt")
    torch.save({k: v.clone() for k, v in want.state_dict().items()}, path)
    got = _quantize(Model(tables, torch.device("meta")), "int8")
    metamat.materialize(got, path)
    _check(want, got, tables, "own checkpoint")



@pytest.mark.parametrize("kind", ["tw", "rw", "cw"])
def test_quant_sharded(tmp_path, kind):
    """TorchRec shards a pruned table over its kept rows: each rank reads its rows of them."""
    from _quant_models import quant_plan, shard, sharder_for

    tables = ebc_tables(dims=(16, 32, 48), rows=(37, 3, 100))
    f = float_model(tables, seed=1)
    path = str(tmp_path / "f.pt")
    torch.save({k: v.clone() for k, v in f.state_dict().items()}, path)
    qref = _quantize(f, "int8", True)
    sharder = sharder_for(kind, tables)
    plan = quant_plan(qref, sharder, 2)
    ref = shard(qref, sharder, plan, 2, "cpu")
    ref.load_state_dict(qref.state_dict())  # TorchRec: the converted model's state, sharded
    got = shard(_quantize(Model(tables, torch.device("meta")), "int8", True), sharder, plan, 2,
                "meta")
    report = metamat.materialize(got, path)
    _check(ref, got, tables, kind)
    assert report.initialized == []


def test_cuda_inference_tbes_emulated(tmp_path):
    """Into CUDA inference TBEs on the emulated device: the CPU conversion's rows."""
    from _quant_models import tbes

    from metamat.emulation import emulated_cuda

    tables = ebc_tables()
    f = float_model(tables, seed=2)
    path = str(tmp_path / "f.pt")
    torch.save({k: v.clone() for k, v in f.state_dict().items()}, path)
    got = _quantize(Model(tables, torch.device("meta")), "int4")
    with emulated_cuda():
        metamat.materialize(got, path, device="cuda")
    ref = _quantize(f, "int4")
    assert len(tbes(ref)) == len(tbes(got)) > 0
    for x, y in zip(tbes(ref), tbes(got)):
        assert y.weights_host.numel() == 0 and torch.equal(x.weights_host, y.weights_dev)
