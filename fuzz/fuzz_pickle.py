"""atheris harness: the restricted unpicklers (DCP ``.metadata``, torch.save ``data.pkl``) and
the opcode walk before them, then a load.

    python fuzz/fuzz_pickle.py -runs=2000 CORPUS_DIR   (seeds: python fuzz/seeds.py)

Input byte 0 even: the rest is the ``.metadata`` of a valid one-process DCP checkpoint; odd:
the ``data.pkl`` of a valid torch.save file. Beyond the contract of ``_harness.check``, no
input may run code: the seeds' payloads (``tests/hostile_pickle.py``) would create ``PWNED``
in the harness's working directory, and its existence after an input is a crash.
"""
import io
import os
import sys
import zipfile

import atheris

import _harness as H

with atheris.instrument_imports(include=["metamat"]):
    import metamat.checkpoint.unpickle  # noqa: F401
    import metamat.checkpoint.torch_save  # noqa: F401
    import metamat.checkpoint.open  # noqa: F401
    import metamat.load  # noqa: F401

_BASE = {}


def _setup() -> None:
    import hostile_gen
    root = H.workdir()
    bases = hostile_gen.make_bases(os.path.join(root, "bases"))
    with zipfile.ZipFile(bases["ts"]) as z:
        records = [(i.filename, z.read(i)) for i in z.infolist()]
    _BASE.update(dcp=bases["dcp"], ts=os.path.join(root, "x.pt"), records=records)
    os.chdir(root)  # where a payload's relative PWNED would land


def _torch_save_with(pkl: bytes) -> bytes:
    buf = io.BytesIO()
    with zipfile.ZipFile(buf, "w", zipfile.ZIP_STORED) as z:
        for name, data in _BASE["records"]:
            z.writestr(name, pkl if name.endswith("/data.pkl") else data)
    return buf.getvalue()


def TestOneInput(data: bytes) -> None:
    if not data:
        return
    if data[0] % 2 == 0:
        H.write(os.path.join(_BASE["dcp"], ".metadata"), data[1:])
        H.check(_BASE["dcp"])
    else:
        H.write(_BASE["ts"], _torch_save_with(data[1:]))
        H.check(_BASE["ts"])
    if os.path.exists("PWNED"):
        raise AssertionError("a pickle ran code: PWNED was created")


def _absolute(argv):
    """Corpus, reproducer and artifact paths made absolute: ``_setup`` changes directory."""
    paths = ("-artifact_prefix=", "-exact_artifact_path=", "-dict=")
    out = [argv[0]]
    for a in argv[1:]:
        opt = next((p for p in paths if a.startswith(p)), None)
        if opt:
            v = a[len(opt):]
            a = opt + os.path.abspath(v) + ("/" if v.endswith("/") else "")
        elif not a.startswith("-"):
            a = os.path.abspath(a)
        out.append(a)
    return out


if __name__ == "__main__":
    argv = _absolute(sys.argv)
    _setup()
    H.run(TestOneInput, argv)
