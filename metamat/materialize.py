"""``metamat.materialize``: turn a model holding meta tensors into a real, initialised one,
or load a checkpoint into it.

Pipeline: plan (find every meta tensor, validate, compute targets) -> allocate (one real
storage per meta storage, nothing touched) -> fill (init engine, or checkpoint load) ->
register (swap the real tensors in everywhere). A failure before register leaves the model
as it was.
"""
from __future__ import annotations

import contextlib
import logging
import signal
import threading
import time
import warnings as _warnings
from typing import Any, Callable, List, Mapping, Optional, Union

import torch
from torch import nn

from .report import Report, make_progress
from .spec import Dist

__all__ = ["materialize"]

_log = logging.getLogger("metamat")


def _default_device() -> torch.device:
    if torch.cuda.is_available():
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


def materialize(
    model: nn.Module,
    ckpt: Any = None,
    *,
    device: Optional[Union[str, torch.device]] = None,
    strict: bool = True,
    dtype: Union[None, str, torch.dtype] = None,
    io_threads: Optional[int] = None,
    staging_bytes: int = 256 << 20,
    progress: Union[None, bool, Callable[[int, int], None]] = None,
    seed: int = 0,
    init: Optional[Mapping[str, Dist]] = None,
    rename: Union[None, Mapping[str, str], Callable[[str], str]] = None,
    verify: bool = False,
) -> Report:
    """Allocate and initialise every meta tensor of ``model`` in place, or load ``ckpt``.

    Args:
        model: a ``DistributedModelParallel`` from ``metamat.shard_on_meta`` or from
            ``DistributedModelParallel(..., device=torch.device("meta"),
            init_parameters=False)``, or any ``nn.Module`` holding meta tensors. With
            ``ckpt``, also an already-materialized model (e.g. an eager DMP): its tensors
            are overwritten in place (a fast replacement for ``dcp.load``).
        ckpt: a checkpoint to load instead of initialising: a path (DCP directory,
            ``.safetensors`` file, HF index json or directory of shards, torch.save file)
            or a ``metamat.open_checkpoint`` object. Keys are the model's ``state_dict()``
            keys, optionally behind ``model.``/``module.``; fused-optimizer state
            (``state.<param>.<table>.momentum1``) behind ``optim.``/``optimizer.`` or none
            (see ``metamat.torchrec.load``).
        device: target device; default the current CUDA device if available, else CPU
            (TorchRec tables: CPU only). Ignored for an already-materialized model.
        strict: with ``ckpt``: every model tensor must be in the checkpoint, and all the
            optimizer state if it holds any (else ``MissingTensorError`` naming them all).
            ``strict=False``: missing meta tensors are initialised as without ``ckpt``
            (``Report.initialized``), missing real ones are left (``Report.unchanged``).
        dtype: checkpoint dtype policy (``metamat.fill_load``): None converts between
            float32/float16/bfloat16, ``"exact"`` forbids it, a dtype requires it.
        io_threads: pread threads (default ``min(8, cpu_count)``).
        staging_bytes: bounce-buffer budget of the reader.
        progress: None: a tqdm bar on rank 0 for loads over a second, only on a TTY;
            True/False force it on/off; a callable gets ``(bytes_done, bytes_total)``.
        seed: RNG seed; values are a pure function of (seed, table name, global row/col).
        init: fnmatch patterns of table names or parameter fqns -> metamat distributions,
            overriding the model's own init.
        rename: model key -> checkpoint key (dict or callable), for DTensor and plain
            models whose checkpoint names differ (TorchRec models match state_dict keys).
        verify: with ``ckpt``: check every byte read against the checkpoint's checksum
            manifest (``python -m metamat checksum CKPT`` writes it) while streaming; a
            missing manifest raises ``MissingFileError`` naming its expected path before
            anything is allocated, a mismatch ``ChecksumMismatchError`` (on every rank) and
            nothing is registered.

    A KeyboardInterrupt during the load propagates between read batches (no reader thread
    is left running) and leaves the model as it was; one arriving while the tensors are
    swapped in is held until the swap is complete.

    Models holding DTensors (tensor parallel, FSDP2) go to ``metamat.dtensor``; models with
    TorchRec sharded modules and plain modules to ``metamat.torchrec``.

    Returns:
        A ``Report`` (bytes, seconds per phase, GB/s; with ``ckpt`` also bytes needed and
        read, read amplification, which tensors were initialised instead of loaded).

    Raises:
        metamat.CheckpointError: with ``ckpt``: unreadable, damaged or mismatching
            checkpoint, raised after validating everything and before the first byte of the
            model is written; in a process group every rank raises if any rank fails.
        metamat.torchrec.compat.UnsupportedError: unsupported version, kernel or module,
            raised before anything is allocated.
    """
    if verify and ckpt is None:
        raise ValueError("materialize: verify=True needs a checkpoint")
    report = _dispatch_dtensor(model, ckpt, device=device, strict=strict, dtype=dtype,
                               io_threads=io_threads, staging_bytes=staging_bytes,
                               progress=progress, seed=seed, init=init, rename=rename,
                               verify=verify)
    if report is None:
        report = _materialize_torchrec(model, ckpt, device=device, strict=strict, dtype=dtype,
                                       io_threads=io_threads, staging_bytes=staging_bytes,
                                       progress=progress, seed=seed, init=init, verify=verify)
    _log.info("metamat.materialize: %s", report.summary())
    _log.debug("materialize phases: %s", report.seconds)
    return report


def _has_torchrec_modules(model: nn.Module) -> bool:
    import sys

    if "torchrec" not in sys.modules:  # nothing of torchrec was ever built
        return False
    from torchrec.distributed.types import ShardedModule

    return any(isinstance(m, ShardedModule) for m in model.modules())


def _dispatch_dtensor(model, ckpt, *, rename, **kw) -> Optional[Report]:
    """Run the DTensor path for DTensor models (and plain models with ``rename``)."""
    from .dtensor import has_dtensor, materialize_dtensor

    if has_dtensor(model) or (rename is not None and not _has_torchrec_modules(model)):
        return materialize_dtensor(model, ckpt, rename=rename, **kw)
    if rename is not None:
        raise ValueError("materialize: rename= is not supported for TorchRec models; their "
                         "checkpoint keys are matched to state_dict() keys (with model./module. "
                         "prefixes detected)")
    return None


def _materialize_torchrec(model, ckpt, *, device, strict, dtype, io_threads, staging_bytes,
                          progress, seed, init, verify=False) -> Report:
    from .torchrec.allocate import allocate
    from .torchrec.fill import fill_init
    from .torchrec.register import register
    from .torchrec.walk import build_plan

    if device is None and ckpt is not None:
        # loading into an already-materialized model: where its tensors are
        device = next((p.device for p in model.parameters() if p.device.type != "meta"), None)
    device = torch.device(device) if device is not None else _default_device()
    if device.type == "meta":
        raise ValueError("materialize: device must be a real device, not meta")
    if device.type == "cuda" and device.index is None and torch.cuda.is_available():
        device = torch.device("cuda", torch.cuda.current_device())
    if ckpt is not None:
        return _materialize_from_checkpoint(
            model, ckpt, device=device, strict=strict, dtype=dtype, io_threads=io_threads,
            staging_bytes=staging_bytes, progress=progress, seed=seed, init=init,
            verify=verify)
    report = Report(device=str(device), source="init")

    t0 = time.perf_counter()
    plan = build_plan(model, device, init)
    t1 = time.perf_counter()
    alloc = allocate(plan)
    t2 = time.perf_counter()
    report.bytes_written = fill_init(plan, alloc, seed)
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    t3 = time.perf_counter()
    with defer_sigint():
        register(model, plan, alloc)
    t4 = time.perf_counter()

    report.seconds = {"plan": t1 - t0, "allocate": t2 - t1, "fill": t3 - t2, "register": t4 - t3}
    report.bytes_allocated = plan.nbytes
    report.num_targets = len(plan.targets)
    report.num_tensors = len(alloc.twins)
    report.warnings = list(plan.warnings)
    for w in plan.warnings:
        _warnings.warn(w, stacklevel=2)
    return report


@contextlib.contextmanager
def defer_sigint():
    """Hold SIGINT while the real tensors are swapped into the model (a KeyboardInterrupt
    halfway through would leave it half meta, half real): raised once the block is done.
    Only in the main thread and while Python's default SIGINT handler is installed."""
    if (threading.current_thread() is not threading.main_thread()
            or signal.getsignal(signal.SIGINT) is not signal.default_int_handler):
        yield
        return
    got = []
    prev = signal.signal(signal.SIGINT, lambda signum, frame: got.append(signum))
    try:
        yield
    finally:
        signal.signal(signal.SIGINT, prev)
    if got:
        raise KeyboardInterrupt


# ---------------------------------------------------------------------------------------------
# the load path


def _agreement_group():
    """The group the ranks agree on success over (CPU tensors: the default group when it
    has a CPU backend, else a gloo group created once), or None without a process group."""
    import torch.distributed as dist

    if not (dist.is_available() and dist.is_initialized()) or dist.get_world_size() == 1:
        return None
    backend = str(dist.get_backend())
    if "gloo" in backend or "mpi" in backend:
        return dist.group.WORLD
    global _GLOO_GROUP
    if _GLOO_GROUP is None:
        _GLOO_GROUP = dist.new_group(backend="gloo")  # collective: every rank is here
    return _GLOO_GROUP


_GLOO_GROUP = None


def _agree(group, err: Optional[BaseException], stage: str) -> None:
    """Every rank says whether ``stage`` succeeded; if any failed, every rank raises (the
    failing rank its own error, the others a CheckpointError naming it). No rank goes on
    to write or register while another has failed, and none waits forever for it."""
    from .checkpoint.errors import CheckpointError

    if group is None:
        if err is not None:
            raise err
        return
    import torch.distributed as dist

    msg = None if err is None else f"{type(err).__name__}: {err}"
    flags: List[Any] = [None] * dist.get_world_size(group)
    dist.all_gather_object(flags, msg, group=group)
    if err is not None:
        raise err
    failed = [(r, m) for r, m in enumerate(flags) if m is not None]
    if failed:
        r, m = failed[0]
        raise CheckpointError(f"materialize failed during {stage} on rank(s) "
                              f"{[r for r, _ in failed]}; nothing was registered. Rank {r}: {m}")


def _materialize_from_checkpoint(model, ckpt, *, device, strict, dtype, io_threads,
                                 staging_bytes, progress, seed, init, verify=False) -> Report:
    """The load path of :func:`materialize` (its docstring has the contract)."""
    from .checkpoint import Checkpoint, open_checkpoint
    from .fill_load import execute_plan, plan_load, resolve_manifest, validate_destination
    from .torchrec.allocate import allocate
    from .torchrec.fill import (_fill_dense, _table_targets, fill_support, fill_targets,
                                needs_write)
    from .torchrec.load import finish, inplace_targets, match_keys
    from .torchrec.register import register
    from .torchrec.walk import build_plan

    import torch.distributed as dist

    group = _agreement_group()
    rank = dist.get_rank() if group is not None else 0
    report = Report(device=str(device), source="checkpoint", seconds={})
    sec = report.seconds

    # 1. open, plan, match keys, validate: nothing allocated, nothing written.
    err: Optional[BaseException] = None
    try:
        t = time.perf_counter()
        ck = ckpt if isinstance(ckpt, Checkpoint) else open_checkpoint(ckpt)
        report.checkpoint = ck.path
        manifest = resolve_manifest(ck, verify)  # missing manifest: fail before allocating
        sec["open"] = time.perf_counter() - t
        t = time.perf_counter()
        plan = build_plan(model, device, init)
        extra, extra_opt = inplace_targets(model, plan)
        sec["plan"] = time.perf_counter() - t
        t = time.perf_counter()
        match = match_keys(plan.targets + extra, plan.optimizer_fqns | extra_opt, ck,
                           strict=strict, inplace=extra)
        plan_load(match.renamed()[0], ck, strict=True, dtype=dtype, check_destinations=False)
        for tg in extra:
            validate_destination(tg)
        sec["validate"] = time.perf_counter() - t
    except BaseException as e:  # noqa: BLE001 - shared with the other ranks, then re-raised
        err = e
    _agree(group, err, "validation")

    # 2. allocate, fill what is not loaded, read. The model is untouched until register
    # (except already-real tensors, which are loaded in place).
    try:
        t = time.perf_counter()
        alloc = allocate(plan)
        sec["allocate"] = time.perf_counter() - t
        t = time.perf_counter()
        written = fill_support(plan, alloc)
        with torch.no_grad():
            written += _fill_dense(plan, alloc, seed)  # loaded dense tensors are overwritten
        init_ids = {id(tg) for tg in match.init}
        written += fill_targets(needs_write([tg for tg in _table_targets(plan, alloc)
                                             if id(tg) in init_ids], alloc), seed)
        sec["fill"] = time.perf_counter() - t
        t = time.perf_counter()
        load_targets, means = match.renamed()
        lp = plan_load(load_targets, ck, strict=True, dtype=dtype)
        cb = make_progress(progress, rank)
        try:
            nread = execute_plan(lp, io_threads=io_threads, staging_bytes=staging_bytes,
                                 progress=cb, verify=manifest)
        finally:
            if hasattr(cb, "close"):
                cb.close()
        finish(means)
        sec["read"] = time.perf_counter() - t
    except BaseException as e:  # noqa: BLE001
        err = e
    _agree(group, err, "reading")

    # 3. register: swap the real tensors in.
    t = time.perf_counter()
    if alloc.twins or plan.storages:
        with defer_sigint():
            register(model, plan, alloc)
    sec["register"] = time.perf_counter() - t

    report.bytes_needed = lp.bytes_needed
    report.bytes_read = nread
    report.bytes_verified = lp.verified_bytes
    report.read_amplification = nread / lp.bytes_needed if lp.bytes_needed else 1.0
    report.bytes_written = written + sum(tg.nbytes for tg in lp.targets)
    report.warnings = [f"{tg.fqn}: row-wise optimizer state of {c} column shards loaded as "
                       "their mean" for tg, _ in match.load
                       for c in [match.remap.get(id(tg), (None, 0, 1))[2]] if c > 1]
    report.bytes_allocated = plan.nbytes
    report.num_targets = len(plan.targets) + len(extra)
    report.num_tensors = len(alloc.twins)
    report.loaded = sorted({tg.fqn for tg, _ in match.load})
    report.initialized = sorted({tg.fqn for tg in match.init})
    report.unchanged = sorted({tg.fqn for tg in match.unchanged})
    report.key_prefixes = dict(match.prefixes)
    report.warnings += [w for w in plan.warnings if not _all_loaded_warning(w, report.loaded)]
    for w in report.warnings:
        _warnings.warn(w, stacklevel=3)
    return report


def _all_loaded_warning(w: str, loaded: List[str]) -> bool:
    """A custom-init_fn warning about a table that was loaded, not initialised."""
    return w.startswith("table ") and any(f".{w.split(chr(39))[1]}.weight" in f for f in loaded)
