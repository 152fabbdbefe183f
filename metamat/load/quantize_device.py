"""Quantized rows into device memory (CUDA inference TBEs), two ways:

* on the host (the default, ``METAMAT_QUANT_ON=host``): the C++ core writes the rows into one
  of two page-locked bounce buffers, copied to the device on the current stream
  (:meth:`DeviceSink.buffer` / :meth:`DeviceSink.send`);
* on the device (``METAMAT_QUANT_ON=device``, INT-N tables whose rows fbgemm's op takes): the
  float rows are copied to the device and quantized there by fbgemm's own row-wise quantizer,
  ``FloatOrHalfToFusedNBitRowwiseQuantizedSBHalf`` (the op TorchRec's conversion calls; on a
  GPU its CUDA kernel, so the bytes are TorchRec's GPU conversion's), then placed into the TBE's
  rows by two strided copies (:meth:`DeviceSink.quantize_on_device`). It uploads 4x the bytes
  of INT8 rows (8x INT4) and frees the host's threads: which is faster is the GPU bench's to
  say (``bench/bench_quant.py --device cuda``, docs/QUANT.md).

On the emulated device (CPU storages standing for device memory) both run on the CPU, fbgemm's
CPU op standing for its CUDA kernel.
"""
from __future__ import annotations

import contextlib
import os
from typing import List, Sequence

import torch

__all__ = ["DeviceSink", "quant_on", "device_quantizable", "QUANT_ON_ENV"]

QUANT_ON_ENV = "METAMAT_QUANT_ON"


def quant_on() -> str:
    """Where INT-N rows for device memory are quantized: ``"host"`` (default) or ``"device"``
    (``METAMAT_QUANT_ON``, read per call).

    Raises:
        ValueError: another value.
    """
    v = os.environ.get(QUANT_ON_ENV, "host").strip().lower() or "host"
    if v not in ("host", "device"):
        raise ValueError(f"{QUANT_ON_ENV}={v!r}: expected 'host' or 'device'")
    return v


def device_quantizable(kind: int, cols: int, col0: int = 0, out_cols: int = 0) -> bool:
    """Whether fbgemm's op quantizes rows of ``cols`` floats into ``kind`` bits (INT-N rows
    whose packed data is a whole number of 2-byte words: its scale/bias alignment) and the
    destination's columns ``[col0, col0 + out_cols)`` start and end on whole bytes of them
    (others go to the host kernel, which refuses them by name)."""
    if kind not in (8, 4, 2) or cols * kind % 16:
        return False
    per = 8 // kind
    return col0 % per == 0 and out_cols % per == 0


class DeviceSink:
    """Rows for device memory, ordered on the current stream. Two page-locked bounce buffers
    (when CUDA is there) alternate; a buffer is reused only after its last copy finished."""

    def __init__(self, on_device: bool = False) -> None:
        self.on_device = on_device  # METAMAT_QUANT_ON=device: see quantize_on_device
        self.bufs: List[torch.Tensor] = []
        self.events: List[object] = [None, None]
        self.k = 0

    def buffer(self, nbytes: int, zero: bool = True) -> torch.Tensor:
        """The next bounce buffer, ``nbytes`` long (zeroed: row padding is zero, as fbgemm's
        storage)."""
        k = self.k = 1 - self.k
        ev = self.events[k]
        if ev is not None:
            ev.synchronize()  # its previous copy is done: the buffer may be overwritten
            self.events[k] = None
        while len(self.bufs) <= k:
            self.bufs.append(torch.empty(0, dtype=torch.uint8))
        if self.bufs[k].numel() < nbytes:
            pin = torch.cuda.is_available()
            self.bufs[k] = torch.empty(max(nbytes, 1 << 20), dtype=torch.uint8, pin_memory=pin)
        b = self.bufs[k][:nbytes]
        if zero:
            b.zero_()
        return b

    def send(self, host: torch.Tensor, dst: torch.Tensor) -> None:
        """Copy bounce buffer ``host`` to ``dst``; the buffer is free again once it is done."""
        dst.copy_(host, non_blocking=dst.device.type == "cuda")
        self._mark(dst.device)

    def _mark(self, dev: torch.device) -> None:
        """The current buffer is free once ``dev``'s current stream got here (the stream the
        copy to ``dev`` and the work after it ran on, whatever the current device)."""
        if dev.type == "cuda":
            ev = torch.cuda.Event()
            ev.record(torch.cuda.current_stream(dev))
            self.events[self.k] = ev
        # the emulated device: device memory is host memory, every copy is done already

    def quantize_on_device(self, src: torch.Tensor, row: int, outs: Sequence) -> None:
        """Rows ``src`` (CPU float32 ``(n, cols)``), job rows ``row`` .. ``row + n``, quantized
        on the device into ``outs`` (bound :class:`~metamat.load.quantize.QuantOut` of one
        job, device memory, :func:`device_quantizable`): the rows uploaded through a bounce
        buffer, fbgemm's op run once per bit width, each destination's columns and scale/bias
        copied into its rows (``sb_last``: data first, as fbgemm's op lays them out)."""
        n, cols = src.shape
        dev = outs[0].base.device
        host = self.buffer(n * cols * 4, zero=False).view(torch.float32).view(n, cols)
        host.copy_(src)
        guard = torch.cuda.device(dev) if dev.type == "cuda" else contextlib.nullcontext()
        with guard:  # the op and the copies on dev's current stream, whatever device is current
            rows = torch.empty((n, cols), dtype=torch.float32, device=dev)
            rows.copy_(host, non_blocking=dev.type == "cuda")
            self._place(rows, row, outs)
            self._mark(dev)  # after the placement: finish() waits for all of it

    @staticmethod
    def _place(rows: torch.Tensor, row: int, outs: Sequence) -> None:
        """fbgemm's op on ``rows`` (once per bit width), each destination's bytes copied into
        its rows."""
        import fbgemm_gpu  # noqa: F401 - registers the op (TorchRec imported it already)

        n = rows.shape[0]
        op = torch.ops.fbgemm.FloatOrHalfToFusedNBitRowwiseQuantizedSBHalf
        by_kind = {}
        for o in outs:
            q = by_kind.get(o.kind)
            if q is None:
                q = by_kind[o.kind] = op(rows, o.kind)  # (n, cols * kind / 8 + 4) uint8
            per = 8 // o.kind
            nb = o.cols // per
            data = q[:, o.col0 // per:o.col0 // per + nb]
            sb = q[:, q.shape[1] - 4:]
            start = o.offset + row * o.stride
            dst = o.base.as_strided((n, nb + 4), (o.stride, 1), o.base.storage_offset() + start)
            if o.sb_last:
                dst[:, :nb].copy_(data)
                dst[:, nb:].copy_(sb)
            else:
                dst[:, :4].copy_(sb)
                dst[:, 4:].copy_(data)

    def finish(self) -> None:
        """Wait for every copy out of the bounce buffers and the device quantization queued
        after them."""
        for ev in self.events:
            if ev is not None:
                ev.synchronize()
        self.events = [None, None]
