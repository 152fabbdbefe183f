"""metamat._pagecache: the one eviction/residency helper of the benches and reader tests."""
from __future__ import annotations

import os

import pytest

from metamat._pagecache import evict, files_of, resident


def test_evict_and_resident(tmp_path):
    d = tmp_path / "ckpt"
    (d / "sub").mkdir(parents=True)
    for name, n in (("a.bin", 3 << 20), ("sub/b.bin", 1 << 20), ("empty", 0)):
        with open(d / name, "wb") as f:
            f.write(os.urandom(n))
    assert files_of(d) == sorted(str(d / n) for n in ("a.bin", "empty", "sub/b.bin"))
    assert files_of([str(d / "a.bin"), str(d / "missing")]) == [str(d / "a.bin")]
    for f in files_of(d):
        with open(f, "rb") as fh:
            fh.read()
    assert resident(d) > 0.9
    ev = evict(d)
    assert ev.files == 3 and ev.nbytes == 4 << 20 and ev.before > 0.9
    if not ev.ok:
        pytest.skip(f"posix_fadvise(DONTNEED) did not evict here: {ev}")
    assert resident(d) == ev.after <= 0.01
    assert "resident" in str(ev)
    assert resident(tmp_path / "nothing") == 1.0
    unchecked = evict(d / "a.bin", check=False)
    assert unchecked.files == 1 and unchecked.after != unchecked.after  # nan
