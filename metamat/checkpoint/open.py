"""Open any supported checkpoint, detecting the format from the files' contents."""
from __future__ import annotations

import os

from . import storage as fs
from .base import Checkpoint, open_binary
from .dcp import is_dcp_dir, open_dcp
from .errors import UnsupportedFormatError
from .safetensors import (looks_like_safetensors, open_safetensors_dir, open_safetensors_file,
                          open_safetensors_index)
from .torch_save import open_torch_save

__all__ = ["open_checkpoint"]


def open_checkpoint(path, *, storage_options=None, trust_pickles: bool = False) -> Checkpoint:
    """Parse the checkpoint at ``path`` (metadata only; no tensor data is read).

    Recognised, by content:
      * a directory with a DCP ``.metadata`` (TORCH_SAVE or SAFETENSORS serialization);
      * a directory with ``*.safetensors.index.json`` or ``*.safetensors`` shards;
      * a file starting with a zip local header: a torch.save archive;
      * a file starting with a safetensors header (8-byte length, then ``{``);
      * a JSON file with a ``weight_map``: an HF shard index.

    ``path`` may be an ``s3://bucket/key`` URL (a "directory" is a key prefix); credentials
    and endpoint come from the environment (``AWS_*``) or ``storage_options``
    (:mod:`metamat.checkpoint.storage`). Errors name the object URL.

    The pickles a checkpoint holds (DCP ``.metadata``, torch.save ``data.pkl``) are untrusted:
    they are unpickled with an allow-list of what the format writes, and a pickle naming
    anything else (``os.system``, a custom class) raises :class:`UnsafePickleError` before
    anything it names is called (:mod:`metamat.checkpoint.unpickle`).

    Args:
        path: a local path or ``s3://`` URL.
        storage_options: S3 credentials, endpoint and read settings; ``"deadline"``: seconds
            the open may take in all (default ``METAMAT_S3_DEADLINE``, else 300): a store
            that stalls or lists forever fails with a ReadError by then (docs/S3.md).
        trust_pickles: for a checkpoint you trust whose pickles hold custom classes: unpickle
            them with plain ``pickle`` (as ``torch.load(weights_only=False)`` and torch's own
            ``dcp.load`` do), which runs whatever they name. To load such a checkpoint, pass
            the opened checkpoint to :func:`metamat.materialize`.

    Returns:
        A :class:`Checkpoint`.

    Raises:
        MissingFileError: ``path`` does not exist.
        UnsupportedFormatError: none of the above (e.g. legacy non-zip torch.save).
        UnsafePickleError: a pickle names a global outside the allow-list (without
            ``trust_pickles``), or is a memory bomb.
        CheckpointError: any other error of the format's parser, for a damaged file.
    """
    path = os.fspath(path)
    store = fs.storage_for(path)
    with store.opening(path, storage_options):  # S3: one deadline, pins, named failures
        ck = _open(path, store, trust_pickles)
        ck.remote_meta = store.pins(ck.files)  # what the reads will require of each object
    ck.storage_options = storage_options  # for what is read later (its checksum sidecar)
    return ck


def _open(path: str, store: fs.Storage, trust_pickles: bool = False) -> Checkpoint:
    store.require(path)
    if store.isdir(path):
        if is_dcp_dir(path):
            return open_dcp(path, trust_pickles=trust_pickles)
        return open_safetensors_dir(path)
    with open_binary(path, "checkpoint file") as f:
        head = f.read(9)
    if head[:4] == b"PK\x03\x04":
        return open_torch_save(path, trust_pickles=trust_pickles)
    if looks_like_safetensors(path):
        return open_safetensors_file(path)
    if head.lstrip()[:1] == b"{":
        return open_safetensors_index(path)
    if head[:1] == b"\x80":
        raise UnsupportedFormatError(
            "legacy (non-zip) torch.save file; re-save with torch>=1.6 defaults", file=path)
    if path.endswith(".safetensors"):
        return open_safetensors_file(path)  # damaged: its parser names the problem
    raise UnsupportedFormatError("unrecognised checkpoint file", file=path)
