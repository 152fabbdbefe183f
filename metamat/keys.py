"""Stable keys: a table's name and a seed become the 64-bit Philox key of its stream; a
tensor's name and a seed become the torch seed its module's own reset runs under."""
from __future__ import annotations

import hashlib
import zlib

_MASK = (1 << 64) - 1


def table_key(name: str) -> int:
    """Stable 64-bit hash of a table name (BLAKE2b, so it never changes across runs)."""
    if not isinstance(name, str):
        raise TypeError(f"table key must be a str (the table's name), got {type(name).__name__}")
    return int.from_bytes(hashlib.blake2b(name.encode("utf-8"), digest_size=8).digest(), "little")


def _splitmix64(x: int) -> int:
    x = (x + 0x9E3779B97F4A7C15) & _MASK
    x = ((x ^ (x >> 30)) * 0xBF58476D1CE4E5B9) & _MASK
    x = ((x ^ (x >> 27)) * 0x94D049BB133111EB) & _MASK
    return x ^ (x >> 31)


def philox_key(seed: int, name: str) -> int:
    """The 64-bit Philox key of table ``name`` under ``seed``."""
    if isinstance(seed, bool) or not isinstance(seed, int):
        raise TypeError(f"seed must be an int, got {type(seed).__name__}")
    if not 0 <= seed <= _MASK:
        raise ValueError(f"seed must be in [0, 2**64), got {seed}")
    return _splitmix64(_splitmix64(seed) ^ table_key(name))


def module_seed(seed: int, fqn: str) -> int:
    """The torch seed a module's own reset runs under (stable across runs and ranks)."""
    return (seed * 1_000_003 + zlib.crc32(fqn.encode())) & 0x7FFF_FFFF_FFFF_FFFF
