"""Ranks agree within a bounded time: a peer that hangs or dies makes the others raise a
clear PeerFailedError within the configured timeout, not the process group's 30 minutes."""
from __future__ import annotations

import time

import pytest
import torch

from _dist import run_dist

import metamat
from metamat.collective import Agreement, resolve_timeout

pytestmark = pytest.mark.multiprocess


def _hang(rank, world):
    m = torch.nn.Linear(4, 4, device="meta")
    if rank == 1:
        Agreement(3.0)  # joins the group creation, then never agrees (stuck elsewhere)
        time.sleep(20)
        return {"slept": True}
    t0 = time.monotonic()
    try:
        metamat.materialize(m, device="cpu", timeout=3.0)
    except metamat.PeerFailedError as e:
        return {"err": str(e), "seconds": time.monotonic() - t0, "meta": m.weight.is_meta}
    return {"err": None}


def test_a_hung_peer_raises_within_the_timeout():
    r0, _ = run_dist(_hang, 2)
    assert r0["err"] and "within 3 s" in r0["err"] and "METAMAT_TIMEOUT" in r0["err"]
    assert r0["seconds"] < 15 and r0["meta"]


def test_resolve_timeout(monkeypatch):
    monkeypatch.setenv("METAMAT_TIMEOUT", "7")
    assert resolve_timeout(None) == 7.0 and resolve_timeout(2) == 2.0
    monkeypatch.setenv("METAMAT_TIMEOUT", "soon")
    with pytest.raises(ValueError, match="METAMAT_TIMEOUT"):
        resolve_timeout(None)
    with pytest.raises(ValueError):
        resolve_timeout(0)
