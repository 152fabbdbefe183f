"""shard_on_meta checks shard placements against the group's ranks in constant time
(metamat/models/torchrec/fastranks.py): the check answers as torch's does, raises torch's
errors, is torch's again afterwards, and a row-wise table over many ranks no longer costs a
scan of every rank per shard."""
from __future__ import annotations

import subprocess
import sys
import textwrap

import pytest

pytest.importorskip("torchrec")

from torch.distributed.remote_device import _remote_device  # noqa: E402

from metamat.models.torchrec.fastranks import _CALLERS, _NAME, indexed_group_ranks  # noqa: E402


def _outcome(fn, pg, placement):
    try:
        return ("ok", fn(pg, placement))
    except Exception as e:  # noqa: BLE001 - compared with torch's own
        return (type(e).__name__, str(e))


def test_the_check_answers_and_fails_as_torchs(world1_env):
    import importlib

    import torch.distributed as dist
    from torch.distributed._shard.sharded_tensor import utils

    real = getattr(utils, _NAME)
    pg = dist.group.WORLD
    placements = [_remote_device("rank:0/cpu"), _remote_device("rank:0/meta"),
                  _remote_device("rank:3/cpu"),  # not in the group: torch's ValueError
                  _remote_device("worker0/cpu"),  # a worker name: needs RPC, torch says so
                  None]
    want = [_outcome(real, pg, p) for p in placements]
    assert [w[0] for w in want] == ["ok", "ok", "ValueError", "RuntimeError", "ValueError"]
    with indexed_group_ranks():
        fast = getattr(utils, _NAME)
        assert fast is not real
        for name in _CALLERS:  # every torch module that calls it gets the same one
            assert getattr(importlib.import_module(name), _NAME) is fast
        for _ in range(2):  # the second time from the group's cached ranks
            assert [_outcome(fast, pg, p) for p in placements] == want
    for name in _CALLERS:
        assert getattr(importlib.import_module(name), _NAME) is real


_MANY_RANKS = textwrap.dedent("""
    import sys
    import torch.distributed as dist
    import torch.distributed.distributed_c10d as c10d
    from torch.testing._internal.distributed.fake_pg import FakeStore
    world = int(sys.argv[1])
    dist.init_process_group("fake", rank=0, world_size=world, store=FakeStore())
    import metamat
    from metamat.models.torchrec.testing import ebc, sharder_and_plan
    from torchrec.distributed.types import ShardingEnv

    sharder, plan = sharder_and_plan(ebc(2, rows=4 * world), world, row_wise=True)
    calls = [0]
    real = c10d.get_process_group_ranks

    def counted(group):
        calls[0] += 1
        return real(group)

    c10d.get_process_group_ranks = counted
    dmp = metamat.shard_on_meta(ebc(2, rows=4 * world),
                                env=ShardingEnv.from_process_group(dist.group.WORLD),
                                plan=plan, sharders=[sharder])
    # (TorchRec builds no module state on a "fake" group: the fused optimizer's is built)
    st = dmp.fused_optimizer.params["embedding_bags.t1.weight"]
    print(calls[0], len(st.metadata().shards_metadata))
""")


def test_a_row_wise_table_over_many_ranks_lists_the_ranks_once(tmp_path):
    """torch lists the group's ranks for every shard it validates (a shard per rank per
    ShardedTensor: quadratic in the world size); under shard_on_meta once per group."""
    pytest.importorskip("torch.testing._internal.distributed.fake_pg")
    script = tmp_path / "many_ranks.py"
    script.write_text(_MANY_RANKS)
    out = subprocess.run([sys.executable, str(script), "512"], capture_output=True,
                         text=True, timeout=600)
    assert out.returncode == 0, out.stderr[-3000:]
    calls, shards = map(int, out.stdout.split()[-2:])
    assert shards == 512  # the table has a shard per rank...
    assert calls <= 4  # ...and the ranks were listed once per group, not once per shard
