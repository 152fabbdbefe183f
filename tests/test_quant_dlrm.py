"""TorchRec's documented inference flow, end to end: a DLRM built on meta,
``quantize_inference_model``, ``shard_quant_model``, then ``metamat.materialize`` from a DCP
checkpoint of the trained float DLRM. The reference is TorchRec's own path: the float model
holding the trained values, quantized by ``quantize_inference_model``."""
from __future__ import annotations

import copy

import pytest
import torch

pytest.importorskip("torchrec")
pytest.importorskip("fbgemm_gpu")

import metamat  # noqa: E402
from metamat.emulation import emulated_cuda  # noqa: E402

from _quant_models import propagate_device  # noqa: E402

ROWS = (50, 7, 300)


def _dlrm(device):
    from torchrec import EmbeddingBagCollection, EmbeddingBagConfig
    from torchrec.models.dlrm import DLRM

    tables = [EmbeddingBagConfig(name=f"t{i}", embedding_dim=16, num_embeddings=n,
                                 feature_names=[f"f{i}"]) for i, n in enumerate(ROWS)]
    return DLRM(embedding_bag_collection=EmbeddingBagCollection(tables=tables, device=device),
                dense_in_features=8, dense_arch_layer_sizes=[32, 16],
                over_arch_layer_sizes=[32, 1], dense_device=device)


@pytest.fixture(scope="module")
def trained(tmp_path_factory):
    """(the trained float DLRM, a DCP checkpoint of it)."""
    import torch.distributed.checkpoint as dcp

    torch.manual_seed(0)
    m = _dlrm(torch.device("cpu"))
    with torch.no_grad():
        for v in m.state_dict().values():
            v.copy_(torch.randn_like(v))
    path = str(tmp_path_factory.mktemp("dlrm") / "ckpt")
    dcp.save(m.state_dict(), checkpoint_id=path)
    return m, path


def _batch():
    from torchrec import KeyedJaggedTensor

    g = torch.Generator().manual_seed(1)
    lengths = torch.randint(0, 4, (3 * 5,), generator=g)
    vals = [torch.randint(0, r, (int(lengths[f * 5:(f + 1) * 5].sum()),), generator=g)
            for f, r in enumerate(ROWS)]
    kjt = KeyedJaggedTensor.from_lengths_sync(keys=["f0", "f1", "f2"], values=torch.cat(vals),
                                              lengths=lengths)
    return torch.randn(5, 8, generator=g), kjt


def _tables(model) -> dict:
    """Table name -> (quantized data, scale, bias) as fbgemm splits its TBEs' rows (the state
    formats differ: unsharded whole rows, quant-sharded split)."""
    from _quant_models import tbes

    out = {}
    for tbe in tbes(model):
        for (name, *_), parts in zip(tbe.embedding_specs,
                                     tbe.split_embedding_weights_with_scale_bias(2)):
            out[name] = tuple(x.cpu() for x in parts)
    return out


@pytest.mark.parametrize("plan", ["cpu", "gpu"])
def test_dlrm_inference_flow(trained, plan):
    from torchrec.inference.modules import quantize_inference_model, shard_quant_model

    model, path = trained
    ref = quantize_inference_model(copy.deepcopy(model))  # TorchRec: float values, converted
    q = quantize_inference_model(_dlrm(torch.device("meta")))
    compute_device = "cuda" if plan == "gpu" else "cpu"
    sharded, _ = shard_quant_model(q, world_size=1, compute_device=compute_device,
                                   sharding_device="meta")
    if plan == "gpu":  # TorchRec's defaults: a GPU plan, the GPU's layout
        with emulated_cuda():
            metamat.materialize(sharded, path, device="cuda")
    else:
        metamat.materialize(sharded, path, device="cpu")
    a, b = _tables(ref), _tables(sharded)
    assert sorted(a) == sorted(b) == ["t0", "t1", "t2"]
    for name in a:  # every table's quantized rows, scales and biases
        for x, y in zip(a[name], b[name]):
            assert torch.equal(x, y), name
    got = sharded.state_dict()
    dense = [k for k in ref.state_dict() if k.startswith(("dense_arch.", "over_arch."))]
    assert len(dense) == 8
    for k in dense:  # the dense part, float
        assert torch.equal(ref.state_dict()[k], got[k].cpu()), k
    if compute_device == "cpu":  # the forward pass on the CPU (a GPU's needs the cuda tests)
        dense, kjt = _batch()
        with propagate_device():
            assert torch.equal(ref(dense, kjt), sharded(dense, kjt))
