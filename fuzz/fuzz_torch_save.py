"""atheris harness: the torch.save zip/pickle reader (restricted unpickler, record locator),
then a load.

    python fuzz/fuzz_torch_save.py -runs=2000 CORPUS_DIR   (seeds: python fuzz/seeds.py)

Input: the bytes of one torch.save file. Inputs not starting with a zip local header are
also tried as the zip itself (so the mutator need not keep the magic).
"""
import sys

import atheris

import _harness as H

with atheris.instrument_imports(include=["metamat"]):
    import metamat.checkpoint.torch_save  # noqa: F401
    import metamat.checkpoint.open  # noqa: F401
    import metamat.load  # noqa: F401

_FILE = f"{H.workdir()}/x.pt"


def TestOneInput(data: bytes) -> None:
    from metamat import CheckpointError
    from metamat.checkpoint.torch_save import parse_torch_save
    H.write(_FILE, data)
    if data[:4] == b"PK\x03\x04":
        H.check(_FILE)
    else:
        try:
            parse_torch_save(_FILE)
        except CheckpointError:
            pass


if __name__ == "__main__":
    H.run(TestOneInput, sys.argv)
