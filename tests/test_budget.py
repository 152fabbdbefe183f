"""The staging budget never hands out more than it was given, and fails clearly when short."""
import pytest
from hypothesis import given, settings, strategies as st

from metamat.budget import MAX_BOUNCE, MIN_BOUNCE, MIN_RING_BUFFER, StagingBudget


@settings(max_examples=300, deadline=None)
@given(total=st.integers(1, 1 << 34), threads=st.integers(1, 64), staged=st.booleans(),
       ring=st.integers(1, 4))
def test_split_never_exceeds_the_budget(total, threads, staged, ring):
    try:
        b = StagingBudget.split(total, threads, staged=staged, ring=ring)
    except ValueError as e:
        assert "too small" in str(e)
        assert total < threads * MIN_BOUNCE + (ring * MIN_RING_BUFFER if staged else 0)
        return
    assert b.used <= total
    assert MIN_BOUNCE <= b.bounce_bytes <= MAX_BOUNCE
    assert b.bounce_bytes % 4096 == 0 and b.ring_bytes % 4096 == 0
    if staged:
        assert b.ring == ring and b.ring_bytes >= MIN_RING_BUFFER
    else:
        assert b.ring == 0 and b.ring_bytes == 0


def test_default_budget_splits():
    b = StagingBudget.split(256 << 20, 8, staged=True)
    assert (b.bounce_bytes, b.ring, b.ring_bytes) == (MAX_BOUNCE, 2, (256 - 64) << 19)
    c = StagingBudget.split(256 << 20, 8, staged=False)
    assert (c.bounce_bytes, c.ring) == (MAX_BOUNCE, 0)
    assert StagingBudget.split(1 << 20, 2, staged=False).bounce_bytes == 512 << 10


@pytest.mark.parametrize("args", [(0, 1), (-5, 1), (1 << 20, 0), (True, 1), (1.5, 1)])
def test_bad_arguments(args):
    with pytest.raises(ValueError):
        StagingBudget.split(*args, staged=False)


def test_too_small_says_what_is_needed():
    with pytest.raises(ValueError, match=f"at least {2 * MIN_BOUNCE + 2 * MIN_RING_BUFFER}"):
        StagingBudget.split(100_000, 2, staged=True)


@pytest.mark.parametrize("cpus,machine,local,want", [
    (2, 2, None, 2), (16, 16, None, 16), (64, 64, None, 16), (128, 128, "8", 16),
    (64, 64, "8", 8), (16, 16, "8", 2), (4, 4, "8", 1), (16, 16, "bogus", 16), (16, 16, "0", 16),
    # bound to its own CPUs already (srun --cpu-bind, numactl): no second division
    (16, 128, "8", 16), (6, 64, "8", 6),
    # a CPU set the ranks share (a container's cpuset): divided
    (64, 128, "8", 8), (32, 128, "8", 4)])
def test_default_io_threads_share_the_node(monkeypatch, cpus, machine, local, want):
    from metamat.load import default_io_threads
    monkeypatch.setattr("os.sched_getaffinity", lambda pid: set(range(cpus)))
    monkeypatch.setattr("os.cpu_count", lambda: machine)
    if local is None:
        monkeypatch.delenv("LOCAL_WORLD_SIZE", raising=False)
    else:
        monkeypatch.setenv("LOCAL_WORLD_SIZE", local)
    assert default_io_threads() == want


def test_ring_shape_caps_cuda_rings_per_thread():
    from metamat.load.staged import RING_BYTES_PER_THREAD, ring_shape
    b = StagingBudget.split(256 << 20, 8, staged=True)  # 2 x 96 MiB
    big = 4 << 30
    assert ring_shape(b, big, cuda=False) == (2, b.ring_bytes)
    assert ring_shape(b, big, cuda=True) == (2, 8 * RING_BYTES_PER_THREAD)
    # a load smaller than a buffer takes one buffer of its size
    assert ring_shape(b, 5 << 20, cuda=True) == (1, 5 << 20)
    assert ring_shape(b, 40 << 20, cuda=True) == (2, 32 << 20)
    # a small budget stays the limit
    s = StagingBudget.split(4 << 20, 8, staged=True)
    assert ring_shape(s, big, cuda=True) == (2, s.ring_bytes)
    assert s.ring * s.ring_bytes + s.threads * s.bounce_bytes <= 4 << 20
