"""Check metamat's declared upstream internals on the installed torch / torchrec / fbgemm.

Every private name metamat uses is declared in :mod:`metamat.models.torch_upstream` and
:mod:`metamat.models.torchrec.upstream` with the versions it was checked on. This script is
how a version gets into those ``checked`` tuples: it runs every group's check (modules,
classes, methods, patch sites) and builds small models on meta the way metamat's users do
(``shard_on_meta`` of an EBC with TW/RW/CW/TWRW/DP tables, FUSED and DENSE kernels, CPU and
CUDA layouts, 2D parallel; an EC; a managed-collision EBC; quantized EBC/EC, unsharded and sharded, plain
and managed-collision ones; FSDP2 and a DTensor; a ShardedTensor), then checks the declared
instance attributes on every object the adapters would read. Nothing is materialized: no compiled core is needed, nothing big is allocated.

    python scripts/check_upstream.py            # exit status 1 if a name is missing
    python scripts/check_upstream.py --json     # the result per declaration

A declaration no instance reached is listed as "not reached" (an optional name, or a kind of
model the script does not build); the exit status only reflects missing ones.
"""
from __future__ import annotations

import argparse
import json
import os
import shutil
import sys
import tempfile
import warnings

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import torch  # noqa: E402
from torch import nn  # noqa: E402


def _tables(n=5, dim=8, rows=40):
    from torchrec import EmbeddingBagConfig

    return [EmbeddingBagConfig(name=f"t{i}", embedding_dim=dim, num_embeddings=rows + 3 * i,
                               feature_names=[f"f{i}"]) for i in range(n)]


def _ec_tables(n=3, dim=8, rows=40):
    from torchrec import EmbeddingConfig

    return [EmbeddingConfig(name=f"t{i}", embedding_dim=dim, num_embeddings=rows + 3 * i,
                            feature_names=[f"f{i}"]) for i in range(n)]


def _plan(module, kinds, kernel, sharder):
    from torchrec.distributed import sharding_plan as sp
    from torchrec.distributed.types import ShardingPlan

    gen = {"tw": lambda: sp.table_wise(rank=0), "rw": sp.row_wise,
           "cw": lambda: sp.column_wise(ranks=[0, 0]),
           "twrw": lambda: sp.table_row_wise(host_index=0), "dp": sp.data_parallel,
           "grid": lambda: sp.grid_shard(host_indexes=[0])}
    mp = sp.construct_module_sharding_plan(module, {t: gen[k]() for t, k in kinds.items()},
                                           local_size=1, world_size=1, device_type="cpu",
                                           sharder=sharder)
    for _, ps in mp.items():
        if ps.sharding_type != "data_parallel":
            ps.compute_kernel = kernel
    return ShardingPlan({"": mp})


def _fused():
    from fbgemm_gpu.split_embedding_configs import EmbOptimType

    return {"optimizer": EmbOptimType.EXACT_ROWWISE_ADAGRAD, "learning_rate": 0.05}


def build_training(env, seen):
    """shard_on_meta models; their objects checked as the adapter checks them."""
    import metamat
    from metamat.models.torchrec import upstream as tr
    from metamat.models.torchrec.sharded import sharded_modules
    from torchrec import EmbeddingBagCollection, EmbeddingCollection
    from torchrec.distributed.embedding import EmbeddingCollectionSharder
    from torchrec.distributed.embeddingbag import EmbeddingBagCollectionSharder
    from torchrec.distributed.types import ShardingStrategy

    kinds = {"t0": "tw", "t1": "rw", "t2": "cw", "t3": "twrw", "t4": "dp", "t5": "grid"}
    for kernel, device in (("fused", None), ("dense", None), ("fused", "cuda")):
        ebc = EmbeddingBagCollection(tables=_tables(6), device="meta")
        sh = EmbeddingBagCollectionSharder(fused_params=_fused())
        k = dict(kinds) if device is None else {"t0": "tw", "t1": "rw", "t2": "cw"}
        ebc_k = ebc if device is None else EmbeddingBagCollection(tables=_tables(3),
                                                                   device="meta")
        dmp = metamat.shard_on_meta(ebc_k, env, plan=_plan(ebc_k, k, kernel, sh),
                                    sharders=[sh], compute_device=device)
        tr.check_dmp(dmp)
        sharded = sharded_modules(dmp.module)
        tr.check_sharded(sharded)
        seen.update(_objects(dmp))
    # TorchRec's 2D parallelism (DMPCollection): one sharding group of this one rank, the
    # default strategy and the fully sharded one (its own kernel wrappers)
    for coll, tables, sharder in ((EmbeddingBagCollection, _tables(3),
                                   EmbeddingBagCollectionSharder),
                                  (EmbeddingCollection, _ec_tables(), EmbeddingCollectionSharder)):
        for strategy in (ShardingStrategy.DEFAULT, ShardingStrategy.FULLY_SHARDED):
            m = coll(tables=tables, device="meta")
            sh = sharder(fused_params=_fused())
            dmpc = metamat.shard_on_meta(
                m, env, plan=_plan(m, {"t0": "tw", "t1": "rw", "t2": "cw"}, "fused", sh),
                sharders=[sh], compute_device="cuda", sharding_group_size=1,
                sharding_strategy=strategy)
            tr.check_dmp(dmpc)
            seen.update(_objects(dmpc))
    ec = EmbeddingCollection(tables=_ec_tables(), device="meta")
    sh = EmbeddingCollectionSharder(fused_params=_fused())
    dmp = metamat.shard_on_meta(ec, env, plan=_plan(ec, {"t0": "tw", "t1": "rw", "t2": "cw"},
                                                    "fused", sh), sharders=[sh])
    tr.check_sharded(sharded_modules(dmp.module))
    seen.update(_objects(dmp))
    seen.update(_managed_collision(env))
    # a ShardedTensor (the state_dict of a sharded table)
    for v in dmp.module.state_dict().values():
        if hasattr(v, "local_shards"):
            seen.add(v)
            for s in v.local_shards():
                seen.add(s.metadata.placement)
            break


def build_quant(seen):
    from metamat.models.torchrec import upstream as tr
    from metamat.models.torchrec.quant import quant_modules
    from torchrec import EmbeddingBagCollection, EmbeddingCollection
    from torchrec.distributed.test_utils.infer_utils import quantize

    class M(nn.Module):
        def __init__(self, coll):
            super().__init__()
            self.coll = coll

    for coll in (EmbeddingBagCollection(tables=_tables(3), device="meta"),
                 EmbeddingCollection(tables=_ec_tables(), device="meta")):
        q = quantize(M(coll), inplace=False, weight_dtype=torch.qint8,
                     quant_state_dict_split_scale_bias=False)
        mods = quant_modules(q)
        tr.check_quant(mods)
        for _, m in mods:
            seen.add(m)
            seen.update(tr.quant_tbes(m))
    seen.update(_quant_managed_collision())
    seen.update(_quant_feature_processed())
    try:
        from torchrec.distributed.embedding_types import EmbeddingComputeKernel
        from torchrec.distributed.planner import EmbeddingShardingPlanner, Topology
        from torchrec.distributed.test_utils.infer_utils import TestQuantEBCSharder
        from torchrec.inference.modules import shard_quant_model
    except ImportError as e:  # pragma: no cover - informational
        print("sharded quant: not built:", e)
        return
    from torchrec.distributed.test_utils.infer_utils import TestQuantECSharder

    kernel = EmbeddingComputeKernel.QUANT.value
    for coll, sharder in (
            (EmbeddingBagCollection(tables=_tables(3), device="meta"),
             TestQuantEBCSharder(sharding_type="table_wise", kernel_type=kernel,
                                 shardable_params=[f"t{i}" for i in range(3)])),
            (EmbeddingCollection(tables=_ec_tables(), device="meta"),
             TestQuantECSharder(sharding_type="table_wise", kernel_type=kernel))):
        q = quantize(M(coll), inplace=False, weight_dtype=torch.qint8,
                     quant_state_dict_split_scale_bias=False)
        plan = EmbeddingShardingPlanner(topology=Topology(world_size=1, compute_device="cpu"),
                                        batch_size=1).plan(q, [sharder])
        sq, _ = shard_quant_model(q, world_size=1, compute_device="cpu",
                                  sharding_device="meta", sharders=[sharder],
                                  sharding_plan=plan)
        mods = quant_modules(sq)
        tr.check_quant(mods)
        for _, m in mods:
            seen.add(m)
            seen.update(tr.quant_tbes(m))


def build_dtensor(seen):
    from metamat.models import torch_upstream as tu
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    mesh = init_device_mesh("cpu", (1,))
    m = nn.Sequential(nn.Linear(4, 4, device="meta"), nn.Linear(4, 2, device="meta"))
    for sub in m:
        fully_shard(sub, mesh=mesh)
    fully_shard(m, mesh=mesh)
    params = tu.fsdp_params(m.modules())
    for fp in params.values():
        seen.add(fp)
        seen.add(fp.sharded_param)
        tu.local_tensor(fp.sharded_param)
    for sub in m.modules():
        if hasattr(sub, "_get_fsdp_state"):
            state = sub._get_fsdp_state()
            seen.add(state)
            seen.update(tu._param_groups(state))


def _managed_collision(env):
    """The objects of a managed-collision EBC (an MCH module and a HashZch one) sharded
    row-wise on meta, and its unsharded MC collection (which the sharder reads)."""
    import metamat
    from torchrec import EmbeddingBagCollection
    from torchrec.distributed.mc_embeddingbag import ManagedCollisionEmbeddingBagCollectionSharder
    from torchrec.modules.mc_embedding_modules import ManagedCollisionEmbeddingBagCollection
    from torchrec.modules.mc_modules import (DistanceLFU_EvictionPolicy,
                                             ManagedCollisionCollection,
                                             MCHManagedCollisionModule)

    tables = _tables(2)
    meta = torch.device("meta")
    from torchrec.modules.hash_mc_evictions import (HashZchEvictionConfig,
                                                    HashZchEvictionPolicyName)
    from torchrec.modules.hash_mc_modules import HashZchManagedCollisionModule

    t0, t1 = tables
    mcs = {t0.name: MCHManagedCollisionModule(zch_size=t0.num_embeddings, device=meta,
                                              eviction_policy=DistanceLFU_EvictionPolicy(),
                                              eviction_interval=1, input_hash_size=1000),
           t1.name: HashZchManagedCollisionModule(
               zch_size=t1.num_embeddings, device=meta, total_num_buckets=1, name=t1.name,
               eviction_policy_name=HashZchEvictionPolicyName.SINGLE_TTL_EVICTION,
               eviction_config=HashZchEvictionConfig(features=t1.feature_names, single_ttl=1),
               tb_logging_frequency=1)}
    module = ManagedCollisionEmbeddingBagCollection(
        EmbeddingBagCollection(tables=tables, device=meta),
        ManagedCollisionCollection(mcs, embedding_configs=tables), return_remapped_features=False)
    sh = ManagedCollisionEmbeddingBagCollectionSharder()
    dmp = metamat.shard_on_meta(module, env, plan=_plan(module, {"t0": "rw", "t1": "rw"},
                                                        "fused", sh), sharders=[sh])
    from metamat.models.torchrec.managed_collision import mc_collections, mc_targets

    mc_targets(mc_collections(dmp.module), False, set())  # the adapter's checks
    return _objects(dmp) + [module._managed_collision_collection]


def _quant_feature_processed():
    """A quantized feature-processed EBC, converted on meta as TorchRec does, and its
    inference sharding (table-wise, on meta)."""
    from metamat.models.torchrec.quant import quant_feature_processors, quant_modules
    from torchrec import EmbeddingBagCollection
    from torchrec.distributed.planner import EmbeddingShardingPlanner, Topology
    from torchrec.distributed.test_utils.infer_utils import (TestQuantFPEBCSharder,
                                                              quantize_fpebc)
    from torchrec.inference.modules import shard_quant_model
    from torchrec.modules.feature_processor_ import PositionWeightedModuleCollection
    from torchrec.modules.fp_embedding_modules import FeatureProcessedEmbeddingBagCollection

    tables = _tables(2)
    fp = FeatureProcessedEmbeddingBagCollection(
        EmbeddingBagCollection(tables=tables, is_weighted=True, device="meta"),
        PositionWeightedModuleCollection(
            max_feature_lengths={f: 3 for t in tables for f in t.feature_names},
            device=torch.device("meta")))
    q = quantize_fpebc(nn.ModuleDict({"coll": fp}), inplace=False, weight_dtype=torch.qint8)
    mods = quant_modules(q)  # before shard_quant_model replaces its collection
    sharder = TestQuantFPEBCSharder(sharding_type="table_wise", kernel_type="quant",
                                    shardable_params=[t.name for t in tables])
    plan = EmbeddingShardingPlanner(topology=Topology(world_size=1, compute_device="cpu"),
                                    batch_size=1).plan(q, [sharder])
    sq, _ = shard_quant_model(q, world_size=1, compute_device="cpu", sharding_device="meta",
                              sharders=[sharder], sharding_plan=plan)
    mods += quant_modules(sq)
    quant_feature_processors(mods)  # the declared attribute reads
    return [m for _, m in mods]


def _quant_managed_collision():
    """Quantized MC collections (EBC and EC), converted on meta as TorchRec does."""
    from metamat.models.torchrec.quant import quant_mc_collections, quant_modules
    from torchrec import EmbeddingBagCollection, EmbeddingCollection
    from torchrec.inference.modules import quantize_embeddings
    from torchrec.modules.mc_embedding_modules import (ManagedCollisionEmbeddingBagCollection,
                                                       ManagedCollisionEmbeddingCollection)
    from torchrec.modules.mc_modules import (DistanceLFU_EvictionPolicy,
                                             ManagedCollisionCollection,
                                             MCHManagedCollisionModule)
    from torchrec.quant.embedding_modules import (QuantManagedCollisionEmbeddingBagCollection,
                                                  QuantManagedCollisionEmbeddingCollection)

    meta = torch.device("meta")
    ebc_tables, ec_tables = _tables(2), _ec_tables(2)

    def mcc(tables):
        return ManagedCollisionCollection(
            {t.name: MCHManagedCollisionModule(zch_size=t.num_embeddings, device=meta,
                                               eviction_policy=DistanceLFU_EvictionPolicy(),
                                               eviction_interval=1, input_hash_size=1000)
             for t in tables}, embedding_configs=tables)

    root = nn.ModuleDict({
        "ebc": ManagedCollisionEmbeddingBagCollection(
            EmbeddingBagCollection(tables=ebc_tables, device=meta), mcc(ebc_tables),
            return_remapped_features=False),
        "ec": ManagedCollisionEmbeddingCollection(
            EmbeddingCollection(tables=ec_tables, device=meta), mcc(ec_tables),
            return_remapped_features=False)})
    kinds = {ManagedCollisionEmbeddingBagCollection: QuantManagedCollisionEmbeddingBagCollection,
             ManagedCollisionEmbeddingCollection: QuantManagedCollisionEmbeddingCollection}
    q = quantize_embeddings(root, dtype=torch.qint8, inplace=False,
                            additional_qconfig_spec_keys=list(kinds), additional_mapping=kinds)
    mods = quant_modules(q)
    quant_mc_collections(mods)  # the declared attribute read
    return [m for _, m in mods] + _sharded_quant_managed_collision(q, ebc_tables, ec_tables)


def _sharded_quant_managed_collision(q, ebc_tables, ec_tables):
    """TorchRec's inference sharding of the quantized MC collections (row-wise, on meta)."""
    import copy

    from metamat.models.torchrec.quant import quant_mc_collections, quant_modules
    from metamat.models.torchrec.quant_mc import rank_mc_modules
    from torchrec.distributed.fused_params import FUSED_PARAM_QUANT_STATE_DICT_SPLIT_SCALE_BIAS
    from torchrec.distributed.mc_modules import InferManagedCollisionCollectionSharder
    from torchrec.distributed.quant_embedding import (
        QuantEmbeddingCollectionSharder, QuantManagedCollisionEmbeddingCollectionSharder)
    from torchrec.distributed.quant_embeddingbag import (
        QuantEmbeddingBagCollectionSharder, QuantManagedCollisionEmbeddingBagCollectionSharder)
    from torchrec.distributed.sharding_plan import construct_module_sharding_plan, row_wise
    from torchrec.distributed.types import ShardingPlan
    from torchrec.inference.modules import shard_quant_model

    fused = {FUSED_PARAM_QUANT_STATE_DICT_SPLIT_SCALE_BIAS: True}
    sharders = {
        "ebc": QuantManagedCollisionEmbeddingBagCollectionSharder(
            QuantEmbeddingBagCollectionSharder(fused_params=fused),
            InferManagedCollisionCollectionSharder()),
        "ec": QuantManagedCollisionEmbeddingCollectionSharder(
            QuantEmbeddingCollectionSharder(fused_params=fused),
            InferManagedCollisionCollectionSharder())}
    tables = {"ebc": ebc_tables, "ec": ec_tables}
    q = copy.deepcopy(q)
    plan = ShardingPlan({name: construct_module_sharding_plan(
        q[name], per_param_sharding={t.name: row_wise(compute_kernel="quant")
                                     for t in tables[name]},
        local_size=1, world_size=1, device_type="cpu", sharder=sharders[name])
        for name in sharders})
    sq, _ = shard_quant_model(q, world_size=1, compute_device="cpu", sharding_device="meta",
                              sharders=list(sharders.values()), sharding_plan=plan)
    mods = quant_modules(sq)
    quant_mc_collections(mods)  # the declared attributes read
    rank_mc_modules(mods)
    return _objects(sq)


def _objects(model):
    """Every object of a model's graph (modules, TBEs, shardings, ...)."""
    out, stack, ids = [], [model], set()
    while stack:
        o = stack.pop()
        if id(o) in ids:
            continue
        ids.add(id(o))
        out.append(o)
        if isinstance(o, nn.Module):
            stack.extend(o.__dict__.get("_modules", {}).values())
        d = getattr(o, "__dict__", None)
        if isinstance(d, dict):
            for v in d.values():
                if isinstance(v, (list, tuple)):
                    stack.extend(x for x in v if hasattr(x, "__dict__"))
                elif isinstance(v, dict):
                    stack.extend(x for x in v.values() if hasattr(x, "__dict__"))
                elif hasattr(v, "__dict__") and not isinstance(v, type):
                    stack.append(v)
    return [o for o in out if o is not None]


class _Seen(dict):
    """Objects by id (modules and plans are not all hashable)."""

    def add(self, o) -> None:
        self[id(o)] = o

    def update(self, objs) -> None:  # type: ignore[override]
        for o in objs:
            self.add(o)


def run() -> dict:
    from metamat.models import boundary
    from metamat.models import torch_upstream as tu
    from metamat.models.torchrec import upstream as tr
    from metamat.testing import process_group
    import torch.distributed as dist

    result = {"versions": {"torch": torch.__version__}, "declarations": {}}
    for b in (tu.BOUNDARY, tr.BOUNDARY):
        b.forget()
    static = {p.qualname: what for b in (tu.BOUNDARY, tr.BOUNDARY) for p, what in b.problems()}
    seen = _Seen()
    errors = []
    d = tempfile.mkdtemp(prefix="check-upstream-")
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            with process_group():
                from torchrec.distributed.types import ShardingEnv
                import torchrec
                import fbgemm_gpu

                result["versions"].update(torchrec=torchrec.__version__,
                                          fbgemm_gpu=fbgemm_gpu.__version__)
                env = ShardingEnv.from_process_group(dist.group.WORLD)
                for name, step in (("training", lambda: build_training(env, seen)),
                                   ("quant", lambda: build_quant(seen)),
                                   ("dtensor", lambda: build_dtensor(seen))):
                    try:
                        step()
                    except Exception as e:  # noqa: BLE001 - reported
                        errors.append(f"{name}: {type(e).__name__}: {e}")
    finally:
        shutil.rmtree(d, ignore_errors=True)
    by_type = {}
    for o in seen.values():
        by_type.setdefault(type(o), o)
    for b in (tu.BOUNDARY, tr.BOUNDARY):
        factories = b._factories
        for p in b.declared:
            what = static.get(p.qualname)
            if what is None and p.kind == "attr" and p.owner not in factories:
                try:
                    cls = boundary.resolve(p.owner)
                except Exception as e:  # noqa: BLE001
                    what = f"owner missing ({e})"
                else:
                    inst = [o for t, o in by_type.items() if issubclass(t, cls)]
                    if not inst:
                        what = "not reached" if not p.optional else "optional, not reached"
                    elif not all(boundary._has(o, p.name) for o in inst):
                        what = "optional, absent" if p.optional else "missing on an instance"
            result["declarations"][p.qualname] = what or "ok"
    result["errors"] = errors
    return result


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--json", action="store_true")
    args = ap.parse_args()
    r = run()
    bad = {k: v for k, v in r["declarations"].items()
           if v not in ("ok", "not reached") and not v.startswith("optional")}
    if args.json:
        print(json.dumps(r, indent=1, sort_keys=True))
    else:
        print(", ".join(f"{k} {v}" for k, v in r["versions"].items()))
        n = len(r["declarations"])
        ok = sum(v == "ok" for v in r["declarations"].values())
        print(f"{n} declarations: {ok} checked present, {len(bad)} missing")
        for k, v in sorted(r["declarations"].items()):
            if v != "ok":
                print(f"  {k}: {v}")
        for e in r["errors"]:
            print("  build error:", e)
    return 1 if bad or r["errors"] else 0


if __name__ == "__main__":
    sys.exit(main())
