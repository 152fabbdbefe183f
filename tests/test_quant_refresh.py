"""A live quantized model refreshed from a new checkpoint: ``materialize(qmodel, ckpt)`` on a
model whose inference TBEs are real (served, say) quantizes the new float rows into a shadow of
each TBE storage and copies it in only after every read succeeded: the same bytes as
TorchRec's conversion of the new float model, nothing changed when the load fails."""
from __future__ import annotations

import os

import pytest
import torch

pytest.importorskip("torchrec")
pytest.importorskip("fbgemm_gpu")

import metamat  # noqa: E402
from metamat.emulation import emulated_cuda  # noqa: E402

from _quant_models import (batch, ebc_tables, feature_rows, float_model, forward,  # noqa: E402
                           meta_quant, quant_plan, quantize, shard, sharder_for, state_bytes,
                           tbes)


def _save(model, path):
    torch.save({k: v.detach().cpu().clone() for k, v in model.state_dict().items()}, path)
    return path


def _same_state(a, b) -> bool:
    x, y = state_bytes(a), state_bytes(b)
    keys = [k for k in x if k.startswith("coll.")]
    assert keys and all(k in y for k in keys)
    return all(torch.equal(u.view(torch.uint8), v.view(torch.uint8))
               for k in keys for (_, u), (_, v) in zip(x[k], y[k]))


def _storages(model):
    return [(t.weights_host.clone(), t.weights_dev.clone()) for t in tbes(model)]


@pytest.mark.parametrize("qdtype,split", [("int8", False), ("int4", True), ("fp16", False)])
def test_refresh_from_a_new_float_checkpoint(tmp_path, qdtype, split):
    tables = ebc_tables()
    served = quantize(float_model(tables, seed=1), qdtype, split)  # live, TorchRec-converted
    new = float_model(tables, seed=2)
    r = metamat.materialize(served, _save(new, str(tmp_path / "new.pt")))
    want = quantize(new, qdtype, split)
    assert _same_state(want, served)
    assert r.bytes_transient >= sum(t.weights_host.numel() for t in tbes(served))  # shadows
    assert [n for n in r.loaded if n.startswith("coll.")] == \
        [f"coll.embedding_bags.t{i}.weight" for i in range(3)] and not r.unchanged
    names, rows = feature_rows(tables)
    kjt = batch(names, rows)
    assert torch.equal(forward(want, kjt), forward(served, kjt))


def test_refresh_from_a_quantized_checkpoint_and_a_partial_one(tmp_path):
    tables = ebc_tables()
    served = quantize(float_model(tables, seed=1), "int8", True)
    new_q = quantize(float_model(tables, seed=3), "int8", True)
    path = str(tmp_path / "q.pt")
    torch.save({k: v.clone() for k, v in new_q.state_dict().items()}, path)
    metamat.materialize(served, path)
    assert _same_state(new_q, served)
    # a checkpoint holding t1 only: t0 and t2 keep their bytes (strict=False), reported so
    before = {k: [(o, x.clone()) for o, x in v] for k, v in state_bytes(served).items()}
    newer = float_model(tables, seed=4)
    sd = {k: v.detach().clone() for k, v in newer.state_dict().items() if ".t1." in k}
    torch.save(sd, str(tmp_path / "t1.pt"))
    r = metamat.materialize(served, str(tmp_path / "t1.pt"), strict=False)
    after = state_bytes(served)
    assert r.loaded == ["coll.embedding_bags.t1.weight"]
    assert set(r.unchanged) >= {"coll.embedding_bags.t0.weight", "coll.embedding_bags.t2.weight"}
    for k in before:
        same = all(torch.equal(a, b) for (_, a), (_, b) in zip(before[k], after[k]))
        assert same == (".t1." not in k), k
    want = state_bytes(quantize(newer, "int8", True))
    assert all(torch.equal(a, b) for (_, a), (_, b) in
               zip(want["coll.embedding_bags.t1.weight"], after["coll.embedding_bags.t1.weight"]))


def test_refresh_sharded(tmp_path):
    tables = ebc_tables(dims=(16, 32, 48), rows=(37, 3, 100))
    old, new = float_model(tables, seed=1), float_model(tables, seed=2)
    qold, qnew = quantize(old, "int4", True), quantize(new, "int4", True)
    sharder = sharder_for("cw", tables)
    plan = quant_plan(qold, sharder, 2)
    served = shard(qold, sharder, plan, 2, "cpu")  # TorchRec's CPU sharding, loaded
    served.load_state_dict(qold.state_dict())
    metamat.materialize(served, _save(new, str(tmp_path / "new.pt")))
    want = shard(qnew, sharder, plan, 2, "cpu")
    want.load_state_dict(qnew.state_dict())
    assert _same_state(want, served)


@pytest.mark.parametrize("how", ["cut", "flipped byte"])
def test_a_failed_refresh_changes_nothing(tmp_path, monkeypatch, how):
    """A checkpoint that fails: a DCP data file cut short (found before any read), or a byte
    flipped near its end, caught by ``verify=True`` after the first tables were quantized into
    the shadows. The error, and the live model's bytes as they were."""
    import torch.distributed.checkpoint as dcp

    from metamat.checkpoint.checksum import write_manifest

    tables = ebc_tables(dims=(8, 16, 40), rows=(2000, 1, 3000))
    served = quantize(float_model(tables, seed=1), "int8", False)
    before = _storages(served)
    path = str(tmp_path / "dcp")
    dcp.save(float_model(tables, seed=2).state_dict(), checkpoint_id=path)
    (data,) = [os.path.join(path, f) for f in os.listdir(path) if f.endswith(".distcp")]
    if how == "cut":
        os.truncate(data, os.path.getsize(data) // 2)
    else:
        write_manifest(path, block_bytes=4096)
        with open(data, "r+b") as f:
            f.seek(os.path.getsize(data) - 100_000)  # inside t2, read in a later round
            b = f.read(1)
            f.seek(-1, 1)
            f.write(bytes([b[0] ^ 0x40]))
    import metamat.load.quantize as quantize_mod

    rows = []
    real = quantize_mod.quantize_into
    monkeypatch.setattr(quantize_mod, "quantize_into",
                        lambda src, *a, **k: rows.append(len(src)) or real(src, *a, **k))
    with pytest.raises(metamat.CheckpointError):
        metamat.materialize(served, path, verify=how != "cut", staging_bytes=1 << 20)
    assert (sum(rows) > 0) == (how != "cut")  # rows were quantized before the flip was met
    after = _storages(served)
    assert all(torch.equal(a, c) and torch.equal(b, d) for (a, b), (c, d) in zip(before, after))


def test_refresh_on_the_emulated_device(tmp_path):
    tables = ebc_tables()
    served = meta_quant(tables, "int8", False)
    with emulated_cuda():
        metamat.materialize(served, _save(float_model(tables, seed=1), str(tmp_path / "a.pt")),
                            device="cuda")
        new = float_model(tables, seed=2)
        metamat.materialize(served, _save(new, str(tmp_path / "b.pt")), device="cuda")
    want = quantize(new, "int8", False)
    for x, y in zip(tbes(want), tbes(served)):
        assert y.weights_host.numel() == 0 and torch.equal(x.weights_host, y.weights_dev)


@pytest.mark.cuda
def test_refresh_on_a_gpu(tmp_path):
    """A model TorchRec converted on the GPU, refreshed there: the shadow in device memory,
    the bytes TorchRec's GPU conversion of the new model gives (rows quantized on the host)."""
    from _quant_models import Model, assert_same_quant_state

    dev = torch.device("cuda", torch.cuda.current_device())
    tables = ebc_tables()

    def on_gpu(f):
        m = Model(tables, dev)
        m.load_state_dict(f.state_dict())
        return quantize(m, "int8", False)

    served = on_gpu(float_model(tables, seed=1))
    new = float_model(tables, seed=2)
    r = metamat.materialize(served, _save(new, str(tmp_path / "new.pt")))
    assert r.device.startswith("cuda")
    want = on_gpu(new)
    assert_same_quant_state(want, served, "refresh", prefix="coll.")
    names, rows = feature_rows(tables)
    kjt = batch(names, rows).to(dev)
    assert torch.equal(want(kjt).values(), served(kjt).values())


def test_refresh_refuses_a_checkpoint_that_does_not_fit(tmp_path):
    """Rows of another shape: the error names the tensor, before anything is read."""
    tables = ebc_tables()
    served = quantize(float_model(tables, seed=1), "int8", False)
    before = _storages(served)
    other = float_model(ebc_tables(rows=(38, 1, 100)), seed=2)
    with pytest.raises(metamat.CheckpointError, match="t0"):
        metamat.materialize(served, _save(other, str(tmp_path / "other.pt")))
    after = _storages(served)
    assert all(torch.equal(a, c) and torch.equal(b, d) for (a, b), (c, d) in zip(before, after))


def test_refresh_sharded_for_a_gpu_emulated(tmp_path):
    """TorchRec's default GPU sharding, materialized on the (emulated) device, then refreshed:
    the live storage is weights_dev."""
    tables = ebc_tables(dims=(16, 32, 48), rows=(37, 3, 100))
    sharder = sharder_for("cw", tables)
    qold = quantize(float_model(tables, seed=1), "int8", True)
    plan = quant_plan(qold, sharder, 1, compute_device="cuda")
    served = shard(meta_quant(tables, "int8", True), sharder, plan, 1, "meta",
                   compute_device="cuda")
    new = float_model(tables, seed=2)
    with emulated_cuda():
        metamat.materialize(served, _save(float_model(tables, seed=1), str(tmp_path / "a.pt")),
                            device="cuda")
        metamat.materialize(served, _save(new, str(tmp_path / "b.pt")), device="cuda")
    want = shard(quantize(new, "int8", True), sharder, plan, 1, "cpu")
    want.load_state_dict(quantize(new, "int8", True).state_dict())
    assert _same_state(want, served)


@pytest.mark.parametrize("qdtype,quantized_ckpt", [("int8", False), ("fp16", False),
                                                   ("int4", True)])
def test_refresh_in_place(tmp_path, qdtype, quantized_ckpt):
    """inplace=True: the reads go into the live storages themselves (no shadow allocated)."""
    tables = ebc_tables()
    served = quantize(float_model(tables, seed=1), qdtype, True)
    storages = [t.weights_host for t in tbes(served)]
    new = float_model(tables, seed=2)
    want = quantize(new, qdtype, True)
    path = str(tmp_path / "new.pt")
    if quantized_ckpt:  # INT4 weights as their uint8 bytes (TorchRec's wrapper's .elem)
        from _quant_models import raw

        torch.save({k: raw(v).clone() for k, v in want.state_dict().items()}, path)
    else:
        _save(new, path)
    r = metamat.materialize(served, path, inplace=True)
    assert _same_state(want, served)
    assert all(t.weights_host is s for t, s in zip(tbes(served), storages))
    assert r.bytes_allocated < sum(s.numel() for s in storages)  # no shadow of the tables


def test_a_failed_refresh_in_place_says_what_changed(tmp_path):
    """inplace=True and a flipped byte met after rows were written: PartialLoadError names the
    tables that may have changed."""
    import torch.distributed.checkpoint as dcp

    from metamat.checkpoint.checksum import write_manifest

    tables = ebc_tables(dims=(8, 16, 40), rows=(2000, 1, 3000))
    served = quantize(float_model(tables, seed=1), "int8", False)
    path = str(tmp_path / "dcp")
    dcp.save(float_model(tables, seed=2).state_dict(), checkpoint_id=path)
    (data,) = [os.path.join(path, f) for f in os.listdir(path) if f.endswith(".distcp")]
    write_manifest(path, block_bytes=4096)
    with open(data, "r+b") as f:
        f.seek(os.path.getsize(data) - 100_000)
        b = f.read(1)
        f.seek(-1, 1)
        f.write(bytes([b[0] ^ 0x40]))
    with pytest.raises(metamat.PartialLoadError) as e:
        metamat.materialize(served, path, verify=True, staging_bytes=1 << 20, inplace=True)
    assert "coll.embedding_bags.t2.weight" in e.value.written


def test_refresh_from_its_own_state_with_registered_tbes(tmp_path):
    """A quantized model with ``register_tbes`` (its state_dict holds the TBEs' metadata
    buffers, ``coll.tbes.0.*``): strict refresh from such a state works, the metadata taken
    as read (metamat lays the TBEs out itself)."""
    import copy

    from torchrec.distributed.test_utils.infer_utils import quantize as trec_quantize

    tables = ebc_tables()
    served = trec_quantize(copy.deepcopy(float_model(tables, seed=1)), inplace=False,
                           register_tbes=True)
    new = trec_quantize(copy.deepcopy(float_model(tables, seed=2)), inplace=False,
                        register_tbes=True)
    sd = {k: v.clone() for k, v in new.state_dict().items()}
    assert any(".tbes.0." in k for k in sd)
    path = str(tmp_path / "q.pt")
    torch.save(sd, path)
    metamat.materialize(served, path)  # strict
    assert _same_state(new, served)


def test_refresh_touches_only_what_the_checkpoint_loads(tmp_path):
    """A checkpoint of the dense part only: no shadow, the tables untouched; a refresh
    reports its shadows as transient bytes, not allocated ones."""
    tables = ebc_tables()
    served = quantize(float_model(tables, seed=1), "int8", False)
    before = _storages(served)
    new = float_model(tables, seed=2)
    path = str(tmp_path / "dense.pt")
    torch.save({k: v.detach().clone() for k, v in new.state_dict().items()
                if k.startswith("dense.")}, path)
    r = metamat.materialize(served, path, strict=False)
    assert r.bytes_allocated < 100 and r.bytes_transient < 100  # the dense layer's
    assert all(torch.equal(a, c) for (a, _), (c, _) in zip(before, _storages(served)))
    r = metamat.materialize(served, _save(new, str(tmp_path / "all.pt")))
    tables_bytes = sum(t.weights_host.numel() for t in tbes(served))
    assert r.bytes_transient >= tables_bytes > r.bytes_allocated


def test_a_pruned_live_table_refreshes(tmp_path):
    """A live module with a pruned table, refreshed from its own quantized state: bytes
    equal."""
    import copy

    from torchrec.distributed.test_utils.infer_utils import quantize as trec_quantize
    from torchrec.quant.embedding_modules import MODULE_ATTR_EMB_CONFIG_NAME_TO_NUM_ROWS_POST_PRUNING_DICT as PRUNE

    tables = ebc_tables()
    f = float_model(tables, seed=1)
    setattr(f.coll, PRUNE, {"t0": 20})
    served = trec_quantize(copy.deepcopy(f), inplace=False)
    f2 = float_model(tables, seed=2)
    setattr(f2.coll, PRUNE, {"t0": 20})
    new = trec_quantize(copy.deepcopy(f2), inplace=False)
    path = str(tmp_path / "q.pt")
    torch.save({k: v.clone() for k, v in new.state_dict().items()}, path)
    metamat.materialize(served, path)
    assert _same_state(new, served)


def test_refresh_refuses_another_device(tmp_path):
    """A live model laid out for the CPU, refreshed with device='cuda' (the emulated GPU): its
    tables are in host memory, refused by name as a GPU would, the model unchanged."""
    tables = ebc_tables()
    served = quantize(float_model(tables, seed=1), "int8", False)
    before = _storages(served)
    path = _save(float_model(tables, seed=2), str(tmp_path / "new.pt"))
    with emulated_cuda(), pytest.raises(metamat.UnsupportedError, match="host placement"):
        metamat.materialize(served, path, device="cuda")
    assert all(torch.equal(a, c) for (a, _), (c, _) in zip(before, _storages(served)))


@pytest.mark.parametrize("kernel", ["quant_uvm", "quant_uvm_caching"])
@pytest.mark.parametrize("inplace", [False, True])
def test_refresh_in_unified_memory_emulated(tmp_path, kernel, inplace):
    """A model served from unified memory (TorchRec's quant_uvm / quant_uvm_caching kernels,
    GPU sharding) refreshed on the emulated device: the new rows written by the host into the
    live storages (through a host shadow, or in place), the cache of every caching TBE emptied
    after the copy (its rows were the old ones); a refresh that fails leaves rows and cache
    as they were."""
    tables = ebc_tables(dims=(16, 32, 48), rows=(37, 3, 100))
    sharder = sharder_for("rw", tables, kernel=kernel)
    qold = quantize(float_model(tables, seed=1), "int8", True)
    plan = quant_plan(qold, sharder, 1, compute_device="cuda")
    served = shard(meta_quant(tables, "int8", True), sharder, plan, 1, "meta",
                   compute_device="cuda")
    new = float_model(tables, seed=2)
    other = float_model(ebc_tables(dims=(16, 32, 48), rows=(38, 3, 100)), seed=3)
    caching = kernel == "quant_uvm_caching"
    with emulated_cuda():
        metamat.materialize(served, _save(float_model(tables, seed=1), str(tmp_path / "a.pt")),
                            device="cuda")
        live = [t.weights_uvm for t in tbes(served)]
        assert all(x.numel() for x in live)
        for t in tbes(served):  # a served cache holds rows, a prefetch queued locations
            assert bool(t.lxu_cache_weights.numel()) == caching
            t.lxu_cache_state.fill_(0)
            t.lxu_state.fill_(5)
            t.lxu_cache_locations_list.push(torch.zeros(3, dtype=torch.int32))
            t.timestep_prefetch_size.increment()
        before = [x.clone() for x in live]
        with pytest.raises(metamat.CheckpointError, match="t0"):
            metamat.materialize(served, _save(other, str(tmp_path / "o.pt")), device="cuda",
                                inplace=inplace)
        assert all(torch.equal(a, b) for a, b in zip(before, live))
        assert all((t.lxu_cache_state == 0).all() for t in tbes(served))
        r = metamat.materialize(served, _save(new, str(tmp_path / "b.pt")), device="cuda",
                                inplace=inplace)
    assert all(t.weights_uvm is x for t, x in zip(tbes(served), live))  # refreshed, not replaced
    dense = sum(p.numel() * p.element_size() for p in served.dense.parameters())
    assert r.bytes_transient == (0 if inplace else sum(x.numel() for x in live) + dense)
    qnew = quantize(new, "int8", True)
    want = shard(qnew, sharder, plan, 1, "cpu")
    want.load_state_dict(qnew.state_dict())
    assert _same_state(want, served)
    for t in tbes(served):
        if caching:  # emptied: the next lookups fetch the new rows
            assert (t.lxu_cache_state == -1).all() and not t.lxu_state.any()
            assert t.lxu_cache_locations_list.size() == 0
            assert t.timestep_prefetch_size.get() == 0


def test_refresh_that_leaves_the_tables_alone_needs_no_device_memory_for_them(tmp_path):
    """A GPU model refreshed from a checkpoint of its dense layer only: no shadow of the
    (untouched) tables, so it is not refused for device memory their shadows would need."""
    tables = ebc_tables(rows=(2000, 1, 3000))
    served = meta_quant(tables, "int8", False)
    f = float_model(tables, seed=1)
    state = {k: v.detach().clone() for k, v in f.state_dict().items()}
    torch.save({k: v for k, v in state.items() if k.startswith("dense.")},
               str(tmp_path / "dense.pt"))
    with emulated_cuda():
        metamat.materialize(served, _save(f, str(tmp_path / "all.pt")), device="cuda")
    before = _storages(served)
    size = sum(t.weights_dev.numel() for t in tbes(served))
    with emulated_cuda(free_memory=size // 2):  # room for the dense layer, not the tables
        r = metamat.materialize(served, str(tmp_path / "dense.pt"), device="cuda",
                                strict=False)
    assert r.bytes_allocated < size // 2
    assert all(torch.equal(a, c) and torch.equal(b, d)
               for (a, b), (c, d) in zip(before, _storages(served)))
    with emulated_cuda(free_memory=size // 2), pytest.raises(metamat.DeviceMemoryError):
        metamat.materialize(served, str(tmp_path / "all.pt"), device="cuda")  # shadows: no room


@pytest.mark.cuda
@pytest.mark.parametrize("kernel", ["quant_uvm", "quant_uvm_caching"])
def test_refresh_in_unified_memory_on_a_gpu(tmp_path, kernel):
    """TorchRec's GPU sharding with a unified-memory kernel, built by TorchRec on the GPU and
    serving (a forward filled its cache), refreshed from a new checkpoint: the bytes and the
    next forward those of the same sharding holding the new model (no stale cached row)."""
    dev = torch.device("cuda", torch.cuda.current_device())
    tables = ebc_tables(dims=(16, 32, 48), rows=(37, 3, 100))
    sharder = sharder_for("rw", tables, kernel=kernel)
    qold = quantize(float_model(tables, seed=1), "int8", True)
    plan = quant_plan(qold, sharder, 1, compute_device="cuda")
    served = shard(qold, sharder, plan, 1, "cuda", compute_device="cuda")
    served.load_state_dict(qold.state_dict())
    kjt = batch(*feature_rows(tables)).to(dev)
    served.coll(kjt)
    new = float_model(tables, seed=2)
    # the device named: the served model's dense layer stayed on the CPU (TorchRec's quant
    # sharding moves only the collection), so it would otherwise say "cpu"
    metamat.materialize(served, _save(new, str(tmp_path / "b.pt")), device=dev)
    qnew = quantize(new, "int8", True)
    want = shard(qnew, sharder, plan, 1, "cuda", compute_device="cuda")
    want.load_state_dict(qnew.state_dict())
    assert torch.equal(want.coll(kjt).values(), served.coll(kjt).values())
    assert _same_state(want, served)
