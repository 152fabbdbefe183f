"""Quantized TorchRec collections into CUDA inference TBEs (``device="cuda"``): rows quantized
on the host, copied to the device through the bounce buffers (INT-N) or the staging ring
(FP16/FP32 and quantized checkpoints).

On the emulated device (CPU storages standing for device memory) everything but the GPU
itself runs here: the bytes, the DEVICE layout, the metadata. The tests marked ``cuda`` run
the same against TorchRec's own conversion on a GPU, with forward passes (``pytest -m cuda``
on a GPU machine)."""
from __future__ import annotations

import pytest
import torch

pytest.importorskip("torchrec")
pytest.importorskip("fbgemm_gpu")

import metamat  # noqa: E402
from metamat.emulation import emulated_cuda  # noqa: E402

from _quant_models import (Model, assert_same_quant_state, batch, ebc_tables,  # noqa: E402
                           feature_rows, float_model, meta_quant, no_meta, quant_plan, quantize,
                           shard, sharder_for, state_bytes, tbes)


def _save(model, path):
    torch.save({k: v.detach().cpu().contiguous() for k, v in model.state_dict().items()}, path)
    return path


def _same_bytes(ref, got):
    """Table state equal byte for byte (the device layout's weights_dev against the host one's
    weights_host: same alignment, same offsets)."""
    a, b = state_bytes(ref), state_bytes(got)
    for k in a:
        if k.startswith("coll."):
            for (_, x), (_, y) in zip(a[k], b[k]):
                assert torch.equal(x.cpu().view(torch.uint8), y.cpu().view(torch.uint8)), k
    for x, y in zip(tbes(ref), tbes(got)):
        assert torch.equal(x.weights_host.cpu(), y.weights_dev.cpu())


@pytest.mark.parametrize("qdtype,split", [("int8", False), ("int4", True), ("int2", False),
                                          ("fp16", True), ("fp32", False)])
def test_emulated_device(tmp_path, qdtype, split):
    tables = ebc_tables()
    f = float_model(tables, seed=5)
    path = _save(f, str(tmp_path / "f.pt"))
    q = meta_quant(tables, qdtype, split)
    with emulated_cuda():
        r = metamat.materialize(q, path, device="cuda")
    assert "emulated" in r.device and no_meta(q)
    ref = quantize(f, qdtype, split)  # TorchRec's conversion on the CPU: the same bytes
    _same_bytes(ref, q)
    for x, y in zip(tbes(ref), tbes(q)):
        assert y.weights_host.numel() == 0 and not y.use_cpu
        assert set(y.weights_placements.tolist()) == {0}  # EmbeddingLocation.DEVICE
        assert torch.equal(x.weights_offsets, y.weights_offsets)
        for (n, bx), (_, by) in zip(x.named_buffers(), y.named_buffers()):
            assert torch.equal(bx, by), n


def test_emulated_device_init_and_quantized_checkpoint(tmp_path):
    tables = ebc_tables()
    f = float_model(tables, seed=6)
    ref = quantize(f, "int8", True)
    torch.save({k: v.clone() for k, v in ref.state_dict().items()}, str(tmp_path / "q.pt"))
    q = meta_quant(tables, "int8", True)
    with emulated_cuda():
        metamat.materialize(q, str(tmp_path / "q.pt"), device="cuda")
    _same_bytes(ref, q)
    q2 = meta_quant(tables, "int8", True)
    q3 = meta_quant(tables, "int8", True)
    with emulated_cuda():
        metamat.materialize(q2, device="cuda", seed=4)
    metamat.materialize(q3, seed=4)  # the CPU layout: the same init bytes
    _same_bytes(q3, q2)


def test_sharded_host_layout_refused_on_a_gpu(tmp_path):
    tables = ebc_tables(dims=(16, 32, 48), rows=(37, 3, 100))
    f = float_model(tables)
    path = _save(f, str(tmp_path / "f.pt"))
    qref = quantize(f, "int8", True)
    sharder = sharder_for("rw", tables)
    got = shard(meta_quant(tables, "int8", True), sharder, quant_plan(qref, sharder, 2), 2, "meta")
    with emulated_cuda(), pytest.raises(metamat.UnsupportedError, match="device='cpu'"):
        metamat.materialize(got, path, device="cuda")
    assert not no_meta(got)


# ------------------------------------------------------------------------------------------
# on a GPU
# ------------------------------------------------------------------------------------------

@pytest.mark.cuda
@pytest.mark.parametrize("qdtype,split", [("int8", False), ("int4", True), ("int2", True),
                                          ("fp16", False)])
def test_cuda_inference_tbes(tmp_path, qdtype, split):
    """Against TorchRec's conversion on the GPU (the float model on cuda, fbgemm's CUDA
    quantization op), every buffer and attribute, and the forward pass on the GPU."""
    dev = torch.device("cuda", torch.cuda.current_device())
    tables = ebc_tables()
    f = float_model(tables, seed=7)
    path = _save(f, str(tmp_path / "f.pt"))
    fc = Model(tables, dev)
    fc.load_state_dict(f.state_dict())
    ref = quantize(fc, qdtype, split)
    q = meta_quant(tables, qdtype, split)
    metamat.materialize(q, path, device="cuda")
    assert no_meta(q)
    _same_bytes(quantize(f, qdtype, split), q)  # the CPU conversion's bytes
    assert_same_quant_state(ref, q, qdtype)  # and the GPU conversion's, and its layout
    names, rows = feature_rows(tables)
    kjt = batch(names, rows).to(dev)
    assert torch.equal(ref(kjt).values(), q(kjt).values())
