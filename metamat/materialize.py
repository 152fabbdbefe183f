"""``metamat.materialize``: the one orchestration, for every model kind.

    find (adapters: TorchRec sharded modules, ordinary modules with plain/DTensor tensors)
    -> plan (targets, storages and the read plan, computed once)
    -> validate (names, shapes, dtypes, coverage, files, a value for every tensor)
    -> agree -> allocate -> fill (init | load) -> agree -> register

Nothing in the model changes before the second agreement; a failure anywhere before it leaves
the model as it was on every rank. Tensors that already exist and are loaded are filled in
shadow copies that the register step copies in (unless ``inplace=True``).
"""
from __future__ import annotations

import fnmatch
import itertools
import logging
import time
import warnings as _warnings
from typing import Any, Callable, Dict, List, Mapping, Optional, Sequence, Set, Tuple, Union

import torch
from torch import nn

from ._gcpause import gc_paused
from .allocate import allocate
from .checkpoint.base import Checkpoint
from .checkpoint.errors import MissingTensorError, UnexpectedTensorError
from .checkpoint.view import MODEL_PREFIXES, CheckpointView, Rename, resolve_keys
from .collective import Agreement, defer_sigint, rank
from .errors import PartialLoadError
from .plan import Target
from .report import Report, make_progress
from .rules import check_init_map

__all__ = ["materialize"]

_log = logging.getLogger("metamat")


def _has_meta(model: nn.Module) -> bool:
    from .models.modules import local_of

    # stops at the first meta tensor: a sharded model lists its tables lazily
    return any(local_of(t).device.type == "meta"
               for t in itertools.chain(model.parameters(), model.buffers()))


def _resolve_device(model: nn.Module, device) -> Tuple[torch.device, bool]:
    """(device, emulated): the explicit device; else the CUDA device a TorchRec model was laid
    out for; else where an eager model lives; else a DTensor mesh's device type; else the
    current CUDA device when there is one, else the CPU. ``emulated``: a CUDA device stood
    in for by the CPU (:mod:`metamat.emulation`)."""
    from . import emulation

    if device is None:
        device = getattr(model, "_metamat_compute_device", None)
    if device is None:
        # only asked without an explicit device: listing a DMP's parameters goes through
        # TorchRec's named_parameters (~7 µs per table)
        if not _has_meta(model):
            real = next((t for t in list(model.parameters()) + list(model.buffers())), None)
            if real is not None:
                from .models.modules import local_of
                device = local_of(real).device
        if device is None:
            from .models.modules import is_dtensor
            mesh_dev = next((t.device_mesh.device_type for t in model.parameters()
                             if is_dtensor(t)), None)
            device = mesh_dev or ("cuda" if torch.cuda.is_available() or emulation.active()
                                  else "cpu")
    device = torch.device(device)
    if device.type == "meta":
        raise ValueError("materialize: device must be a real device, not meta")
    if device.type == "cuda" and device.index is None and torch.cuda.is_available():
        device = torch.device("cuda", torch.cuda.current_device())
    device, emulated = emulation.resolve(device)
    if device.type == "cuda" and not torch.cuda.is_available():
        from .errors import UnsupportedError

        raise UnsupportedError(f"materialize: device {device} asked for, and torch sees no "
                               "CUDA device here (torch.cuda.is_available() is False)")
    return device, emulated


class _Load:
    """The read plan of one call and what it matched (computed once, before allocation)."""

    def __init__(self) -> None:
        self.plan = None
        self.loaded: Set[int] = set()  # ids of targets the checkpoint provides
        self.unexpected: List[str] = []
        self.prefixes: Dict[str, Optional[str]] = {}
        self.means: list = []
        self.manifest = None
        self.described: Dict[str, str] = {}  # assembled/renamed by merge rules: how
        self.warnings: List[str] = []
        # saved optimizer state of model tables, taken here (bit i of mine) or maybe by
        # another rank: settled in the validation agreement (_settle_optimizer)
        self.pending: List[str] = []
        self.mine = 0
        self.ignore: Sequence[str] = ()
        self.strict = True
        self.path = ""
        self.quant: list = []  # load.quantize.QuantReads: float rows quantized while read


def _optimizer_hint(unexpected: Sequence[str], has_fused: bool, orphans=frozenset()) -> str:
    lost = [k for k in unexpected if k in orphans]
    if lost:
        return (f" {len(lost)} of them are saved optimizer state of tables that have no such "
                "state in this plan (e.g. data-parallel now, or another optimizer), so nothing "
                "can load it; accept losing it with ignore_unexpected=[...] naming them")
    opt = [k for k in unexpected
           if k.startswith(("optim.", "optimizer.", "state.")) or ".state." in k]
    if opt and not has_fused:
        return (f" {len(opt)} of them look like optimizer state, and this model has no fused "
                "optimizer to load it into; ignore them with ignore_unexpected=['optim.*'] "
                "(or the prefix your checkpoint uses)")
    return ""


def _plan_load(parts, ck: Checkpoint, *, strict: bool, dtype, rename: Rename,
               ignore: Sequence[str], merge=None) -> _Load:
    """Match every target to the checkpoint and plan the reads (no allocation, no writes)."""
    from .checkpoint.merge import missing_message
    from .load import plan_load

    out = _Load()
    keys = ck.tensors()
    # adapters that match the checkpoint themselves (quantized tables) are left out here
    model_t = [t for p in parts if not hasattr(p, "match_checkpoint") for t in p.targets
               if not t.optimizer and t.persistent]
    names: Dict[str, List[str]] = {}
    for p in parts:  # global names: a rank without a block of a tensor still knows it
        names.update(p.names())
    found, prefix, used = resolve_keys(keys, names, prefixes=MODEL_PREFIXES, rename=rename)
    out.prefixes["model"] = prefix
    missing = sorted(n for n in names if n not in found)
    assembled: Dict[str, Any] = {}
    notes: Dict[str, str] = {}
    if missing and merge is not None:  # checkpoint tensors in another layout or name
        from .checkpoint.merge import resolve_merges

        rules = [r for m in merge for r in ([m] if m != "auto" else
                                            [x for p in parts if hasattr(p, "merge_rules")
                                             for x in p.merge_rules()])]
        shapes_all: Dict[str, tuple] = {}
        for p in parts:
            if hasattr(p, "shapes"):
                shapes_all.update(p.shapes())
        mr = resolve_merges(rules, missing, keys, used, prefix, shapes_all, ck.path)
        found.update(mr.renamed)
        used |= mr.used
        assembled, out.described = mr.entries, mr.described
        notes = {n: why for r in rules for n, why in getattr(r, "notes", {}).items()}
        notes.update(mr.incomplete)
        missing = [n for n in missing if n not in found and n not in assembled]
    if missing:
        msg, looks = missing_message(missing, [k for k in keys if k not in used], notes,
                                     strict)
        if strict:
            raise MissingTensorError(msg, names=missing, file=ck.path)
        if looks:
            out.warnings.append(msg)
    load: List[Target] = [t for t in model_t if t.fqn in found or t.fqn in assembled]
    view_keys = {n: found[n] for n in found}
    from .load.quantize import refuse_quantized
    refuse_quantized(load, keys, view_keys, ck.path)  # quantized tables into a float model
    for p in parts:  # quantized tables: from float rows (quantized while read) or quantized
        if hasattr(p, "match_checkpoint"):
            m = p.match_checkpoint(keys, found, ckpt_path=ck.path)
            load += m.load
            view_keys.update(m.keys)
            used |= m.used
            out.loaded |= {id(t) for t in p.loaded_targets()}
    opt_parts = [p for p in parts if hasattr(p, "match_optimizer")]
    has_fused = any(t.optimizer for p in opt_parts for t in p.targets)
    cands: Set[str] = set()
    for p in opt_parts:
        m = p.match_optimizer(keys, strict=strict, ckpt_path=ck.path)
        load += m.load
        view_keys.update(m.keys)
        used |= m.used
        out.loaded |= {id(t) for t in m.loaded}
        out.means += m.means
        out.prefixes["optim"] = m.prefix
        cands |= set(m.candidates)
    out.pending, out.ignore, out.strict, out.path = sorted(cands), tuple(ignore), strict, ck.path
    out.mine = sum(1 << i for i, k in enumerate(out.pending) if k in used)
    out.unexpected = sorted(k for k in keys if k not in used and k not in cands
                            and not any(fnmatch.fnmatchcase(k, pat) for pat in ignore))
    if out.unexpected and strict:
        u = out.unexpected
        raise UnexpectedTensorError(
            f"{len(u)} checkpoint tensor(s) match nothing in the model: {', '.join(u[:20])}"
            + (" ..." if len(u) > 20 else "") + "." + _optimizer_hint(u, has_fused)
            + " Pass ignore_unexpected=[patterns] or strict=False to load anyway.",
            names=u, file=ck.path)
    shapes: Dict[str, tuple] = {}
    for p in parts:
        if hasattr(p, "nd_shapes"):
            shapes.update(p.nd_shapes())
    view = CheckpointView(ck, view_keys, shapes, extra=assembled)
    out.plan = plan_load(load, view, strict=True, dtype=dtype, check_destinations=False)
    out.loaded |= {id(t) for t in load}
    out.quant = [p.plan_reads(view, dtype) for p in parts if hasattr(p, "plan_reads")]
    out.plan.bytes_needed += sum(q.bytes_needed for q in out.quant)
    return out


def _settle_optimizer(ld: _Load, taken: Sequence[int]) -> None:
    """Saved optimizer state of a model table that no rank takes (a table that is data-parallel
    now, state of another optimizer) is unexpected: every rank has the same lists, so every
    rank raises the same error under ``strict`` (nothing was allocated), else the Report
    lists it. Never dropped silently.

    Raises:
        UnexpectedTensorError: ``strict`` and such state that ``ignore_unexpected`` does not
            name.
    """
    bits = 0
    for t in taken:
        bits |= t or 0
    lost = [k for i, k in enumerate(ld.pending) if not bits >> i & 1
            and not any(fnmatch.fnmatchcase(k, pat) for pat in ld.ignore)]
    if not lost:
        return
    if ld.strict:
        raise UnexpectedTensorError(
            f"{len(lost)} checkpoint tensor(s) match nothing in the model: "
            f"{', '.join(lost[:20])}" + (" ..." if len(lost) > 20 else "") + "."
            + _optimizer_hint(lost, True, set(lost))
            + " Pass ignore_unexpected=[patterns] or strict=False to load anyway.",
            names=lost, file=ld.path)
    ld.unexpected = sorted(ld.unexpected + lost)


def _shadow(x: torch.Tensor) -> torch.Tensor:
    return torch.empty_strided(x.shape, x.stride(), dtype=x.dtype, device=x.device)


def _bind_reads(ld: _Load, alloc, inplace: bool) -> List[Tuple[torch.Tensor, torch.Tensor, str]]:
    """Point the read plan's targets at real memory; tensors of the live model get shadow
    copies (unless ``inplace``). Bytes in unified memory (UVM tables) are written from the
    host, where they live: their targets are host views, and their shadows host memory.
    Returns (live, shadow, fqn) triples."""
    from .allocate import host_alias
    from .load import validate_destination

    shadows = []
    dests = list(ld.plan.targets) + [dst for dst, _ in ld.means]
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
            if inplace:
                t.tensor = live
            else:
                t.tensor = _shadow(live)
                shadows.append((live, t.tensor, t.fqn))
    for t in ld.plan.targets:
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
            mesh's device type, else the current CUDA device if there is one, else the CPU
            (TorchRec tables too: on a GPU host each rank's GPU, ``cuda:LOCAL_RANK`` under
            torchrun; docs/TORCHREC_GPU.md).
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
        rename: model key -> checkpoint key (dict or callable) when names differ.
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
            copies: no transient memory, but a failure after the first write raises
            :class:`PartialLoadError` naming what may have changed.
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
    ranks = Agreement(timeout)  # collective: before any rank-specific work
    loading = ckpt is not None
    report = Report(source="checkpoint" if loading else "init", seconds={})
    sec = report.seconds
    err: Optional[BaseException] = None
    parts: list = []
    ld = _Load()
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
        dev, emulated = _resolve_device(model, device)
        report.device = "cuda (emulated on the CPU)" if emulated else str(dev)
        from .models import find_parts

        parts = find_parts(model, dev, init_map, loading=loading, emulated=emulated)
        sec["plan"] = time.perf_counter() - t
        t = time.perf_counter()
        if loading:
            manifest = ld.manifest
            ld = _plan_load(parts, ck, strict=strict, dtype=dtype, rename=rename,
                            ignore=tuple(ignore_unexpected), merge=_merge_arg(merge))
            ld.manifest = manifest
        for p in parts:
            if hasattr(p, "decide"):
                p.decide(init_map, ld.loaded, dev)
        sec["validate"] = time.perf_counter() - t
    except BaseException as e:  # noqa: BLE001 - told to the other ranks, then re-raised
        err = e
    try:  # the bits: which saved optimizer state this rank takes (no rank: unexpected)
        taken = ranks.agree(err, "validation", payload=ld.mine)
        _settle_optimizer(ld, taken)
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
                if hasattr(p, "before_read"):
                    p.before_read()
        sec["allocate"] = time.perf_counter() - t
        t = time.perf_counter()
        report.bytes_written = sum(p.fill(alloc, seed, ld.loaded) for p in parts)
        sec["fill"] = time.perf_counter() - t
        if loading:
            t = time.perf_counter()
            reading = True
            executed = _read(ld, io_threads, staging_bytes, progress, io, alloc)
            for p in parts:
                if hasattr(p, "after_load"):
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
    except BaseException as e:  # noqa: BLE001
        _undo(parts)
        live = sorted({t.fqn for t in ld.plan.targets if _is_live(t, alloc)}) \
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
    sec["register"] = time.perf_counter() - t
    for w in report.warnings:
        _warnings.warn(w, stacklevel=3)  # 3: past gc_paused's wrapper
    _log.info("metamat.materialize: %s", report.summary())
    _log.debug("materialize phases: %s", report.seconds)
    return report


def _merge_arg(merge) -> Optional[list]:
    """``merge=`` -> a list of rules ("auto" kept as a marker) or None.

    Raises:
        TypeError: neither "auto", None nor a list of Merge rules and "auto".
    """
    from .checkpoint.merge import Merge

    if merge is None:
        return None
    if isinstance(merge, str):
        if merge != "auto":
            raise TypeError(f"merge must be 'auto', None or a list of metamat.Merge, got {merge!r}")
        return ["auto"]
    if isinstance(merge, Merge):
        return [merge]
    rules = list(merge)
    for r in rules:
        if not (r == "auto" or isinstance(r, Merge) or callable(getattr(r, "match", None))):
            raise TypeError(f"merge: {r!r} is not a metamat.Merge (nor 'auto')")
    return rules


def _undo(parts) -> None:
    """Put back what an adapter changed in the model before the call failed (TorchRec
    collections laid out again for the GPU)."""
    for p in parts:
        undo = getattr(p, "undo", None)
        if undo is not None:
            undo()


def _is_live(t: Target, alloc) -> bool:
    return alloc is not None and t.tensor is not None and t.tensor.device.type != "meta" \
        and alloc.key_of(t.tensor) is None


def _read(ld: _Load, io_threads, staging_bytes, progress, io, alloc):
    from .allocate import DEVICE
    from .load import execute

    def in_device_memory(t: Target) -> bool:
        return alloc.memory_of(t.tensor) == DEVICE

    # on the emulated device, what a GPU holds in device memory goes through the staging ring
    staged = in_device_memory if alloc.emulated else False
    cb = make_progress(progress, rank())
    try:
        out = execute(ld.plan, io_threads=io_threads, staging_bytes=staging_bytes,
                      progress=cb, verify=ld.manifest, io=io, staged=staged)
        for q in ld.quant:  # float rows quantized into place, through a bounded scratch buffer
            r = q.execute(io_threads=io_threads, staging_bytes=staging_bytes, verify=ld.manifest,
                          io=io)
            out.bytes_read += r.bytes_read
            out.bytes_verified += r.bytes_verified
            out.bytes_reread += r.bytes_reread
            out.bytes_direct += r.bytes_direct
        return out
    finally:
        if hasattr(cb, "close"):
            cb.close()


def _fill_report(report: Report, parts, ld: _Load, executed, alloc, shadows) -> None:
    targets = [t for p in parts for t in p.targets]
    report.bytes_allocated = alloc.nbytes
    report.bytes_by_memory = alloc.bytes_by_memory()
    report.bytes_transient = sum(s.untyped_storage().nbytes() for _l, s, _f in shadows)
    report.num_targets = len(targets)
    report.warnings = [w for p in parts for w in p.warnings]
    report.warnings += list(getattr(executed, "warnings", ()))  # e.g. s3 objects nothing pins
    report.warnings += ld.warnings
    for p in parts:
        if hasattr(p, "value_sources"):
            report.buffers.update(p.value_sources())
        if hasattr(p, "sources"):
            report.sources.update(p.sources())
    for name, how in ld.described.items():  # assembled or renamed by a merge rule
        if report.sources.get(name) == "checkpoint":
            report.sources[name] = how
    if ld.plan is None:
        return
    lp = ld.plan
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
