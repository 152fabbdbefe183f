"""Multi-probe zero-collision hashing (TorchRec's ``HashZchManagedCollisionModule``) on real
TorchRec: shard on meta, materialize, load DCP checkpoints of eager models (any world size:
the tables reshard at bucket boundaries), look up and train on; compared with eager TorchRec
DMPs holding the same values (gloo, CPU, world size 1 and 2).

On the CPU, fbgemm's ``zero_collision_hash`` only looks ids up (``readonly``): it cannot insert
new ids, so the CPU runs write the slots an eager model's training fills (each bucket full of
ids of that bucket, ``_trained_slots``) and train the tables with read-only lookups. Insertion
and eviction run in the GPU test."""
from __future__ import annotations

import os

import pytest
import torch
import torch.distributed as dist

pytest.importorskip("torchrec")
pytest.importorskip("fbgemm_gpu")
pytest.importorskip("torchrec.modules.hash_mc_modules")

import metamat  # noqa: E402

from _dist import run_dist  # noqa: E402
import test_torchrec_managed_collision as mc  # noqa: E402
from test_torchrec_managed_collision import (  # noqa: E402
    _batch, _output, _same, _save_again, _shared,
)
from test_torchrec_materialize import (  # noqa: E402
    assemble, local_blocks, no_meta_left, reference_table,
)

SEED = 5
ROWS = (64, 96)
BUCKETS = 4  # a multiple of the world size; each table's rows a multiple of it
HASH = 400  # raw ids in [0, HASH): a full bucket holds a quarter of its ids
FAKE_ID = 10 * HASH  # ids no batch holds (the GPU test's expired slots)
MC_PREFIX = "_managed_collision_collection._managed_collision_modules."


def _module(kind: str, device: torch.device, buckets: int = BUCKETS, inference: bool = False):
    """Two tables: t0 with TTL eviction (its metadata) and id-frequency tracking (its runtime
    metadata) and metrics logging; t1 with neither. ``inference``: modules for serving (no
    eviction metadata)."""
    from torchrec import (EmbeddingBagCollection, EmbeddingBagConfig, EmbeddingCollection,
                          EmbeddingConfig)
    from torchrec.modules.hash_mc_evictions import (HashZchEvictionConfig,
                                                    HashZchEvictionPolicyName)
    from torchrec.modules.hash_mc_modules import HashZchManagedCollisionModule
    from torchrec.modules.mc_embedding_modules import (ManagedCollisionEmbeddingBagCollection,
                                                       ManagedCollisionEmbeddingCollection)
    from torchrec.modules.mc_modules import ManagedCollisionCollection

    config = EmbeddingBagConfig if kind == "ebc" else EmbeddingConfig
    tables = [config(name=f"t{i}", embedding_dim=8, num_embeddings=rows,
                     feature_names=[f"f{i}"]) for i, rows in enumerate(ROWS)]
    first = dict(eviction_policy_name=HashZchEvictionPolicyName.SINGLE_TTL_EVICTION,
                 eviction_config=HashZchEvictionConfig(features=["f0"], single_ttl=10),
                 track_id_freq=True, tb_logging_frequency=100)
    mcs = {t.name: HashZchManagedCollisionModule(
        zch_size=t.num_embeddings, device=device, total_num_buckets=buckets, name=t.name,
        is_inference=inference, **(first if i == 0 else {})) for i, t in enumerate(tables)}
    mcc = ManagedCollisionCollection(mcs, embedding_configs=tables)
    if kind == "ebc":
        return ManagedCollisionEmbeddingBagCollection(
            EmbeddingBagCollection(tables=tables, device=device), mcc,
            return_remapped_features=False)
    return ManagedCollisionEmbeddingCollection(
        EmbeddingCollection(tables=tables, device=device), mcc, return_remapped_features=False)


def _eager(kind: str, world_size: int, device: str = "cpu", **module_args):
    return mc._eager(kind, world_size, device, build=_module, **module_args)


def _on_meta(kind: str, world_size: int, cuda: bool = False, **module_args):
    return mc._on_meta(kind, world_size, cuda, build=_module, **module_args)


def _hash_zchs(model):
    from torchrec.modules.hash_mc_modules import HashZchManagedCollisionModule

    return [m for m in model.modules() if isinstance(m, HashZchManagedCollisionModule)]


def _read_only(model):
    """Look ids up without inserting (all fbgemm's CPU kernel does), the rest of the model
    training: TorchRec's in-trainer bulk-eval mode of the MC modules."""
    model.train()
    for mc in _hash_zchs(model):
        mc.reset_intrainer_bulk_eval_mode()
    return model


def _trained_slots(model, rank: int, world_size: int) -> None:
    """Write the state training leaves: every bucket full of ids of that bucket (id %
    buckets), in shuffled slots; TTL metadata and id counts."""
    with torch.no_grad():
        for i, mc in enumerate(_hash_zchs(model)):
            g = torch.Generator().manual_seed(1000 * i + 10 * world_size + rank)
            per = mc._zch_size // (mc._end_bucket - mc._start_bucket)
            for j, b in enumerate(range(mc._start_bucket, mc._end_bucket)):
                ids = b + mc._buckets * torch.randperm(HASH // mc._buckets, generator=g)[:per]
                mc._hash_zch_identities[j * per:(j + 1) * per, 0] = ids
            if mc._hash_zch_metadata is not None:
                mc._hash_zch_metadata.copy_(torch.randint(
                    0, 500_000, mc._hash_zch_metadata.shape, generator=g, dtype=torch.int32))
            if mc._hash_zch_runtime_meta is not None:
                mc._hash_zch_runtime_meta.copy_(torch.randint(
                    0, 50, mc._hash_zch_runtime_meta.shape, generator=g))


def _step(kind: str, model, seed: int) -> torch.Tensor:
    out = _output(kind, model(_batch(seed, hash_size=HASH)))
    weights = torch.arange(out.numel(), dtype=out.dtype, device=out.device)
    (out * weights.reshape(out.shape)).sum().backward()
    return out.detach().cpu().clone()


def _loaded_reference(kind: str, world_size: int, ckpt: str, device: str = "cpu",
                      **module_args):
    import torch.distributed.checkpoint as dcp

    model = _eager(kind, world_size, device, **module_args)
    sd = model.state_dict()
    dcp.load(sd, checkpoint_id=ckpt)
    model.load_state_dict(sd)
    return model


def _hits(kind: str, model) -> int:
    """How many looked-up ids of a batch were found in their slots (the test's slots are
    meaningful: a lookup is not just a fallback)."""
    hits = 0
    with torch.no_grad():
        for mc in _hash_zchs(model):
            seen = set(mc._hash_zch_identities.flatten().tolist())
            hits += len(seen & set(_batch(400, hash_size=HASH).values().tolist()))
    return hits


def _mc_state(model) -> dict:
    blocks = local_blocks(model.state_dict())
    return {k: v for k, v in blocks.items() if MC_PREFIX in k}


def worker_world2(rank, world_size, tmp, kind):
    import torch.distributed.checkpoint as dcp

    res = {}
    fresh = _eager(kind, world_size)
    model = _on_meta(kind, world_size)
    metamat.materialize(model, seed=SEED)
    res["init_left"] = no_meta_left(model)
    mine, theirs = local_blocks(model.state_dict()), local_blocks(fresh.state_dict())
    res["init_mc_differs"] = _same(mine, theirs, [k for k in theirs if MC_PREFIX in k])
    res["init_keys_differ"] = sorted(set(mine) ^ set(theirs))
    res["mc_keys"] = sorted(k.rsplit(".", 1)[1] for k in theirs if MC_PREFIX in k)
    res["init_tables"] = {k: v for k, v in mine.items() if k.endswith(".weight")}
    mcs = _hash_zchs(model)
    res["devices"] = sorted({str(d) for mc in mcs for d in (
        mc._device, mc.device, *([mc._eviction_module._device] if mc._eviction_module else []))})
    res["loggers"] = [type(mc._scalar_logger).__name__ for mc in mcs]
    res["eager_loggers"] = [type(mc._scalar_logger).__name__ for mc in _hash_zchs(fresh)]

    # an eager model's trained state (slots written, tables trained), saved by DCP
    eager = _eager(kind, world_size)
    _trained_slots(eager, rank, world_size)
    _read_only(eager)
    for step in range(2):
        _step(kind, eager, seed=100 + step)
    ckpt = _shared(tmp, f"{kind}-world2")
    dcp.save(eager.state_dict(), checkpoint_id=ckpt)
    dist.barrier()

    theirs_model = _loaded_reference(kind, world_size, ckpt)
    loaded = _on_meta(kind, world_size)
    report = metamat.materialize(loaded, ckpt)
    res["load_left"] = no_meta_left(loaded)
    res["load_differs"] = _same(local_blocks(loaded.state_dict()),
                                local_blocks(theirs_model.state_dict()))
    res["load_unexpected"] = report.unexpected
    res["hits"] = _hits(kind, loaded)
    _read_only(loaded), _read_only(theirs_model)
    outs = [(_step(kind, loaded, seed=200 + s), _step(kind, theirs_model, seed=200 + s))
            for s in range(2)]
    res["train_out_differs"] = [i for i, (a, b) in enumerate(outs)
                                if not torch.allclose(a, b, rtol=1e-5, atol=1e-6)]
    after_mine = local_blocks(loaded.state_dict())
    after_theirs = local_blocks(theirs_model.state_dict())
    res["train_mc_differs"] = _same(after_mine, after_theirs,
                                    [k for k in after_theirs if MC_PREFIX in k])
    res["train_tables_close"] = all(
        torch.allclose(a[0][1], after_theirs[k][0][1], rtol=1e-5, atol=1e-6)
        for k, a in after_mine.items() if k.endswith(".weight"))
    res["save_after"] = _save_again(loaded, _shared(tmp, f"{kind}-resave"))
    reference = local_blocks(_loaded_reference(kind, world_size, ckpt).state_dict())
    live = _eager(kind, world_size)  # in place: the tables written, the MC state shadowed
    metamat.materialize(live, ckpt, inplace=True)
    res["inplace_differs"] = _same(local_blocks(live.state_dict()), reference)
    # a failed bucket check in place: the tables may be written (PartialLoadError names them),
    # the MC state is left as it was
    live = _eager(kind, world_size, buckets=BUCKETS // 2)
    before = _mc_state(live)
    try:
        metamat.materialize(live, ckpt, inplace=True)
        res["partial_error"] = None
    except metamat.PartialLoadError as e:
        res["partial_error"] = (str(e.__cause__), e.written)
    res["partial_mc_changed"] = _same(_mc_state(live), before)
    on_meta = _on_meta(kind, world_size)  # nothing live: inplace=True is just a load
    metamat.materialize(on_meta, ckpt, inplace=True)
    res["meta_inplace_differs"] = _same(local_blocks(on_meta.state_dict()), reference)
    # serving modules, sharded: the training checkpoint's eviction metadata dropped, as
    # TorchRec's load hook does
    serve_ref = _loaded_reference(kind, world_size, ckpt, inference=True)
    serve = _on_meta(kind, world_size, inference=True)
    res["serve_unexpected"] = metamat.materialize(serve, ckpt).unexpected
    res["serve_differs"] = _same(local_blocks(serve.state_dict()),
                                 local_blocks(serve_ref.state_dict()))
    live = _eager(kind, world_size)  # a real model, loaded through shadow copies
    metamat.materialize(live, ckpt)
    res["live_differs"] = _same(local_blocks(live.state_dict()), local_blocks(
        _loaded_reference(kind, world_size, ckpt).state_dict()))

    # laid out for GPUs, on the emulated device: the same state as on the CPU
    mc._emulated_gpu_layout(res, lambda: _on_meta(kind, world_size, cuda=True), ckpt, SEED,
                            mine, lambda: _loaded_reference(kind, world_size, ckpt))

    # another bucket count probes ids elsewhere: refused, the model left on meta
    victim = _on_meta(kind, world_size, buckets=BUCKETS // 2)
    try:
        metamat.materialize(victim, ckpt)
        res["bucket_error"] = None
    except metamat.UnsupportedError as e:
        res["bucket_error"] = str(e)
    res["victim_still_meta"] = bool(no_meta_left(victim))
    victim = _on_meta(kind, world_size, buckets=BUCKETS // 2)  # in place: nothing live to write
    try:
        metamat.materialize(victim, ckpt, inplace=True)
        res["inplace_bucket_error"] = None
    except metamat.UnsupportedError as e:
        res["inplace_bucket_error"] = str(e)
    res["victim_buckets"] = sorted({int(b) for mc in _hash_zchs(victim)
                                    for b in mc._hash_zch_bucket.flatten()})

    one = os.path.join(tmp, f"{kind}-world1")  # a world-1 checkpoint, resharded here
    if os.path.isdir(one):
        ref = _loaded_reference(kind, world_size, one)
        target = _on_meta(kind, world_size)
        metamat.materialize(target, one)
        res["world1_differs"] = _same(local_blocks(target.state_dict()),
                                      local_blocks(ref.state_dict()))
        res["world1_out_close"] = torch.allclose(_step(kind, _read_only(target), seed=300),
                                                 _step(kind, _read_only(ref), seed=300))
    return res


def worker_world1(rank, world_size, tmp, kind):
    """The world-2 checkpoint into one rank (its buckets are whole there); then a world-1
    checkpoint for the second world-2 run."""
    import torch.distributed.checkpoint as dcp

    res = {}
    ckpt = os.path.join(tmp, f"{kind}-world2")
    ref = _loaded_reference(kind, world_size, ckpt)
    loaded = _on_meta(kind, world_size)
    metamat.materialize(loaded, ckpt)
    res["differs"] = _same(local_blocks(loaded.state_dict()), local_blocks(ref.state_dict()))
    res["hits"] = _hits(kind, loaded)
    res["out_close"] = torch.allclose(_step(kind, _read_only(loaded), seed=300),
                                      _step(kind, _read_only(ref), seed=300))
    own = _eager(kind, world_size)
    _trained_slots(own, rank, world_size)
    dcp.save(own.state_dict(), checkpoint_id=_shared(tmp, f"{kind}-world1"))
    return res


def worker_unsharded(rank, world_size, tmp, kind):
    """The MC collection not sharded (one process, the modules adapter): TorchRec's initial
    state from meta; the world-2 checkpoint loaded as TorchRec's ``load_state_dict`` does, into
    a model on meta and a live one; another bucket count refused."""
    import torch.distributed.checkpoint as dcp

    res = {}
    model = _module(kind, torch.device("meta"))
    metamat.materialize(model, device="cpu", seed=SEED)
    theirs = _module(kind, torch.device("cpu"))
    mine = local_blocks(model.state_dict())
    res["init_left"] = [n for n, t in [*model.named_buffers(), *model.named_parameters()]
                        if t.is_meta]
    res["init_mc_differs"] = _same(mine, local_blocks(theirs.state_dict()),
                                   [k for k in mine if MC_PREFIX in k])
    res["init_tables"] = {k: v for k, v in mine.items() if k.endswith(".weight")}
    res["loggers"] = [type(mc._scalar_logger).__name__ for mc in _hash_zchs(model)]
    ckpt = os.path.join(tmp, f"{kind}-world2")
    ref = _module(kind, torch.device("cpu"))
    sd = ref.state_dict()
    dcp.load(sd, checkpoint_id=ckpt)
    ref.load_state_dict(sd)
    for how, target in (("meta", _module(kind, torch.device("meta"))),
                        ("live", _module(kind, torch.device("cpu")))):
        metamat.materialize(target, ckpt, device="cpu")
        res[f"{how}_differs"] = _same(local_blocks(target.state_dict()),
                                      local_blocks(ref.state_dict()))
        for m in (target, ref):
            for mc in _hash_zchs(m):
                mc.reset_intrainer_bulk_eval_mode()
        res[f"{how}_out"] = torch.allclose(_output(kind, target.eval()(_batch(400, hash_size=HASH))),
                                           _output(kind, ref.eval()(_batch(400, hash_size=HASH))))
    # serving modules drop the training checkpoint's eviction metadata, as TorchRec's hook does
    serve_ref = _module(kind, torch.device("cpu"), inference=True)
    sd = serve_ref.state_dict()
    res["serve_keys"] = sorted(k.rsplit(".", 1)[1] for k in sd if MC_PREFIX in k)
    dcp.load(sd, checkpoint_id=ckpt)
    serve_ref.load_state_dict(sd)
    serve = _module(kind, torch.device("meta"), inference=True)
    report = metamat.materialize(serve, ckpt, device="cpu")
    res["serve_unexpected"] = report.unexpected
    res["serve_differs"] = _same(local_blocks(serve.state_dict()),
                                 local_blocks(serve_ref.state_dict()))
    res["serve_out"] = torch.allclose(_output(kind, serve(_batch(400, hash_size=HASH))),
                                      _output(kind, serve_ref(_batch(400, hash_size=HASH))))
    victim = _module(kind, torch.device("meta"), buckets=BUCKETS // 2)
    try:
        metamat.materialize(victim, ckpt, device="cpu")
        res["bucket_error"] = None
    except metamat.UnsupportedError as e:
        res["bucket_error"] = str(e)
    res["victim_meta"] = any(t.is_meta for t in victim.parameters())
    live = _module(kind, torch.device("cpu"), buckets=BUCKETS // 2)  # in place, live
    before = _mc_state(live)
    try:
        metamat.materialize(live, ckpt, device="cpu", inplace=True)
        res["inplace_failed"] = False
    except (metamat.PartialLoadError, metamat.UnsupportedError):
        res["inplace_failed"] = True
    res["inplace_mc_changed"] = _same(_mc_state(live), before)
    res["devices"] = sorted({str(d) for mc in _hash_zchs(model) for d in (
        mc._device, *([mc._eviction_module._device] if mc._eviction_module else []))})
    return res


@pytest.fixture(scope="module", params=["ebc", "ec"])
def hzch_runs(request, tmp_path_factory):
    kind = request.param
    return mc.world_runs(kind, str(tmp_path_factory.mktemp(f"hzch-{kind}")), worker_world2,
                         worker_world1, worker_unsharded)


def _table_key(kind: str, i: int) -> str:
    return f"_embedding_module.{'embedding_bags' if kind == 'ebc' else 'embeddings'}.t{i}.weight"


@pytest.mark.multiprocess
def test_init_gives_torchrec_state_and_plan_invariant_tables(hzch_runs):
    kind, ranks, _, _, _ = hzch_runs
    for r in ranks:
        assert r["init_left"] == [] and r["init_keys_differ"] == [], r
        assert r["init_mc_differs"] == [], r["init_mc_differs"]
        assert {"_hash_zch_identities", "_hash_zch_metadata",
                "_hash_zch_runtime_meta"} <= set(r["mc_keys"]), r["mc_keys"]
        assert r["devices"] == ["cpu"], r["devices"]
        # TorchRec's eager module logs metrics; built on meta it cannot: built at register
        assert r["loggers"] == r["eager_loggers"] == ["ScalarLogger", "NoneType"], r
    for i, rows in enumerate(ROWS):
        full = assemble([r["init_tables"] for r in ranks], _table_key(kind, i), (rows, 8))
        assert torch.equal(full, reference_table(f"t{i}", rows, 8, SEED))


@pytest.mark.multiprocess
def test_load_equals_torchrec_load_and_trains_the_same(hzch_runs):
    _, ranks, _, _, _ = hzch_runs
    for r in ranks:
        assert r["load_left"] == [] and r["load_differs"] == [], r["load_differs"]
        assert r["load_unexpected"] == [] and r["hits"] > 0, r
        assert r["train_out_differs"] == [] and r["train_mc_differs"] == [], r
        assert r["train_tables_close"] and r["save_after"] and r["live_differs"] == [], r
        assert r["inplace_differs"] == [] and r["meta_inplace_differs"] == [], r
        cause, written = r["partial_error"]
        assert "_hash_zch_bucket" in cause and r["partial_mc_changed"] == [], r
        assert written and not any(MC_PREFIX in w for w in written), written
        assert r["serve_unexpected"] == [] and r["serve_differs"] == [], r


@pytest.mark.multiprocess
def test_laid_out_for_gpus_on_the_emulated_device(hzch_runs):
    _, ranks, _, _, _ = hzch_runs
    for r in ranks:
        assert r["emulated_init_differs"] == [] and r["emulated_load_differs"] == [], r


@pytest.mark.multiprocess
def test_checkpoints_reshard_at_bucket_boundaries(hzch_runs):
    """World 2 -> 1 and world 1 -> 2, each equal to TorchRec's own load; lookups alike."""
    _, _, one, second, _ = hzch_runs
    assert one[0]["differs"] == [] and one[0]["out_close"] and one[0]["hits"] > 0, one
    for r in second:
        assert r["world1_differs"] == [] and r["world1_out_close"], r


@pytest.mark.multiprocess
def test_another_bucket_count_is_refused_and_the_model_stays_on_meta(hzch_runs):
    _, ranks, _, _, unsharded = hzch_runs
    for r in [*ranks, unsharded]:
        error = r["bucket_error"]
        assert error is not None and "_hash_zch_bucket" in error and "'t0'" in error, r
        assert "[4] buckets, this module 2" in error
    assert all(r["victim_still_meta"] for r in ranks) and unsharded["victim_meta"]
    for r in ranks:  # in place into a model on meta: the same error, its buffers untouched
        assert "[4] buckets, this module 2" in r["inplace_bucket_error"], r
        assert r["victim_buckets"] == [BUCKETS // 2], r


@pytest.mark.multiprocess
def test_unsharded_collection_init_and_loads_like_torchrec(hzch_runs):
    kind, _, _, _, r = hzch_runs
    assert r["init_left"] == [] and r["init_mc_differs"] == [], r
    assert r["loggers"] == ["ScalarLogger", "NoneType"], r
    for i, rows in enumerate(ROWS):
        assert torch.equal(r["init_tables"][_table_key(kind, i)][0][1],
                           reference_table(f"t{i}", rows, 8, SEED))
    for how in ("meta", "live"):
        assert r[f"{how}_differs"] == [] and r[f"{how}_out"], (how, r)
    assert "_hash_zch_metadata" not in r["serve_keys"], r["serve_keys"]
    assert r["serve_unexpected"] == [] and r["serve_differs"] == [] and r["serve_out"], r
    assert r["inplace_failed"] and r["inplace_mc_changed"] == [], r
    assert r["devices"] == ["cpu"], r


# -- on a GPU: ids inserted and evicted by fbgemm's CUDA kernel ---------------------------------
def _buckets_of(model) -> dict:
    """Table -> the sorted ids of each local bucket (where an id lands within its bucket may
    depend on which GPU thread claims a free slot first: compared as sets)."""
    out = {}
    for i, mc in enumerate(_hash_zchs(model)):
        per = mc._zch_size // (mc._end_bucket - mc._start_bucket)
        ids = mc._hash_zch_identities.detach().flatten().cpu()
        out[f"t{i}"] = [sorted(ids[j:j + per].tolist()) for j in range(0, ids.numel(), per)]
    return out


def _gpu_step(kind: str, model, seed: int) -> torch.Tensor:
    out = _output(kind, model(_batch(seed, batch=2, hash_size=HASH, device="cuda")))
    weights = torch.arange(out.numel(), dtype=out.dtype, device=out.device)
    (out * weights.reshape(out.shape)).sum().backward()
    return out.detach().cpu().clone()


def _expire_empty_slots(mc) -> int:
    """Fills ``mc``'s empty slots with ids no batch holds, expired for its TTL policy (metadata
    an hour old): every bucket is full, so each new id the next inserting step brings evicts
    one of them (fbgemm's kernel takes an occupied slot only when it has expired). Returns
    how many."""
    import time

    with torch.no_grad():
        ids = mc._hash_zch_identities.data.view(-1)
        empty = ids == -1
        n = int(empty.sum())
        ids[empty] = torch.arange(FAKE_ID, FAKE_ID + n, dtype=ids.dtype, device=ids.device)
        mc._hash_zch_metadata.view(-1)[empty] = int(time.time() / 3600) - 1
    return n


def _t0(model):
    """t0's module (the one with TTL eviction, hence eviction metadata)."""
    return next(m for m in _hash_zchs(model) if m._name == "t0")


def _fake_ids(mc) -> int:
    return int((mc._hash_zch_identities >= FAKE_ID).sum())


def worker_cuda(rank, world_size, tmp, kind):
    """One NCCL rank: init as eager TorchRec on CUDA; an eager model trained with insertions
    (then t0's free slots filled with expired ids) saved by DCP and loaded like TorchRec's
    load; read-only steps alike; an inserting step evicts the same number of expired ids and
    puts the same ids in the same buckets."""
    import torch.distributed.checkpoint as dcp

    res = {}
    fresh = _eager(kind, world_size, "cuda")
    model = _on_meta(kind, world_size, cuda=True)
    report = metamat.materialize(model, seed=SEED)
    res["device"] = str(report.device)
    mine, theirs = local_blocks(model.state_dict()), local_blocks(fresh.state_dict())
    res["init_mc_differs"] = _same(mine, theirs, [k for k in theirs if MC_PREFIX in k])
    res["loggers"] = [type(mc._scalar_logger).__name__ for mc in _hash_zchs(model)]
    res["devices"] = sorted({str(mc._device) for mc in _hash_zchs(model)})
    eager = _eager(kind, world_size, "cuda")
    for step in range(3):
        _gpu_step(kind, eager, seed=100 + step)
    res["inserted"] = sum(int(((mc._hash_zch_identities != -1) & (mc._hash_zch_identities < FAKE_ID))
                              .sum()) for mc in _hash_zchs(eager))
    res["expired"] = _expire_empty_slots(_t0(eager))
    ckpt = _shared(tmp, f"{kind}-cuda")
    dcp.save(eager.state_dict(), checkpoint_id=ckpt)
    ref = _loaded_reference(kind, world_size, ckpt, "cuda")
    loaded = _on_meta(kind, world_size, cuda=True)
    metamat.materialize(loaded, ckpt)
    res["load_differs"] = _same(local_blocks(loaded.state_dict()), local_blocks(ref.state_dict()))
    if res["load_differs"]:  # a wrong load may leave fbgemm's kernel spinning on a slot
        return res
    _read_only(loaded), _read_only(ref)
    outs = [(_gpu_step(kind, loaded, 200 + s), _gpu_step(kind, ref, 200 + s)) for s in range(2)]
    res["read_only_close"] = [torch.allclose(a, b, rtol=1e-5, atol=1e-6) for a, b in outs]
    for m in (loaded, ref):  # inserting again, eviction module rebuilt on the module's device
        for mc in _hash_zchs(m):
            mc.reset_training_mode()
        torch.manual_seed(SEED)  # the evicted rows' refill (init_fn, CUDA RNG) alike
        _gpu_step(kind, m, seed=300)
    res["insert_buckets_same"] = _buckets_of(loaded) == _buckets_of(ref)
    res["evicted"] = [res["expired"] - _fake_ids(_t0(m)) for m in (loaded, ref)]
    res["inserted_after"] = sum(int(((mc._hash_zch_identities != -1)
                                     & (mc._hash_zch_identities < FAKE_ID)).sum())
                                for mc in _hash_zchs(loaded))
    return res


@pytest.mark.cuda
@pytest.mark.multiprocess
@pytest.mark.parametrize("kind", ["ebc", "ec"])
def test_on_a_gpu_with_insertions_like_eager_torchrec(kind, tmp_path):
    r = run_dist(worker_cuda, 1, str(tmp_path), kind, backend="nccl")[0]
    assert r["device"].startswith("cuda") and r["devices"][0].startswith("cuda"), r
    assert r["init_mc_differs"] == [] and r["loggers"] == ["ScalarLogger", "NoneType"], r
    assert r["inserted"] > 0 and r["load_differs"] == [] and all(r["read_only_close"]), r
    assert r["insert_buckets_same"] and r["inserted_after"] > r["inserted"], r
    # t0's new ids each took an expired slot (TorchRec then reset and refilled those rows)
    assert r["expired"] > 0 and r["evicted"][0] == r["evicted"][1] > 0, r
