"""metamat.materialize(model, ckpt) on real TorchRec models and real checkpoints.

Checkpoints are written by torch DCP (from eager TorchRec DMPs), ``safetensors.torch``
and ``torch.save``; they are loaded into DMPs sharded on meta with other plans and world
sizes, and into eager DMPs in place. Tables and fused-optimizer state must come back bit for
bit; a bad checkpoint must leave the model exactly as it was. Scenarios share spawned gloo
groups to keep the runtime down.
"""
from __future__ import annotations

import json
import os
import shutil
import struct
from typing import Dict, List

import pytest
import torch
import torch.distributed as dist

pytest.importorskip("torchrec")
pytest.importorskip("fbgemm_gpu")

from _dist import run_dist  # noqa: E402
from test_torchrec_materialize import (  # noqa: E402
    _optim_blocks, _step, assemble, ebc_tables, fused_params, kjt_batch, local_blocks,
    make_plan, meta_bytes_of, no_meta_left, reference_table,
)

N_TABLES = 5
# saved by an eager DMP at world 2, loaded at world 2 with another plan:
# RW->TW, TW->CW, CW->TWRW, DP->RW (DP -> sharded), RW->DP (sharded -> DP)
SAVE_KINDS = {"t0": "rw", "t1": "tw", "t2": "cw", "t3": "dp", "t4": "rw"}
LOAD2_KINDS = {"t0": "tw", "t1": "cw", "t2": "twrw", "t3": "rw", "t4": "dp"}
LOAD1_KINDS = {"t0": "tw", "t1": "tw", "t2": "rw", "t3": "cw", "t4": "twrw"}
# t4 is data-parallel in LOAD2: its saved momentum has nowhere to go (unexpected, never dropped
# silently), accepted by name
DROPPED = "optim.state.embedding_bags.t4.weight.t4.momentum1"
SEED = 3


def _tables():
    return ebc_tables(n=N_TABLES)


def _sharder():
    from torchrec.distributed.embeddingbag import EmbeddingBagCollectionSharder

    return EmbeddingBagCollectionSharder(fused_params=fused_params())


def _ebc(tables=None):
    from torchrec import EmbeddingBagCollection

    return EmbeddingBagCollection(tables=tables or _tables(), device=torch.device("meta"))


def _eager(kinds, world_size, tables=None):
    from torchrec.distributed.model_parallel import DistributedModelParallel
    from torchrec.distributed.types import ShardingEnv

    ebc, sharder = _ebc(tables), _sharder()
    plan = make_plan(ebc, kinds, "fused", world_size, sharder)
    env = ShardingEnv.from_process_group(dist.group.WORLD)
    return DistributedModelParallel(ebc, env, device=torch.device("cpu"), plan=plan,
                                    sharders=[sharder])


def _on_meta(kinds, world_size, tables=None):
    import metamat

    ebc, sharder = _ebc(tables), _sharder()
    plan = make_plan(ebc, kinds, "fused", world_size, sharder)
    return metamat.shard_on_meta(ebc, plan=plan, sharders=[sharder])


def _state(model) -> Dict[str, list]:
    """Local blocks of the tables and of the fused optimizer state."""
    out = local_blocks(model.state_dict())
    out.update(_optim_blocks(model))
    return out


def _bits_of(model) -> Dict[str, list]:
    return {k: [(o, t.view(torch.int16 if t.element_size() == 2 else torch.int32))
                for o, t in v] for k, v in _state(model).items()}


def _unchanged(before, model) -> bool:
    after = _bits_of(model)
    return before.keys() == after.keys() and all(
        all(o1 == o2 and torch.equal(a, b) for (o1, a), (o2, b) in zip(before[k], after[k]))
        for k in before)


def _shared_dir(rank, tmp):
    return os.path.join(tmp, "ckpt")


def _try(fn):
    try:
        fn()
    except Exception as e:  # noqa: BLE001 - the type and message go to the parent
        return f"{type(e).__name__}: {e}"
    return None


# --------------------------------------------------------------------------------------
# world 2: save with one plan, load with another (meta and eager), agreement on failure
# --------------------------------------------------------------------------------------


def worker_world2(rank, world_size, tmp):
    import torch.distributed.checkpoint as dcp

    import metamat

    res = {}
    eager = _eager(SAVE_KINDS, world_size)
    _step(eager, kjt_batch(N_TABLES, batch=8, rows=40, seed=10 + rank))  # momentum != 0
    res["saved"] = _state(eager)
    full = os.path.join(tmp, "full")
    weights = os.path.join(tmp, "weights")
    dcp.save({"model": eager.state_dict(), "optim": eager.fused_optimizer.state_dict()},
             checkpoint_id=full)
    dcp.save(eager.state_dict(), checkpoint_id=weights)
    dist.barrier()

    # one rank's failure makes every rank raise; nothing registered, no hang
    meta = _on_meta(LOAD2_KINDS, world_size)
    bad = full if rank == 0 else os.path.join(tmp, "does-not-exist")
    res["agree_err"] = _try(lambda: metamat.materialize(meta, bad, device="cpu",
                                                         ignore_unexpected=[DROPPED]))
    res["agree_meta_left"] = meta_bytes_of(meta)

    # momentum of a table that is data-parallel now: refused under strict, named
    res["dropped_err"] = _try(lambda: metamat.materialize(meta, full, device="cpu"))
    res["dropped_meta_left"] = meta_bytes_of(meta)

    # meta DMP, another plan: tables and optimizer state
    report = metamat.materialize(meta, full, device="cpu", ignore_unexpected=[DROPPED])
    res["report"] = str(report)
    res["prefixes"] = report.key_prefixes
    res["initialized"] = report.initialized
    res["amp"] = report.read_amplification
    res["warnings"] = report.warnings
    res["meta_left"] = no_meta_left(meta)
    res["loaded_meta"] = _state(meta)

    # eager DMP, same other plan: overwritten in place; failure first leaves it unchanged
    eager2 = _eager(LOAD2_KINDS, world_size)
    before = _bits_of(eager2)
    res["agree_eager_err"] = _try(lambda: metamat.materialize(eager2, bad,
                                                               ignore_unexpected=[DROPPED]))
    res["agree_eager_unchanged"] = _unchanged(before, eager2)
    res["eager_unexpected"] = metamat.materialize(eager2, full, strict=False).unexpected
    res["loaded_eager"] = _state(eager2)

    # weights-only checkpoint: optimizer state initialised (zeros), strict still passes
    meta_w = _on_meta(LOAD2_KINDS, world_size)
    rep_w = metamat.materialize(meta_w, weights, device="cpu")
    res["weights_initialized"] = rep_w.initialized
    res["weights_prefixes"] = rep_w.key_prefixes
    res["loaded_weights_only"] = _state(meta_w)

    # train after loading: meta-loaded and eager-loaded models step identically
    batch = kjt_batch(N_TABLES, batch=8, rows=40, seed=20 + rank)
    res["out_meta"] = _step(meta, batch)
    res["out_eager"] = _step(eager2, batch)
    res["after_meta"] = _state(meta)
    res["after_eager"] = _state(eager2)
    return res


def _full(per_rank: List[Dict[str, list]], key: str, shape) -> torch.Tensor:
    return assemble(per_rank, key, shape)


def _shape(key: str) -> tuple:
    name = key.split(".")[2] if key.startswith("state.") else key.split(".")[-2]
    rows = 40 + 3 * int(name[1:])
    return (rows, 8) if not key.startswith("state.") else (rows,)


def _full_any(per_rank, key) -> torch.Tensor:
    """The global tensor, its shape taken from the blocks (CW row-wise momentum is
    rows x column shards long)."""
    n = max(o[0] + t.shape[0] for r in per_rank for o, t in r.get(key, []))
    shape = _shape(key)
    return assemble(per_rank, key, (n,) + tuple(shape[1:]))


def _assert_same_state(saved_ranks, loaded_ranks, keys=None, what=""):
    """Tables bit-identical; row-wise momentum bit-identical, with one accumulator per row
    repeated for each column shard, and the mean taken when going from CW to one."""
    keys = keys or sorted({k for r in saved_ranks for k in r})
    for k in keys:
        a = _full_any(saved_ranks, k)
        b = _full_any(loaded_ranks, k)
        assert not torch.isnan(a).any() and not torch.isnan(b).any(), f"{what} {k}: holes"
        rows = _shape(k)[0]
        if a.shape != b.shape:
            if a.shape[0] == rows:
                a = a.repeat(b.shape[0] // rows)
            else:
                a = a.view(-1, rows).mean(0)
                torch.testing.assert_close(a, b, msg=f"{what} {k} mean")
                continue
        assert torch.equal(a.view(torch.int32), b.view(torch.int32)), f"{what} {k} differs"


@pytest.fixture(scope="module")
def world2(tmp_path_factory):
    tmp = str(tmp_path_factory.mktemp("load2"))
    return tmp, run_dist(worker_world2, 2, tmp)


@pytest.mark.multiprocess
def test_dcp_other_plan_bit_identical_world2(world2):
    _, res = world2
    saved = [r["saved"] for r in res]
    keys = sorted({k for r in saved for k in r})
    assert sum(k.startswith("state.") for k in keys) == 4  # 4 sharded tables have momentum
    for r in res:
        assert r["meta_left"] == []
        assert r["prefixes"] == {"model": "model.", "optim": "optim."}
        assert set(r["initialized"]) <= {"state.embedding_bags.t3.weight.t3.momentum1"}
        assert set(r["warnings"]) <= {"state.embedding_bags.t2.weight.t2.momentum1: "
                                      "row-wise optimizer state of 2 column shards loaded as "
                                      "their mean"}
        # column slices of row-major chunks: rows closer than 4 KiB are read as one span
        assert 1.0 <= r["amp"] <= 2.0
    # DP->RW t3 has no saved momentum; RW->DP t4 has none loaded: compare the common ones
    loaded_keys = sorted({k for r in res for k in r["loaded_meta"]})
    common = [k for k in keys if k in loaded_keys]
    assert "embedding_bags.t3.weight" in common and "embedding_bags.t4.weight" in common
    _assert_same_state(saved, [r["loaded_meta"] for r in res], common, "meta")
    _assert_same_state(saved, [r["loaded_eager"] for r in res], common, "eager")
    # t3 was DP when saved, so the checkpoint has no optimizer state for it: initialised
    # (zeros, as TorchRec does) even with strict=True; all others come from the checkpoint.
    t3m = _full([r["loaded_meta"] for r in res], "state.embedding_bags.t3.weight.t3.momentum1", (49,))
    assert torch.equal(t3m, torch.zeros(49))


@pytest.mark.multiprocess
def test_saved_state_without_a_place_is_unexpected_world2(world2):
    """RW -> DP t4: its saved momentum cannot load; strict refuses it by name (the model left
    on meta), strict=False reports it, ignore_unexpected accepts it (above)."""
    _, res = world2
    for r in res:
        assert r["dropped_err"].startswith("UnexpectedTensorError"), r["dropped_err"]
        assert DROPPED in r["dropped_err"] and "no such state in this plan" in r["dropped_err"]
        assert r["dropped_meta_left"][1] < 1024
        assert r["eager_unexpected"] == [DROPPED]


@pytest.mark.multiprocess
def test_failure_on_one_rank_raises_everywhere_world2(world2):
    _, res = world2
    for rank, r in enumerate(res):
        assert r["agree_err"] is not None and r["agree_eager_err"] is not None
        assert "CheckpointError" in r["agree_err"] or "MissingFileError" in r["agree_err"]
        if rank == 0:
            assert "rank(s) [1]" in r["agree_err"], r["agree_err"]
        assert r["agree_meta_left"][1] < 1024  # still on meta: nothing real allocated
        assert r["agree_eager_unchanged"]


@pytest.mark.multiprocess
def test_weights_only_checkpoint_initialises_optimizer_world2(world2):
    _, res = world2
    saved = [r["saved"] for r in res]
    weights = sorted(k for k in {k for r in saved for k in r} if not k.startswith("state."))
    _assert_same_state(saved, [r["loaded_weights_only"] for r in res], weights, "weights-only")
    inits = sorted({k for r in res for k in r["weights_initialized"]})
    assert inits and all(k.startswith("state.") and k.endswith("momentum1") for k in inits)
    for r in res:
        assert r["weights_prefixes"] == {"model": "", "optim": None}
        for k, blocks in r["loaded_weights_only"].items():
            if k.startswith("state."):
                assert all(torch.equal(t, torch.zeros_like(t)) for _, t in blocks)


@pytest.mark.multiprocess
def test_train_step_after_load_world2(world2):
    _, res = world2
    for r in res:
        assert torch.isfinite(r["out_meta"]).all()
        assert torch.equal(r["out_meta"], r["out_eager"])
    keys = sorted({k for r in res for k in r["after_meta"]})
    _assert_same_state([r["after_eager"] for r in res], [r["after_meta"] for r in res], keys,
                       "after step")
    # the step changed the weights (the optimizer ran on the loaded state)
    k = "embedding_bags.t0.weight"
    assert not torch.equal(_full([r["after_meta"] for r in res], k, _shape(k)),
                           _full([r["loaded_meta"] for r in res], k, _shape(k)))


# --------------------------------------------------------------------------------------
# world 1: other world size, other formats, missing tensors, hostile files, dense (DLRM)
# --------------------------------------------------------------------------------------


def _write_formats(tmp: str, full: Dict[str, torch.Tensor]) -> Dict[str, str]:
    """Checkpoints of the full tables in every non-DCP format (and hostile variants)."""
    from safetensors.torch import save_file

    paths = {}
    st = os.path.join(tmp, "model.safetensors")
    save_file(full, st)
    paths["safetensors"] = st
    shards = os.path.join(tmp, "shards")
    os.makedirs(shards)
    names = sorted(full)
    wmap = {}
    for i, part in enumerate((names[:2], names[2:])):
        fn = f"model-{i + 1:05d}-of-00002.safetensors"
        save_file({k: full[k] for k in part}, os.path.join(shards, fn))
        wmap.update({k: fn for k in part})
    idx = os.path.join(shards, "model.safetensors.index.json")
    with open(idx, "w") as f:
        json.dump({"metadata": {}, "weight_map": wmap}, f)
    paths["index"] = idx
    pt = os.path.join(tmp, "model.pt")
    torch.save(full, pt)
    paths["torch_save"] = pt

    missing = {k: v for k, v in full.items() if ".t2." not in k}
    paths["missing_t2"] = os.path.join(tmp, "missing.safetensors")
    save_file(missing, paths["missing_t2"])

    # hostile variants of the single file
    data = open(st, "rb").read()
    (hlen,) = struct.unpack("<Q", data[:8])
    header = json.loads(data[8:8 + hlen])
    body = data[8 + hlen:]

    def write(name, hdr, payload):
        raw = json.dumps(hdr).encode()
        p = os.path.join(tmp, name + ".safetensors")
        with open(p, "wb") as f:
            f.write(struct.pack("<Q", len(raw)) + raw + payload)
        paths[name] = p

    paths["truncated"] = os.path.join(tmp, "truncated.safetensors")
    with open(paths["truncated"], "wb") as f:
        f.write(data[:-100])
    p = os.path.join(tmp, "header_past_end.safetensors")
    with open(p, "wb") as f:
        f.write(struct.pack("<Q", len(data) * 4) + data[8:])
    paths["header_past_end"] = p
    last = max((k for k in header if k != "__metadata__"),
               key=lambda k: header[k]["data_offsets"][1])
    h = json.loads(json.dumps(header))
    b, e = h[last]["data_offsets"]
    h[last]["data_offsets"] = [b + len(body), e + len(body)]
    write("offsets_outside", h, body)
    save_file({k: (v.double() if ".t1." in k else v) for k, v in full.items()},
              os.path.join(tmp, "wrong_dtype.safetensors"))
    paths["wrong_dtype"] = os.path.join(tmp, "wrong_dtype.safetensors")
    save_file({k: (torch.cat([v, v[:1]]) if ".t1." in k else v) for k, v in full.items()},
              os.path.join(tmp, "wrong_shape.safetensors"))
    paths["wrong_shape"] = os.path.join(tmp, "wrong_shape.safetensors")
    return paths


HOSTILE = ("truncated", "header_past_end", "offsets_outside", "wrong_dtype", "wrong_shape")


def worker_world1(rank, world_size, tmp, full_dcp):
    import metamat
    from metamat.checkpoint import CheckpointError, MissingTensorError

    res = {}
    # DCP written at world 2 (RW/TW/CW/DP) into world 1 (TW/RW/CW/TWRW)
    meta = _on_meta(LOAD1_KINDS, world_size)
    rep = metamat.materialize(meta, full_dcp, device="cpu")
    res["dcp"] = _state(meta)
    res["dcp_amp"] = rep.read_amplification

    # the full tables, through other formats
    blocks = local_blocks(meta.state_dict())
    full = {k: assemble([blocks], k, _shape(k)) for k in blocks}
    paths = _write_formats(tmp, full)
    res["full"] = full
    for fmt in ("safetensors", "index", "torch_save"):
        m = _on_meta(LOAD1_KINDS, world_size)
        metamat.materialize(m, paths[fmt], device="cpu")
        res[fmt] = local_blocks(m.state_dict())
    # an opened checkpoint object works too
    m = _on_meta(LOAD1_KINDS, world_size)
    metamat.materialize(m, metamat.open_checkpoint(paths["safetensors"]), device="cpu")
    res["object"] = local_blocks(m.state_dict())

    # fp32 checkpoint into fp16 tables
    from torchrec.modules.embedding_configs import DataType

    t16 = _tables()
    for t in t16:
        t.data_type = DataType.FP16
    m16 = _on_meta(LOAD1_KINDS, world_size, t16)
    metamat.materialize(m16, paths["safetensors"], device="cpu")
    res["fp16"] = local_blocks(m16.state_dict())
    res["fp16_out"] = _step(m16, kjt_batch(N_TABLES, batch=4, rows=40, seed=1))

    # missing table: strict names it and leaves the model on meta; non-strict initialises
    m = _on_meta(LOAD1_KINDS, world_size)
    try:
        metamat.materialize(m, paths["missing_t2"], device="cpu")
        res["strict_err"] = None
    except MissingTensorError as e:
        res["strict_err"], res["strict_names"] = str(e), e.names
    res["strict_meta"] = meta_bytes_of(m)
    rep = metamat.materialize(m, paths["missing_t2"], device="cpu", strict=False, seed=SEED)
    res["nonstrict"] = local_blocks(m.state_dict())
    res["nonstrict_initialized"] = rep.initialized
    res["nonstrict_report"] = str(rep)

    # hostile files: CheckpointError, meta model still meta, eager model unchanged bit for bit
    m = _on_meta(LOAD1_KINDS, world_size)
    eager = _eager(LOAD1_KINDS, world_size)
    before = _bits_of(eager)
    res["hostile"] = {}
    for name in HOSTILE:
        errs = []
        for model in (m, eager):
            try:
                metamat.materialize(model, paths[name], device="cpu")
                errs.append(None)
            except CheckpointError as e:
                errs.append(f"{type(e).__name__}: {e}")
        res["hostile"][name] = (errs, meta_bytes_of(m), _unchanged(before, eager))
    # ...and the same eager model then loads the good file in place
    metamat.materialize(eager, paths["safetensors"])
    res["eager_good"] = local_blocks(eager.state_dict())
    return res


@pytest.fixture(scope="module")
def world1(world2, tmp_path_factory):
    tmp2, res2 = world2
    tmp = str(tmp_path_factory.mktemp("load1"))
    (r,) = run_dist(worker_world1, 1, tmp, os.path.join(tmp2, "full"))
    return res2, r


@pytest.mark.multiprocess
def test_dcp_world2_into_world1(world1):
    res2, r = world1
    saved = [x["saved"] for x in res2]
    _assert_same_state(saved, [r["dcp"]], sorted(k for k in r["dcp"] if k in
                                                 {k for x in saved for k in x}), "world1")
    assert 1.0 <= r["dcp_amp"] <= 2.0


@pytest.mark.multiprocess
@pytest.mark.parametrize("fmt", ["safetensors", "index", "torch_save", "object"])
def test_other_formats_bit_identical(world1, fmt):
    _, r = world1
    for k, v in r["full"].items():
        got = assemble([r[fmt]], k, v.shape)
        assert torch.equal(got.view(torch.int32), v.view(torch.int32)), (fmt, k)


@pytest.mark.multiprocess
def test_fp32_checkpoint_into_fp16_tables(world1):
    _, r = world1
    for k, v in r["full"].items():
        full = torch.full(v.shape, float("nan"), dtype=torch.float16)
        for o, t in r["fp16"][k]:
            full[o[0]:o[0] + t.shape[0], o[1]:o[1] + t.shape[1]] = t
        assert full.dtype == torch.float16
        assert torch.equal(full, v.half()), k
    assert torch.isfinite(r["fp16_out"].float()).all()


@pytest.mark.multiprocess
def test_missing_table_strict_and_nonstrict(world1):
    _, r = world1
    assert r["strict_err"] is not None and "embedding_bags.t2.weight" in r["strict_err"]
    assert r["strict_names"] == ["embedding_bags.t2.weight"]
    assert r["strict_meta"][1] < 1024  # nothing allocated
    # the file has no optimizer state: initialised (zeros), listed, allowed even when strict
    assert [k for k in r["nonstrict_initialized"] if not k.startswith("state.")] == \
        ["embedding_bags.t2.weight"]
    assert "initialised (not in checkpoint): embedding_bags.t2.weight" in r["nonstrict_report"]
    for k, v in r["full"].items():
        got = assemble([r["nonstrict"]], k, v.shape)
        if ".t2." in k:  # the init path's plan-invariant values
            ref = reference_table("t2", v.shape[0], v.shape[1], SEED)
            assert torch.equal(got, ref)
        else:
            assert torch.equal(got, v), k


@pytest.mark.multiprocess
@pytest.mark.parametrize("name", HOSTILE)
def test_hostile_checkpoint_leaves_model_untouched(world1, name):
    _, r = world1
    (err_meta, err_eager), meta_bytes, eager_unchanged = r["hostile"][name]
    assert err_meta is not None and err_eager is not None, name
    assert meta_bytes[1] < 1024, "meta model got real storage"
    assert eager_unchanged, "eager model was modified"
    for k, v in r["full"].items():
        assert torch.equal(assemble([r["eager_good"]], k, v.shape), v), k


# --------------------------------------------------------------------------------------
# DLRM: dense MLPs loaded from their state_dict keys
# --------------------------------------------------------------------------------------


def _dlrm(dense_device):
    from torchrec import EmbeddingBagCollection
    from torchrec.models.dlrm import DLRM

    ebc = EmbeddingBagCollection(tables=ebc_tables(n=3), device=torch.device("meta"))
    return DLRM(embedding_bag_collection=ebc, dense_in_features=4, dense_arch_layer_sizes=[16, 8],
                over_arch_layer_sizes=[16, 1], dense_device=dense_device), ebc


def worker_dlrm(rank, world_size, tmp):
    import torch.distributed.checkpoint as dcp
    from torchrec.distributed.model_parallel import DistributedModelParallel
    from torchrec.distributed.types import ShardingEnv

    import metamat

    torch.manual_seed(5)
    model, ebc = _dlrm(torch.device("cpu"))
    sharder = _sharder()
    path = "sparse_arch.embedding_bag_collection"
    plan = make_plan(ebc, {"t0": "tw", "t1": "rw", "t2": "cw"}, "fused", world_size, sharder, path)
    env = ShardingEnv.from_process_group(dist.group.WORLD)
    eager = DistributedModelParallel(model, env, device=torch.device("cpu"), plan=plan,
                                     sharders=[sharder])
    dense = torch.randn(8, 4, generator=torch.Generator().manual_seed(1))
    batch = kjt_batch(3, batch=8, rows=40, seed=2)
    eager(dense, batch).sum().backward()
    ckpt = os.path.join(tmp, "dlrm")
    dcp.save(eager.state_dict(), checkpoint_id=ckpt)

    model2, ebc2 = _dlrm(torch.device("meta"))
    plan2 = make_plan(ebc2, {"t0": "rw", "t1": "cw", "t2": "tw"}, "fused", world_size, sharder,
                      path)
    meta = metamat.shard_on_meta(model2, plan=plan2, sharders=[sharder])
    rep = metamat.materialize(meta, ckpt, device="cpu")
    res = {"left": no_meta_left(meta), "loaded": rep.loaded, "initialized": rep.initialized}
    se, sm = eager.state_dict(), meta.state_dict()
    res["dense_diff"] = [k for k, v in se.items() if not hasattr(v, "local_shards")
                         and not torch.equal(v, sm[k])]
    res["dense_keys"] = sorted(k for k, v in se.items() if not hasattr(v, "local_shards"))
    with torch.no_grad():
        res["out_equal"] = torch.equal(eager(dense, batch), meta(dense, batch))
    loss = meta(dense, batch).sum()
    loss.backward()
    res["grads"] = all(p.grad is not None for n, p in meta.named_parameters() if "over_arch" in n)
    return res


@pytest.mark.multiprocess
def test_dlrm_dense_and_tables_loaded(tmp_path):
    (r,) = run_dist(worker_dlrm, 1, str(tmp_path))
    assert r["left"] == []
    assert all(k.startswith("state.") for k in r["initialized"])  # weights-only checkpoint
    assert any("dense_arch" in k for k in r["loaded"]) and any("over_arch" in k for k in r["loaded"])
    assert r["dense_keys"] and r["dense_diff"] == []
    assert r["out_equal"]
    assert r["grads"]
