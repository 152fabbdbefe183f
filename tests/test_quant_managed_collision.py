"""Quantized managed-collision collections (TorchRec's ``QuantManagedCollisionEmbedding[Bag]
Collection``, for serving) built on meta, filled from a float training checkpoint: quantized
tables and remapping state equal to TorchRec's own conversion of the trained model, lookups
alike; MCH and HashZch modules, EBC and EC, INT8 and INT4; a training DMP's world-2 checkpoint;
a live model refreshed."""
from __future__ import annotations

import os

import pytest
import torch
import torch.distributed as dist
from torch import nn

pytest.importorskip("torchrec")
pytest.importorskip("fbgemm_gpu")

import metamat  # noqa: E402
from metamat.testing import process_group  # noqa: E402

import test_torchrec_hash_zch as hz  # noqa: E402
import test_torchrec_managed_collision as mch  # noqa: E402
from _dist import run_dist  # noqa: E402

KINDS = {"mch": mch, "hash": hz}


class Model(nn.Module):
    def __init__(self, zch: str, kind: str, device: torch.device):
        super().__init__()
        self.mc = KINDS[zch]._module(kind, device)


def _trained(zch: str, kind: str, seed: int) -> Model:
    """A float model as training leaves it: random tables, remapping state written."""
    m = Model(zch, kind, torch.device("cpu"))
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in m.parameters():
            if p.is_floating_point():
                p.copy_(torch.randn(p.shape, generator=g))
    if zch == "mch":
        mch._trained_mc_state(m, 0, 1)
    else:
        hz._trained_slots(m, 0, 1)
    return m


def _quantize(model: nn.Module, dtype: torch.dtype) -> nn.Module:
    """TorchRec's conversion for serving. A real model's tables are converted first: the MC
    collections' conversion takes their quantized weights from the inner collection and, when
    that is still a float one, gives an EmbeddingCollection's tables zeros. A model on meta
    has no weights: the MC collections are converted directly."""
    from torchrec import EmbeddingCollection
    from torchrec.inference.modules import quantize_embeddings
    from torchrec.modules.mc_embedding_modules import (ManagedCollisionEmbeddingBagCollection,
                                                       ManagedCollisionEmbeddingCollection)
    from torchrec.quant.embedding_modules import EmbeddingCollection as QuantEmbeddingCollection
    from torchrec.quant.embedding_modules import (QuantManagedCollisionEmbeddingBagCollection,
                                                  QuantManagedCollisionEmbeddingCollection)

    if not any(p.is_meta for p in model.parameters()):
        model = quantize_embeddings(
            model, dtype=dtype, inplace=True, additional_qconfig_spec_keys=[EmbeddingCollection],
            additional_mapping={EmbeddingCollection: QuantEmbeddingCollection})
    mcs = {ManagedCollisionEmbeddingBagCollection: QuantManagedCollisionEmbeddingBagCollection,
           ManagedCollisionEmbeddingCollection: QuantManagedCollisionEmbeddingCollection}
    return quantize_embeddings(model, dtype=dtype, inplace=True,
                               additional_qconfig_spec_keys=list(mcs), additional_mapping=mcs)


def _lookup(zch: str, kind: str, model: Model, device: str = "cpu") -> torch.Tensor:
    batch = mch._batch(400, hash_size=KINDS[zch].HASH, device=device)
    out = model.mc(batch)
    return mch._output(kind, out)


def _differs(a: nn.Module, b: nn.Module) -> list:
    """Keys whose tensors differ (INT4/INT2 weights compared as their bytes)."""
    sa, sb = a.state_dict(), b.state_dict()
    return sorted(set(sa) ^ set(sb)) + [
        k for k in sa if k in sb and not torch.equal(getattr(sa[k], "elem", sa[k]).cpu(),
                                                     getattr(sb[k], "elem", sb[k]).cpu())]


# TorchRec cannot build an INT4 QuantManagedCollisionEmbeddingBagCollection on meta: its
# conversion copies the float collection's meta weights into the inference TBE
@pytest.mark.parametrize("zch", ["mch", "hash"])
@pytest.mark.parametrize("kind,dtype", [("ebc", torch.qint8), ("ec", torch.qint8),
                                        ("ec", torch.quint4x2)],
                         ids=["ebc-int8", "ec-int8", "ec-int4"])
def test_float_checkpoint_into_quantized_mc_collection_like_torchrec(zch, kind, dtype,
                                                                     tmp_path):
    import torch.distributed.checkpoint as dcp

    from torchrec.quant.embedding_modules import (QuantManagedCollisionEmbeddingBagCollection,
                                                  QuantManagedCollisionEmbeddingCollection)

    with process_group():
        trained = _trained(zch, kind, seed=1)
        dcp.save(trained.state_dict(), checkpoint_id=str(tmp_path / "ckpt"))
        reference = _quantize(trained, dtype)
        model = _quantize(Model(zch, kind, torch.device("meta")), dtype)
        assert isinstance(model.mc, (QuantManagedCollisionEmbeddingBagCollection,
                                     QuantManagedCollisionEmbeddingCollection))
        report = metamat.materialize(model, str(tmp_path / "ckpt"), device="cpu")
        assert report.unexpected == []  # HashZch serving modules drop the eviction metadata
        assert not any(t.is_meta for t in [*model.parameters(), *model.buffers()])
        assert _differs(model, reference) == []
        assert torch.equal(_lookup(zch, kind, model), _lookup(zch, kind, reference))


@pytest.mark.parametrize("zch", ["mch", "hash"])
def test_into_cuda_inference_tbes_on_the_emulated_device(zch, tmp_path):
    """On a GPU: the tables into CUDA inference TBEs, the MC state on the device; the same
    bytes as TorchRec's conversion on the CPU (the emulated device: CPU memory standing in)."""
    import torch.distributed.checkpoint as dcp

    from metamat.emulation import emulated_cuda

    with process_group():
        trained = _trained(zch, "ebc", seed=4)
        dcp.save(trained.state_dict(), checkpoint_id=str(tmp_path / "ckpt"))
        reference = _quantize(trained, torch.qint8)
        model = _quantize(Model(zch, "ebc", torch.device("meta")), torch.qint8)
        with emulated_cuda():
            report = metamat.materialize(model, str(tmp_path / "ckpt"), device="cuda")
    assert "emulated" in report.device and report.unexpected == []
    assert not any(t.is_meta for t in [*model.parameters(), *model.buffers()])
    assert _differs(model, reference) == []


@pytest.mark.cuda
@pytest.mark.parametrize("zch", ["mch", "hash"])
@pytest.mark.parametrize("kind", ["ebc", "ec"])
def test_on_a_gpu_like_torchrecs_conversion_on_the_gpu(zch, kind, tmp_path):
    """Into CUDA inference TBEs and MC state on the GPU: the bytes of TorchRec's conversion
    (of the trained model on the CPU and on the GPU), and the same lookups on the GPU."""
    import torch.distributed.checkpoint as dcp

    dev = torch.device("cuda", torch.cuda.current_device())
    with process_group():
        trained = _trained(zch, kind, seed=5)
        dcp.save(trained.state_dict(), checkpoint_id=str(tmp_path / "ckpt"))
        on_gpu = Model(zch, kind, dev)
        on_gpu.load_state_dict(trained.state_dict())
        reference = _quantize(on_gpu, torch.qint8)
        model = _quantize(Model(zch, kind, torch.device("meta")), torch.qint8)
        metamat.materialize(model, str(tmp_path / "ckpt"), device="cuda")
    assert not any(t.is_meta for t in [*model.parameters(), *model.buffers()])
    assert _differs(model, _quantize(trained, torch.qint8)) == []
    assert _differs(model, reference) == []
    assert torch.equal(_lookup(zch, kind, model, "cuda"), _lookup(zch, kind, reference, "cuda"))


def worker_world2(rank, world_size, tmp, zch):
    """A training DMP (EBC, row-wise) whose trained state is saved by DCP."""
    import torch.distributed.checkpoint as dcp

    eager = KINDS[zch]._eager("ebc", world_size)
    if zch == "mch":
        mch._trained_mc_state(eager, rank, world_size)
    else:
        hz._trained_slots(eager, rank, world_size)
    # the serving model holds the collection as ``mc``
    sd = {f"mc.{k}": v for k, v in eager.state_dict().items()}
    dcp.save(sd, checkpoint_id=os.path.join(tmp, "ckpt"))
    dist.barrier()
    return True


@pytest.mark.parametrize("zch", ["mch", "hash"])
def test_quantized_mc_collection_as_the_model_itself(zch, tmp_path):
    """The quantized MC collection is the root module: its MC state found all the same."""
    import torch.distributed.checkpoint as dcp

    with process_group():
        trained = _trained(zch, "ebc", seed=3)
        dcp.save(trained.mc.state_dict(), checkpoint_id=str(tmp_path / "ckpt"))
        reference = _quantize(trained, torch.qint8).mc
        init = _quantize(Model(zch, "ebc", torch.device("meta")), torch.qint8).mc
        metamat.materialize(init, seed=0, device="cpu")
        model = _quantize(Model(zch, "ebc", torch.device("meta")), torch.qint8).mc
        report = metamat.materialize(model, str(tmp_path / "ckpt"), device="cpu")
    for m in (init, model):
        assert not any(t.is_meta for t in [*m.parameters(), *m.buffers()])
    assert report.unexpected == [] and _differs(model, reference) == []


@pytest.mark.multiprocess
@pytest.mark.parametrize("zch", ["mch", "hash"])
def test_training_dmp_checkpoint_into_quantized_model_and_live_refresh(zch, tmp_path):
    """A world-2 training checkpoint (MCH: one sorted run of slots per shard, sorted again as
    TorchRec's load hook does) into a quantized model on meta, equal to TorchRec's float load +
    conversion; then a live quantized model refreshed from a new checkpoint."""
    import torch.distributed.checkpoint as dcp

    run_dist(worker_world2, 2, str(tmp_path), zch)
    ckpt = str(tmp_path / "ckpt")
    with process_group():
        float_model = Model(zch, "ebc", torch.device("cpu"))
        sd = float_model.state_dict()
        dcp.load(sd, checkpoint_id=ckpt)
        float_model.load_state_dict(sd)
        reference = _quantize(float_model, torch.qint8)
        model = _quantize(Model(zch, "ebc", torch.device("meta")), torch.qint8)
        metamat.materialize(model, ckpt, device="cpu")
        assert _differs(model, reference) == []
        assert torch.equal(_lookup(zch, "ebc", model), _lookup(zch, "ebc", reference))

        newer = _trained(zch, "ebc", seed=2)  # a newer checkpoint, into the live model
        dcp.save(newer.state_dict(), checkpoint_id=str(tmp_path / "newer"))
        metamat.materialize(model, str(tmp_path / "newer"), device="cpu")
        reference = _quantize(newer, torch.qint8)
        assert _differs(model, reference) == []
        assert torch.equal(_lookup(zch, "ebc", model), _lookup(zch, "ebc", reference))
