"""The torch RNG state a module's own init (or a callable init) runs under."""
from __future__ import annotations

from contextlib import contextmanager
from typing import Iterator

import torch

__all__ = ["seeded"]


@contextmanager
def seeded(seed: int) -> Iterator[None]:
    """Run the block with torch's CPU generator, and the current GPU's when CUDA is
    initialized, seeded with ``seed``; both states restored after. (``torch.manual_seed``
    reseeds every GPU's generator for good, and one CUDA initializes later too.)"""
    devices = [torch.cuda.current_device()] if torch.cuda.is_initialized() else []
    with torch.random.fork_rng(devices=devices):
        torch.default_generator.manual_seed(seed)
        for d in devices:
            torch.cuda.default_generators[d].manual_seed(seed)
        yield
