"""TorchRec's 2D parallelism (``DMPCollection``) built on meta and materialized, on the
emulated GPU: 4 gloo ranks in sharding groups of 2 (every shard has two replicas), 8 ranks in
groups of 4 split into nodes of 2 (table-row-wise and grid sharding), and 2 ranks in groups
of 1.

``shard_on_meta(..., sharding_group_size=2)`` builds TorchRec's own ``DMPCollection`` with its
tables on meta; ``materialize`` fills every replica with the same plan-invariant values (each
sharding group, assembled on its own, equals metamat's CPU materialize of a plain DMP), loads
a training checkpoint of a plain DMP into every replica, and leaves ``sync()`` reducing the
real tensors. Managed-collision collections (MCH, HashZch): each replica's tables and MC state
equal those of the same rank of a plain 2-rank sharding (metamat's init; TorchRec's own load
of a trained eager model's checkpoint). TorchRec runs ``DMPCollection`` on GPUs only: the
``cuda`` test compares with it there (NCCL, training, and replicas syncing where a host has two
or more GPUs).
"""
from __future__ import annotations

import os

import pytest
import torch

pytest.importorskip("torchrec")
pytest.importorskip("fbgemm_gpu")

import _torchrec_gpu_models as M  # noqa: E402
from _dist import run_dist  # noqa: E402

WORLD, GROUP = 4, 2
SEED = 11
# every location and sharding type TorchRec's 2D parallelism takes; table-row-wise and grid
# sharding split a group into nodes of NODE ranks (DMPCollection's node_group_size)
LAYOUT = {"t0": ("tw", "fused"), "t1": ("rw", "fused_uvm"), "t2": ("cw", "fused_uvm_caching"),
          "t3": ("dp", "dense"), "t4": ("rw", "fused_uvm_caching"), "t5": ("cw", "fused"),
          "t6": ("twrw", "fused_uvm"), "t7": ("grid", "fused")}
SAVED = {"t0": ("rw", "fused"), "t1": ("tw", "fused"), "t2": ("rw", "fused"),
         "t3": ("dp", "dense"), "t4": ("cw", "fused"), "t5": ("tw", "fused"),
         "t6": ("cw", "fused"), "t7": ("twrw", "fused")}
NODE = GROUP


def _state(model) -> dict:
    out = M.local_blocks(model.state_dict())
    out.update(M.optimizer_blocks(model))
    return out


def unsharded_mismatches(model, tables) -> list:
    """Table keys of a model whose every rank holds whole tables (sharding groups of one
    rank) whose local blocks are not metamat's materialize of the same tables unsharded
    (values are plan-invariant) or do not cover the table; a block's rows and columns are
    read at its global offsets."""
    from torchrec import EmbeddingBagCollection

    import metamat

    ref = EmbeddingBagCollection(tables=tables, device="meta")
    metamat.materialize(ref, device="cpu", seed=SEED)
    want = ref.state_dict()
    bad = []
    for key, blocks in M.local_blocks(model.state_dict()).items():
        if key not in want:
            continue
        full = want[key]
        covered = torch.zeros(full.shape, dtype=torch.bool)
        for (r, c), t in blocks:
            rows, cols = slice(r, r + t.shape[0]), slice(c, c + t.shape[1])
            covered[rows, cols] = True
            if not torch.equal(M.bits(t.cpu()), M.bits(full[rows, cols])):
                bad.append(key)
        if not covered.all():
            bad.append(key)
    return bad


def _two_dim(kind: str, layout, inter_host: bool = False, **opts):
    import metamat

    module, sharder, plan, tables = M.build(kind, layout, GROUP, **opts)
    extra = {"use_inter_host_allreduce": True} if inter_host else {}
    if any(s in ("twrw", "grid") for s, _ in layout.values()):
        extra["node_group_size"] = NODE
    model = metamat.shard_on_meta(module, plan=plan, sharders=[sharder], compute_device="cuda",
                                  sharding_group_size=GROUP, **extra)
    return model, tables


def _group_of(rank: int, inter_host: bool = False) -> int:
    """The sharding group (replica) of a global rank: TorchRec strides a group over the world
    (0, 2 | 1, 3), or with ``use_inter_host_allreduce`` takes consecutive ranks (0, 1 | 2, 3)."""
    return rank // GROUP if inter_host else rank % (WORLD // GROUP)


def _plain_cpu(kind: str, layout):
    import metamat

    module, sharder, plan, _ = M.build(kind, M.cpu_layout(layout), WORLD, device_type="cpu")
    return metamat.shard_on_meta(module, plan=plan, sharders=[sharder])


def _shard_views(model, prefix: str = "") -> list:
    """The model's table shards and fused optimizer state as TorchRec gives them (views of
    the TBEs' storage), data-parallel tables left out (DDP averages their gradients); only
    those whose key starts with ``prefix``."""
    state = {f"{k}.{n}": t for k, v in model.fused_optimizer.state_dict()["state"].items()
             for n, t in v.items() if isinstance(t, torch.Tensor)}
    return [t for sd in (model.state_dict(), state)
            for k, blocks in M.local_views(sd).items() if k.startswith(prefix) and (
                hasattr(sd[k], "_local_tensor") or hasattr(sd[k], "local_shards"))
            for _, t in blocks if t.numel()]


def _sync_lists_off_live(model, device_type: str) -> list:
    """What ``sync()`` would average but the live tables do not hold: each tensor of the lists
    TorchRec cached on meta while building (``weights_by_dtype``, ``optimizer_tensors_by_dtype``
    of each context) must be on ``device_type`` and be the same view of the same storage as
    one the live kernels give now. On one GPU sync() is the identity, so this is what shows
    lists left behind there."""
    ctxs = getattr(model, "_ctxs", None) or []
    if not ctxs:
        return ["no DMPCollection contexts"]

    def view(t):
        return (t.untyped_storage().data_ptr(), t.storage_offset(), tuple(t.shape), t.dtype)

    off = []
    for ci, ctx in enumerate(ctxs):
        live = set()
        for kernel, _ in ctx.modules_to_sync:
            live.update(view(w) for w in kernel.split_embedding_weights())
            live.update(view(s["sum"]) for s in kernel.get_optimizer_state())
        for kind in ("weights_by_dtype", "optimizer_tensors_by_dtype"):
            for dtype, ts in getattr(ctx, kind).items():
                off += [f"ctx {ci} {kind}[{dtype}][{i}] on {t.device}" +
                        ("" if view(t) in live else ", not a live view")
                        for i, t in enumerate(ts)
                        if t.device.type != device_type or view(t) not in live]
        if not live:
            off.append(f"ctx {ci}: no tensors to sync")
    return off


def worker_init(rank, world_size, kind, layout, tmp, inter_host=False):
    import torch.distributed.checkpoint as dcp

    import metamat
    from metamat.emulation import emulated_cuda

    model, _ = _two_dim(kind, layout, inter_host)
    with emulated_cuda():
        report = metamat.materialize(model, seed=SEED)
    ref = _plain_cpu(kind, layout)
    metamat.materialize(ref, device="cpu", seed=SEED)
    res = dict(kind=type(model).__name__, device=report.device, two_dim=_state(model),
               ref=_state(ref), buffers=M.fbgemm_mismatches(model),
               meta_left=[n for n, t in list(model.named_parameters()) +
                          list(model.named_buffers()) if t.is_meta])
    # sync(): the replicas differ by 2.0 (tables and optimizer state), their mean is +1.0
    tensors = _shard_views(model)
    before = [t.clone() for t in tensors]
    with torch.no_grad():
        for t in tensors:
            t.add_(2.0 * _group_of(rank, inter_host))
    model.sync()
    res["synced"] = [float((t - (b + 1.0)).abs().max()) for t, b in zip(tensors, before)]
    with torch.no_grad():
        for t, b in zip(tensors, before):
            t.copy_(b)
    # dcp.save of the 2D model's own state_dict (DTensors), loaded into a plain CPU DMP
    path = os.path.join(tmp, "saved")
    dcp.save(model.state_dict(), checkpoint_id=path)
    back = _plain_cpu(kind, layout)
    metamat.materialize(back, path, device="cpu")
    res["roundtrip"] = M.local_blocks(back.state_dict())
    again, _ = _two_dim(kind, layout, inter_host)  # and into a fresh 2D model
    with emulated_cuda():
        metamat.materialize(again, path)
    res["roundtrip_2d"] = M.local_blocks(again.state_dict())
    return res


def worker_load(rank, world_size, tmp):
    import torch.distributed as dist
    import torch.distributed.checkpoint as dcp
    from torchrec.distributed.model_parallel import DistributedModelParallel
    from torchrec.distributed.types import ShardingEnv

    import metamat
    from metamat.emulation import emulated_cuda

    module, sharder, plan, _ = M.build("ebc", SAVED, world_size, device_type="cpu")
    eager = DistributedModelParallel(module, ShardingEnv.from_process_group(dist.group.WORLD),
                                     device=torch.device("cpu"), plan=plan, sharders=[sharder])
    M.backward(eager, M.batch(len(SAVED), seed=20 + rank))  # momentum != 0
    path = os.path.join(tmp, "training")
    dcp.save({"model": eager.state_dict(), "optim": eager.fused_optimizer.state_dict()},
             checkpoint_id=path)
    model, _ = _two_dim("ebc", LAYOUT)
    with emulated_cuda():
        report = metamat.materialize(model, path)
    res = dict(saved=_state(eager), loaded=_state(model), initialized=report.initialized)
    # in place into the live model, whose replicas have drifted apart
    with torch.no_grad():
        for t in _shard_views(model):
            t.add_(float(rank))
    with emulated_cuda():
        metamat.materialize(model, path)
    res["reloaded"] = _state(model)
    return res


def _groups(ranks: list, inter_host: bool = False) -> list:
    """The ranks' results split by sharding group (each one whole replica of the model)."""
    return [[ranks[r] for r in range(WORLD) if _group_of(r, inter_host) == g]
            for g in range(WORLD // GROUP)]


@pytest.mark.multiprocess
@pytest.mark.parametrize("kind,layout,inter_host", [
    ("ebc", LAYOUT, False), ("ec", M.MIXED_EC, False),
    ("dlrm", {"t0": ("rw", "fused"), "t1": ("tw", "fused"), "t2": ("dp", "dense")}, False),
    ("ebc", LAYOUT, True),
    ("pec", {"t0": ("rw", "fused"), "t1": ("rw", "fused_uvm"), "t2": ("rw", "fused_uvm_caching")},
     False)], ids=["ebc", "ec", "dlrm", "ebc-inter-host", "pec"])
def test_every_replica_gets_the_plain_models_values_and_sync_reduces_them(kind, layout,
                                                                        inter_host, tmp_path):
    if kind == "pec":
        pytest.importorskip("torchrec.modules.pec_embedding_modules")  # torchrec >= 1.8
    ranks = run_dist(worker_init, WORLD, kind, layout, str(tmp_path), inter_host)
    assert all(r["kind"] == "DMPCollection" for r in ranks)
    assert all(r["device"] == "cuda (emulated on the CPU)" for r in ranks)
    assert all(r["meta_left"] == [] for r in ranks)
    assert all(r["buffers"] == [] for r in ranks), [r["buffers"] for r in ranks]
    ref = [r["ref"] for r in ranks]
    for g, group in enumerate(_groups(ranks, inter_host)):
        # each sharding group holds every table once: the CPU values
        mine = [r["two_dim"] for r in group]
        tables = sorted({k for r in mine for k in r if not k.startswith("state.")})
        M.assert_same(mine, ref, f"{kind} replica {g}", tables)
        # and the optimizer state, TorchRec's zeros (its shape follows the column split)
        state = sorted({k for r in mine for k in r if k.startswith("state.")})
        assert len(state) == sum(k != "dense" for _, k in layout.values()), state
        for k in state:
            full = M.global_of(mine, k)
            assert not torch.isnan(full).any() and not full.any(), f"{kind} {k}"
        tables_only = [{k: v for k, v in r["two_dim"].items() if not k.startswith("state.")}
                       for r in group]
        M.assert_same([r["roundtrip"] for r in ranks], tables_only,
                      f"{kind} dcp round trip, replica {g}")
        M.assert_same([r["roundtrip_2d"] for r in group], tables_only,
                      f"{kind} dcp round trip into 2D, replica {g}")
    for r in ranks:
        assert len(r["synced"]) >= 2 and max(r["synced"]) < 1e-6, r["synced"]


@pytest.mark.multiprocess
def test_a_plain_training_checkpoint_loads_into_every_replica(tmp_path):
    ranks = run_dist(worker_load, WORLD, str(tmp_path))
    saved = [r["saved"] for r in ranks]
    assert all(r["initialized"] == [] for r in ranks)
    momentum = sorted({k for r in saved for k in r if k.startswith("state.")})
    assert len(momentum) == len(SAVED) - 1  # every fused table's row-wise Adagrad state
    assert any(t.any() for r in saved for k in momentum for _, t in r.get(k, []))
    # the tables, and the momentum where both plans keep one per row (a column-wise or grid
    # table keeps one per row and column shard)
    split = ("cw", "grid")
    keys = sorted({k for r in saved for k in r if not k.startswith("state.")} |
                  {k for k in momentum if SAVED[k.split(".")[2]][0] not in split
                   and LAYOUT[k.split(".")[2]][0] not in split})
    assert [k.split(".")[2] for k in keys if k.startswith("state.")] == ["t0", "t1"], keys
    for g, group in enumerate(_groups(ranks)):
        M.assert_same([r["loaded"] for r in group], saved, f"replica {g}", keys)
        M.assert_same([r["reloaded"] for r in group], saved, f"replica {g} in place", keys)


def worker_refusals(rank, world_size):
    from torchrec import EmbeddingBagCollection
    from torchrec.distributed.types import DMPCollectionConfig

    import metamat

    out = {}
    module, sharder, plan, _ = M.build("ebc", {"t0": ("tw", "fused")}, 1)
    cases = {
        "cpu": dict(plan=plan, compute_device="cpu", sharding_group_size=1),
        "no_plan": dict(compute_device="cuda", sharding_group_size=1, submodule_configs=[
            DMPCollectionConfig(module=EmbeddingBagCollection, plan=plan,
                                sharding_group_size=1)]),
        "size": dict(plan=plan, compute_device="cuda", sharding_group_size=3),
        "fixed": dict(plan=plan, compute_device="cuda", sharding_group_size=1, world_size=2),
        "sub_size": dict(plan=plan, compute_device="cuda", sharding_group_size=1,
                         submodule_configs=[DMPCollectionConfig(
                             module=EmbeddingBagCollection, plan=plan, sharding_group_size=3)]),
        "world_plan": dict(plan=M.build("ebc", {"t0": ("tw", "fused")}, 2)[2],
                           compute_device="cuda", sharding_group_size=1),
    }
    for name, kw in cases.items():
        try:
            metamat.shard_on_meta(module, sharders=[sharder], **kw)
        except (ValueError, metamat.UnsupportedError) as e:
            out[name] = str(e)
    # a submodule config's type planned in the main plan
    container, sharders, plan2, config, _ = _ebc_and_ec()
    plan2.plan.update(config.plan.plan)
    try:
        metamat.shard_on_meta(container, plan=plan2, sharders=sharders, compute_device="cuda",
                              sharding_group_size=2, submodule_configs=[config])
    except ValueError as e:
        out["context"] = str(e)
    twrw = {"t0": ("twrw", "fused"), "t1": ("tw", "fused")}
    module, sharder, plan, _ = M.build("ebc", twrw, world_size)
    try:  # TorchRec asserts it too, later
        metamat.shard_on_meta(module, plan=plan, sharders=[sharder], compute_device="cuda",
                              sharding_group_size=world_size, node_group_size=3)
    except ValueError as e:
        out["nodes"] = str(e)
    out["meta"] = all(t.is_meta for t in module.parameters())
    # TorchRec keeps the first node groups a process makes: nodes of 1, then of 2
    module, sharder, plan, _ = M.build("ebc", twrw, world_size)
    metamat.shard_on_meta(module, plan=plan, sharders=[sharder], compute_device="cuda",
                          sharding_group_size=world_size, node_group_size=1)
    module, sharder, plan, _ = M.build("ebc", twrw, world_size)
    try:
        metamat.shard_on_meta(module, plan=plan, sharders=[sharder], compute_device="cuda",
                              sharding_group_size=world_size, node_group_size=2)
    except metamat.UnsupportedError as e:
        out["second_nodes"] = str(e)
    out["meta_again"] = all(t.is_meta for t in module.parameters())
    # no plan, and TorchRec's planner fails on rank 0: every rank raises (none waits for it)
    from torchrec.distributed.planner import EmbeddingShardingPlanner
    from torchrec.distributed.planner.types import PlannerError

    def fail(self, *a, **k):
        raise PlannerError("no plan fits")
    if rank == 0:
        EmbeddingShardingPlanner.plan = fail
    module, sharder, _, _ = M.build("ebc", twrw, world_size)
    try:
        metamat.shard_on_meta(module, sharders=[sharder], compute_device="cuda",
                              sharding_group_size=world_size)
    except (PlannerError, RuntimeError) as e:
        out["planner"] = f"{type(e).__name__}: {e}"
    return out


@pytest.mark.multiprocess
def test_what_two_dim_needs_is_checked_before_building():
    ranks = run_dist(worker_refusals, 2)
    out = ranks[0]
    assert out["planner"] == "PlannerError: no plan fits", out["planner"]
    assert ranks[1]["planner"] == "RuntimeError: shard_on_meta: TorchRec's planner failed on " \
        "rank 0: PlannerError: no plan fits", ranks[1]["planner"]
    assert "GPUs only" in out["cpu"], out
    assert "with submodule_configs, give the plan" in out["no_plan"], out
    assert "must divide the world size 2" in out["size"], out
    assert "'world_size' is fixed" in out["fixed"], out
    assert "config of EmbeddingBagCollection: its sharding_group_size 3 must divide" in \
        out["sub_size"], out
    assert "places shards on rank 1" in out["world_plan"], out
    assert "the plan plans ec (EmbeddingCollection), which DMPCollection shards in the " \
        "submodule config of EmbeddingCollection" in out["context"], out
    assert "into nodes of 3 ranks (node_group_size)" in out["nodes"], out
    assert "needs nodes of 2 ranks, but this process's node group is [" in \
        out["second_nodes"], out
    assert out["meta_again"], out
    assert ".t0" in out["nodes"] and ".t1" not in out["nodes"], out
    assert out["meta"]


def worker_planned(rank, world_size, strategy):
    from torchrec import EmbeddingBagCollection
    from torchrec.distributed.types import ShardingStrategy

    import metamat
    from metamat.emulation import emulated_cuda

    _, _, _, tables = M.build("ebc", LAYOUT, GROUP)
    module = EmbeddingBagCollection(tables=tables, device="meta")
    model = metamat.shard_on_meta(module, compute_device="cuda", sharding_group_size=GROUP,
                                  sharding_strategy=ShardingStrategy[strategy])
    with emulated_cuda():
        metamat.materialize(model, seed=SEED)
    ref = EmbeddingBagCollection(tables=tables, device="meta")
    metamat.materialize(ref, device="cpu", seed=SEED)
    plan = model.plan.plan[""]
    return dict(two_dim=_state(model), ref=M.local_blocks(ref.state_dict()),
                kernels=sorted({ps.compute_kernel for ps in plan.values()}),
                ranks=sorted({int(r) for ps in plan.values() for r in ps.ranks or []}),
                wrappers=sorted({type(w).__name__ for w in M.wrappers(model)}))


@pytest.mark.multiprocess
@pytest.mark.parametrize("strategy", ["DEFAULT", "FULLY_SHARDED"])
def test_without_a_plan_torchrecs_planner_plans_one_sharding_group(strategy):
    ranks = run_dist(worker_planned, WORLD, strategy)
    fully = "ShardedBatchedFusedEmbeddingBag" in ranks[0]["wrappers"]
    assert fully == (strategy == "FULLY_SHARDED"), ranks[0]["wrappers"]
    for g, group in enumerate(_groups(ranks)):
        # the plan DMPCollection kept: the group's own global ranks, GPU kernels
        assert all(r["ranks"] == sorted(q for q in range(WORLD) if _group_of(q) == g)
                   for r in group), [r["ranks"] for r in group]
        assert all(set(r["kernels"]) <= {"fused", "fused_uvm", "fused_uvm_caching", "dense"}
                   for r in group), group[0]["kernels"]
        mine = [r["two_dim"] for r in group]
        M.assert_same(mine, [ranks[0]["ref"]], f"replica {g}",
                      sorted(k for k in mine[0] if not k.startswith("state.")))


# ------------------------------------------------------------------------------------------
# Table-row-wise and grid sharding under 2D: 8 ranks, sharding groups of 4 split into nodes
# of 2 (TorchRec's intra_and_cross_node_pg_2D example: group 0,2,4,6 has nodes 0,2 | 4,6)

# each table constrained to one sharding type and kernel; TorchRec's planner places them
NODES = {"t0": ("table_row_wise", "fused"), "t1": ("table_row_wise", "fused_uvm_caching"),
         "t2": ("grid_shard", "fused"), "t3": ("grid_shard", "fused_uvm"),
         "t4": ("row_wise", "fused_uvm")}


def worker_nodes(rank, world_size, tmp, inter_host):
    import torch.distributed as dist
    import torch.distributed.checkpoint as dcp
    from torchrec import EmbeddingBagCollection

    import metamat
    from metamat.emulation import emulated_cuda
    from metamat.models.torchrec import upstream

    module, sharder, plan, tables = M.build_planned(NODES, world_size=4, local_size=2)
    model = metamat.shard_on_meta(module, plan=plan, sharders=[sharder], compute_device="cuda",
                                  sharding_group_size=4, node_group_size=2,
                                  use_inter_host_allreduce=inter_host)
    with emulated_cuda():
        metamat.materialize(model, seed=SEED)
    groups = []
    for m in model.modules():
        for sh in upstream.shardings(m) if hasattr(m, "_embedding_shardings") else []:
            intra_cross = upstream.node_groups(sh)
            if intra_cross is not None:
                groups.append([dist.get_process_group_ranks(g) for g in intra_cross]
                              + [sh._local_size])
    # the reference: the same tables unsharded (values are plan-invariant)
    ref = EmbeddingBagCollection(tables=tables, device="meta")
    metamat.materialize(ref, device="cpu", seed=SEED)
    path = os.path.join(tmp, "saved")
    dcp.save(model.state_dict(), checkpoint_id=path)
    back = EmbeddingBagCollection(tables=tables, device="meta")
    metamat.materialize(back, path, device="cpu")
    return dict(two_dim=_state(model), groups=groups, buffers=M.fbgemm_mismatches(model),
                plan={t: (ps.sharding_type, sorted({int(r) for r in ps.ranks}))
                      for m in plan.plan.values() for t, ps in m.items()},
                ref=M.local_blocks(ref.state_dict()),
                roundtrip=M.local_blocks(back.state_dict()))


@pytest.mark.multiprocess
@pytest.mark.parametrize("inter_host", [False, True], ids=["strided", "inter-host"])
def test_table_row_wise_and_grid_shards_split_each_group_into_nodes_as_torchrec_does(
        tmp_path, inter_host):
    world = 8
    ranks = run_dist(worker_nodes, world, str(tmp_path), inter_host)
    plan = ranks[0]["plan"]
    # the planner used both nodes of a group: grid tables' column shards span them
    assert {t: s for t, (s, _) in plan.items()} == {t: s for t, (s, _) in NODES.items()}
    assert any(set(r) == {0, 1, 2, 3} for s, r in plan.values() if s == "grid_shard"), plan
    def replica(rank):  # strided groups 0,2,4,6 | 1,3,5,7; inter-host 0-3 | 4-7
        return rank // 4 if inter_host else rank % 2

    for rank, r in enumerate(ranks):
        assert r["buffers"] == [], r["buffers"]
        # TorchRec's node groups: nodes of 2 in the group's order, cross groups across them
        group = [q for q in range(world) if replica(q) == replica(rank)]
        node = group[:2] if rank in group[:2] else group[2:]
        cross = [g for g in group if group.index(g) % 2 == group.index(rank) % 2]
        assert r["groups"] and all(g == [node, cross, 2] for g in r["groups"]), r["groups"]
    for g in range(2):
        mine = [ranks[r]["two_dim"] for r in range(world) if replica(r) == g]
        tables = sorted({k for r in mine for k in r if not k.startswith("state.")})
        assert len(tables) == len(NODES), tables
        M.assert_same(mine, [ranks[0]["ref"]], f"replica {g}", tables)
        # the optimizer state (grid's follows the node size), TorchRec's zeros, all covered
        state = sorted({k for r in mine for k in r if k.startswith("state.")})
        assert len(state) == len(NODES), state
        for k in state:
            full = M.global_of(mine, k)
            assert not torch.isnan(full).any() and not full.any(), k
    for r in ranks:  # dcp.save of the 2D model, loaded whole into an unsharded collection
        M.assert_same([r["roundtrip"]], [ranks[0]["ref"]], "dcp round trip")


# ------------------------------------------------------------------------------------------
# The FULLY_SHARDED strategy: each replica holds the whole tables until TorchRec's first
# training forward reduce-scatters them; its kernels keep a view of the weights and a stream

FULLY = {"t0": ("tw", "fused"), "t1": ("rw", "fused"), "t2": ("cw", "fused"),
         "t3": ("rw", "fused_uvm_caching"), "t4": ("dp", "dense")}


def worker_fully_sharded(rank, world_size, kind, layout, tmp):
    import torch.distributed.checkpoint as dcp
    from torchrec.distributed.types import ShardingStrategy

    import metamat
    from metamat.emulation import emulated_cuda

    def build():
        module, sharder, plan, _ = M.build(kind, layout, GROUP)
        return metamat.shard_on_meta(module, plan=plan, sharders=[sharder],
                                     compute_device="cuda", sharding_group_size=GROUP,
                                     sharding_strategy=ShardingStrategy.FULLY_SHARDED)

    model = build()
    with emulated_cuda():
        metamat.materialize(model, seed=SEED)
    ref = _plain_cpu(kind, layout)
    metamat.materialize(ref, device="cpu", seed=SEED)
    kernels = []
    for w in M.wrappers(model):
        if hasattr(w, "_unsharded_param"):
            weights = w._emb_module.weights_dev
            kernels.append(dict(
                kind=type(w).__name__, numel=weights.numel(),
                same=w._unsharded_param is weights and not weights.is_meta,
                stream=repr(w._async_stream), sharded=w.weights_sharded))
    res = dict(two_dim=_state(model), ref=_state(ref), kernels=kernels,
               buffers=M.fbgemm_mismatches(model))
    # its own checkpoint, into a fresh model and in place into the live one
    path = os.path.join(tmp, "saved")
    dcp.save(model.state_dict(), checkpoint_id=path)
    fresh = build()
    with emulated_cuda():
        metamat.materialize(fresh, path)
    res["fresh"] = _state(fresh)
    views = _shard_views(model)
    with torch.no_grad():
        for t in views:
            t.add_(1.0)
    with emulated_cuda():
        metamat.materialize(model, path)
    res["in_place"] = _state(model)
    # a training forward reduce-scattered the weights (TorchRec's flag, its backward not run):
    # refused, nothing written
    scattered = next(w for w in M.wrappers(model) if hasattr(w, "weights_sharded"))
    scattered.weights_sharded = True
    with torch.no_grad():
        for t in views:
            t.add_(1.0)
    try:
        with emulated_cuda():
            metamat.materialize(model, path)
    except metamat.UnsupportedError as e:
        res["refused"] = str(e)
    res["kept"] = _state(model)
    return res


@pytest.mark.multiprocess
@pytest.mark.parametrize("kind,layout,wrapper", [
    ("ebc", FULLY, "ShardedBatchedFusedEmbeddingBag"),
    ("ec", {t: v for t, v in FULLY.items() if v[0] != "dp"}, "ShardedBatchedFusedEmbedding")],
    ids=["ebc", "ec"])
def test_fully_sharded_replicas_hold_whole_tables_that_its_kernels_see(kind, layout, wrapper,
                                                                      tmp_path):
    ranks = run_dist(worker_fully_sharded, WORLD, kind, layout, str(tmp_path))
    for r in ranks:
        assert r["buffers"] == [], r["buffers"]
        kinds = {k["kind"] for k in r["kernels"]}
        assert kinds == {wrapper}, r["kernels"]
        assert any(k["numel"] for k in r["kernels"]), r["kernels"]
        for k in r["kernels"]:  # TorchRec's view of the weights is the real storage
            assert k["same"] and not k["sharded"], k
            assert k["stream"] == "NoStream(cuda: made at registration)", k
    for g, group in enumerate(_groups(ranks)):
        mine = [r["two_dim"] for r in group]
        tables = sorted(k for k in mine[0] if not k.startswith("state."))
        M.assert_same(mine, [r["ref"] for r in ranks], f"replica {g}", tables)
        M.assert_same([r["fresh"] for r in group], mine, f"load, replica {g}", tables)
        M.assert_same([r["in_place"] for r in group], mine, f"in place, replica {g}", tables)
        for r in group:  # the refused load wrote nothing: the +1.0 drift is still there
            assert "reduce-scattered over the replicas" in r["refused"], r.get("refused")
            assert all(torch.equal(b, a + 1.0) for k in tables
                       for (_, a), (_, b) in zip(r["in_place"][k], r["kept"][k])
                       if k.split(".")[1] not in ("t4",)), "the refused load wrote"


# ------------------------------------------------------------------------------------------
# submodule_configs: a module type with its own plan and sharding group. 4 ranks: the
# EmbeddingBagCollection in the default groups of 2 (two replicas), the EmbeddingCollection
# in groups of 1 (four replicas, each rank holding every table)

SUB_EBC = {"t0": ("rw", "fused"), "t1": ("tw", "fused_uvm_caching"), "t2": ("twrw", "fused")}
SUB_EC = {"t0": ("rw", "fused_uvm"), "t1": ("cw", "fused"), "t2": ("tw", "fused")}


def _ebc_and_ec():
    """(container on meta, sharders, default plan, the EC's submodule config, the same
    container unsharded on meta): an EBC planned for groups of 2, an EC for groups of 1."""
    from torch import nn
    from torchrec import EmbeddingBagCollection, EmbeddingCollection
    from torchrec.distributed.types import DMPCollectionConfig, ShardingPlan

    ebc, ebc_sharder, ebc_plan, ebc_tables = M.build("ebc", SUB_EBC, GROUP)
    ec, ec_sharder, ec_plan, ec_tables = M.build("ec", SUB_EC, 1)

    def container(bags, seqs):
        m = nn.Module()
        m.ebc, m.ec = bags, seqs
        return m

    ref = container(EmbeddingBagCollection(tables=ebc_tables, device="meta"),
                    EmbeddingCollection(tables=ec_tables, device="meta"))
    config = DMPCollectionConfig(module=EmbeddingCollection,
                                 plan=ShardingPlan({"ec": ec_plan.plan[""]}),
                                 sharding_group_size=1)
    return (container(ebc, ec), [ebc_sharder, ec_sharder],
            ShardingPlan({"ebc": ebc_plan.plan[""]}), config, ref)


def worker_submodule_configs(rank, world_size, tmp):
    import torch.distributed as dist
    import torch.distributed.checkpoint as dcp

    import metamat
    from metamat.emulation import emulated_cuda

    module, sharders, plan, config, ref = _ebc_and_ec()
    def placed(cfg):  # every table's ranks and shard placements
        return [(list(ps.ranks), [str(sm.placement) for sm in ps.sharding_spec.shards]
                 if ps.sharding_spec is not None else None)
                for ps in cfg.plan.plan["ec"].values()]

    given = placed(config)
    model = metamat.shard_on_meta(module, plan=plan, sharders=sharders, compute_device="cuda",
                                  sharding_group_size=GROUP, submodule_configs=[config],
                                  node_group_size=GROUP)
    with emulated_cuda():
        metamat.materialize(model, seed=SEED)
    metamat.materialize(ref, device="cpu", seed=SEED)
    res = dict(two_dim=_state(model), ref=M.local_blocks(ref.state_dict()),
               buffers=M.fbgemm_mismatches(model), sync_lists=_sync_lists_off_live(model, "cpu"),
               kept=given == placed(config),
               group_sizes=[dist.get_world_size(c.sharding_pg) for c in model._ctxs])
    # sync(): replicas pushed 2.0 apart (by the EBC's replica) come back to their mean, +1.0,
    # in the EBC's two replicas and the EC's four
    ebc, ec = _shard_views(model, "ebc."), _shard_views(model, "ec.")
    before = [t.clone() for t in ebc + ec]
    with torch.no_grad():
        for t in ebc + ec:
            t.add_(2.0 * _group_of(rank))
    model.sync()
    res["synced"] = [float((t - (b + 1.0)).abs().max()) for t, b in zip(ebc + ec, before)]
    res["views"] = (len(ebc), len(ec))
    with torch.no_grad():
        for t, b in zip(ebc + ec, before):
            t.copy_(b)
    path = os.path.join(tmp, "saved")  # dcp.save of the model, loaded into the unsharded one
    dcp.save(model.state_dict(), checkpoint_id=path)
    _, _, _, _, back = _ebc_and_ec()
    metamat.materialize(back, path, device="cpu")
    res["roundtrip"] = M.local_blocks(back.state_dict())
    return res


@pytest.mark.multiprocess
def test_submodule_configs_give_a_module_type_its_own_plan_and_sharding_group(tmp_path):
    ranks = run_dist(worker_submodule_configs, WORLD, str(tmp_path))
    ref = ranks[0]["ref"]
    for r in ranks:
        assert r["kept"], "the caller's submodule plan was changed"
        assert r["group_sizes"] == [GROUP, 1], r["group_sizes"]
        assert r["buffers"] == [], r["buffers"]
        assert r["sync_lists"] == [], r["sync_lists"]
        assert all(n > 0 for n in r["views"]) and max(r["synced"]) < 1e-6, r["synced"]
        M.assert_same([r["roundtrip"]], [ref], "dcp round trip")
    ec_keys = sorted(k for k in ref if k.startswith("ec."))
    ebc_keys = sorted(k for k in ref if k.startswith("ebc."))
    assert len(ec_keys) == len(SUB_EC) and len(ebc_keys) == len(SUB_EBC)
    for rank, r in enumerate(ranks):
        M.assert_same([r["two_dim"]], [ref], f"EC on rank {rank}", ec_keys)
    for g, group in enumerate(_groups(ranks)):
        M.assert_same([r["two_dim"] for r in group], [ref], f"EBC replica {g}", ebc_keys)


# ------------------------------------------------------------------------------------------
# On GPUs (NCCL): against TorchRec's own DMPCollection on CUDA holding the same values

def _train_step(model, batch):
    out = M.train_step(model, batch)
    model.sync()
    return out


def _close(a: dict, b: dict) -> list:
    """Keys whose blocks differ (in number, offsets, shape or beyond float tolerance)."""
    return [k for k in sorted(set(a) | set(b)) if len(a.get(k, [])) != len(b.get(k, [])) or any(
        o1 != o2 or x.shape != y.shape
        or not torch.allclose(x.float(), y.float(), rtol=1e-5, atol=1e-6)
        for (o1, x), (o2, y) in zip(a[k], b[k]))]


GPU_LAYOUTS = {
    "locations": {"t0": ("tw", "fused"), "t1": ("rw", "fused_uvm"),
                  "t2": ("cw", "fused_uvm_caching"), "t3": ("dp", "dense")},
    # node groups of one rank each (node_group_size=1)
    "node-grouped": {"t0": ("twrw", "fused"), "t1": ("grid", "fused_uvm_caching"),
                     "t2": ("cw", "fused")},
    # the FULLY_SHARDED strategy (weights reduce-scattered after each forward)
    "fully-sharded": {"t0": ("tw", "fused"), "t1": ("rw", "fused"), "t2": ("cw", "fused"),
                      "t3": ("dp", "dense")},
}


def worker_gpu(rank, world_size, name):
    import torch.distributed as dist
    from torchrec.distributed.model_parallel import DMPCollection

    import metamat

    dev = torch.device("cuda", rank)
    torch.cuda.set_device(dev)
    # groups of one rank: each GPU holds every table (two column shards of t2), a replica
    from torchrec.distributed.types import ShardingStrategy

    layout = GPU_LAYOUTS[name]
    nodes = {"node_group_size": 1} if name == "node-grouped" else \
        {"sharding_strategy": ShardingStrategy.FULLY_SHARDED} if name == "fully-sharded" else {}
    module, sharder, plan, tables = M.build("ebc", layout, 1)
    gpu = metamat.shard_on_meta(module, plan=plan, sharders=[sharder], compute_device="cuda",
                                sharding_group_size=1, **nodes)
    report = metamat.materialize(gpu, seed=SEED)
    res = dict(device=report.device, memory=report.bytes_by_memory,
               init_bits=unsharded_mismatches(gpu, tables),
               streams={(type(w._async_stream).__name__, str(w._async_stream.device))
                        for w in M.wrappers(gpu) if hasattr(w, "_async_stream")},
               sync_lists=_sync_lists_off_live(gpu, "cuda"))
    # TorchRec's own DMPCollection on the GPU, given the same values
    emod, esharder, eplan, _ = M.build("ebc", layout, 1)
    eager = DMPCollection(emod, device=dev, plan=eplan, world_size=world_size,
                          sharding_group_size=1, global_pg=dist.group.WORLD,
                          sharders=[esharder], **nodes)
    eager.load_state_dict(gpu.state_dict())
    res["loaded"] = _close(_state(gpu), _state(eager))
    outs = []
    # each replica its own batch: sync() averages them (FULLY_SHARDED: its forward's
    # reduce-scatter and its backward's all-gather, no sync())
    step_of = M.train_step if name == "fully-sharded" else _train_step
    for step in range(2):
        b = M.batch(len(tables), seed=step + 10 * rank, device=dev)
        outs.append((step_of(gpu, b), step_of(eager, b)))
    res["out_close"] = [torch.allclose(a, b, rtol=1e-5, atol=1e-6) for a, b in outs]
    res["after"] = _close(_state(gpu), _state(eager))
    res["replicas"] = [t.cpu() for t in _shard_views(gpu)]
    return res


@pytest.mark.cuda
@pytest.mark.parametrize("name", sorted(GPU_LAYOUTS))
def test_trains_and_syncs_like_torchrecs_own_dmp_collection_on_gpus(name):
    """On one GPU, TorchRec's 2D path on CUDA (NCCL mesh, unified memory, node groups,
    training); with two or more, two replicas that train on different batches and sync."""
    world = min(2, torch.cuda.device_count())
    ranks = run_dist(worker_gpu, world, name, backend="nccl")
    uvm = any(k.startswith("fused_uvm") for _, k in GPU_LAYOUTS[name].values())
    for r in ranks:
        assert r["device"].startswith("cuda:"), r["device"]
        assert r["memory"]["device"] > 0 and ("uvm" in r["memory"]) == uvm, r["memory"]
        if name == "fully-sharded":  # its kernels' streams: real ones, on the rank's GPU
            assert r["streams"] == {("Stream", r["device"])}, r["streams"]
        # what sync() averages is the live tables and state (sync over one GPU is the
        # identity: this is what can fail there)
        assert r["sync_lists"] == [], r["sync_lists"]
        assert r["init_bits"] == [], r["init_bits"]
        assert r["loaded"] == [], r["loaded"]
        assert all(r["out_close"]), r["out_close"]
        assert r["after"] == [], r["after"]
    if world > 1:  # synced: both replicas hold the same tables and state
        assert all(torch.allclose(a, b) for a, b in zip(ranks[0]["replicas"],
                                                         ranks[1]["replicas"]))


# ------------------------------------------------------------------------------------------
# Groups of one rank on the emulated GPU: every rank a whole replica, column shards together

def worker_one_rank_groups(rank, world_size):
    import metamat
    from metamat.emulation import emulated_cuda

    layout = {"t0": ("cw", "fused"), "t1": ("rw", "fused_uvm_caching"), "t2": ("tw", "fused_uvm"),
              "t3": ("cw", "fused_uvm")}
    module, sharder, plan, tables = M.build("ebc", layout, 1)  # cw: two shards on rank 0
    model = metamat.shard_on_meta(module, plan=plan, sharders=[sharder], compute_device="cuda",
                                  sharding_group_size=1)
    with emulated_cuda():
        metamat.materialize(model, seed=SEED)
    blocks = M.local_blocks(model.state_dict())
    return dict(bad=unsharded_mismatches(model, tables),
                shards={k: len(v) for k, v in blocks.items()},
                whole={k: not torch.isnan(M.global_of([blocks], k).float()).any() for k in blocks},
                state=M.optimizer_blocks(model))


@pytest.mark.multiprocess
def test_groups_of_one_rank_hold_whole_tables_with_several_column_shards():
    ranks = run_dist(worker_one_rank_groups, 2)
    for r in ranks:
        assert r["bad"] == [], r["bad"]
        assert r["shards"]["embedding_bags.t0.weight"] == 2, r["shards"]
        assert r["shards"]["embedding_bags.t3.weight"] == 2, r["shards"]
        assert all(r["whole"].values()), r["whole"]
        state = r["state"]
        assert len(state) == 4 and all(not t.any() for v in state.values() for _, t in v)


# ------------------------------------------------------------------------------------------
# Managed-collision collections under 2D: each replica holds a plain sharding's state

def _zch(zch: str):
    """The MC test module of ``zch`` ("mch" or "hash": multi-probe HashZch) and its
    ``(build, trained)``: the module builder and what writes a trained model's MC state."""
    import test_torchrec_managed_collision as MC

    if zch == "mch":
        def trained(kind, eager, rank, world_size):
            for step in range(2):
                MC._step(kind, eager, seed=100 + step)
            MC._trained_mc_state(eager, rank, world_size)
        return MC._module, trained
    import test_torchrec_hash_zch as H

    def trained(kind, eager, rank, world_size):
        H._trained_slots(eager, rank, world_size)
        H._read_only(eager)
        for step in range(2):
            H._step(kind, eager, seed=100 + step)
    return H._module, trained


def worker_mc_plain(rank, world_size, tmp, kind, zch):
    """The reference, on 2 ranks (one sharding group): metamat's init, and TorchRec's own
    load of a trained eager model's checkpoint."""
    import torch.distributed as dist
    import torch.distributed.checkpoint as dcp

    import metamat
    import test_torchrec_managed_collision as MC

    build, trained = _zch(zch)
    init = MC._on_meta(kind, world_size, build=build)
    metamat.materialize(init, seed=SEED)
    eager = MC._eager(kind, world_size, build=build)
    trained(kind, eager, rank, world_size)
    path = os.path.join(tmp, "mc")
    dcp.save(eager.state_dict(), checkpoint_id=path)
    dist.barrier()
    loaded = MC._eager(kind, world_size, build=build)
    sd = loaded.state_dict()
    dcp.load(sd, checkpoint_id=path)
    loaded.load_state_dict(sd)  # TorchRec's load hook sorts the MC state again
    return dict(init=M.local_blocks(init.state_dict()), load=M.local_blocks(loaded.state_dict()))


def worker_mc_two_dim(rank, world_size, tmp, kind, zch):
    import metamat
    import test_torchrec_managed_collision as MC
    from metamat.emulation import emulated_cuda

    def two_dim():
        module = _zch(zch)[0](kind, torch.device("meta"))
        return metamat.shard_on_meta(module, plan=MC._plan(module, kind, GROUP, "cuda"),
                                     sharders=[MC._sharder(kind)], compute_device="cuda",
                                     sharding_group_size=GROUP)
    init, loaded = two_dim(), two_dim()
    with emulated_cuda():
        metamat.materialize(init, seed=SEED)
        metamat.materialize(loaded, os.path.join(tmp, "mc"))
    return dict(init=M.local_blocks(init.state_dict()), load=M.local_blocks(loaded.state_dict()))


@pytest.mark.multiprocess
@pytest.mark.parametrize("kind,zch", [("ebc", "mch"), ("ec", "mch"), ("ebc", "hash")])
def test_managed_collision_replicas_hold_the_plain_shardings_state(kind, zch, tmp_path):
    import torchrec

    if tuple(int(x) for x in torchrec.__version__.split(".")[:2]) < (1, 8):
        pytest.skip("refused before torchrec 1.8 (test_managed_collision_refused_before_1_8)")
    plain = run_dist(worker_mc_plain, GROUP, str(tmp_path), kind, zch)
    two_dim = run_dist(worker_mc_two_dim, WORLD, str(tmp_path), kind, zch)
    for rank, mine in enumerate(two_dim):
        ref = plain[rank // (WORLD // GROUP)]  # this rank's place in its sharding group
        for what in ("init", "load"):
            keys = sorted(ref[what])
            assert sorted(mine[what]) == keys, (rank, what)
            assert sum("_managed_collision_modules" in k for k in keys) >= 4, keys
            bad = [k for k in keys if len(mine[what][k]) != len(ref[what][k]) or any(
                o1 != o2 or not torch.equal(M.bits(a), M.bits(b))
                for (o1, a), (o2, b) in zip(mine[what][k], ref[what][k]))]
            assert bad == [], (rank, what, bad)


def worker_mc_old(rank, world_size):
    import metamat
    import test_torchrec_managed_collision as MC

    module = MC._module("ebc", torch.device("meta"))
    try:
        metamat.shard_on_meta(module, plan=MC._plan(module, "ebc", 1, "cuda"),
                              sharders=[MC._sharder("ebc")], compute_device="cuda",
                              sharding_group_size=1)
    except metamat.UnsupportedError as e:
        return str(e)
    return None


@pytest.mark.multiprocess
def test_managed_collision_refused_before_1_8():
    import torchrec

    if tuple(int(x) for x in torchrec.__version__.split(".")[:2]) >= (1, 8):
        pytest.skip("torchrec 1.8 and later shard managed collision under 2D")
    error = run_dist(worker_mc_old, 2)[0]
    assert error and "needs torchrec 1.8 or later" in error, error
