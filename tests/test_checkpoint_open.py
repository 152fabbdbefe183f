"""Format detection by content, not by file name."""
from __future__ import annotations

import torch
import torch.distributed.checkpoint as dcp
import pytest
from safetensors.torch import save_file

from metamat.checkpoint import (HeaderTooLargeError, MissingFileError, UnsupportedFormatError,
                                open_checkpoint)


def test_detects_by_content_not_name(tmp_path):
    save_file({"a": torch.zeros(3)}, str(tmp_path / "weights.pt"))  # safetensors named .pt
    torch.save({"a": torch.zeros(3)}, tmp_path / "weights.safetensors")  # zip named .safetensors
    assert open_checkpoint(tmp_path / "weights.pt").format == "safetensors"
    assert open_checkpoint(tmp_path / "weights.safetensors").format == "torch_save"
    d = tmp_path / "dcp"
    dcp.save({"a": torch.zeros(3)}, checkpoint_id=str(d))
    assert open_checkpoint(d).format == "dcp"


def test_unknown_missing_and_damaged(tmp_path):
    with pytest.raises(MissingFileError):
        open_checkpoint(tmp_path / "nothing")
    (tmp_path / "x.bin").write_bytes(b"hello world, not a checkpoint")
    with pytest.raises(UnsupportedFormatError, match="x.bin"):
        open_checkpoint(tmp_path / "x.bin")
    (tmp_path / "y.safetensors").write_bytes(b"\xff" * 8 + b"{}")
    with pytest.raises(HeaderTooLargeError, match="y.safetensors"):
        open_checkpoint(tmp_path / "y.safetensors")
    (tmp_path / "empty").mkdir()
    with pytest.raises(UnsupportedFormatError, match="empty"):
        open_checkpoint(tmp_path / "empty")
