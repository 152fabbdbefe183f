"""``materialize_dtensor``: real memory for a meta model split by TP (``parallelize_module``)
or FSDP2 (``fully_shard``), initialised plan-invariantly or loaded rank-locally.

Pipeline: plan (walk) -> allocate -> fill (engine | checkpoint) -> agree (all ranks) ->
register (swap) -> ``reset_parameters()`` for modules with no fused equivalent. Any failure
before register leaves the model unchanged on every rank.
"""
from __future__ import annotations

import time
import warnings as _warnings
from typing import Any, Callable, Mapping, Optional, Union

import torch
from torch import nn

from ..report import Report, make_progress
from ..spec import Dist
from .ckpt_view import Rename
from .fill import allocate, fill_init, fill_load, plan_entries_load
from .register import agree, swap
from .walk import check_init, walk

__all__ = ["materialize_dtensor"]


def _default_device(entries) -> torch.device:
    for e in entries:
        if e.mesh is not None:
            t = e.mesh.device_type
            if t == "cuda":
                return torch.device("cuda", torch.cuda.current_device())
            return torch.device(t)
    if torch.cuda.is_available():
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


def _reset_modules(entries) -> list:
    mods, seen = [], set()
    for e in entries:
        m = e.owner.module
        if e.default.reset and id(m) not in seen:
            seen.add(id(m))
            mods.append((e.owner.fqn.rsplit(".", 1)[0] if "." in e.owner.fqn else "", m))
    return mods


def materialize_dtensor(
    model: nn.Module,
    ckpt: Any = None,
    *,
    device: Optional[Union[str, torch.device]] = None,
    seed: int = 0,
    init: Optional[Mapping[str, Dist]] = None,
    strict: bool = True,
    dtype: Union[None, str, torch.dtype] = None,
    rename: Rename = None,
    io_threads: Optional[int] = None,
    staging_bytes: int = 256 << 20,
    progress: Union[None, bool, Callable[[int, int], None]] = None,
    verify: bool = False,
) -> Report:
    """Allocate, fill and register every meta tensor (DTensor or plain) of ``model``.

    Collective when a process group is initialised: every rank of the world must call it.

    Args:
        model: built on ``meta`` and split with ``parallelize_module`` and/or ``fully_shard``
            (DTensor parameters/buffers with Shard(dim)/Replicate placements, even or uneven,
            any number of mesh dims); plain meta tensors beside them are materialized whole.
        ckpt: None to initialise; else a path or an opened ``metamat.checkpoint.Checkpoint``
            (DCP written by any mesh/plan, safetensors file or HF index set, torch.save).
            Each rank reads only its blocks' bytes.
        device: where the blocks live; default the mesh's device type (CUDA: current device).
        seed: init seed; every element is a pure function of (seed, fqn, global position),
            so the full tensors do not depend on the mesh or the placements.
        init: fnmatch pattern of parameter fqns -> distribution, overriding defaults.
            Otherwise ``nn.Linear``/``_ConvNd`` U(+-1/sqrt(fan_in)), ``nn.Embedding`` N(0, 1)
            (padding row zero), norm layers ones/zeros; other modules get their own
            ``reset_parameters()`` after materializing (one warning lists them).
        strict: loading, a tensor absent from ``ckpt`` raises; else it is initialised.
        dtype: load dtype policy (``metamat.fill_load``): None/"auto", "exact", a dtype.
        rename: model key -> checkpoint key, a callable or a mapping. Without it, keys
            are matched as they are, else behind a ``model.``/``module.`` prefix.
        io_threads, staging_bytes: passed to the loader.
        progress: None: a tqdm bar on rank 0 for loads over a second, only on a TTY;
            True/False force it on/off; a callable gets ``(bytes_done, bytes_total)``.
        verify: loading, check every byte read against the checkpoint's checksum manifest
            while streaming (``metamat.materialize``).

    Returns:
        A :class:`metamat.Report`: bytes, seconds per phase; for loads bytes needed and
        read, read amplification, fqns loaded and initialised.

    Raises:
        UnsupportedDTensorError: Partial/_StridedShard placements, or a parameter with no
            fused init and no ``reset_parameters()`` (before anything is allocated).
        metamat.CheckpointError: the checkpoint does not match the model or cannot be read.
        PeerFailedError: on the other ranks, when one failed (a ``CheckpointError`` too
            when the failure was one), naming the rank and its error.
        In every case the model is unchanged on every rank.
    """
    from ..checkpoint.base import Checkpoint
    from ..checkpoint.open import open_checkpoint
    from ..fill_load import resolve_manifest
    from ..materialize import defer_sigint

    import torch.distributed as dist

    rank = dist.get_rank() if dist.is_available() and dist.is_initialized() else 0
    loading = ckpt is not None
    report = Report(source="checkpoint" if loading else "init", seconds={})
    sec = report.seconds
    error: Optional[BaseException] = None
    entries: list = []
    result = None
    t = time.perf_counter()
    try:
        if loading:
            ck = ckpt if isinstance(ckpt, Checkpoint) else open_checkpoint(ckpt)
            report.checkpoint = ck.path
            manifest = resolve_manifest(ck, verify)  # missing: fail before allocating
            sec["open"] = time.perf_counter() - t
            t = time.perf_counter()
        entries = walk(model, init)
        dev = torch.device(device) if device is not None else _default_device(entries)
        if dev.type == "meta":
            raise ValueError("materialize_dtensor: device must be a real device, not meta")
        if dev.type == "cuda" and dev.index is None:
            dev = torch.device("cuda", torch.cuda.current_device())
        report.device = str(dev)
        if loading:
            result = plan_entries_load(entries, ck, strict=strict, dtype=dtype, rename=rename)
            loaded = {id(e) for e in result.loaded}
            check_init([e for e in entries if id(e) not in loaded])
        else:
            check_init(entries)
        sec["plan"] = time.perf_counter() - t
        t = time.perf_counter()
        report.bytes_allocated = allocate(entries, dev)
        sec["allocate"] = time.perf_counter() - t
        t = time.perf_counter()
        if not loading:
            report.bytes_written = fill_init(entries, seed)
            sec["fill"] = time.perf_counter() - t
        else:
            cb = make_progress(progress, rank)
            try:
                fill_load(result, dtype=dtype, io_threads=io_threads,
                          staging_bytes=staging_bytes, progress=cb, verify=manifest)
            finally:
                if hasattr(cb, "close"):
                    cb.close()
            sec["read"] = time.perf_counter() - t
            t = time.perf_counter()
            report.bytes_written = (sum(e.nbytes for e in result.loaded)
                                    + fill_init([e for e in entries if id(e) not in loaded], seed))
            sec["fill"] = time.perf_counter() - t
        if dev.type == "cuda":
            torch.cuda.synchronize(dev)
    except BaseException as e:  # noqa: BLE001 - told to the other ranks, then re-raised
        error = e
    agree(error)  # raises on every rank if any rank failed; the model is still unchanged

    t = time.perf_counter()
    with defer_sigint():
        report.num_tensors = swap(entries)
    loaded = set() if result is None else {id(e) for e in result.loaded}
    resets = _reset_modules([e for e in entries if id(e) not in loaded])
    _run_resets(entries, resets, loaded, seed)
    sec["register"] = time.perf_counter() - t

    report.num_targets = sum(len(e.targets()) for e in entries)
    if result is not None:
        st = result.stats
        report.bytes_needed, report.bytes_read = st.bytes_needed, st.bytes_read
        report.read_amplification = st.read_amplification
        report.bytes_verified = st.bytes_verified
        report.loaded = [e.fqn for e in result.loaded]
        report.initialized = [e.fqn for e in entries if id(e) not in loaded]
        if result.prefix:
            report.key_prefixes = {"model": result.prefix}
    if resets:
        msg = ("no fused init for these modules; called their reset_parameters() (values "
               "depend on the placement and torch's RNG): "
               + ", ".join(f"{n or '<root>'} ({type(m).__name__})" for n, m in resets))
        report.warnings.append(msg)
        _warnings.warn(msg, stacklevel=2)
    return report


def _run_resets(entries, resets, loaded, seed: int) -> None:
    """Call ``reset_parameters()`` on ``resets`` (already registered). It rewrites every tensor
    of its module, so loaded blocks are saved and put back, and fused values (init=
    overrides) are filled again."""
    if not resets:
        return
    ids = {id(m) for _n, m in resets}
    mine = [e for e in entries if id(e.owner.module) in ids]
    keep = [(e, e.local.clone()) for e in mine if id(e) in loaded]
    with torch.no_grad():
        for _n, m in resets:
            m.reset_parameters()
        for e, saved in keep:
            e.local.copy_(saved)
    fill_init([e for e in mine if id(e) not in loaded and e.default.dist is not None], seed)
