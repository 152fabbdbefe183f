"""The data of a checksum manifest (:mod:`.checksum` builds and checks them, locally;
:mod:`.checksum_remote` in S3): per saved chunk, the xxh3_64 digest of each ``block_bytes``
block of its byte range."""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Dict, List, Tuple

from . import storage as fs
from .access import contained_path
from .errors import ChecksumMismatchError, InvalidHeaderError
from .limits import short_repr

__all__ = ["ALGORITHM", "ChunkSum", "Manifest", "VerifyResult", "block_span",
           "block_mismatch", "xxh3_64"]

ALGORITHM = "xxh3_64"
_VERSION = 1


def xxh3_64():
    """The hasher class of :data:`ALGORITHM` (``xxhash.xxh3_64``: it releases the GIL)."""
    try:
        import xxhash
    except ImportError as e:  # a declared dependency; say which one is missing
        raise ImportError("metamat's checksum manifests need the 'xxhash' package "
                          "(pip install xxhash)") from e
    return xxhash.xxh3_64


@dataclass(frozen=True)
class ChunkSum:
    """Checksums of one saved chunk.

    Attributes:
        file: data file, relative to the manifest root.
        tensor: the fqn.
        offsets: the chunk's position in the global tensor.
        byte_offset: first byte of the chunk in ``file``.
        nbytes: bytes of the chunk.
        blocks: hex xxh3_64 of each block ``[byte_offset + i*B, +B)`` (B = block_bytes).
    """

    file: str
    tensor: str
    offsets: Tuple[int, ...]
    byte_offset: int
    nbytes: int
    blocks: Tuple[str, ...]


@dataclass
class Manifest:
    """A checkpoint's checksums.

    Attributes:
        root: directory the file names are relative to (absolute; not stored in the JSON).
        format: the checkpoint format, as ``Checkpoint.format``.
        block_bytes: block size of every chunk's digests.
        files: relative file -> size in bytes when the manifest was written.
        chunks: one entry per saved chunk.
        algorithm: always ``"xxh3_64"`` for now.
    """

    root: str
    format: str
    block_bytes: int
    files: Dict[str, int]
    chunks: List[ChunkSum] = field(default_factory=list)
    algorithm: str = ALGORITHM

    def to_json(self) -> dict:
        return {"version": _VERSION, "algorithm": self.algorithm, "format": self.format,
                "block_bytes": self.block_bytes, "files": self.files,
                "chunks": [{"file": c.file, "tensor": c.tensor, "offsets": list(c.offsets),
                            "byte_offset": c.byte_offset, "nbytes": c.nbytes,
                            "blocks": list(c.blocks)} for c in self.chunks]}

    @classmethod
    def from_json(cls, d, root: str, where: str) -> "Manifest":
        """Parse :meth:`to_json` output; ``where`` names the sidecar in errors.

        Raises:
            InvalidHeaderError: not a manifest this version understands.
        """
        try:
            if d["version"] != _VERSION or d["algorithm"] != ALGORITHM:
                raise InvalidHeaderError(f"manifest version {short_repr(d['version'])} / "
                                         f"algorithm {short_repr(d['algorithm'])} not "
                                         "supported", file=where)
            bb = d["block_bytes"]
            files = {str(k): int(v) for k, v in d["files"].items()}
            chunks = [ChunkSum(str(c["file"]), str(c["tensor"]),
                               tuple(int(o) for o in c["offsets"]), int(c["byte_offset"]),
                               int(c["nbytes"]), tuple(str(b) for b in c["blocks"]))
                      for c in d["chunks"]]
        except (KeyError, TypeError, ValueError, AttributeError) as e:
            raise InvalidHeaderError(f"malformed checksum manifest ({type(e).__name__}: {e})",
                                     file=where) from None
        if not isinstance(bb, int) or bb <= 0:
            raise InvalidHeaderError(f"block_bytes {short_repr(bb)} must be a positive int",
                                     file=where)
        # names come from the sidecar: nothing outside the checkpoint is hashed or named
        for rel in list(files) + [c.file for c in chunks]:
            contained_path(root, rel, "manifest file name", where)
        for c in chunks:
            if c.byte_offset < 0 or c.nbytes < 0 or len(c.blocks) != -(-c.nbytes // bb):
                raise InvalidHeaderError(f"chunk at {c.offsets} has {len(c.blocks)} digests "
                                         f"for {c.nbytes} B", file=where, tensor=c.tensor)
        return cls(root, str(d.get("format", "")), bb, files, chunks)

    def abspath(self, rel: str) -> str:
        return fs.normpath(fs.join(self.root, rel))


@dataclass
class VerifyResult:
    """What a verification covered.

    Attributes:
        blocks: blocks hashed and found equal.
        bytes_hashed: bytes read to hash them.
        uncovered_bytes: bytes of the requested reads that no manifest chunk covers
            (headers, or a different checkpoint): not verified.
    """

    blocks: int = 0
    bytes_hashed: int = 0
    uncovered_bytes: int = 0


def block_span(m: Manifest, c: ChunkSum, i: int) -> Tuple[int, int]:
    """(first byte, length) of block ``i`` of chunk ``c`` in its file."""
    return c.byte_offset + i * m.block_bytes, min(m.block_bytes, c.nbytes - i * m.block_bytes)


def block_mismatch(m: Manifest, c: ChunkSum, i: int, got: str) -> ChecksumMismatchError:
    """The named error for block ``i`` of chunk ``c`` hashing to ``got`` (hex)."""
    b0, n = block_span(m, c, i)
    return ChecksumMismatchError(
        f"chunk at {tuple(c.offsets)}: bytes [{b0}, {b0 + n}) hash {got}, the manifest says "
        f"{c.blocks[i]} ({m.algorithm})", file=m.abspath(c.file), tensor=c.tensor,
        chunk=tuple(c.offsets), byte_range=(b0, b0 + n))
