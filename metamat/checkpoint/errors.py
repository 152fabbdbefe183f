"""Named errors for checkpoint reading and loading.

Every way a checkpoint can be malformed or not match the model has its own class, all
deriving from :class:`CheckpointError` (an ``Exception``, unlike torch DCP's
``CheckpointException``). Messages name the file and the tensor when they are known.
"""
from __future__ import annotations

from typing import Optional

__all__ = [
    "CheckpointError",
    "UnsupportedFormatError",
    "InvalidHeaderError",
    "HeaderTooLargeError",
    "InvalidOffsetError",
    "TruncatedFileError",
    "MissingFileError",
    "MissingTensorError",
    "ShapeMismatchError",
    "DtypeMismatchError",
    "CoverageError",
    "OverlappingChunksError",
    "DestinationError",
    "ReadError",
    "ChecksumMismatchError",
    "LimitExceededError",
    "UnsafePathError",
    "UnsafePickleError",
    "KeyCollisionError",
    "WriteError",
]


class CheckpointError(Exception):
    """Base class of every checkpoint problem metamat reports.

    Attributes:
        file: path of the offending file, when known.
        tensor: name (fqn) of the offending tensor, when known.
    """

    def __init__(self, message: str, *, file: Optional[str] = None,
                 tensor: Optional[str] = None) -> None:
        parts = []
        if file is not None:
            parts.append(f"file {file!s}")
        if tensor is not None:
            parts.append(f"tensor {tensor!r}")
        prefix = (", ".join(parts) + ": ") if parts else ""
        super().__init__(prefix + message)
        self.detail = message
        self.file = None if file is None else str(file)
        self.tensor = tensor

    def with_tensor(self, tensor: str) -> "CheckpointError":
        """The same error naming ``tensor`` (for parsers that learn the name later).

        Returns ``self`` when a tensor is already named or the class takes other arguments.
        """
        if self.tensor is not None or type(self).__init__ is not CheckpointError.__init__:
            return self
        e = type(self)(self.detail, file=self.file, tensor=tensor)
        e.__cause__ = self.__cause__
        return e


class UnsupportedFormatError(CheckpointError):
    """The path is not a checkpoint format metamat reads (or uses an unsupported feature)."""


class InvalidHeaderError(CheckpointError):
    """A header/metadata block does not parse or violates the format's rules."""


class HeaderTooLargeError(InvalidHeaderError):
    """A declared header length is above the format's limit or past the end of the file."""


class InvalidOffsetError(InvalidHeaderError):
    """Declared byte offsets are inconsistent (overlap, holes, or disagree with shape×itemsize)."""


class TruncatedFileError(CheckpointError):
    """A byte range the checkpoint declares lies (partly) past the end of its file."""


class MissingFileError(CheckpointError):
    """A file referenced by the checkpoint's metadata does not exist."""


class MissingTensorError(CheckpointError):
    """Tensors requested by the model are absent from the checkpoint (strict mode).

    Attributes:
        names: the missing fqns.
    """

    def __init__(self, message: str, *, names=(), file=None) -> None:
        super().__init__(message, file=file)
        self.names = list(names)


class UnexpectedTensorError(CheckpointError):
    """The checkpoint holds tensors the model has no place for (``strict=True``; like
    ``load_state_dict``'s ``unexpected_keys``). ``names`` lists them all."""

    def __init__(self, message: str, *, names=(), file=None) -> None:
        super().__init__(message, file=file)
        self.names = list(names)


class ShapeMismatchError(CheckpointError):
    """The checkpoint's global shape (or a chunk's shape) differs from the model's."""


class DtypeMismatchError(CheckpointError):
    """The saved dtype cannot be loaded into the destination dtype (or is unknown)."""


class CoverageError(CheckpointError):
    """The saved chunks do not cover the block a target needs."""


class OverlappingChunksError(CheckpointError):
    """Two saved chunks of one tensor overlap, so the data to read is ambiguous."""


class DestinationError(CheckpointError):
    """A destination tensor is not what the plan says (shape, dtype, device, strides)."""


class ReadError(CheckpointError):
    """A file could not be read: the C++ reader failed (I/O error, short read), or a file
    the checkpoint names is a directory or cannot be opened."""


class ChecksumMismatchError(CheckpointError):
    """Bytes on disk differ from the checksum manifest (see :mod:`.checksum`).

    Attributes:
        chunk: offsets of the chunk (its position in the global tensor), when known.
        byte_range: ``(start, end)`` of the block that differs, when known.
    """

    def __init__(self, message: str, *, file=None, tensor=None, chunk=None,
                 byte_range=None) -> None:
        super().__init__(message, file=file, tensor=tensor)
        self.chunk = chunk
        self.byte_range = byte_range


class LimitExceededError(CheckpointError):
    """Metadata is larger, deeper or more numerous than a safety limit allows
    (:mod:`.limits`). The message names the limit, the value seen and how to raise it.

    Attributes:
        limit: the limit's name, e.g. ``"metadata bytes"``.
        value: what was seen (or a lower bound of it).
        maximum: the limit in force.
        env: the environment variable that raises it (``None`` if there is none).
    """

    def __init__(self, message: str, *, limit: str = "", value=None, maximum=None,
                 env: Optional[str] = None, file=None, tensor=None) -> None:
        super().__init__(message, file=file, tensor=tensor)
        self.limit, self.value, self.maximum, self.env = limit, value, maximum, env


class UnsafePathError(InvalidHeaderError):
    """A path named by the checkpoint's own metadata (an index ``weight_map`` entry, a
    checksum manifest entry, a DCP ``relative_path``) is absolute, holds a NUL byte or
    leads outside the checkpoint directory."""


class UnsafePickleError(UnsupportedFormatError):
    """A pickle the checkpoint holds (DCP ``.metadata``, torch.save ``data.pkl``) asks for
    more than the format needs: a global outside metamat's allow-list (``os.system``, a custom
    class), a BUILD on a class or a shared object, an extension-registry code, a persistent id
    the format does not use, or a memo index far past the entries written (a memory bomb).
    Raised while unpickling, before anything it names is called and before any tensor byte is
    read. Open a checkpoint you trust with ``open_checkpoint(path, trust_pickles=True)``
    (``--trust-pickles`` on the command line): plain ``pickle``, as
    ``torch.load(weights_only=False)``.

    Attributes:
        name: the refused global as ``module.name``, when a global was refused.
    """

    def __init__(self, message: str, *, name: Optional[str] = None, file=None,
                 tensor=None) -> None:
        super().__init__(message, file=file, tensor=tensor)
        self.name = name


class KeyCollisionError(InvalidHeaderError):
    """Two entries of a torch.save'd nested dict flatten to the same key
    (``{"0.weight": A, "0": {"weight": B}}``)."""


class WriteError(CheckpointError):
    """A file metamat writes (a checksum sidecar) could not be written; nothing is left
    behind."""
