"""The torch RNG state a module's own init (or a callable init) runs under."""
from __future__ import annotations

from contextlib import contextmanager
from typing import Iterable, Iterator

import torch

__all__ = ["seeded"]


@contextmanager
def seeded(seed: int, devices: Iterable[torch.device] = ()) -> Iterator[None]:
    """Run the block with torch's CPU generator, the current GPU's when CUDA is initialized,
    and the generator of each CUDA device in ``devices`` (where the block's tensors are:
    ``normal_`` on ``cuda:1`` draws from cuda:1's generator, current or not), seeded with
    ``seed``; every state restored after. (``torch.manual_seed`` reseeds every GPU's generator
    for good, and one CUDA initializes later too.)"""
    indices = {torch.cuda.current_device()} if torch.cuda.is_initialized() else set()
    for d in devices:
        if d.type == "cuda":
            indices.add(d.index if d.index is not None else torch.cuda.current_device())
    with torch.random.fork_rng(devices=sorted(indices)):
        torch.default_generator.manual_seed(seed)
        for i in sorted(indices):
            torch.cuda.default_generators[i].manual_seed(seed)
        yield
