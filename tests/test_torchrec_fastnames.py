"""shard_on_meta makes TorchRec's table-name filter constant-time per table
(metamat/models/torchrec/fastnames.py): a NameList answers ``in`` as a list does after any
sequence of changes, and the modules built are those eager DMP builds, with plain lists."""
from __future__ import annotations

import random

import pytest
import torch

from metamat.models.torchrec.fastnames import NameList, indexed_table_names


def test_name_list_answers_in_like_a_list_after_any_changes():
    rng = random.Random(0)
    pool = [f"t{i}" for i in range(12)] + [3, (1, 2)]
    for _ in range(300):
        start = rng.sample(pool, rng.randrange(len(pool)))
        plain, fast = list(start), NameList(start)
        for _ in range(rng.randrange(1, 12)):
            op = rng.choice(["append", "extend", "iadd", "insert", "remove", "pop", "clear",
                             "setitem", "delitem", "imul", "sort"])
            x, more = rng.choice(pool), [rng.choice(pool), rng.choice(pool)]
            has_x, nonempty = x in plain, bool(plain)  # decided once for both lists
            for lst in (plain, fast):
                if op == "append":
                    lst.append(x)
                elif op == "extend":
                    lst.extend(iter(more))
                elif op == "iadd":
                    lst += more
                elif op == "insert":
                    lst.insert(0, x)
                elif op == "remove" and has_x:
                    lst.remove(x)
                elif op == "pop" and nonempty:
                    lst.pop()
                elif op == "clear":
                    lst.clear()
                elif op == "setitem" and nonempty:
                    lst[0] = x
                elif op == "delitem" and nonempty:
                    del lst[0]
                elif op == "imul":
                    lst *= 1
                elif op == "sort":
                    lst.sort(key=repr)
            assert list(fast) == plain and type(fast) is NameList
            for y in pool + ["absent", [1]]:  # an unhashable probe: compared the list's way
                assert (y in fast) == (y in plain), (op, y)
    unhashable = NameList(["a", ["b"]])  # an unhashable element: no set, still right
    assert "a" in unhashable and ["b"] in unhashable and "b" not in unhashable
    unhashable.append(["c"])
    assert ["c"] in unhashable


def _modules(world1_env, kind, via):
    from torchrec import EmbeddingBagCollection, EmbeddingCollection
    from torchrec.distributed.embedding import EmbeddingCollectionSharder
    from torchrec.distributed.embeddingbag import EmbeddingBagCollectionSharder
    from torchrec.distributed.model_parallel import DistributedModelParallel
    from torchrec.distributed.sharding_plan import construct_module_sharding_plan, table_wise
    from torchrec.distributed.types import ShardingPlan
    from torchrec.modules.embedding_configs import EmbeddingBagConfig, EmbeddingConfig

    import metamat

    n = 7
    if kind == "ebc":
        cfgs = [EmbeddingBagConfig(name=f"t{i}", embedding_dim=8, num_embeddings=10 + i,
                                   feature_names=[f"f{i}"]) for i in range(n)]
        build = lambda: EmbeddingBagCollection(tables=cfgs, device=torch.device("meta"))  # noqa
        sharder = EmbeddingBagCollectionSharder()
    else:
        cfgs = [EmbeddingConfig(name=f"t{i}", embedding_dim=8, num_embeddings=10 + i,
                                feature_names=[f"f{i}"]) for i in range(n)]
        build = lambda: EmbeddingCollection(tables=cfgs, device=torch.device("meta"))  # noqa
        sharder = EmbeddingCollectionSharder()
    # the plan lists the tables in another order than the module: the filter keeps the plan's
    names = [c.name for c in cfgs][::-1]
    mp = construct_module_sharding_plan(build(), {t: table_wise(rank=0) for t in names},
                                        local_size=1, world_size=1, device_type="cpu",
                                        sharder=sharder)
    plan = ShardingPlan({"": mp})
    if via == "eager":
        dmp = DistributedModelParallel(build(), env=world1_env, device=torch.device("cpu"),
                                       plan=plan, sharders=[sharder])
    else:
        dmp = metamat.shard_on_meta(build(), env=world1_env, plan=plan, sharders=[sharder])
    return dmp.module


@pytest.mark.parametrize("kind", ["ebc", "ec"])
def test_sharded_modules_equal_eager_and_keep_plain_lists(world1_env, kind):
    pytest.importorskip("torchrec")
    eager, meta = _modules(world1_env, kind, "eager"), _modules(world1_env, kind, "metamat")
    assert type(meta._table_names) is list and meta._table_names == eager._table_names
    assert list(meta.module_sharding_plan) == list(eager.module_sharding_plan)
    assert {k: v.sharding_type for k, v in meta.module_sharding_plan.items()} == \
        {k: v.sharding_type for k, v in eager.module_sharding_plan.items()}
    assert "_table_names" not in type(meta).__dict__  # the class attribute is gone


def test_name_lists_only_while_active_and_nested_use_is_left_alone(world1_env):
    pytest.importorskip("torchrec")
    from torchrec.distributed.embeddingbag import ShardedEmbeddingBagCollection

    seen = []
    real_init = ShardedEmbeddingBagCollection.__init__

    def spy(self, *args, **kwargs):
        real_init(self, *args, **kwargs)
        seen.append(type(self.__dict__["_table_names"]))

    ShardedEmbeddingBagCollection.__init__ = spy
    try:
        with indexed_table_names():
            outer = ShardedEmbeddingBagCollection.__dict__["_table_names"]
            with indexed_table_names():  # nested: the outer patch stays the one in place
                assert ShardedEmbeddingBagCollection.__dict__["_table_names"] is outer
            sm = _modules(world1_env, "ebc", "eager")
        assert seen == [NameList]  # built while active: a NameList inside the constructor
        assert type(sm.__dict__["_table_names"]) is list  # a plain list once it ends
        assert "_table_names" not in ShardedEmbeddingBagCollection.__dict__
    finally:
        ShardedEmbeddingBagCollection.__init__ = real_init
