"""Shared fixtures and markers: CUDA tests skip for the real reason (no GPU or no backend);
TorchRec tests are marked ``torchrec`` (``make test-compat`` runs them on the older stack)."""
import functools
import inspect
import re

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


# A TorchRec test: its module is named after torchrec, or imports torchrec/fbgemm (or a helper
# named after them) or skips without them at its top level; or its module does so anywhere and
# the test's own code names them; or it takes the world1_env fixture or is skipped without
# torchrec.
_IMPORTS = r"(?:(?:from|import)\s+\S*(?:torchrec|fbgemm)|importorskip\(\s*[\"'](?:torchrec|fbgemm_gpu))"
_TOP = re.compile(r"^(?:\S.*)?" + _IMPORTS, re.M)
_ANY = re.compile(_IMPORTS)


@functools.lru_cache(maxsize=None)
def _module_imports_torchrec(path: str) -> tuple:
    """(at its top level, anywhere)"""
    try:
        with open(path, encoding="utf-8") as f:
            text = f.read()
    except OSError:
        return (False, False)
    return (bool(_TOP.search(text)), bool(_ANY.search(text)))


def _is_torchrec_test(item) -> bool:
    path = str(getattr(item, "path", getattr(item, "fspath", "")))
    top, anywhere = _module_imports_torchrec(path)
    if top or "torchrec" in path.rsplit("/", 1)[-1]:
        return True
    if "world1_env" in getattr(item, "fixturenames", ()):
        return True
    if any("torchrec" in str(m.kwargs.get("reason", "")) for m in item.iter_markers("skipif")):
        return True
    if not anywhere:
        return False
    try:
        src = inspect.getsource(item.function)
    except (AttributeError, OSError, TypeError):
        return False
    return "torchrec" in src or "fbgemm" in src


def pytest_configure(config):
    config.addinivalue_line("markers", "torchrec: builds or reads TorchRec/fbgemm objects "
                            "(set by tests/conftest.py; `make test-compat` runs these)")


def pytest_itemcollected(item):
    if _is_torchrec_test(item):
        item.add_marker(pytest.mark.torchrec)


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
