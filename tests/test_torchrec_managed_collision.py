"""Managed-collision (zero-collision hashing) collections on real TorchRec: shard on meta,
materialize, load a DCP checkpoint of a trained eager model, train on; compared with eager
TorchRec DMPs holding the same values (gloo, CPU, world size 1 and 2)."""
from __future__ import annotations

import os
from typing import Dict, List

import pytest
import torch
import torch.distributed as dist

pytest.importorskip("torchrec")
pytest.importorskip("fbgemm_gpu")

import metamat  # noqa: E402

from _dist import run_dist  # noqa: E402
from test_torchrec_materialize import (  # noqa: E402
    assemble, fused_params, local_blocks, no_meta_left, reference_table,
)

SEED = 11
HASH = 64  # raw ids are drawn from [0, HASH); each table remaps them into its rows
# Eviction resets rows with fbgemm's reset_weight_momentum, which has no CPU kernel: no
# eviction within the tests' few steps; the trained MC state is written (_trained_mc_state).
EVICT_EVERY = 1000
ROWS = (64, 68)
MC_PREFIX = "_managed_collision_collection._managed_collision_modules."


def _module(kind: str, device: torch.device, hash_size: int = HASH,
            evict_every: int = EVICT_EVERY, buckets: int = 1):
    from torchrec import (EmbeddingBagCollection, EmbeddingBagConfig, EmbeddingCollection,
                          EmbeddingConfig)
    from torchrec.modules.mc_embedding_modules import (ManagedCollisionEmbeddingBagCollection,
                                                       ManagedCollisionEmbeddingCollection)
    from torchrec.modules.mc_modules import (DistanceLFU_EvictionPolicy, LRU_EvictionPolicy,
                                             ManagedCollisionCollection,
                                             MCHManagedCollisionModule)

    config = EmbeddingBagConfig if kind == "ebc" else EmbeddingConfig
    tables = [config(name=f"t{i}", embedding_dim=8, num_embeddings=rows,
                     feature_names=[f"f{i}"]) for i, rows in enumerate(ROWS)]
    policies = [DistanceLFU_EvictionPolicy(), LRU_EvictionPolicy()]
    mcs = {t.name: MCHManagedCollisionModule(zch_size=t.num_embeddings, device=device,
                                             eviction_policy=policies[i],
                                             eviction_interval=evict_every,
                                             input_hash_size=hash_size, buckets=buckets)
           for i, t in enumerate(tables)}
    mcc = ManagedCollisionCollection(mcs, embedding_configs=tables)
    if kind == "ebc":
        return ManagedCollisionEmbeddingBagCollection(
            EmbeddingBagCollection(tables=tables, device=device), mcc,
            return_remapped_features=False)
    return ManagedCollisionEmbeddingCollection(
        EmbeddingCollection(tables=tables, device=device), mcc, return_remapped_features=False)


def _sharder(kind: str):
    if kind == "ebc":
        from torchrec.distributed.embeddingbag import EmbeddingBagCollectionSharder
        from torchrec.distributed.mc_embeddingbag import \
            ManagedCollisionEmbeddingBagCollectionSharder

        return ManagedCollisionEmbeddingBagCollectionSharder(
            EmbeddingBagCollectionSharder(fused_params=fused_params()))
    from torchrec.distributed.embedding import EmbeddingCollectionSharder
    from torchrec.distributed.mc_embedding import ManagedCollisionEmbeddingCollectionSharder

    return ManagedCollisionEmbeddingCollectionSharder(
        EmbeddingCollectionSharder(fused_params=fused_params()))


def _plan(module, kind: str, world_size: int, device_type: str = "cpu"):
    """Every table row-wise (the only sharding TorchRec gives MC collections)."""
    from torchrec.distributed.sharding_plan import construct_module_sharding_plan, row_wise
    from torchrec.distributed.types import ShardingPlan

    tables = module._managed_collision_collection._managed_collision_modules
    per_table = {t: row_wise(compute_kernel="fused") for t in tables}
    return ShardingPlan({"": construct_module_sharding_plan(
        module, per_param_sharding=per_table, local_size=world_size, world_size=world_size,
        device_type=device_type, sharder=_sharder(kind))})


def _eager(kind: str, world_size: int, device: str = "cpu", build=None, **module_args):
    """An eager DMP of ``build`` (this file's ``_module`` by default)."""
    from torchrec.distributed.model_parallel import DistributedModelParallel
    from torchrec.distributed.types import ShardingEnv

    dev = torch.device(device if device == "cpu" else f"cuda:{torch.cuda.current_device()}")
    module = (build or _module)(kind, dev, **module_args)
    return DistributedModelParallel(
        module, ShardingEnv.from_process_group(dist.group.WORLD), device=dev,
        plan=_plan(module, kind, world_size, dev.type), sharders=[_sharder(kind)])


def _on_meta(kind: str, world_size: int, cuda: bool = False, build=None, **module_args):
    """On meta; ``cuda``: laid out for GPUs."""
    module = (build or _module)(kind, torch.device("meta"), **module_args)
    plan = _plan(module, kind, world_size, "cuda" if cuda else "cpu")
    return metamat.shard_on_meta(module, plan=plan, sharders=[_sharder(kind)],
                                 compute_device="cuda" if cuda else None)


def _batch(seed: int, batch: int = 6, hash_size: int = HASH, device: str = "cpu"):
    """Raw ids in [0, HASH): about half of them were seen in training (_trained_mc_state)."""
    from torchrec import KeyedJaggedTensor

    g = torch.Generator().manual_seed(seed)
    lengths = torch.randint(1, 4, (len(ROWS) * batch,), generator=g)
    values = torch.randint(0, hash_size, (int(lengths.sum()),), generator=g)
    return KeyedJaggedTensor.from_lengths_sync(
        keys=[f"f{i}" for i in range(len(ROWS))], values=values,
        lengths=lengths).to(torch.device(device))


def _output(kind: str, out) -> torch.Tensor:
    """One tensor of the forward's output (KeyedTensor, or a dict of JaggedTensors)."""
    if isinstance(out, tuple):
        out = out[0]
    if kind == "ebc":
        return out.values()
    return torch.cat([out[f"f{i}"].values() for i in range(len(ROWS))])


def _step(kind: str, model, seed: int, **batch_args) -> torch.Tensor:
    """Forward (MC remapping, and eviction where it is due), backward, fused optimizer step."""
    out = _output(kind, model(_batch(seed, **batch_args)))
    weights = torch.arange(out.numel(), dtype=out.dtype, device=out.device)
    (out * weights.reshape(out.shape)).sum().backward()
    return out.detach().cpu().clone()


def _same(a: Dict[str, list], b: Dict[str, list], keys=None) -> List[str]:
    """Keys whose local blocks differ (offsets or bits)."""
    bad = []
    for k in keys if keys is not None else sorted(set(a) | set(b)):
        x, y = a.get(k), b.get(k)
        if x is None or y is None or len(x) != len(y) or any(
                ox != oy or tx.dtype != ty.dtype or not torch.equal(tx, ty)
                for (ox, tx), (oy, ty) in zip(x, y)):
            bad.append(k)
    return bad


def _trained_mc_state(model, rank: int, world_size: int) -> None:
    """Write the MC state training gives (raw ids seen, each in a slot of its own, counts,
    the iteration), since training cannot evict on CPU: per rank, half its rows hold raw
    ids of its input range (sorted, as TorchRec keeps them), mapped to shuffled rows."""
    from torchrec.modules.mc_modules import MCHManagedCollisionModule

    mcs = [m for m in model.modules() if isinstance(m, MCHManagedCollisionModule)]
    assert len(mcs) == len(ROWS)
    with torch.no_grad():
        for i, mc in enumerate(mcs):
            g = torch.Generator().manual_seed(1000 * i + 10 * world_size + rank)
            start, n = mc._output_global_offset, mc._zch_size
            lo, hi = HASH * rank // world_size, HASH * (rank + 1) // world_size
            seen = (lo + torch.randperm(hi - lo, generator=g)[: n // 2]).sort().values
            mc._mch_sorted_raw_ids.fill_(torch.iinfo(torch.int64).max)
            mc._mch_sorted_raw_ids[: seen.numel()] = seen
            mc._mch_remapped_ids_mapping.copy_(start + torch.randperm(n, generator=g))
            for buf in mc._mch_metadata.values():
                buf.copy_(torch.randint(0, 50, (n,), generator=g))
            mc._current_iter_tensor.fill_(7)


def _shared(tmp: str, name: str) -> str:
    path = os.path.join(tmp, name)
    os.makedirs(path, exist_ok=True)
    return path


def worker_world2(rank, world_size, tmp, kind):
    import torch.distributed.checkpoint as dcp

    res = {}
    # init: TorchRec's MC state, metamat's plan-invariant tables
    fresh = _eager(kind, world_size)
    model = _on_meta(kind, world_size)
    from metamat.models.torchrec.meta_factories import recorded_value

    res["recorded_rows"] = [n for n, b in model.named_buffers()  # no CPU copy per row
                            if recorded_value(b) is not None and "._mch_" in n
                            and b.numel() > 1]
    res["recorded_small"] = sorted(n.rsplit(".", 1)[1] for n, b in model.named_buffers()
                                   if recorded_value(b) is not None and "._mch_" not in n)
    metamat.materialize(model, seed=SEED)
    res["init_left"] = no_meta_left(model)
    mine, theirs = local_blocks(model.state_dict()), local_blocks(fresh.state_dict())
    res["init_mc_differs"] = _same(mine, theirs, [k for k in theirs if MC_PREFIX in k])
    res["init_keys_differ"] = sorted(set(mine) ^ set(theirs))
    res["init_tables"] = {k: v for k, v in mine.items() if k.endswith(".weight")}

    # a trained eager model, saved by DCP
    eager = _eager(kind, world_size)
    for step in range(2):
        _step(kind, eager, seed=100 + step)
    _trained_mc_state(eager, rank, world_size)
    ckpt = _shared(tmp, f"{kind}-world2")
    dcp.save(eager.state_dict(), checkpoint_id=ckpt)
    dist.barrier()

    # TorchRec's own load of it, and metamat's
    theirs_model = _loaded_reference(kind, world_size, ckpt)
    loaded = _on_meta(kind, world_size)
    report = metamat.materialize(loaded, ckpt)
    res["load_left"] = no_meta_left(loaded)
    res["load_differs"] = _same(local_blocks(loaded.state_dict()),
                                local_blocks(theirs_model.state_dict()))
    res["load_unexpected"] = report.unexpected
    # training goes on identically: remapping, eviction, gradients, fused optimizer
    outs = [(_step(kind, loaded, seed=200 + s), _step(kind, theirs_model, seed=200 + s))
            for s in range(2)]
    res["train_out_differs"] = [i for i, (a, b) in enumerate(outs)
                                if not torch.allclose(a, b, rtol=1e-5, atol=1e-6)]
    after_mine = local_blocks(loaded.state_dict())
    after_theirs = local_blocks(theirs_model.state_dict())
    res["train_mc_differs"] = _same(after_mine, after_theirs,
                                    [k for k in after_theirs if MC_PREFIX in k])
    res["train_tables_close"] = all(
        torch.allclose(a[0][1], b[0][1], rtol=1e-5, atol=1e-6)
        for k, a in after_mine.items() if k.endswith(".weight")
        for b in [after_theirs[k]])
    res["save_after"] = _save_again(loaded, _shared(tmp, f"{kind}-resave"))
    live = _eager(kind, world_size)  # a real model, loaded in place (its MC state shadowed)
    metamat.materialize(live, ckpt, inplace=True)
    res["inplace_differs"] = _same(local_blocks(live.state_dict()), local_blocks(
        _loaded_reference(kind, world_size, ckpt).state_dict()))
    live = _eager(kind, world_size)
    on_meta = _on_meta(kind, world_size)  # nothing live: inplace=True is just a load
    metamat.materialize(on_meta, ckpt, inplace=True)
    res["meta_inplace_differs"] = _same(local_blocks(on_meta.state_dict()), local_blocks(
        _loaded_reference(kind, world_size, ckpt).state_dict()))
    metamat.materialize(live, ckpt)
    res["live_differs"] = _same(local_blocks(live.state_dict()), local_blocks(
        _loaded_reference(kind, world_size, ckpt).state_dict()))

    # laid out for GPUs, on the emulated device: the same state as on the CPU
    _emulated_gpu_layout(res, lambda: _on_meta(kind, world_size, cuda=True), ckpt, SEED, mine,
                         lambda: _loaded_reference(kind, world_size, ckpt))
    from metamat.emulation import emulated_cuda

    cpu_layout = _on_meta(kind, world_size)  # not laid out again for a GPU: refused
    try:
        with emulated_cuda():
            metamat.materialize(cpu_layout, seed=SEED)
        res["relayout_error"] = None
    except metamat.UnsupportedError as e:
        res["relayout_error"] = str(e)
    res["relayout_left_meta"] = bool(no_meta_left(cpu_layout))

    # a world-1 checkpoint cannot be split at this plan's row boundaries (TorchRec's rule)
    one = os.path.join(tmp, f"{kind}-world1")
    if os.path.isdir(one):
        victim = _on_meta(kind, world_size)
        try:
            metamat.materialize(victim, one)
            res["split_error"] = None
        except metamat.UnsupportedError as e:
            res["split_error"] = str(e)
        res["victim_still_meta"] = bool(no_meta_left(victim))
    return res


def _emulated_gpu_layout(res: dict, on_meta, ckpt: str, seed: int, init_blocks, reference):
    """Laid out for GPUs (``on_meta()``), on the emulated device: init and load give the same
    state as on the CPU (``init_blocks``, ``reference()``'s)."""
    from metamat.emulation import emulated_cuda

    gpu_init, gpu_load = on_meta(), on_meta()
    with emulated_cuda():
        metamat.materialize(gpu_init, seed=seed)
        metamat.materialize(gpu_load, ckpt)
    res["emulated_init_differs"] = _same(local_blocks(gpu_init.state_dict()), init_blocks)
    res["emulated_load_differs"] = _same(local_blocks(gpu_load.state_dict()),
                                         local_blocks(reference().state_dict()))


def _loaded_reference(kind: str, world_size: int, ckpt: str, device: str = "cpu",
                      **module_args):
    """An eager DMP loaded TorchRec's way: ``dcp.load`` into its state_dict, then
    ``load_state_dict`` (whose hook sorts the MC slots again)."""
    import torch.distributed.checkpoint as dcp

    model = _eager(kind, world_size, device, **module_args)
    sd = model.state_dict()
    dcp.load(sd, checkpoint_id=ckpt)
    model.load_state_dict(sd)
    return model


def _save_again(model, path: str) -> bool:
    """``dcp.save(model.state_dict())`` works on the materialized model."""
    import torch.distributed.checkpoint as dcp

    dcp.save(model.state_dict(), checkpoint_id=path)
    return True


def worker_world1(rank, world_size, tmp, kind):
    """A world-2 checkpoint into one rank (its row boundaries contain this rank's); then the
    world-1 checkpoint the world-2 worker cannot split."""
    import torch.distributed.checkpoint as dcp

    res = {}
    ckpt = os.path.join(tmp, f"{kind}-world2")
    theirs_model = _loaded_reference(kind, world_size, ckpt)
    loaded = _on_meta(kind, world_size)
    metamat.materialize(loaded, ckpt)
    res["differs"] = _same(local_blocks(loaded.state_dict()),
                           local_blocks(theirs_model.state_dict()))
    a, b = _step(kind, loaded, seed=300), _step(kind, theirs_model, seed=300)
    res["out_close"] = torch.allclose(a, b, rtol=1e-5, atol=1e-6)
    # A model trained on one rank (a loaded one keeps the checkpoint's row boundaries, as
    # TorchRec's load hook leaves them: its "initial" segments alias the loaded buffer)
    own = _eager(kind, world_size)
    _trained_mc_state(own, rank, world_size)
    dcp.save(own.state_dict(), checkpoint_id=_shared(tmp, f"{kind}-world1"))
    return res


def worker_unsharded(rank, world_size, tmp, kind):
    """The MC collection not sharded (one process, the modules adapter): TorchRec's initial
    MC state from meta; the world-2 and world-1 checkpoints loaded as TorchRec's
    ``load_state_dict`` does (slots sorted again), into a model on meta and a live one."""
    import torch.distributed.checkpoint as dcp

    res = {}
    model = _module(kind, torch.device("meta"), buckets=2)  # as TorchRec's planner wants
    metamat.materialize(model, device="cpu", seed=SEED)
    mine, theirs = local_blocks(model.state_dict()), local_blocks(
        _module(kind, torch.device("cpu"), buckets=2).state_dict())
    res["init_left"] = [n for n, t in list(model.named_buffers()) + list(model.named_parameters())
                        if t.is_meta]
    res["init_mc_differs"] = _same(mine, theirs, [k for k in theirs if MC_PREFIX in k])
    res["init_tables"] = {k: v for k, v in mine.items() if k.endswith(".weight")}
    for name in ("world2", "world1"):
        ckpt = os.path.join(tmp, f"{kind}-{name}")
        ref = _module(kind, torch.device("cpu"))
        sd = ref.state_dict()
        dcp.load(sd, checkpoint_id=ckpt)
        ref.load_state_dict(sd)
        for how, target in (("meta", _module(kind, torch.device("meta"))),
                            ("live", _module(kind, torch.device("cpu")))):
            metamat.materialize(target, ckpt, device="cpu")
            res[f"{name}_{how}_differs"] = _same(local_blocks(target.state_dict()),
                                                 local_blocks(ref.state_dict()))
            # eval: remapping without profiling, which would advance the state compared next
            res[f"{name}_{how}_out"] = torch.allclose(
                _output(kind, target.eval()(_batch(400))), _output(kind, ref.eval()(_batch(400))))
    # training steps (profiling: history buffers made on the module's device) alike
    ref = _module(kind, torch.device("cpu"))
    sd = ref.state_dict()
    dcp.load(sd, checkpoint_id=os.path.join(tmp, f"{kind}-world2"))
    ref.load_state_dict(sd)
    target = _module(kind, torch.device("meta"))
    metamat.materialize(target, os.path.join(tmp, f"{kind}-world2"), device="cpu")
    res["meta_attrs_left"] = no_meta_left(target)
    res["train_out"] = all(torch.allclose(_step(kind, target.train(), seed=500 + s),
                                          _step(kind, ref.train(), seed=500 + s))
                           for s in range(2))
    res["meta_after_train"] = no_meta_left(target)  # history buffers on the real device
    res["train_differs"] = _same(local_blocks(target.state_dict()),
                                 local_blocks(ref.state_dict()), [k for k in local_blocks(
                                     ref.state_dict()) if MC_PREFIX in k])
    return res


def world_runs(kind: str, tmp: str, world2, world1, unsharded):
    """The workers' runs, in order: world 2 (it saves the world-2 checkpoint), world 1 (it
    loads that and saves a world-1 one), world 2 again (now with it), unsharded."""
    first = run_dist(world2, 2, tmp, kind)
    one = run_dist(world1, 1, tmp, kind)
    second = run_dist(world2, 2, tmp, kind)
    return kind, first, one, second, run_dist(unsharded, 1, tmp, kind)[0]


@pytest.fixture(scope="module", params=["ebc", "ec"])
def mc_runs(request, tmp_path_factory):
    kind = request.param
    return world_runs(kind, str(tmp_path_factory.mktemp(f"mc-{kind}")), worker_world2,
                      worker_world1, worker_unsharded)


@pytest.mark.multiprocess
def test_init_gives_torchrec_mc_state_and_plan_invariant_tables(mc_runs):
    kind, ranks, _, _, _ = mc_runs
    for r in ranks:
        assert r["init_left"] == [] and r["init_keys_differ"] == [], r
        assert r["init_mc_differs"] == [], r["init_mc_differs"]
    for i, rows in enumerate(ROWS):
        key = f"_embedding_module.{'embedding_bags' if kind == 'ebc' else 'embeddings'}" \
              f".t{i}.weight"
        full = assemble([r["init_tables"] for r in ranks], key, (rows, 8))
        assert torch.equal(full, reference_table(f"t{i}", rows, 8, SEED)), key


@pytest.mark.multiprocess
def test_load_equals_torchrec_load_and_trains_the_same(mc_runs):
    _, ranks, _, _, _ = mc_runs
    for r in ranks:
        assert r["load_left"] == [] and r["load_differs"] == [], r["load_differs"]
        assert r["load_unexpected"] == []
        assert r["train_out_differs"] == [] and r["train_mc_differs"] == [], r
        assert r["train_tables_close"] and r["save_after"] and r["live_differs"] == [], r
        assert r["inplace_differs"] == [] and r["meta_inplace_differs"] == [], r


@pytest.mark.multiprocess
def test_state_is_written_not_recorded_on_the_cpu(mc_runs):
    """Sharding on meta keeps no CPU copy of the row-sized MC buffers (materialize writes
    their values on the target device)."""
    _, ranks, _, _, _ = mc_runs
    assert all(r["recorded_rows"] == [] for r in ranks), ranks
    assert {"_output_segments_tensor", "_current_iter_tensor"} <= set(ranks[0]["recorded_small"])


@pytest.mark.multiprocess
def test_laid_out_for_gpus_on_the_emulated_device(mc_runs):
    _, ranks, _, _, _ = mc_runs
    for r in ranks:
        assert r["emulated_init_differs"] == [] and r["emulated_load_differs"] == [], r
        assert "compute_device='cuda'" in r["relayout_error"] and r["relayout_left_meta"], r


def test_other_mc_kinds_are_refused_and_a_failed_sharding_leaves_the_modules_alone(
        monkeypatch):
    """MCH subclasses are named before anything is built; a failure while the
    zch sizes are exchanged removes the temporary hook from the user's MCH modules."""
    from torchrec.modules.mc_modules import MCHManagedCollisionModule

    from metamat.models.torchrec import mc_sharding
    from metamat.testing import process_group

    class Custom(MCHManagedCollisionModule):
        pass

    with process_group():
        module = _module("ebc", torch.device("meta"))
        mcc = module._managed_collision_collection._managed_collision_modules
        odd = Custom(zch_size=ROWS[0], device=torch.device("meta"),
                     eviction_policy=mcc["t0"]._eviction_policy, eviction_interval=1,
                     input_hash_size=HASH)
        real_t0, mcc["t0"] = mcc["t0"], odd
        with pytest.raises(metamat.UnsupportedError, match="Custom of table 't0'"):
            metamat.shard_on_meta(module, plan=_plan(module, "ebc", 1), sharders=[_sharder("ebc")])
        mcc["t0"] = real_t0

        def broken(*_a, **_k):
            raise RuntimeError("no exchange device")

        monkeypatch.setattr(mc_sharding, "_exchange_device", broken)
        with pytest.raises(RuntimeError, match="no exchange device"):
            metamat.shard_on_meta(module, plan=_plan(module, "ebc", 1), sharders=[_sharder("ebc")])
        assert all("rebuild_with_output_id_range" not in mc.__dict__ for mc in mcc.values())


@pytest.mark.multiprocess
def test_world2_checkpoint_into_one_rank(mc_runs):
    _, _, one, _, _ = mc_runs
    assert one[0]["differs"] == [] and one[0]["out_close"], one


@pytest.mark.multiprocess
def test_checkpoint_split_elsewhere_is_refused_and_model_stays_on_meta(mc_runs):
    _, _, _, ranks, _ = mc_runs
    for r in ranks:
        assert r["split_error"] is not None and "_output_segments_tensor" in r["split_error"]
        assert "cannot reshard" in r["split_error"] and r["victim_still_meta"], r


# -- on a GPU: eviction runs (fbgemm's CUDA kernels) --------------------------------------------
GPU_HASH = 1000  # more raw ids than rows: the MC modules evict at every step


def worker_cuda(rank, world_size, tmp, kind):
    """One NCCL rank: init as eager TorchRec on CUDA; a trained (evicting) eager model's DCP
    checkpoint loaded like TorchRec's load; two more evicting steps alike."""
    import torch.distributed.checkpoint as dcp

    args = dict(hash_size=GPU_HASH, evict_every=1)
    res = {}
    fresh = _eager(kind, world_size, "cuda", **args)
    model = _on_meta(kind, world_size, cuda=True, **args)
    report = metamat.materialize(model, seed=SEED)
    res["device"] = str(report.device)
    mine, theirs = local_blocks(model.state_dict()), local_blocks(fresh.state_dict())
    res["init_mc_differs"] = _same(mine, theirs, [k for k in theirs if MC_PREFIX in k])
    eager = _eager(kind, world_size, "cuda", **args)
    for step in range(3):
        _step(kind, eager, seed=100 + step, hash_size=GPU_HASH, device="cuda")
    ckpt = _shared(tmp, f"{kind}-cuda")
    dcp.save(eager.state_dict(), checkpoint_id=ckpt)
    ref = _loaded_reference(kind, world_size, ckpt, "cuda", **args)
    loaded = _on_meta(kind, world_size, cuda=True, **args)
    metamat.materialize(loaded, ckpt)
    res["load_differs"] = _same(local_blocks(loaded.state_dict()),
                                local_blocks(ref.state_dict()))
    outs = []
    for s in range(2):
        pair = []
        for m in (loaded, ref):
            # TorchRec refills evicted rows with the table's init_fn (uniform_, the CUDA RNG)
            torch.manual_seed(1000 + s)
            pair.append(_step(kind, m, seed=200 + s, hash_size=GPU_HASH, device="cuda"))
        outs.append(pair)
    res["out_close"] = [torch.allclose(a, b, rtol=1e-5, atol=1e-6) for a, b in outs]
    after, want = local_blocks(loaded.state_dict()), local_blocks(ref.state_dict())
    res["train_mc_differs"] = _same(after, want, [k for k in want if MC_PREFIX in k])
    res["train_tables_close"] = all(
        torch.allclose(a[0][1], want[k][0][1], rtol=1e-5, atol=1e-6)
        for k, a in after.items() if k.endswith(".weight"))
    from torchrec.distributed.types import ShardingEnv

    from metamat.models.torchrec.mc_sharding import _exchange_device

    env = ShardingEnv.from_process_group(dist.group.WORLD)  # NCCL: on this rank's GPU
    res["exchange"] = str(_exchange_device(env, None))
    return res


@pytest.mark.cuda
@pytest.mark.multiprocess
@pytest.mark.parametrize("kind", ["ebc", "ec"])
def test_on_a_gpu_with_eviction_like_eager_torchrec(kind, tmp_path):
    r = run_dist(worker_cuda, 1, str(tmp_path), kind, backend="nccl")[0]
    assert r["device"].startswith("cuda"), r
    assert r["init_mc_differs"] == [] and r["load_differs"] == [], r
    assert all(r["out_close"]) and r["train_mc_differs"] == [], r
    assert r["train_tables_close"] and r["exchange"].startswith("cuda"), r


@pytest.mark.multiprocess
def test_unsharded_collection_init_and_loads_like_torchrec(mc_runs):
    """A world-2 checkpoint's slots come in two sorted runs: the loaded module sorts them, as
    TorchRec's load hook does, or raw ids would be looked up in an unsorted array."""
    kind, _, _, _, r = mc_runs
    assert r["init_left"] == [] and r["init_mc_differs"] == [], r
    for i, rows in enumerate(ROWS):
        key = f"_embedding_module.{'embedding_bags' if kind == 'ebc' else 'embeddings'}" \
              f".t{i}.weight"
        assert torch.equal(r["init_tables"][key][0][1], reference_table(f"t{i}", rows, 8, SEED))
    for name in ("world2", "world1"):
        for how in ("meta", "live"):
            assert r[f"{name}_{how}_differs"] == [] and r[f"{name}_{how}_out"], (name, how, r)
    assert r["meta_attrs_left"] == [] and r["meta_after_train"] == [], r
    assert r["train_out"] and r["train_differs"] == [], r


def test_a_rank_whose_slots_remap_outside_its_rows_is_refused():
    """A rank's loaded MCH slots must remap into its own rows (every module TorchRec trains
    keeps them there); slots of a state sorted as one table point at other ranks' rows."""
    from torchrec.modules.mc_modules import LRU_EvictionPolicy, MCHManagedCollisionModule

    from metamat.models.torchrec.managed_collision import check_rows

    mc = MCHManagedCollisionModule(zch_size=32, device=torch.device("cpu"),
                                   eviction_policy=LRU_EvictionPolicy(), eviction_interval=1,
                                   input_hash_size=HASH, output_global_offset=32,
                                   output_segments=[0, 32, 64])
    check_rows("k", "t0", mc, 32 + torch.randperm(32))  # its own rows, any order
    mixed = torch.arange(16, 48)
    with pytest.raises(metamat.UnsupportedError, match=r"k: the checkpoint's slots of rows "
                       r"\[32, 64\) of table 't0' remap 16 of 32 ids to rows outside them"):
        check_rows("k", "t0", mc, mixed)
