"""module_state_dict (metamat/models/torchrec/state_dict.py) gives what ``state_dict()`` gives:
the same keys in the same order, the very ShardedTensors TorchRec's hook puts in, detached
tensors for the rest; on real TorchRec modules (every sharding type, both collections, on meta
and eager) and on ordinary modules with hooks, buffers and overridden methods."""
from __future__ import annotations

import os
import sys

import pytest
import torch
from torch import nn

from metamat.models.torchrec.state_dict import module_state_dict

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

# DMP wraps the DATA_PARALLEL table's module in DDP, with an argument torch 2.13 deprecates
pytestmark = pytest.mark.filterwarnings("ignore:`broadcast_buffers` is deprecated:FutureWarning")


def _same(want: dict, got: dict, fresh=()) -> None:
    """``fresh``: keys whose tensors a hook makes anew on every call (compared by value)."""
    assert list(got) == list(want)
    for k, w in want.items():
        g = got[k]
        if not isinstance(w, torch.Tensor):
            assert g == w, k  # extra state
            continue
        if k in fresh:
            assert torch.equal(g, w), k
            continue
        if hasattr(w, "local_shards") or hasattr(w, "_local_tensor"):
            assert g is w, k  # TorchRec's ShardedTensor/DTensor
            continue
        assert type(g) is type(w) and g is not w, k  # a new detached tensor, like detach()
        assert (g.shape, g.dtype, g.device, g.requires_grad) == \
            (w.shape, w.dtype, w.device, w.requires_grad), k
        assert g.untyped_storage()._cdata == w.untyped_storage()._cdata, k
        assert g.storage_offset() == w.storage_offset() and g.stride() == w.stride(), k


def _sharded(kind: str, kinds: dict, via: str, env):
    import metamat
    from test_torchrec_materialize import ebc_tables, ec_tables, fused_params, make_plan
    from torchrec import EmbeddingBagCollection, EmbeddingCollection
    from torchrec.distributed.embedding import EmbeddingCollectionSharder
    from torchrec.distributed.embeddingbag import EmbeddingBagCollectionSharder
    from torchrec.distributed.model_parallel import DistributedModelParallel

    if kind == "ebc":
        tables, cls = ebc_tables(n=len(kinds)), EmbeddingBagCollection
        sharder = EmbeddingBagCollectionSharder(fused_params=fused_params())
    else:
        tables, cls = ec_tables(n=len(kinds)), EmbeddingCollection
        sharder = EmbeddingCollectionSharder(fused_params=fused_params())
    kinds = {t.name: kinds[t.name] for t in tables}
    plan = make_plan(cls(tables=tables, device=torch.device("meta")), kinds, "fused", 1, sharder)
    if via == "metamat":
        return metamat.shard_on_meta(cls(tables=tables, device=torch.device("meta")), env=env,
                                     plan=plan, sharders=[sharder])
    device = torch.device("meta" if via == "torchrec-meta" else "cpu")
    return DistributedModelParallel(cls(tables=tables, device=device), env=env, device=device,
                                    plan=plan, sharders=[sharder])


@pytest.mark.parametrize("via", ["metamat", "torchrec-meta", "eager"])
@pytest.mark.parametrize("kind", ["ebc", "ec"])
def test_equals_state_dict_on_torchrec_modules(world1_env, kind, via):
    from metamat.models.torchrec.sharded import root_of, sharded_modules

    if (kind, via) == ("ec", "torchrec-meta"):
        pytest.skip("TorchRec's DistributedModelParallel(device=meta) cannot build an "
                    "EmbeddingCollection (a local shard on meta, its placement on cpu)")

    # every sharding type one rank can hold (EC has no TWRW), and a DATA_PARALLEL table
    kinds = {"t0": "tw", "t1": "rw", "t2": "cw", "t3": "dp"}
    if kind == "ebc":
        kinds["t4"] = "twrw"
    dmp = _sharded(kind, kinds, via, world1_env)
    sharded = sharded_modules(root_of(dmp))
    assert sharded
    for name, sm in sharded:
        for prefix in ("", f"{name}."):
            want = sm.state_dict(prefix=prefix)
            got = module_state_dict(sm, prefix)
            _same(want, got)
            assert any(hasattr(v, "local_shards") for v in got.values())


def test_hooks_on_a_table_module_fall_back_to_state_dict(world1_env):
    from metamat.models.torchrec.sharded import root_of, sharded_modules

    dmp = _sharded("ebc", {"t0": "tw", "t1": "rw", "t2": "dp"}, "metamat", world1_env)
    (_, sm), = sharded_modules(root_of(dmp))
    seen = []
    sm.embedding_bags["t2"].register_state_dict_pre_hook(lambda m, p, kv: seen.append(p))
    sm.embedding_bags["t1"].register_state_dict_post_hook(
        lambda m, sd, p, md: sd.__setitem__(p + "extra", torch.zeros(1)))
    got = module_state_dict(sm, "x.")
    assert seen == ["x.embedding_bags.t2."] and "x.embedding_bags.t1.extra" in got
    seen.clear()
    want = sm.state_dict(prefix="x.")
    _same({k: v for k, v in want.items() if not k.endswith("extra")},
          {k: v for k, v in got.items() if not k.endswith("extra")})
    assert list(got) == list(want)


class _Leaf(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.randn(3, 2))
        self.register_buffer("count", torch.zeros(2))
        self.register_buffer("scratch", torch.ones(1), persistent=False)
        self.register_parameter("bias", None)  # a None parameter: not in the state_dict


class _Extra(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.w = nn.Parameter(torch.ones(2))

    def get_extra_state(self):
        return {"step": 3}

    def set_extra_state(self, state) -> None:
        pass


class _Top(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.plain = nn.Module()
        self.plain.register_parameter("weight", nn.Parameter(torch.randn(4)))
        # plain modules all the way down: read directly (buffers, non-persistent ones, None)
        self.tables = nn.ModuleDict({"a": nn.Module(), "c": nn.Module()})
        self.tables["a"].register_parameter("weight", nn.Parameter(torch.randn(2)))
        self.tables["a"].register_parameter("unset", None)
        self.tables["c"].register_parameter("weight", nn.Parameter(torch.randn(5)))
        self.tables["c"].inner = nn.Module()
        self.tables["c"].inner.register_buffer("b", torch.arange(3))
        self.tables["c"].inner.register_buffer("tmp", torch.arange(2), persistent=False)
        self.tables["c"].inner.register_buffer("gone", None)
        self.mixed = nn.ModuleDict({"plain": nn.Module(), "leaf": _Leaf()})  # falls back
        self.mixed["plain"].register_parameter("weight", nn.Parameter(torch.randn(1)))
        self.extra = _Extra()
        self.none = None
        self.register_buffer("top", torch.ones(2))
        self.lin = nn.Linear(2, 3)


@pytest.mark.parametrize("case", ["plain", "pre_hook", "post_hook_returns", "public_post_hook",
                                  "child_hook", "override"])
def test_equals_state_dict_on_ordinary_modules(case):
    top = _Top()
    calls, fresh = [], ()
    if case == "pre_hook":
        top.register_state_dict_pre_hook(lambda m, p, kv: calls.append((p, kv)))
    elif case == "post_hook_returns":
        # a private post-hook may return a new destination (torch uses the returned dict)
        def replace(m, sd, p, md):
            calls.append(md["version"])
            out = type(sd)((k, v) for k, v in sd.items() if "lin" not in k)
            return out
        top._register_state_dict_hook(replace)
    elif case == "public_post_hook":
        def drop(m, sd, p, md):
            del sd[p + "top"]
        top.register_state_dict_post_hook(drop)
    elif case == "child_hook":
        top.tables["a"].register_state_dict_post_hook(
            lambda m, sd, p, md: sd.__setitem__(p + "added", torch.ones(1)))
        fresh = ("m.tables.a.added",)
    elif case == "override":
        top.tables["c"].__class__ = type("Custom", (nn.Module,), {
            "_save_to_state_dict": lambda self, d, p, kv: d.__setitem__(p + "custom", torch.ones(1))})
        fresh = ("m.tables.c.custom",)
    want = top.state_dict(prefix="m.")
    n_calls = len(calls)
    got = module_state_dict(top, "m.")
    assert len(calls) == 2 * n_calls
    _same(want, got, fresh)
    assert got["m.extra._extra_state"] == {"step": 3}
    if case == "plain":
        assert "m.mixed.leaf.scratch" not in got and "m.mixed.leaf.bias" not in got
        assert "m.tables.c.inner.b" in got and "m.tables.c.inner.tmp" not in got


def test_a_failing_public_post_hook_return_is_refused():
    top = _Top()
    top.register_state_dict_post_hook(lambda m, sd, p, md: {})
    with pytest.raises(RuntimeError, match="must return None"):
        top.state_dict()
    with pytest.raises(RuntimeError, match="must return None"):
        module_state_dict(top)
