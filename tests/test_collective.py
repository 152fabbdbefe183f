"""Ranks agree within a bounded time: a peer that hangs or dies makes the others raise a
clear PeerFailedError within the configured timeout, not the process group's 30 minutes."""
from __future__ import annotations

import os
import time

import pytest
import torch

from _dist import run_dist

import metamat
from metamat.collective import Agreement, resolve_timeout

pytestmark = pytest.mark.multiprocess


def _hang(rank, world, flags):
    m = torch.nn.Linear(4, 4, device="meta")
    raised = os.path.join(flags, "rank0-gave-up")
    if rank == 1:
        Agreement(3.0)  # joins the group creation, then never agrees (stuck elsewhere)...
        for _ in range(3000):  # ...until rank 0 gave up on it (5 minutes: a hang guard)
            if os.path.exists(raised):
                return {"released": True}
            time.sleep(0.1)
        return {"released": False}
    try:
        metamat.materialize(m, device="cpu", timeout=3.0)
    except metamat.PeerFailedError as e:
        return {"err": str(e), "meta": m.weight.is_meta}
    finally:
        open(raised, "w").close()
    return {"err": None}


def test_a_hung_peer_raises_within_the_timeout(tmp_path):
    """Rank 1 stays stuck until rank 0 has raised: the error came from rank 0's own timeout
    (not from rank 1 leaving, nor the group's 30 minutes), with the timeout in its message.
    No clock is read: on a busy machine "within 15 s" proved little."""
    r0, r1 = run_dist(_hang, 2, str(tmp_path))
    assert r0["err"] and "within 3 s" in r0["err"] and "METAMAT_TIMEOUT" in r0["err"]
    assert r0["meta"] and r1 == {"released": True}


def test_resolve_timeout(monkeypatch):
    monkeypatch.setenv("METAMAT_TIMEOUT", "7")
    assert resolve_timeout(None) == 7.0 and resolve_timeout(2) == 2.0
    monkeypatch.setenv("METAMAT_TIMEOUT", "soon")
    with pytest.raises(ValueError, match="METAMAT_TIMEOUT"):
        resolve_timeout(None)
    with pytest.raises(ValueError):
        resolve_timeout(0)


def _world_again(rank, world, store):
    """materialize, the program's process group destroyed and made again (a new store), then
    materialize again; last, the exit hook destroys the agreement group it holds."""
    import torch.distributed as dist
    from metamat import collective

    first = torch.nn.Linear(4, 4, device="meta")
    metamat.materialize(first, device="cpu", seed=1)
    old = collective._GROUPS[collective.resolve_timeout(None)][1]
    dist.destroy_process_group()
    dist.init_process_group("gloo", init_method="file://" + store, rank=rank, world_size=world)
    again = torch.nn.Linear(4, 4, device="meta")
    metamat.materialize(again, device="cpu", seed=1)
    new = collective._GROUPS[collective.resolve_timeout(None)][1]
    collective._drop_groups()
    return {"same": torch.equal(first.weight, again.weight), "new_group": new is not old,
            "dropped": not collective._GROUPS}


def test_a_new_process_group_gets_a_new_agreement_group(tmp_path):
    """The agreement group is made once per process group: after the program destroyed its
    group and made another, materialize agrees on a group of the new one (the cached group of
    the destroyed one is never used)."""
    for r in run_dist(_world_again, 2, str(tmp_path / "store2")):
        assert r == {"same": True, "new_group": True, "dropped": True}
