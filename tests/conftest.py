"""Shared fixtures and markers: CUDA tests skip for the real reason (no GPU or no backend)."""
import pytest
import torch


def _cuda_usable() -> str | None:
    """None when CUDA tests can run, else why not."""
    if not torch.cuda.is_available():
        return "no CUDA device visible to torch"
    from metamat._ext import core

    if not core().cuda_compiled():
        return "metamat was built without its CUDA backend"
    return None


def pytest_collection_modifyitems(config, items):
    reason = None
    for item in items:
        if "cuda" in item.keywords:
            if reason is None:
                reason = _cuda_usable() or ""
            if reason:
                item.add_marker(pytest.mark.skip(reason=reason))


@pytest.fixture(scope="session")
def reader():
    """The compiled core with its checkpoint reader (a missing build fails, never skips)."""
    from metamat._ext import core

    C = core()
    assert hasattr(C, "read_ops"), "metamat._C was built without the io reader"
    return C


@pytest.fixture(scope="module")
def world1_env():
    """A world-size-1 gloo group and TorchRec ShardingEnv for one test module, destroyed after
    it (later modules must not inherit a default group: DCP, for one, behaves differently)."""
    pytest.importorskip("torchrec")
    import torch.distributed as dist
    from torchrec.distributed.types import ShardingEnv

    from metamat.testing import process_group

    with process_group():
        yield ShardingEnv.from_process_group(dist.group.WORLD)


def bits(t: torch.Tensor) -> torch.Tensor:
    """Integer view of a float tensor, for bit-exact comparison."""
    return t.contiguous().view({8: torch.int64, 4: torch.int32, 2: torch.int16}[t.element_size()])
