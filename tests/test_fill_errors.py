"""Bad arguments raise TypeError/ValueError with a clear message, before anything is written."""
import subprocess
import sys

import pytest
import torch

import metamat


def test_bad_dtype():
    with pytest.raises(TypeError, match="dtype"):
        metamat.fill_(torch.zeros(4, 4, dtype=torch.int32), metamat.Uniform(), key="t")


def test_non_unit_column_stride():
    with pytest.raises(ValueError, match="column stride"):
        metamat.fill_(torch.zeros(4, 6).t(), metamat.Uniform(), key="t")


def test_meta_tensor():
    with pytest.raises(ValueError, match="meta"):
        metamat.fill_(torch.empty(4, 4, device="meta"), metamat.Uniform(), key="t")


def test_three_dims():
    with pytest.raises(ValueError, match="1-D or 2-D"):
        metamat.fill_(torch.zeros(2, 2, 2), metamat.Uniform(), key="t")


@pytest.mark.parametrize("make", [
    lambda: metamat.Uniform(1.0, 0.0),
    lambda: metamat.Uniform(0.0, 0.0),
    lambda: metamat.Normal(0.0, -1.0),
    lambda: metamat.TruncatedNormal(0.0, 1.0, 2.0, -2.0),
    lambda: metamat.TruncatedNormal(0.0, 0.0),
    lambda: metamat.Uniform(0.0, float("inf")),
    lambda: metamat.Zeros(1.0),
])
def test_bad_distributions(make):
    with pytest.raises(ValueError):
        make()


def test_bad_key_seed_offsets():
    t = torch.zeros(4, 4)
    with pytest.raises(TypeError, match="str"):
        metamat.fill_(t, metamat.Uniform(), key=3)
    with pytest.raises(ValueError, match="seed"):
        metamat.fill_(t, metamat.Uniform(), key="t", seed=-1)
    with pytest.raises(ValueError, match="row_offset"):
        metamat.fill_(t, metamat.Uniform(), key="t", row_offset=-1)
    with pytest.raises(TypeError, match="dist"):
        metamat.fill_(t, "uniform", key="t")


def test_failed_batch_writes_nothing():
    good = torch.zeros(8, 8)
    with pytest.raises(TypeError):
        metamat.fill_many_([(good, metamat.Uniform(), "a", 0, 0),
                            (torch.zeros(2, 2, dtype=torch.int64), metamat.Uniform(), "b", 0, 0)])
    assert torch.equal(good, torch.zeros(8, 8))


def _run(code: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)


def test_import_is_lean():
    r = _run("import sys, torch, metamat; "
             "assert 'metamat._C' not in sys.modules, 'extension loaded at import'; "
             "assert not torch.cuda.is_initialized(), 'CUDA initialised at import'; print('ok')")
    assert r.returncode == 0, r.stderr
    assert "ok" in r.stdout


def test_missing_extension_says_how_to_rebuild():
    r = _run("import sys; sys.modules['metamat._C'] = None\n"
             "import torch, metamat\n"
             "try:\n    metamat.fill_(torch.zeros(2, 2), metamat.Uniform(), key='t')\n"
             "except metamat.ExtensionNotBuiltError as e:\n    print('ERR', e)\n")
    assert r.returncode == 0, r.stderr
    assert "ERR" in r.stdout and "make build" in r.stdout
