"""Quantized feature-processed collections (TorchRec's quantized
``FeatureProcessedEmbeddingBagCollection``: position-weighted features served from quantized
tables), on meta, from a float training checkpoint: tables equal TorchRec's own conversion
byte for byte, position weights loaded from the float module's ``_feature_processors`` (each
rank's copy under inference sharding), outputs equal; the quantized model's own checkpoint
reloads; without a checkpoint the tables get the quantized initial values of the float model
and the position weights TorchRec's ones. Into CUDA inference TBEs on the emulated device, and
on a GPU (``cuda``) against TorchRec's conversion there."""
from __future__ import annotations

import copy

import pytest
import torch
from torch import nn

pytest.importorskip("torchrec")
pytest.importorskip("fbgemm_gpu")

import metamat  # noqa: E402

from _quant_models import (QDTYPES, assert_same_quant_state, batch, ebc_tables,  # noqa: E402
                           no_meta, propagate_device, quant_plan, shard)

MAX_LEN = 5


class FPModel(nn.Module):
    """A weighted EBC with position weights under ``coll`` and a dense layer."""

    def __init__(self, tables, device) -> None:
        super().__init__()
        from torchrec import EmbeddingBagCollection
        from torchrec.modules.feature_processor_ import PositionWeightedModuleCollection
        from torchrec.modules.fp_embedding_modules import FeatureProcessedEmbeddingBagCollection

        device = torch.device(device)
        ebc = EmbeddingBagCollection(tables=tables, is_weighted=True, device=device)
        weights = PositionWeightedModuleCollection(
            max_feature_lengths={t.feature_names[0]: MAX_LEN for t in tables}, device=device)
        self.coll = FeatureProcessedEmbeddingBagCollection(ebc, weights)
        self.dense = nn.Linear(4, 2, device=device)

    def forward(self, kjt):
        return self.coll(kjt)


def float_model(tables, seed: int = 0) -> FPModel:
    """Trained-looking: random tables and position weights (not TorchRec's init)."""
    torch.manual_seed(seed)
    m = FPModel(tables, "cpu")
    with torch.no_grad():
        for v in m.state_dict().values():
            v.copy_(torch.randn(v.shape))
    return m


def quantize(model: nn.Module, qdtype: str, split: bool) -> nn.Module:
    """TorchRec's conversion of the feature-processed collection (of a copy). Its
    ``from_float`` reads the split-scale/bias mode from the inner EmbeddingBagCollection."""
    from torchrec import EmbeddingBagCollection
    from torchrec.distributed.test_utils.infer_utils import quantize_fpebc
    from torchrec.quant.embedding_modules import (
        quant_prep_enable_quant_state_dict_split_scale_bias_for_types as split_mode)

    model = copy.deepcopy(model)
    if split:
        split_mode(model, [EmbeddingBagCollection])
    return quantize_fpebc(model, inplace=True, weight_dtype=QDTYPES[qdtype],
                          quant_state_dict_split_scale_bias=split)


def forward(model: nn.Module, tables) -> torch.Tensor:
    kjt = batch([t.feature_names[0] for t in tables], [t.num_embeddings for t in tables])
    with propagate_device(), torch.no_grad():  # inference: position weights require grad
        out = model.coll(kjt)
    out = out.wait() if hasattr(out, "wait") else out
    return out.to_dict() if hasattr(out, "to_dict") else out


def check(ref, got, tables, what: str) -> None:
    assert_same_quant_state(ref, got, what)
    a, b = forward(ref, tables), forward(got, tables)
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a), what
    assert no_meta(got), what


def save(model, path: str) -> str:
    torch.save({k: v.detach().clone() for k, v in model.state_dict().items()}, path)
    return path


@pytest.mark.parametrize("qdtype,split", [("int8", False), ("int4", False), ("int2", True),
                                          ("fp16", False), ("int8", True)])
def test_from_float_training_checkpoint(tmp_path, qdtype, split):
    tables = ebc_tables()  # dims 8/16/40, a 1-row table
    f = float_model(tables)
    path = save(f, str(tmp_path / "f.pt"))
    q = quantize(FPModel(tables, "meta"), qdtype, split)
    report = metamat.materialize(q, path)
    check(quantize(f, qdtype, split), q, tables, qdtype)
    # every float tensor used: the tables and the position weights under their training names
    assert report.initialized == [] and len(report.loaded) == len(f.state_dict())


def test_quantized_models_own_checkpoint_reloads(tmp_path):
    tables = ebc_tables()
    want = quantize(float_model(tables, seed=3), "int8", True)
    path = save(want, str(tmp_path / "q.pt"))
    got = quantize(FPModel(tables, "meta"), "int8", True)
    metamat.materialize(got, path)
    check(want, got, tables, "own checkpoint")


def test_init_without_checkpoint():
    """The tables: the quantized values of the float model's metamat init (the same seed);
    the position weights: ones, as TorchRec initialises them."""
    tables = ebc_tables()
    f = FPModel(tables, "meta")
    metamat.materialize(f, device="cpu", seed=7)
    got = quantize(FPModel(tables, "meta"), "int8", False)
    metamat.materialize(got, device="cpu", seed=7)
    check(quantize(f, "int8", False), got, tables, "init")
    for w in got.coll.feature_processor.position_weights.values():
        assert torch.equal(w, torch.ones(MAX_LEN))


@pytest.mark.parametrize("kind", ["table_wise", "column_wise"])
def test_inference_sharded(tmp_path, kind):
    """TorchRec's quant sharding of the feature-processed collection (TW, CW; 2 ranks in one
    process): each rank's copy of the position weights loaded from the one float tensor."""
    from torchrec.distributed.test_utils.infer_utils import TestQuantFPEBCSharder

    if not hasattr(torch._C._distributed_c10d, "ProcessGroupNCCL"):  # the reference's need
        pytest.skip("TorchRec's own CPU sharding of position weights (copy_to_device) needs "
                    "a torch built with NCCL")
    tables = ebc_tables(dims=(16, 32, 48), rows=(37, 3, 100))
    f = float_model(tables, seed=1)
    path = save(f, str(tmp_path / "f.pt"))
    qref = quantize(f, "int8", True)
    sharder = TestQuantFPEBCSharder(sharding_type=kind, kernel_type="quant",
                                    shardable_params=[t.name for t in tables])
    plan = quant_plan(qref, sharder, 2)
    ref = shard(qref, sharder, plan, 2, "cpu")  # position weights copied, tables zeros
    ref.load_state_dict(qref.state_dict(), strict=False)  # TorchRec: the converted tables
    got = shard(quantize(FPModel(tables, "meta"), "int8", True), sharder, plan, 2, "meta")
    report = metamat.materialize(got, path)
    check(ref, got, tables, kind)
    per_rank = got.coll.feature_processors_per_rank
    assert len(per_rank) == 2 and per_rank[0] is not per_rank[1]
    for copy_ in per_rank:
        for name, w in copy_.position_weights.items():
            assert torch.equal(w, f.coll._feature_processors.position_weights[name])
            assert copy_.position_weights_dict[name] is w  # TorchRec's alias, swapped too
    assert report.initialized == []


def _tbes(model):
    from _quant_models import tbes

    return tbes(model)


def test_emulated_device(tmp_path):
    """Into CUDA inference TBEs on the emulated device: the tables in device memory hold the
    CPU conversion's rows, the position weights the float model's."""
    from metamat.emulation import emulated_cuda

    tables = ebc_tables()
    f = float_model(tables, seed=5)
    path = save(f, str(tmp_path / "f.pt"))
    q = quantize(FPModel(tables, "meta"), "int8", False)
    with emulated_cuda():
        report = metamat.materialize(q, path, device="cuda")
    assert "emulated" in report.device and no_meta(q)
    ref = quantize(f, "int8", False)
    assert len(_tbes(ref)) == len(_tbes(q)) > 0
    for x, y in zip(_tbes(ref), _tbes(q)):
        assert y.weights_host.numel() == 0 and not y.use_cpu
        assert torch.equal(x.weights_host, y.weights_dev)
    for name, w in q.coll.feature_processor.position_weights.items():
        assert torch.equal(w, f.coll._feature_processors.position_weights[name])


@pytest.mark.cuda
def test_cuda_inference_tbes(tmp_path):
    """On a GPU (unsharded): the state and the forward pass of TorchRec's conversion there."""
    dev = torch.device("cuda", torch.cuda.current_device())
    tables = ebc_tables()
    f = float_model(tables, seed=7)
    path = save(f, str(tmp_path / "f.pt"))
    fc = FPModel(tables, dev)
    fc.load_state_dict(f.state_dict())
    ref = quantize(fc, "int8", True)
    q = quantize(FPModel(tables, "meta"), "int8", True)
    metamat.materialize(q, path, device="cuda")
    assert no_meta(q)
    assert_same_quant_state(ref, q, "cuda")
    kjt = batch([t.feature_names[0] for t in tables],
                [t.num_embeddings for t in tables]).to(dev)
    with torch.no_grad():
        assert torch.equal(ref.coll(kjt).values(), q.coll(kjt).values())
