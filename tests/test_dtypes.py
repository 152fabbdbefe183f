"""The Python dtype codes are the C++ core's (csrc/include/metamat/dtype.h)."""
import torch

from metamat import dtypes


def test_codes_match_the_core(reader):
    core = reader.DTYPE_CODES
    assert core["raw"] == dtypes.RAW
    for dt, code in dtypes.CODES.items():
        assert core[str(dt).removeprefix("torch.")] == code
    assert len(core) == len(dtypes.CODES) + 1


def test_itemsize():
    assert [dtypes.itemsize(d) for d in dtypes.FILL_DTYPES] == [4, 2, 2, 8]
