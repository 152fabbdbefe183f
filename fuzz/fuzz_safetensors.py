"""atheris harness: the safetensors header parser (and HF index json), then a load.

    python fuzz/fuzz_safetensors.py -runs=2000 CORPUS_DIR   (seeds: python fuzz/seeds.py)

Input: the bytes of one ``.safetensors`` file; a first byte of ``{`` is read as an index json
next to a fixed valid shard.
"""
import sys

import atheris

import _harness as H

with atheris.instrument_imports(include=["metamat"]):
    import metamat.checkpoint.safetensors  # noqa: F401
    import metamat.checkpoint.open  # noqa: F401
    import metamat.load  # noqa: F401

_DIR = H.workdir()
_FILE = f"{_DIR}/x.safetensors"


def _shard() -> None:
    import torch
    from safetensors.torch import save_file
    save_file({"a": torch.arange(6.0).reshape(2, 3)}, f"{_DIR}/s-1.safetensors")


def TestOneInput(data: bytes) -> None:
    if data[:1] == b"{":
        H.write(f"{_DIR}/m.safetensors.index.json", data)
        H.check(f"{_DIR}/m.safetensors.index.json")
        return
    H.write(_FILE, data)
    H.check(_FILE)


if __name__ == "__main__":
    _shard()
    H.run(TestOneInput, sys.argv)
