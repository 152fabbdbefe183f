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


def _gpu_sharded(tables, kind, qdtype, world_size=1, ec=False, kernel="quant",
                 compute_device="cuda"):
    """(TorchRec's converted float model, the quant-sharded meta model planned for a GPU, the
    sharder, the plan): ``shard_quant_model(..., compute_device="cuda",
    sharding_device="meta")``, TorchRec's default for GPU inference."""
    f = float_model(tables, seed=11, ec=ec)
    qref = quantize(f, qdtype, True)
    sharder = sharder_for(kind, tables, ec=ec, kernel=kernel)
    plan = quant_plan(qref, sharder, world_size, compute_device=compute_device)
    got = shard(meta_quant(tables, qdtype, True, ec=ec), sharder, plan, world_size, "meta",
                compute_device=compute_device)
    return f, qref, got, sharder, plan


def _fbgemm_relayout(model, device):
    """fbgemm's own move of a meta-sharded model's TBEs to a GPU layout (what TorchRec's
    inference runtime does: ``reset_weights_placements_and_offsets`` to DEVICE, then
    ``recompute_module_buffers``), on ``device``: the reference layout."""
    from fbgemm_gpu.split_table_batched_embeddings_ops_common import EmbeddingLocation

    for t in tbes(model):
        t.reset_weights_placements_and_offsets(device, EmbeddingLocation.DEVICE.value)
        t.recompute_module_buffers()
    return model


def _assert_cpu_sharding_bytes(qref, sharder, plan, got):
    """Every table block of ``got`` (state_dict keys under ``coll.``) holds the bytes of
    TorchRec's CPU sharding of the converted model ``qref`` with the same plan, at the same
    offsets; returns that reference model."""
    ref = shard(qref, sharder, plan, 1, "cpu")
    ref.load_state_dict(qref.state_dict())
    a, b = state_bytes(ref), state_bytes(got)
    keys = [k for k in a if k.startswith("coll.")]
    assert len(keys) >= 3 and keys == [k for k in b if k.startswith("coll.")]
    for k in keys:
        assert [o for o, _ in a[k]] == [o for o, _ in b[k]], k
        for (_, x), (_, y) in zip(a[k], b[k]):
            assert torch.equal(x.view(torch.uint8), y.view(torch.uint8)), k
    return ref


def _assert_padding_zero(model):
    """Zero every table view of the state in place: the TBE storages must then be all zero
    (the state's tensors alias weights_dev, and the row padding and table gaps are 0)."""
    for parts in state_bytes(model).values():
        for _, x in parts:
            if x.dtype == torch.uint8 or x.dtype == torch.float16:
                x.view(torch.uint8).zero_()
    for t in tbes(model):
        assert t.weights_dev.numel() and not t.weights_dev.any()


def _manual_plan(qmodel, per_table, world_size=1):
    """A plan from TorchRec's ``construct_module_sharding_plan`` (its generators fill in the
    ``dense`` compute kernel, as TorchRec's own GPU inference tests build them)."""
    from torchrec.distributed.sharding_plan import construct_module_sharding_plan
    from torchrec.distributed.types import ShardingPlan

    return ShardingPlan({"coll": construct_module_sharding_plan(
        qmodel.coll, per_table, local_size=world_size, world_size=world_size,
        device_type="cuda")})


def _meta_devices(model) -> list:
    """Device references to meta left in the model's objects."""
    from metamat.models.torchrec.graph import scan

    out = []
    for holder, key in scan(model).device_refs:
        v = holder.__dict__.get(key)
        if (isinstance(v, torch.device) and v.type == "meta") or v == "meta":
            out.append((type(holder).__name__, key))
    return out


@pytest.mark.parametrize("coll,kind,qdtype", [
    ("ebc", "tw", "int8"), ("ebc", "rw", "int4"), ("ebc", "cw", "int8"), ("ebc", "tw", "int2"),
    ("ebc", "cw", "int4"), ("ebc", "dense kernel", "int8"),
    ("ec", "tw", "int8"), ("ec", "rw", "int4"), ("ec", "cw", "int8")])
def test_sharded_for_a_gpu_emulated(tmp_path, coll, kind, qdtype):
    """TorchRec's default GPU inference sharding (``shard_quant_model(compute_device="cuda",
    sharding_device="meta")``, world size 1): HOST-placed TBEs on meta, laid out for the
    device as fbgemm lays them out, the tables' bytes TorchRec's conversion's. (TorchRec's
    quant sharding splits scale/bias, which it cannot do for FP16 tables: INT-N only.)"""
    from _quant_models import ec_tables
    from torchrec.distributed.sharding_plan import column_wise, table_wise

    ec = coll == "ec"
    tables = ec_tables(rows=(37, 3, 100)) if ec else ebc_tables(dims=(16, 32, 48),
                                                                rows=(37, 3, 100))
    f, qref, got, sharder, plan = _gpu_sharded(tables, "tw" if kind == "dense kernel" else kind,
                                               qdtype, ec=ec)
    if kind == "dense kernel":  # TW and CW tables, the kernel TorchRec's generators give
        plan = _manual_plan(qref, {"t0": table_wise(rank=0), "t1": column_wise(ranks=[0, 0]),
                                   "t2": table_wise(rank=0)})
        assert {ps.compute_kernel for ps in plan.plan["coll"].values()} == {"dense"}
        got = shard(meta_quant(tables, qdtype, True), sharder, plan, 1, "meta",
                    compute_device="cuda")
    path = _save(f, str(tmp_path / "f.pt"))
    layout = _fbgemm_relayout(shard(meta_quant(tables, qdtype, True, ec=ec), sharder, plan, 1,
                                    "meta", compute_device="cuda"), torch.device("cpu"))
    with emulated_cuda():
        r = metamat.materialize(got, path, device="cuda")
    assert "emulated" in r.device and no_meta(got) and not _meta_devices(got)
    _assert_cpu_sharding_bytes(qref, sharder, plan, got)
    assert len(tbes(layout)) == len(tbes(got)) > 0
    for x, y in zip(tbes(layout), tbes(got)):
        for name in ("embedding_specs", "row_alignment", "host_size", "dev_size", "uvm_size",
                     "weights_physical_placements", "weights_physical_offsets",
                     "weight_initialized", "feature_table_map", "pooling_mode"):
            assert getattr(x, name) == getattr(y, name), name
        assert not y.use_cpu and y.weights_host.numel() == 0
        assert set(y.weights_placements.tolist()) == {0}  # EmbeddingLocation.DEVICE
        for name in ("weights_offsets", "weights_placements"):
            assert torch.equal(getattr(x, name), getattr(y, name)), name
        bx, by = dict(x.named_buffers()), dict(y.named_buffers())
        assert bx.keys() == by.keys()
        for n in bx:  # fbgemm leaves the (unused) cache buffers on meta: compare the others
            if not bx[n].is_meta:
                assert torch.equal(bx[n], by[n]), n
    if kind == "cw":
        sd = got.state_dict()
        attr = "embeddings" if ec else "embedding_bags"
        placements = {str(s.placement) for s in sd[f"coll.{attr}.t2.weight"].metadata()
                      .shards_metadata}
        assert placements == {"cpu"}, placements  # the device (the CPU stands for it)
    _assert_padding_zero(got)


@pytest.mark.parametrize("coll,kind", [("ebc", "tw"), ("ebc", "rw"), ("ebc", "cw"),
                                       ("ec", "rw"), ("ec", "cw")])
def test_sharded_for_a_gpu_forward_emulated(tmp_path, coll, kind):
    """The sharded module after its TBEs were laid out for the device runs TorchRec's forward
    (input dist, lookups, output dist): its TBEs' rows shown to fbgemm's CPU kernel (which
    refuses DEVICE placements) as HOST ones, the outputs equal TorchRec's CPU sharding's."""
    from _quant_models import ec_tables, forward

    ec = coll == "ec"
    tables = ec_tables(rows=(37, 3, 100)) if ec else ebc_tables(dims=(16, 32, 48),
                                                                rows=(37, 3, 100))
    f, qref, got, sharder, plan = _gpu_sharded(tables, kind, "int8", ec=ec)
    with emulated_cuda():
        metamat.materialize(got, _save(f, str(tmp_path / "f.pt")), device="cuda")
    for t in tbes(got):  # the device's rows as host ones, for the CPU kernel
        t.weights_host, t.host_size, t.dev_size = t.weights_dev, t.dev_size, 0
        t.weights_placements = torch.full_like(t.weights_placements, 3)  # HOST
        t.weights_physical_placements = [3] * len(t.weights_physical_placements)
    ref = shard(qref, sharder, plan, 1, "cpu")
    ref.load_state_dict(qref.state_dict())
    kjt = batch(*feature_rows(tables))
    assert torch.equal(forward(ref, kjt), forward(got, kjt))


def test_sharded_for_a_gpu_init_is_the_cpu_init(tmp_path):
    """No checkpoint: the same init bytes as the same model materialized on the CPU."""
    tables = ebc_tables(dims=(16, 32, 48), rows=(37, 3, 100))
    _, _, got, sharder, plan = _gpu_sharded(tables, "rw", "int8")
    on_cpu = shard(meta_quant(tables, "int8", True), sharder, plan, 1, "meta",
                   compute_device="cuda")
    with emulated_cuda():
        metamat.materialize(got, device="cuda", seed=3)
    with pytest.warns(UserWarning, match="quant-sharded for a GPU .* laid out on the CPU"):
        metamat.materialize(on_cpu, device="cpu", seed=3)  # said: its lookups stay GPU ones
    assert len(tbes(on_cpu)) == len(tbes(got)) > 0
    for x, y in zip(tbes(on_cpu), tbes(got)):  # same row alignment (16): the same bytes
        assert torch.equal(x.weights_host, y.weights_dev)


def _fbgemm_unified_relayout(model, total_memory, monkeypatch):
    """fbgemm's own move of a meta-sharded model's TBEs into unified memory, on the CPU
    standing for a GPU of ``total_memory`` bytes (its properties monkeypatched: fbgemm sizes
    the cache by them): each TBE's tables to the location of its kernel
    (``reset_weights_placements_and_offsets``, ``recompute_module_buffers``), then the
    cache fbgemm builds for MANAGED_CACHING tables (``update_cache_load_factor`` ->
    ``_apply_cache_state``): the reference layout and cache buffers."""
    from types import SimpleNamespace

    from fbgemm_gpu.split_table_batched_embeddings_ops_common import EmbeddingLocation
    from metamat.models.torchrec.quant_layout import KERNEL_LOCATIONS, tbe_kernel
    from metamat.models.torchrec.upstream import quant_tbes

    monkeypatch.setattr(torch.cuda, "get_device_properties",
                        lambda *a, **k: SimpleNamespace(total_memory=total_memory))
    monkeypatch.setattr(torch.cuda, "memory_reserved", lambda *a, **k: 0)
    for tbe in quant_tbes(model.coll):
        where = getattr(EmbeddingLocation, KERNEL_LOCATIONS[tbe_kernel(model.coll, tbe)])
        tbe.reset_weights_placements_and_offsets(torch.device("cpu"), where.value)
        tbe.recompute_module_buffers()
        tbe.use_cpu = False
        if where == EmbeddingLocation.MANAGED_CACHING:
            tbe.update_cache_load_factor(tbe.cache_load_factor)
    monkeypatch.undo()
    return model


UNIFIED_ATTRS = ("embedding_specs", "row_alignment", "host_size", "dev_size", "uvm_size",
                 "weights_physical_placements", "weights_physical_offsets",
                 "feature_table_map", "pooling_mode", "max_D_cache", "total_cache_hash_size",
                 "use_cpu")


@pytest.mark.parametrize("kernel", ["quant_uvm", "quant_uvm_caching"])
@pytest.mark.parametrize("coll,kind,qdtype", [("ebc", "tw", "int8"), ("ebc", "rw", "int4"),
                                              ("ebc", "cw", "int8"), ("ec", "rw", "int8")])
def test_sharded_in_unified_memory_emulated(tmp_path, monkeypatch, kernel, coll, kind, qdtype):
    """TorchRec's GPU inference sharding with the unified-memory kernels (``quant_uvm``:
    MANAGED tables; ``quant_uvm_caching``: MANAGED_CACHING, a cache in device memory): the
    rows in fbgemm's host-mapped memory (TorchRec builds inference TBEs with
    ``uvm_host_mapped=True``), written there by the host; the tables' bytes TorchRec's
    conversion's; layout, placements and every cache buffer as fbgemm lays them out (the
    cache empty: every slot -1); TorchRec's forward over the rows."""
    from _quant_models import ec_tables, forward

    ec = coll == "ec"
    tables = ec_tables(rows=(37, 3, 100)) if ec else ebc_tables(dims=(16, 32, 48),
                                                                rows=(37, 3, 100))
    f, qref, got, sharder, plan = _gpu_sharded(tables, kind, qdtype, ec=ec, kernel=kernel)
    path = _save(f, str(tmp_path / "f.pt"))
    with emulated_cuda():
        r = metamat.materialize(got, path, device="cuda")
    assert no_meta(got) and not _meta_devices(got)
    assert r.bytes_by_memory["uvm_host_mapped"] == sum(t.uvm_size for t in tbes(got)) > 0
    ref = _assert_cpu_sharding_bytes(qref, sharder, plan, got)
    layout = _fbgemm_unified_relayout(
        shard(meta_quant(tables, qdtype, True, ec=ec), sharder, plan, 1, "meta",
              compute_device="cuda"), 80 << 30, monkeypatch)
    caching = kernel == "quant_uvm_caching"
    assert len(tbes(layout)) == len(tbes(got)) > 0
    for x, y in zip(tbes(layout), tbes(got)):
        for name in UNIFIED_ATTRS:
            assert getattr(x, name) == getattr(y, name), name
        assert set(y.weights_physical_placements) == {2 if caching else 1}  # MANAGED(_CACHING)
        assert y.weights_dev.numel() == 0 and y.weights_host.numel() == 0
        assert y.weights_uvm.numel() == y.uvm_size > 0
        for name in ("weights_offsets", "weights_placements"):
            assert torch.equal(getattr(x, name), getattr(y, name)), name
        bx, by = dict(x.named_buffers()), dict(y.named_buffers())
        assert bx.keys() == by.keys()
        for n in bx:  # fbgemm leaves the (unused) pruning buffers on meta: the others
            if not bx[n].is_meta:
                assert bx[n].dtype == by[n].dtype and torch.equal(bx[n], by[n]), n
        assert x.state_dict().keys() == y.state_dict().keys()  # persistent as fbgemm's
        assert (y.lxu_cache_weights.numel() > 0) == caching
        if caching:
            assert y.lxu_cache_state.shape[1] == 32 and (y.lxu_cache_state == -1).all()
    for t in tbes(got):  # the rows as host ones (and no cache) for fbgemm's CPU kernel
        t.weights_host, t.host_size, t.uvm_size = t.weights_uvm, t.uvm_size, 0
        t.weights_placements = torch.full_like(t.weights_placements, 3)  # HOST
        t.weights_physical_placements = [3] * len(t.weights_physical_placements)
        t.lxu_cache_weights = torch.zeros(0, 0, dtype=torch.uint8)
    kjt = batch(*feature_rows(tables))
    assert torch.equal(forward(ref, kjt), forward(got, kjt))


def test_enforce_hbm_keeps_unified_rows_in_device_memory(tmp_path):
    """``enforce_hbm=True`` in the sharder's fused params: fbgemm keeps the rows of a
    unified-memory kernel in device memory (``weights_uvm`` a device tensor); so does
    metamat, the bytes the same, and a refresh writes them through the device path."""
    from torchrec.distributed.test_utils.infer_utils import TestQuantEBCSharder

    tables = ebc_tables(dims=(16, 32, 48), rows=(37, 3, 100))
    f = float_model(tables, seed=11)
    qref = quantize(f, "int8", True)
    sharder = TestQuantEBCSharder(sharding_type="table_wise", kernel_type="quant_uvm_caching",
                                  fused_params={"enforce_hbm": True},
                                  shardable_params=[t.name for t in tables])
    plan = quant_plan(qref, sharder, 1, compute_device="cuda")
    got = shard(meta_quant(tables, "int8", True), sharder, plan, 1, "meta",
                compute_device="cuda")
    assert all(t.enforce_hbm for t in tbes(got))
    path = _save(f, str(tmp_path / "f.pt"))
    with emulated_cuda():
        r = metamat.materialize(got, path, device="cuda")
        assert set(r.bytes_by_memory) == {"device"}
        assert all(t.weights_uvm.numel() == t.uvm_size > 0 for t in tbes(got))
        _assert_cpu_sharding_bytes(qref, sharder, plan, got)
        new = float_model(tables, seed=12)
        r = metamat.materialize(got, _save(new, str(tmp_path / "g.pt")), device="cuda")
        assert set(r.bytes_by_memory) <= {"device"}
    _assert_cpu_sharding_bytes(quantize(new, "int8", True), sharder, plan, got)


def test_unified_memory_cache_sized_by_free_memory(monkeypatch):
    """The cache of a ``quant_uvm_caching`` TBE gets the sets fbgemm gives it on a GPU with
    that much free memory: enough for ``cache_load_factor`` of the rows (32 sets here), or
    fewer where they do not fit (10); a second caching TBE is sized by what the first left
    (TorchRec builds them one after the other)."""
    from metamat.models.torchrec.quant_layout import device_twin
    from metamat.models.torchrec.quant_layout import device_bytes

    tables = ebc_tables(dims=(16, 32, 48), rows=(37, 3, 5000))
    _, _, got, sharder, plan = _gpu_sharded(tables, "tw", "int8", kernel="quant_uvm_caching")
    for free, sets in ((80 << 30, 32), (20000, 10)):
        layout = _fbgemm_unified_relayout(
            shard(meta_quant(tables, "int8", True), sharder, plan, 1, "meta",
                  compute_device="cuda"), free, monkeypatch)
        (x,), (tbe,) = tbes(layout), tbes(got)
        y = device_twin(tbe, "quant_uvm_caching", free)
        assert y.lxu_cache_state.shape == x.lxu_cache_state.shape == (sets, 32), free
        for n, b in x.named_buffers():
            assert b.shape == y._buffers[n].shape and b.dtype == y._buffers[n].dtype, n
    # what the first TBE took is not free for the second
    first = device_twin(tbe, "quant_uvm_caching", 120_000)
    second = device_twin(tbe, "quant_uvm_caching", 120_000 - device_bytes(first))
    assert first.lxu_cache_state.shape[0] == 32 > second.lxu_cache_state.shape[0] >= 1


def test_unified_memory_cache_sizing_refuses_what_fbgemm_asserts():
    """fbgemm asserts a positive cache_load_factor and free memory left after
    cache_reserved_memory when it sizes a cache: clear errors here, before any allocation."""
    from metamat.models.torchrec.quant_layout import device_twin

    tables = ebc_tables(dims=(16, 32, 48), rows=(37, 3, 5000))
    _, _, got, _, _ = _gpu_sharded(tables, "tw", "int8", kernel="quant_uvm_caching")
    (tbe,) = tbes(got)
    tbe.cache_reserved_memory = 50_000.0
    with pytest.raises(metamat.DeviceMemoryError, match="no GPU memory is left.*cache_sets"):
        device_twin(tbe, "quant_uvm_caching", 40_000)
    assert device_twin(tbe, "quant_uvm_caching", 80_000).lxu_cache_state.shape[0] >= 1
    tbe.cache_load_factor = 0.0
    with pytest.raises(ValueError, match="cache_load_factor 0.0: it must be > 0"):
        device_twin(tbe, "quant_uvm_caching", 80 << 30)


def test_unified_memory_cache_that_does_not_fit_is_refused(tmp_path):
    """A cache that takes the GPU's free memory (fbgemm caps its sets there, then its state
    needs more): DeviceMemoryError naming the cache and what to change, before anything is
    allocated; the model left on meta."""
    tables = ebc_tables(dims=(16, 32, 48), rows=(37, 3, 5000))
    _, _, got, _, _ = _gpu_sharded(tables, "tw", "int8", kernel="quant_uvm_caching")
    with emulated_cuda(free_memory=20000), pytest.raises(
            metamat.DeviceMemoryError, match="10 sets.*lower cache_load_factor"):
        metamat.materialize(got, device="cuda", seed=1)
    assert not no_meta(got)
    with emulated_cuda(free_memory=200_000):
        r = metamat.materialize(got, device="cuda", seed=1)
    assert r.bytes_by_memory["device"] >= 32 * 32 * 64  # 32 sets of 32 slots of 64 bytes


@pytest.mark.parametrize("case,match", [
    ("cpu plan", "device='cpu'"),
    ("two ranks", "rank 1, which TorchRec places on cuda:1"),
    ("one table on the cpu", "placed on cpu, cuda"),
])
def test_sharded_refused_on_a_gpu(tmp_path, case, match):
    """What metamat cannot lay out on one GPU is refused by name, the model left on meta."""
    from torchrec.distributed.sharding_plan import table_wise

    tables = ebc_tables(dims=(16, 32, 48), rows=(37, 3, 100))
    kw = {"cpu plan": dict(compute_device="cpu"), "two ranks": dict(world_size=2),
          "one table on the cpu": {}}[case]
    f, qref, got, sharder, _ = _gpu_sharded(tables, "tw" if case != "two ranks" else "rw",
                                            "int8", **kw)
    if case == "one table on the cpu":
        plan = _manual_plan(qref, {"t0": table_wise(rank=0, device="cpu"),
                                   "t1": table_wise(rank=0), "t2": table_wise(rank=0)})
        got = shard(meta_quant(tables, "int8", True), sharder, plan, 1, "meta",
                    compute_device="cuda")
    path = _save(f, str(tmp_path / "f.pt"))
    with emulated_cuda(), pytest.raises(metamat.UnsupportedError, match=match):
        metamat.materialize(got, path, device="cuda")
    assert not no_meta(got)
    if case == "cpu plan":
        metamat.materialize(got, path, device="cpu")  # what the message says to do
        assert no_meta(got)


def test_sharded_for_a_gpu_goes_to_cuda_0():
    """TorchRec sends rank 0's inputs to cuda:0: another GPU is refused before allocation."""
    from metamat.models.torchrec.quant import quant_modules
    from metamat.models.torchrec.quant_part import QuantPart

    tables = ebc_tables(dims=(16, 32, 48), rows=(37, 3, 100))
    _, _, got, _, _ = _gpu_sharded(tables, "tw", "int8")
    with pytest.raises(metamat.UnsupportedError, match="device='cuda:0'"):
        QuantPart(got, torch.device("cuda", 1), {}, modules=quant_modules(got), loading=True,
                  emulated=True)
    QuantPart(got, torch.device("cuda", 0), {}, modules=quant_modules(got), loading=True,
              emulated=True)


# ------------------------------------------------------------------------------------------
# on a GPU
# ------------------------------------------------------------------------------------------

@pytest.mark.cuda
@pytest.mark.parametrize("qdtype,split,where", [  # (FP16 rows are never quantized on the device)
    (q, s, w) for q, s in (("int8", False), ("int4", True), ("int2", True))
    for w in ("host", "device")] + [("fp16", False, "host")])
def test_cuda_inference_tbes(tmp_path, monkeypatch, qdtype, split, where):
    """Against TorchRec's conversion on the GPU (the float model on cuda, fbgemm's CUDA
    quantization op), every buffer and attribute, and the forward pass on the GPU; the rows
    quantized on the host, or on the device (METAMAT_QUANT_ON=device)."""
    monkeypatch.setenv("METAMAT_QUANT_ON", where)
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


@pytest.mark.cuda
@pytest.mark.parametrize("kind,qdtype,kernel,where", [  # (unified memory: written by the host)
    (k, q, "quant", w) for k, q in (("tw", "int8"), ("rw", "int4"), ("cw", "int8"), ("tw", "int2"))
    for w in ("host", "device")] + [
    ("tw", "int8", "quant_uvm", "host"), ("rw", "int4", "quant_uvm_caching", "host"),
    ("cw", "int8", "quant_uvm_caching", "host")])
def test_cuda_sharded_inference(tmp_path, monkeypatch, kind, qdtype, kernel, where):
    """TorchRec's default GPU inference sharding built on meta and materialized on the GPU,
    against the same plan sharded by TorchRec on the GPU (``sharding_device="cuda"``) with the
    converted state loaded: every table byte, every TBE buffer and attribute (unified memory
    and the cache of the ``quant_uvm*`` kernels included), the forward (a caching TBE's
    cache filled by it: then its state too); the rows quantized on the host or on the
    device."""
    monkeypatch.setenv("METAMAT_QUANT_ON", where)
    dev = torch.device("cuda", torch.cuda.current_device())
    tables = ebc_tables(dims=(16, 32, 48), rows=(37, 3, 100))
    f, qref, got, sharder, plan = _gpu_sharded(tables, kind, qdtype, kernel=kernel)
    path = _save(f, str(tmp_path / "f.pt"))
    ref = shard(qref, sharder, plan, 1, "cuda", compute_device="cuda")
    ref.load_state_dict(qref.state_dict())
    metamat.materialize(got, path, device="cuda")
    assert no_meta(got)
    assert_same_quant_state(ref, got, kind, prefix="coll.")
    for k, v in ref.state_dict().items():
        if hasattr(v, "metadata"):  # ShardedTensor placements: the same device named
            assert [str(s.placement) for s in v.metadata().shards_metadata] == \
                [str(s.placement) for s in got.state_dict()[k].metadata().shards_metadata], k
    names, rows = feature_rows(tables)
    kjt = batch(names, rows).to(dev)
    assert torch.equal(ref.coll(kjt).values(), got.coll(kjt).values())
    if kernel == "quant_uvm_caching":  # both caches took the same rows
        for x, y in zip(tbes(ref), tbes(got)):
            assert (y.lxu_cache_state >= 0).any()
            assert torch.equal(x.lxu_cache_state, y.lxu_cache_state)
            assert torch.equal(x.lxu_cache_weights, y.lxu_cache_weights)


@pytest.mark.parametrize("qdtype", ["int8", "int4", "int2"])
def test_quantized_on_the_device_emulated(tmp_path, monkeypatch, qdtype):
    """METAMAT_QUANT_ON=device: float rows uploaded and quantized by fbgemm's op on the device
    (here its CPU kernel on the emulated device), placed into the TBE rows: the same bytes as
    the host kernel's, unsharded and column-wise sharded (the row's scale/bias in every
    shard), from a checkpoint and from the init; a dim the op refuses (INT8 of 5 columns)
    falls back to the host kernel."""
    dims = (8, 16, 40) if qdtype != "int8" else (5, 16, 40)
    tables = ebc_tables(dims=dims, rows=(37, 1, 100))
    f = float_model(tables, seed=9)
    path = _save(f, str(tmp_path / "f.pt"))
    got = {}
    for where in ("host", "device"):
        monkeypatch.setenv("METAMAT_QUANT_ON", where)
        q = meta_quant(tables, qdtype, False)
        q_init = meta_quant(tables, qdtype, False)
        with emulated_cuda():
            metamat.materialize(q, path, device="cuda")
            metamat.materialize(q_init, device="cuda", seed=2)
        got[where] = [t.weights_dev.clone() for t in tbes(q) + tbes(q_init)]
    assert all(torch.equal(a, b) for a, b in zip(got["host"], got["device"]))
    if qdtype != "int8":  # TorchRec's conversion refuses odd INT8 dims
        _same_bytes(quantize(f, qdtype, False), q)


def test_quantized_on_the_device_sharded_emulated(tmp_path, monkeypatch):
    tables = ebc_tables(dims=(16, 32, 48), rows=(37, 3, 100))
    f, qref, _, sharder, plan = _gpu_sharded(tables, "cw", "int4")
    path = _save(f, str(tmp_path / "f.pt"))
    got = {}
    for where in ("host", "device"):
        monkeypatch.setenv("METAMAT_QUANT_ON", where)
        q = shard(meta_quant(tables, "int4", True), sharder, plan, 1, "meta",
                  compute_device="cuda")
        with emulated_cuda():
            metamat.materialize(q, path, device="cuda")
        got[where] = [t.weights_dev.clone() for t in tbes(q)]
    assert all(torch.equal(a, b) for a, b in zip(got["host"], got["device"]))


def test_quant_on_is_checked_first(tmp_path, monkeypatch):
    tables = ebc_tables()
    path = _save(float_model(tables), str(tmp_path / "f.pt"))
    q = meta_quant(tables, "int8", False)
    monkeypatch.setenv("METAMAT_QUANT_ON", "gpu")
    with emulated_cuda(), pytest.raises(ValueError, match="METAMAT_QUANT_ON='gpu'"):
        metamat.materialize(q, path, device="cuda")
    assert not no_meta(q)


@pytest.mark.parametrize("kind", [8, 4, 2])
@pytest.mark.parametrize("sb_last", [False, True])
def test_device_quantization_against_the_host_kernel(kind, sb_last):
    """DeviceSink.quantize_on_device (fbgemm's op, then the placement) against the host
    kernel through the bounce buffers, byte for byte: whole rows and two column shards of
    one job (the row's scale/bias in each), both scale/bias placements, padded rows, a
    nonzero row offset; a shard not on whole bytes falls back to the host kernel's error."""
    from metamat.load.quantize import QuantJob, QuantOut, quantize_into
    from metamat.load.quantize_device import DeviceSink

    cols, rows = 48, 9
    src = torch.randn(rows, cols, generator=torch.Generator().manual_seed(kind))
    src[3] = 0.0  # a zero row: its range is 0
    src[4, ::2] = -0.0

    def outs():
        split = 16
        return [QuantOut(0, cols, kind, 1, 64, cols * kind // 8 + 4 + 12, sb_last),
                QuantOut(0, split, kind, 2, 0, split * kind // 8 + 4, sb_last),
                QuantOut(split, cols - split, kind, 3, 32, (cols - split) * kind // 8 + 8,
                         sb_last)]

    got = {}
    for on_device in (False, True):
        job = QuantJob("t", "t", (rows + 2, cols), 0, rows + 2, outs())
        for o in job.outs:
            o.base = torch.zeros(o.offset + (rows + 2) * o.stride, dtype=torch.uint8)
            o.device_memory = True
        sink = DeviceSink(on_device=on_device)
        quantize_into(src, job, 2, sink=sink)  # rows 2.. of the job
        sink.finish()
        got[on_device] = [o.base for o in job.outs]
    for a, b in zip(got[False], got[True]):
        assert torch.equal(a, b)
    if kind != 8:
        bad = QuantJob("t", "t", (rows, cols), 0, rows,
                       [QuantOut(1, cols - 8, kind, 4, 0, cols, sb_last)])
        bad.outs[0].base = torch.zeros(rows * cols, dtype=torch.uint8)
        bad.outs[0].device_memory = True
        with pytest.raises(RuntimeError, match="whole bytes"):
            quantize_into(src, bad, 0, sink=DeviceSink(on_device=True))


@pytest.mark.cuda
def test_cuda_many_small_pieces(tmp_path, monkeypatch):
    """Tables of a few MiB cut into 4 KiB pieces: the bounce buffers turn over hundreds of
    times with the copies truly asynchronous; host and device quantization both give the
    bytes of TorchRec's GPU conversion."""
    import metamat.load.quantize as quantize_mod

    monkeypatch.setattr(quantize_mod, "PIECE_BYTES", 4096)
    dev = torch.device("cuda", torch.cuda.current_device())
    tables = ebc_tables(dims=(64, 128), rows=(20000, 7000))
    f = float_model(tables, seed=8)
    path = _save(f, str(tmp_path / "f.pt"))
    fc = Model(tables, dev)
    fc.load_state_dict(f.state_dict())
    ref = quantize(fc, "int4", False)
    for where in ("host", "device"):
        monkeypatch.setenv("METAMAT_QUANT_ON", where)
        q = meta_quant(tables, "int4", False)
        metamat.materialize(q, path, device="cuda", staging_bytes=1 << 20)
        for x, y in zip(tbes(ref), tbes(q)):
            assert torch.equal(x.weights_dev, y.weights_dev), where
