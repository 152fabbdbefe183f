"""``metamat.materialize``: the one orchestration, for every model kind.

    find (adapters, :mod:`metamat.models`: TorchRec sharded and quantized modules, ordinary
          modules with plain/DTensor tensors)
    -> plan (targets and storages, :mod:`metamat.plan`)
    -> validate (names, shapes, dtypes, coverage, files: :mod:`metamat.matching` and the read
       plan; a value for every tensor)
    -> agree -> allocate -> fill (init | load) -> agree -> register

Nothing in the model changes before the second agreement; a failure anywhere before it leaves
the model as it was on every rank. Tensors that already exist and are loaded are filled in
shadow copies that the register step copies in (unless ``inplace=True``).
"""
from __future__ import annotations

import logging
import time
import warnings as _warnings
from typing import TYPE_CHECKING, Any, Callable, List, Mapping, Optional, Sequence, Tuple, Union

import torch
from torch import nn

from ._gcpause import gc_paused
from .allocate import DEVICE, allocate
from .checkpoint.base import Checkpoint
from .checkpoint.view import Rename
from .collective import Agreement, defer_sigint, rank
from .errors import PartialLoadError
from .plan import Target
from .report import Report, make_progress
from .rules import check_init_map

if TYPE_CHECKING:
    from .matching import LoadMatch
    from .models.adapter import Adapter

__all__ = ["materialize"]

_log = logging.getLogger("metamat")


def _shadow(x: torch.Tensor) -> torch.Tensor:
    return torch.empty_strided(x.shape, x.stride(), dtype=x.dtype, device=x.device)


def _bind_reads(ld: "LoadMatch", alloc,
                inplace: bool) -> List[Tuple[torch.Tensor, torch.Tensor, str]]:
    """Point the read plan's targets at real memory; tensors of the live model get shadow
    copies (unless ``inplace``, and the target is not ``shadowed``). Bytes in unified memory
    (UVM tables) are written from the host, where they live: their targets are host views,
    and their shadows host memory. Returns (live, shadow, fqn) triples."""
    from .allocate import host_alias
    from .load import validate_destination

    shadows = []
    dests = list(ld.reads.targets) + [dst for dst, _ in ld.means]
    for t in dests:
        x = t.tensor
        if x.device.type == "meta":
            t.tensor = alloc.host_view(alloc.view(x))
        elif alloc.key_of(x) is not None:
            t.tensor = alloc.host_view(x)
        else:
            live = host_alias(x)
            if live is None:
                live = x
            if inplace and not t.shadowed:
                t.tensor = live
            else:
                t.tensor = _shadow(live)
                shadows.append((live, t.tensor, t.fqn))
    for t in ld.reads.targets:
        validate_destination(t)
    return shadows


@gc_paused()  # many live objects per table or tensor: see metamat._gcpause
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
    init: Optional[Mapping[str, Any]] = None,
    rename: Rename = None,
    merge: Any = "auto",
    verify: bool = False,
    ignore_unexpected: Sequence[str] = (),
    inplace: bool = False,
    timeout: Optional[float] = None,
    io: str = "auto",
    storage_options: Optional[Mapping[str, Any]] = None,
    trust_pickles: bool = False,
) -> Report:
    """Give every meta tensor of ``model`` real memory and its value, or load ``ckpt``.

    Collective when a process group is initialised: every rank must call it.

    Args:
        model: any ``nn.Module`` holding meta tensors: a TorchRec ``DistributedModelParallel``
            (from :func:`metamat.shard_on_meta` or ``DistributedModelParallel(...,
            device=torch.device("meta"), init_parameters=False)``), a tensor-parallel or FSDP2
            model (DTensor parameters on meta), a plain model built on meta or under
            :func:`metamat.init_empty_weights`. With ``ckpt``, also an already real model.
        ckpt: a checkpoint to load: a path (DCP directory, ``.safetensors`` file, Hugging Face
            index json or directory of shards, torch.save file) or a
            :func:`metamat.open_checkpoint` object. Each rank reads only its blocks' bytes.
            Keys are the model's ``state_dict()`` keys, optionally behind ``model.`` or
            ``module.``; fused-optimizer state (``state.<param>.<table>.momentum1``) behind
            ``optim.``, ``optimizer.`` or nothing.
        device: target device; default: where an already real model lives, else the DTensor
            mesh's device type, else this rank's GPU if there is one (``cuda:LOCAL_RANK``
            under torchrun, unless ``torch.cuda.set_device`` chose another GPU than cuda:0;
            else the current CUDA device), else the CPU. ``"cuda"`` without
            an index is that GPU, or the one a TorchRec model was laid out for (another GPU
            than that one is refused: its plan places this rank's shards there;
            docs/TORCHREC_GPU.md).
        strict: with ``ckpt``, like ``load_state_dict``: every persistent model tensor must be
            in the checkpoint (else :class:`MissingTensorError` naming them all) and every
            checkpoint tensor must match one (else :class:`UnexpectedTensorError`, unless
            ``ignore_unexpected`` covers it). Fused-optimizer state is optional.
            ``strict=False``: missing meta tensors are initialised as without ``ckpt``,
            missing real ones are left; unexpected ones are listed in the Report.
        dtype: checkpoint dtype policy: None converts between float32/float16/bfloat16,
            ``"exact"`` forbids it, a dtype requires every saved tensor to have it.
        io_threads: reader threads (default ``metamat.load.default_io_threads()``: this
            process's CPUs, shared by the node's ranks, at most 16).
        staging_bytes: host memory the load may use for bounce and staging buffers.
        progress: None: a tqdm bar on rank 0 for loads over a second, only on a TTY;
            True/False force it on/off; a callable gets ``(bytes_done, bytes_total)``.
        seed: values are a pure function of (seed, tensor or table name, global position)
            for every fused distribution, whatever the plan or the world size.
        init: name or fnmatch pattern -> value for tensors no checkpoint provides: a
            :class:`metamat.Dist` (fused), a tensor (the global value) or a callable (given
            the whole tensor of an ordinary module, under a seed keyed by its name, each rank
            keeping its block; a TorchRec table's local block). Names are TorchRec table names
            or ``state_dict()`` keys; an exact name wins, then the first matching pattern.
        rename: model key -> checkpoint key (dict or callable) when names differ; a TorchRec
            table's fused-optimizer state follows its weight's rename.
        merge: model tensors the checkpoint holds in several pieces or under other names,
            for those it does not hold as they are: ``"auto"`` (default) applies the model's
            own conversion rules (transformers' checkpoint conversion mapping: per-expert MoE
            tensors stacked and concatenated into fused experts, renames); a list of
            :class:`metamat.Merge` rules (``"auto"`` among them adds the model's own); None
            applies none. Each rank reads only the pieces' bytes its blocks need.
        verify: with ``ckpt``, check every byte read against the checkpoint's checksum
            manifest (``python -m metamat checksum CKPT`` writes it) while streaming.
        ignore_unexpected: fnmatch patterns of checkpoint keys that may match nothing.
        inplace: with ``ckpt``, write already-real tensors in place instead of into shadow
            copies: no transient memory for them, but a failure after the first write raises
            :class:`PartialLoadError` naming what may have changed. Managed-collision
            remapping state, checked after the read, is shadowed all the same.
        io: how checkpoint bytes are read: ``"auto"`` (large ranges of files that are not in
            the page cache stream through it with sequential readahead and are dropped from
            it behind the reader, so the cache is left as it was; cached or small ranges are
            plain buffered reads), ``"buffered"`` or ``"direct"`` (``O_DIRECT``, pipelined).
        storage_options: for an ``s3://bucket/prefix`` ``ckpt``: credentials, endpoint and
            read settings (see ``docs/S3.md``); default: the ``AWS_*`` environment.
            ``"deadline"``: seconds the open, and then the reads, may each take in all
            (default ``METAMAT_S3_DEADLINE``, else 300): a stalled store fails with a
            ReadError by then on its rank, and its peers raise one naming it.
        trust_pickles: with a ``ckpt`` path, unpickle its DCP ``.metadata`` / torch.save
            ``data.pkl`` with plain pickle instead of the allow-list of what those formats
            write (as ``torch.load(weights_only=False)``): only for checkpoints you trust
            that carry custom classes. Default False: anything else is
            :class:`metamat.checkpoint.UnsafePickleError` before a byte of tensor data is read.
        timeout: seconds a rank waits for its peers at each agreement point before raising
            :class:`PeerFailedError` (a dead peer is noticed at once); default
            ``METAMAT_TIMEOUT`` or 600.

    Returns:
        A :class:`Report` (bytes, seconds per phase, GB/s; with ``ckpt`` bytes needed and
        read, read amplification, which tensors were loaded, initialised, left unchanged,
        which checkpoint tensors were unexpected; where each buffer's value came from).

    Raises:
        metamat.CheckpointError: unreadable, damaged or mismatching checkpoint, raised after
            validating everything and before the first byte of the model is written.
        metamat.MissingValueError: meta tensors with no value source (before allocating).
        metamat.UnsupportedError: unsupported versions, kernels, modules or placements.
        metamat.PeerFailedError: another rank failed (a ``CheckpointError`` too when that was
            a checkpoint problem). In every case the model is unchanged on every rank.
        metamat.PartialLoadError: only with ``inplace=True``, after writes began.
    """
    if verify and ckpt is None:
        raise ValueError("materialize: verify=True needs a checkpoint")
    from .load.execute import IO_MODES
    if io not in IO_MODES:
        raise ValueError(f"materialize: io must be one of {IO_MODES}, got {io!r}")
    from .matching import LoadMatch, match_parts, merge_rules_arg, settle_optimizer
    from .models import find_parts
    from .models.device import resolve_device

    ranks = Agreement(timeout)  # collective: before any rank-specific work
    loading = ckpt is not None
    report = Report(source="checkpoint" if loading else "init", seconds={})
    sec = report.seconds
    err: Optional[BaseException] = None
    parts: List[Adapter] = []
    ld = LoadMatch()
    dev = torch.device("cpu")
    emulated = False
    t = time.perf_counter()
    try:
        if loading:
            from .checkpoint import open_checkpoint
            from .load.verify import resolve_manifest

            ck = ckpt if isinstance(ckpt, Checkpoint) else open_checkpoint(
                ckpt, storage_options=storage_options, trust_pickles=trust_pickles)
            report.checkpoint = ck.path
            ld.manifest = resolve_manifest(ck, verify)  # missing: fail before allocating
            sec["open"] = time.perf_counter() - t
            t = time.perf_counter()
        init_map = check_init_map(init)
        dev, emulated = resolve_device(model, device)
        report.device = "cuda (emulated on the CPU)" if emulated else str(dev)
        parts = find_parts(model, dev, init_map, loading=loading, emulated=emulated,
                           inplace=inplace)
        sec["plan"] = time.perf_counter() - t
        t = time.perf_counter()
        if loading:
            manifest = ld.manifest
            ld = match_parts(parts, ck, strict=strict, dtype=dtype, rename=rename,
                             ignore=tuple(ignore_unexpected), merge=merge_rules_arg(merge))
            ld.manifest = manifest
        for p in parts:
            p.decide(init_map, ld.loaded, dev)
        sec["validate"] = time.perf_counter() - t
    except BaseException as e:  # noqa: BLE001 - told to the other ranks, then re-raised
        err = e
    try:  # the bits: which saved optimizer state this rank takes (no rank: unexpected)
        taken = ranks.agree(err, "validation", payload=ld.mine)
        settle_optimizer(ld, taken)
    except BaseException:
        _undo(parts)
        raise

    reading = False  # the reads began (with inplace=True: the live model may be written)
    shadows: list = []
    executed = None
    alloc = None
    try:
        t = time.perf_counter()
        alloc = allocate([g for p in parts for g in p.storages], dev, emulated=emulated)
        for p in parts:
            p.bind(alloc, dev)
        if loading:
            shadows = _bind_reads(ld, alloc, inplace)
            for p in parts:
                p.before_read()
            if dev.type == "cuda":  # the caches' write-back and the last training step land
                torch.cuda.synchronize(dev)  # before the host writes rows in place
        sec["allocate"] = time.perf_counter() - t
        t = time.perf_counter()
        report.bytes_written = sum(p.fill(alloc, seed, ld.loaded) for p in parts)
        if dev.type == "cuda" and not loading:  # the kernels ran, not just launched: the
            torch.cuda.synchronize(dev)  # phase's seconds (Report.fill_gbps) are real
        sec["fill"] = time.perf_counter() - t
        if loading:
            t = time.perf_counter()
            reading = True
            executed = _read(ld, io_threads, staging_bytes, progress, io, alloc)
            for p in parts:
                p.after_load()
            sec["read"] = time.perf_counter() - t
        if dev.type == "cuda":
            torch.cuda.synchronize(dev)
        _fill_report(report, parts, ld, executed, alloc, shadows)
        mine = report.rank_summary(rank())
    except BaseException as e:  # noqa: BLE001
        err = e
        mine = None
    try:  # one collective: every rank's success and its summary for the job's Report
        report.ranks = ranks.agree(err, "fill", payload=mine)
        for p in parts:  # where every rank's shards are (placements name them)
            p.peers({s.rank: s.device for s in report.ranks if s is not None})
    except BaseException as e:  # noqa: BLE001
        _undo(parts)
        live = sorted({t.fqn for t in ld.reads.targets if _is_live(t, alloc)}
                      | {n for p in parts for n in p.written_in_place()}) \
            if reading and inplace else []
        if live:
            raise PartialLoadError(
                "the load failed after writing into the model's own tensors (inplace=True): "
                f"the model is partly loaded; these may have changed: {', '.join(live[:20])}"
                + (" ..." if len(live) > 20 else ""), written=live) from e
        raise

    t = time.perf_counter()
    with defer_sigint():
        with torch.no_grad():
            for live, shadow, _fqn in shadows:
                live.copy_(shadow)
        report.num_tensors = sum(p.register(alloc, loaded=loading) for p in parts)
        if dev.type == "cuda":  # the shadows' copies and emptied caches, seen on every stream
            torch.cuda.synchronize(dev)
    sec["register"] = time.perf_counter() - t
    for w in report.warnings:
        _warnings.warn(w, stacklevel=3)  # 3: past gc_paused's wrapper
    _log.info("metamat.materialize: %s", report.summary())
    _log.debug("materialize phases: %s", report.seconds)
    return report


def _undo(parts: Sequence[Adapter]) -> None:
    """Put back what an adapter changed in the model before the call failed (TorchRec
    collections laid out again for the GPU)."""
    for p in parts:
        if p.undo is not None:
            p.undo()


def _is_live(t: Target, alloc) -> bool:
    return alloc is not None and t.tensor is not None and t.tensor.device.type != "meta" \
        and alloc.key_of(t.tensor) is None and not t.shadowed


def _read(ld: "LoadMatch", io_threads, staging_bytes, progress, io, alloc):
    from .load import execute

    def in_device_memory(t: Target) -> bool:
        return alloc.memory_of(t.tensor) == DEVICE

    # on the emulated device, what a GPU holds in device memory goes through the staging ring
    staged = in_device_memory if alloc.emulated else False
    cb = make_progress(progress, rank())
    try:
        out = execute(ld.reads, io_threads=io_threads, staging_bytes=staging_bytes,
                      progress=cb, verify=ld.manifest, io=io, staged=staged)
        for q in ld.quant:  # float rows quantized into place, through a bounded scratch buffer
            out.merge(q.execute(io_threads=io_threads, staging_bytes=staging_bytes,
                                verify=ld.manifest, io=io))
        return out
    finally:
        if hasattr(cb, "close"):
            cb.close()


def _fill_report(report: Report, parts: Sequence[Adapter], ld: "LoadMatch", executed, alloc,
                 shadows) -> None:
    targets = [t for p in parts for t in p.targets]
    by_memory = alloc.bytes_by_memory()
    shadowed = 0  # adapters' own shadows (live tables), by the memory they are in
    for k in {k for p in parts for k in p.transient_keys()} & set(alloc.storages):
        n = alloc.storages[k].nbytes()
        kind = alloc.memory.get(k, DEVICE)
        by_memory[kind] = by_memory.get(kind, 0) - n
        shadowed += n
    report.bytes_allocated = alloc.nbytes - shadowed
    report.bytes_by_memory = {k: v for k, v in by_memory.items() if v > 0}
    report.bytes_transient = sum(s.untyped_storage().nbytes() for _l, s, _f in shadows) \
        + shadowed
    report.num_targets = len(targets)
    report.warnings = [w for p in parts for w in p.warnings]
    report.warnings += list(getattr(executed, "warnings", ()))  # e.g. s3 objects nothing pins
    report.warnings += ld.warnings
    for p in parts:
        report.buffers.update(p.value_sources())
        report.sources.update(p.sources())
    for name, how in ld.described.items():  # assembled or renamed by a merge rule
        if report.sources.get(name) == "checkpoint":
            report.sources[name] = how
    if ld.reads is None:
        return
    lp = ld.reads
    report.bytes_needed = lp.bytes_needed
    report.bytes_read = executed.bytes_read
    report.bytes_verified = executed.bytes_verified
    report.bytes_direct = executed.bytes_direct
    report.read_amplification = (executed.bytes_read / lp.bytes_needed
                                 if lp.bytes_needed else 1.0)
    report.bytes_written += sum(t.nbytes for t in lp.targets)
    report.loaded = sorted({t.fqn for t in targets if id(t) in ld.loaded})
    not_loaded = [t for t in targets if id(t) not in ld.loaded and t.persistent]
    report.initialized = sorted({t.fqn for t in not_loaded if alloc.key_of(t.tensor) is not None})
    report.unchanged = sorted({t.fqn for t in not_loaded if alloc.key_of(t.tensor) is None})
    report.unexpected = list(ld.unexpected)
    report.key_prefixes = dict(ld.prefixes)
