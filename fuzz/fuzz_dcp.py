"""atheris harness: the DCP chunk locator (both serializations), then a load.

    python fuzz/fuzz_dcp.py -runs=2000 CORPUS_DIR   (seeds: python fuzz/seeds.py)

A valid one-process DCP checkpoint of each serialization is written at start. Input byte 0
picks it (even: TORCH_SAVE, odd: SAFETENSORS); bit 0 of byte 1 set means bytes 2-17 are a
signed (offset, length) pair given to the storage entry of tensor ``byte 1 >> 1 % 4``; the
rest of the input replaces the ``.distcp`` data file. Bit 1 of byte 1 set: the data file
shrinks to ``(byte 0 >> 1) / 128`` of its size while ``open_checkpoint`` reads it (just
before the C pass over its blobs: another job rewriting the checkpoint; a mapped file gave
SIGBUS). ``.metadata`` (a pickle DCP trusts) is only ever written by the harness, never fuzzed
as bytes.
"""
import dataclasses
import os
import pickle
import struct
import sys

import atheris

import _harness as H

with atheris.instrument_imports(include=["metamat"]):
    import metamat.checkpoint.dcp  # noqa: F401
    import metamat.checkpoint.open  # noqa: F401
    import metamat.load  # noqa: F401

_BASES = {}


def _setup() -> None:
    import hostile_gen
    from torch.distributed.checkpoint import FileSystemReader
    root = H.workdir()
    bases = hostile_gen.make_bases(root)
    for key in ("dcp", "dcpst"):
        d = bases[key]
        md = FileSystemReader(d).read_metadata()
        with open(os.path.join(d, ".metadata"), "rb") as f:
            raw = f.read()
        _BASES[key] = (d, md, raw, sorted({v.relative_path for v in md.storage_data.values()}))


def TestOneInput(data: bytes) -> None:
    if len(data) < 2:
        return
    d, md, raw_md, files = _BASES["dcp" if data[0] % 2 == 0 else "dcpst"]
    body = data[2:]
    if data[1] & 1 and len(data) >= 18:
        off, ln = struct.unpack("<qq", data[2:18])
        body = data[18:]
        keys = sorted(md.storage_data, key=lambda k: k.fqn)
        k = keys[(data[1] >> 1) % len(keys)]
        sd = dict(md.storage_data)
        sd[k] = dataclasses.replace(sd[k], offset=off, length=ln)
        raw = pickle.dumps(dataclasses.replace(md, storage_data=sd))
    else:
        raw = raw_md
    H.write(os.path.join(d, ".metadata"), raw)
    data_file = os.path.join(d, files[0])
    H.write(data_file, body)
    if data[1] & 2:
        import hostile_gen
        cut = len(body) * (data[0] >> 1) // 128
        with hostile_gen.during_zip_pass(lambda: hostile_gen.truncate(data_file, cut)):
            H.check(d)
    else:
        H.check(d)


if __name__ == "__main__":
    _setup()
    H.run(TestOneInput, sys.argv)
