"""The adapter of TorchRec's quantized inference modules (:mod:`.quant`): find, match the
checkpoint (:mod:`.quant_keys`), fill what no checkpoint gives, register.

* storages: each inference TBE's weights storage (zeroed: row padding and the gaps between
  tables stay 0, as fbgemm's ``torch.zeros``; large storages are born zero and cost nothing);
* values: from a float checkpoint, each block's rows quantized while read
  (:mod:`metamat.load.quantize`); from a quantized one, its bytes; else the table's init
  (``init=``, its ``init_fn`` or TorchRec's default), drawn as the float table's values (plan
  invariant: a pure function of seed, table, global row and column) and quantized the same
  way;
* metadata: the TBE laid out for the CPU by fbgemm itself (:func:`.quant_layout.host_twin`): its
  buffers and layout attributes replace the meta ones at register time; meta devices
  (TBEs, modules, shard placements) become the CPU;
* each rank's managed-collision modules of TorchRec's inference sharding of a quantized MC
  collection (:mod:`.quant_mc`): their rows of the training state, or TorchRec's initial
  values, checked and sorted again after a load as TorchRec's load hook does;
* on a GPU (``device="cuda"``, or the emulated device): unsharded collections built on meta
  are laid out for a GPU already (DEVICE placement, ``weights_dev``); their rows are
  quantized on the host and copied to the device through two bounce buffers
  (:class:`~metamat.load.quantize.DeviceSink`), their metadata moved there.
"""
from __future__ import annotations

from typing import Dict, List, Mapping, Optional, Set

import torch
from torch import nn

from ...allocate import DEVICE, HOST, UVM, UVM_HOST_MAPPED, Allocation, host_alias
from ...errors import MissingValueError, UnsupportedError
from ...load.quantize import (DeviceSink, QuantJob, QuantOut, plan_quant_reads, quant_on,
                              quantize_into, rows_per_piece)
from ...plan import StorageGroup, Target, storage_key
from ...rules import default_table_dist, dist_from_init_fn, match_init
from ...spec import Dist
from ...support import fill_support
from ..adapter import Adapter
from .compat import check_versions
from .graph import scan
from .managed_collision import finish_mc_modules, is_mch
from .quant import QuantTBE, find_tbes
from .quant_layout import (CACHE_FILL, CACHE_MAPS, cache_free_memory, cache_values,
                           check_device_memory, device_bytes, device_layout, device_twin,
                           empty_cache, gpu_relayout_refusal, host_layout, host_twin,
                           in_unified_memory, is_caching, planned_for_gpu, tbe_kernel)
from .quant_keys import QuantMatch, match_quant
from .quant_mc import (check_loaded, match_own_state, rank_mc_modules, rank_mc_targets,
                       validate_loaded)
from .upstream import drop_quantized_weights, quantized_weights

__all__ = ["QuantPart"]



class QuantPart(Adapter):
    """The quantized TorchRec modules of one model (``modules``: (name, module)), found."""

    kind = "torchrec_quant"

    def __init__(self, model: nn.Module, device: torch.device, init, *, modules: list,
                 loading: bool, emulated: bool = False, inplace: bool = False,
                 claimed: Set[int] = frozenset()) -> None:
        check_versions()
        self.modules = modules
        self.others = claimed  # storages the modules adapter owns (quantized MC state)
        self.device = device
        self.cuda = device.type == "cuda" or emulated  # CUDA inference TBEs (or emulated)
        self.tbes: List[QuantTBE] = [t for name, m in modules for t in find_tbes(name, m)]
        # a live model (real TBE storages, a checkpoint given): each storage is planned as a
        # meta stand-in, like a model on meta; its shadow starts as a copy of the live bytes,
        # takes the reads, and is copied in once every read succeeded (register). With
        # inplace=True the reads go into the live storage itself (no shadow).
        self.real: Dict[int, torch.Tensor] = {}  # stand-in storage key -> the live storage
        self.touched: Set[int] = set()  # those the checkpoint loads into (decide)
        self.inplace = inplace
        self.live_unified: Dict[int, str] = {}  # stand-ins of live storages in unified memory
        for t in self.tbes:
            if not t.storage.is_meta:
                self._stand_in(t, device, emulated)
        # TBEs TorchRec's quant sharding left HOST-placed on meta for a GPU plan: laid out for
        # the device here, as TorchRec lays them out when it shards on the GPU
        self.relaid: Dict[int, object] = {}
        if self.cuda:
            quant_on()  # METAMAT_QUANT_ON checked before anything is allocated
            owners = dict(modules)
            # fbgemm sizes each TBE's cache by the memory free when it is built, after the
            # TBEs before it took theirs: the same order here
            free, used = cache_free_memory(device, emulated), 0
            for t in self.tbes:
                if self._is_live(t.storage):
                    continue
                if t.storage is t.module.weights_dev:
                    used += t.storage.untyped_storage().nbytes()
                    continue
                why = gpu_relayout_refusal(t.owner, owners[t.owner])
                if why is not None:
                    raise UnsupportedError(why + " (docs/QUANT.md)")
                twin = self.relaid[id(t.module)] = device_twin(
                    t.module, tbe_kernel(owners[t.owner], t.module),
                    None if free is None else free - used)
                used += device_bytes(twin)
            if self.relaid and device.type == "cuda" and device.index not in (None, 0):
                raise UnsupportedError(
                    f"{self.tbes[0].owner or '<root>'}: TorchRec places the shards of rank 0 "
                    f"on cuda:0 (its inputs go there), not on {device}: materialize it with "
                    "device='cuda:0' (docs/QUANT.md)")
        self.tables = [tb for t in self.tbes for tb in t.tables]
        self.twins = {id(t.module): host_twin(t.module) for t in self.tbes
                      if not self._is_live(t.storage)}
        self.graph = scan(*[m for _, m in modules])
        self.keys = {storage_key(t.storage) for t in self.tbes}
        # weights of TBEs relaid in unified memory (quant_uvm, quant_uvm_caching kernels) ->
        # its kind; each caching TBE's cache buffers (meta, on its twin), by name
        # (enforce_hbm: fbgemm keeps "UVM" rows in device memory)
        self.unified: Dict[int, str] = {
            storage_key(t.storage): UVM_HOST_MAPPED if t.module.uvm_host_mapped else UVM
            for t in self.tbes if in_unified_memory(self.relaid.get(id(t.module)))
            and not t.module.enforce_hbm}
        self.unified.update(self.live_unified)  # their shadows: host memory (HOST)
        self.caches: Dict[int, Dict[str, torch.Tensor]] = {
            id(t.module): {n: self.relaid[id(t.module)]._buffers[n]
                           for n in (*CACHE_FILL, *CACHE_MAPS)}
            for t in self.tbes if is_caching(self.relaid.get(id(t.module)))}
        self.storages = [StorageGroup(k, self._nbytes(k), kind="zeros",
                                      memory=HOST if k in self.live_unified
                                      else self.unified.get(k, DEVICE))
                         for k in dict.fromkeys(storage_key(t.storage) for t in self.tbes)
                         if not (inplace and k in self.real)]  # in place: nothing to allocate
        self.storages += [StorageGroup(storage_key(b), b.untyped_storage().nbytes(),
                                       kind="zeros", where=f"{t.owner or '<root>'}: {n}")
                          for t in self.tbes for n, b in self.caches.get(id(t.module),
                                                                        {}).items()]
        self._emulated = emulated  # (decide checks the device memory of what it keeps)
        # each rank's MC modules of sharded quantized MC collections: one storage per tensor
        self.ranks = rank_mc_modules(modules)
        self.rank_state = rank_mc_targets(self.ranks, loading)
        self.mc_keys = {storage_key(tg.tensor) for _, _, tg in self.rank_state
                        if tg.tensor.is_meta}
        self.storages += [StorageGroup(storage_key(tg.tensor),
                                       tg.tensor.untyped_storage().nbytes(), kind="targets",
                                       where=tg.fqn)
                          for _, _, tg in self.rank_state if tg.tensor.is_meta]
        self.loaded: Set[int] = set()  # ids of the targets a checkpoint gave (fill)
        self._check_meta()
        # one report target per table block (Report.loaded / initialized name them)
        self.targets: List[Target] = [
            Target(t.fqn, t.name, t.global_shape, (t.row0, t.col0), (t.rows, t.cols),
                   torch.uint8, tensor=t.storage) for t in self.tables]
        self.targets += [tg for _, _, tg in self.rank_state]
        self.warnings: List[str] = [
            f"{name or '<root>'}: quant-sharded for a GPU (shard_quant_model's default "
            "compute_device='cuda') and laid out on the CPU: its lookups keep TorchRec's GPU "
            "path; for a model that runs on the CPU shard it with compute_device='cpu'"
            for name, m in modules if not self.cuda and planned_for_gpu(m)
            and not any(self._is_live(t.storage) for t in self.tbes if t.owner == name)]
        self.match: Optional[QuantMatch] = None
        self.init_jobs: List[QuantJob] = []
        self._loaded_names: Set[str] = set()

    def _stand_in(self, t: QuantTBE, device: torch.device, emulated: bool) -> None:
        real = t.storage
        where = t.owner or "<root>"
        if real.dim() != 1 or real.storage_offset() or not real.is_contiguous():
            raise UnsupportedError(f"{where}: its inference TBE's weights are not one whole "
                                   "storage: cannot load into it")
        # DEVICE placement or unified memory (seen from the GPU), else HOST
        in_device = real is t.module.weights_dev or real is t.module.weights_uvm
        if in_device != self.cuda or (not emulated and real.device != device):
            raise UnsupportedError(
                f"{where}: its tables live on {real.device} ("
                f"{'device' if in_device else 'host'} placement), the call materializes on "
                f"{'the emulated GPU' if emulated else device}: pass device='{real.device}'")
        standin = torch.empty(real.shape, dtype=real.dtype, device="meta")
        t.storage = standin
        for tb in t.tables:
            tb.storage = standin
        self.real[storage_key(standin)] = real
        if real is t.module.weights_uvm and not t.module.enforce_hbm:  # host memory
            self.live_unified[storage_key(standin)] = HOST

    def _is_live(self, x: torch.Tensor) -> bool:
        """``x`` views the stand-in of a live storage."""
        return bool(self.real) and x.is_meta and storage_key(x) in self.real

    def _shadowed(self) -> Set[int]:
        """Live storages written through a shadow: those the checkpoint loads into."""
        return set() if self.inplace else self.touched

    def transient_keys(self) -> Set[int]:
        """The shadows of live storages (freed when the call returns)."""
        return set(self._shadowed())

    def _nbytes(self, key: int) -> int:
        return next(t.storage.untyped_storage().nbytes() for t in self.tbes
                    if storage_key(t.storage) == key)

    def _replaced(self) -> Set[int]:
        """ids of the meta tensors register replaces wholesale (TBE metadata, leftovers)."""
        out: Set[int] = set()
        for t in self.tbes:
            tbe = t.module
            out.update(id(b) for b in tbe._buffers.values() if b is not None)
            out.update(id(getattr(tbe, a)) for a in ("weights_offsets", "weights_placements",
                                                     "weights_host", "weights_dev", "weights_uvm"))
        for _, m in self.modules:
            for pair in (quantized_weights(m) or {}).values():
                out.update(id(x) for x in pair if isinstance(x, torch.Tensor))
        return out

    def _check_meta(self) -> None:
        replaced = self._replaced()
        from .quant import ordinary_children

        # ordinary modules inside quantized collections (MC collections, feature processors):
        # their parameters and buffers are the modules adapter's (checked: none left
        # unowned), placeholders in plain attributes are left as TorchRec leaves them (MCH's
        # _evicted_emb_indices, replaced at an eviction)
        mccs = [mcc for _, mcc in ordinary_children(self.modules)]
        for mcc in mccs:
            for t in [*mcc.parameters(), *mcc.buffers()]:
                if t.is_meta and storage_key(t) not in self.others:
                    raise UnsupportedError(
                        f"meta tensor {self.graph.path(t)} of a quantized collection's "
                        f"{type(mcc).__name__}: no adapter took it")
        theirs = {storage_key(t) for t in scan(*mccs).meta_tensors()} if mccs else set()
        # each rank's MC modules: their tensors are targets; MCH's placeholder is replaced
        # once real (finish_mc_modules); any other meta tensor of theirs is refused below
        theirs |= self.mc_keys | {storage_key(r.module._evicted_emb_indices) for r in self.ranks
                                  if is_mch(r.module)}
        for t in self.graph.meta_tensors():
            if storage_key(t) in self.keys or id(t) in replaced or storage_key(t) in theirs:
                continue
            raise UnsupportedError(f"meta tensor {self.graph.path(t)} ({t.dtype}, shape "
                                   f"{tuple(t.shape)}) of a quantized TorchRec module: metamat "
                                   "does not know its value")

    def claimed(self) -> Set[int]:
        return set(self.keys) | self.mc_keys

    def names(self) -> Dict[str, List[str]]:
        """Every table weight's name (what a float or a quantized checkpoint holds). The
        tables of a quantized managed-collision collection, or feature-processed one, also go
        by their training name (the float modules keep them in their ``_embedding_module``,
        ``_embedding_bag_collection``)."""
        from .quant import quant_feature_processors, quant_mc_collections

        heads = [(n[:-len("_managed_collision_collection")], "_embedding_module.")
                 for n, _ in quant_mc_collections(self.modules)]
        heads += [(n.rsplit(".", 1)[0] + "." if "." in n else "", "_embedding_bag_collection.")
                  for n, _, _ in quant_feature_processors(self.modules)]
        out = {}
        for t in self.tables:
            head, inner = next(((h, i) for h, i in heads if t.fqn.startswith(h)), (None, ""))
            out[t.fqn] = [t.fqn] if head is None else [
                t.fqn, f"{head}{inner}{t.fqn[len(head):]}"]
        out.update({tg.fqn: [tg.fqn] for _, _, tg in self.rank_state if tg.persistent})
        return out

    # -- checkpoint --------------------------------------------------------------------------

    def checkpoint_targets(self) -> List[Target]:
        """Each rank's MC state, by name (the tables are matched by match_checkpoint: float
        or quantized rows)."""
        return [tg for _, _, tg in self.rank_state if tg.persistent]

    def match_checkpoint(self, keys: Mapping[str, object], found: Mapping[str, str], *,
                         ckpt_path: str) -> QuantMatch:
        """What the checkpoint gives each table (:func:`.quant_keys.match_quant`). The TBE
        metadata a quantized model's own state_dict holds (``register_tbes``: ``<module>.tbes.
        <i>.<buffer>``) is taken as read: metamat lays every TBE out itself. An
        inference-sharded MC collection's own state: :func:`.quant_mc.match_own_state`."""
        self.match = match_quant(self.tables, keys, found, path=ckpt_path)
        self._loaded_names = set(self.match.tables)
        prefix = next((found[t.fqn][:len(found[t.fqn]) - len(t.fqn)] for t in self.tables
                       if t.fqn in found and found[t.fqn].endswith(t.fqn)), "")
        for name, m in self.modules:
            head = f"{prefix}{name}." if name else prefix
            self.match.used |= {head + b for b, _ in m.named_buffers()
                                if b.startswith("tbes.") and head + b in keys}
        if self.rank_state:  # a sharded MC collection's own checkpoint: each rank's names
            tables = {t.name for t in self.tables if t.fqn in self.match.tables}
            names, used = match_own_state(self.rank_state, keys, prefix, tables)
            self.match.keys.update(names)
            self.match.used |= used
        return self.match

    def plan_reads(self, view, dtype):
        """The quantized loads of the matched float tables, planned and validated."""
        jobs = self.match.jobs if self.match is not None else []
        return plan_quant_reads(jobs, view, dtype=dtype)

    def loaded_targets(self) -> List[Target]:
        return [t for t in self.targets if t.fqn in self._loaded_names]

    # -- values ------------------------------------------------------------------------------

    def decide(self, init: Mapping, loaded: Set[int], device: torch.device) -> None:
        """Tables no checkpoint gives get their init, quantized (MissingValueError when it is
        not a distribution metamat draws)."""
        missing, jobs = [], {}
        for t in self.tables:
            if t.fqn in self._loaded_names or self._is_live(t.storage):
                continue  # loaded, or live and not in the checkpoint: left as it is
            dist = match_init(init, (t.fqn, t.name))
            if dist is None:
                fn = getattr(t.config, "init_fn", None)
                dist = default_table_dist(t.source_shape[0]) if fn is None \
                    else dist_from_init_fn(fn)
            if not isinstance(dist, Dist):
                missing.append(t.fqn)
                continue
            key = (t.fqn, t.row0, t.rows)
            if key not in jobs:
                jobs[key] = QuantJob(t.fqn, t.name, t.source_shape, t.row0, t.rows, [], dist)
            jobs[key].outs.append(QuantOut(t.col0, t.cols, t.kind, storage_key(t.storage),
                                           t.offset, t.stride, t.sb_last))
        if missing:
            raise MissingValueError(
                f"{len(missing)} quantized table(s) have no value: not in the checkpoint, and "
                "their init is not a distribution metamat draws (pass init={table: "
                f"metamat.Uniform(...)}}): {', '.join(sorted(set(missing))[:20])}",
                names=sorted(set(missing)))
        self.init_jobs = list(jobs.values())
        # live storages the checkpoint does not touch: no shadow, nothing copied
        touched = {o.storage for j in (self.match.jobs if self.match else []) for o in j.outs}
        touched |= {storage_key(tg.tensor) for tg in (self.match.load if self.match else [])}
        self.touched = touched & set(self.real)
        self.storages = [g for g in self.storages
                         if g.key not in self.real or g.key in self.touched]
        if self.cuda:  # what will be allocated: no shadow of a live table left untouched
            check_device_memory(self.storages, [(t.owner or "<root>", self.relaid[id(t.module)])
                                                for t in self.tbes if id(t.module) in self.caches],
                                device, self._emulated)

    def bind(self, alloc: Allocation, device: Optional[torch.device] = None) -> None:
        """Point the jobs at the new storages; twins of every meta view of them."""
        for t in self.graph.meta_tensors():
            if storage_key(t) in self.keys or storage_key(t) in self.mc_keys:
                alloc.twin(t)
        jobs = self.init_jobs + (self.match.jobs if self.match is not None else [])
        for job in jobs:
            for o in job.outs:
                o.base = self._full(alloc, o.storage)  # unified memory: its host alias
                # quantized on the host, copied to the device; unified memory is host memory:
                # written in place, no copy (where the host has a view of it)
                o.device_memory = self.cuda and (o.storage not in self.unified
                                                 or o.base.device.type == "cuda")
        for tg in self.targets:  # (the report's: a live table not loaded is unchanged)
            if self._is_live(tg.tensor):
                tg.tensor = self.real[storage_key(tg.tensor)]
            elif tg.tensor.is_meta:
                tg.tensor = alloc.view(tg.tensor)
        if self.inplace and self.match is not None:  # the plain reads, into the live bytes
            for tg in self.match.load:
                if self._is_live(tg.tensor):
                    tg.tensor = self._live_view(tg.tensor)

    def _live_view(self, x: torch.Tensor) -> torch.Tensor:
        """The live storage viewed as meta stand-in view ``x`` views the stand-in."""
        real = self.real[storage_key(x)]
        return torch.empty((0,), dtype=x.dtype, device=real.device).set_(
            real.untyped_storage(), x.storage_offset(), x.shape, x.stride())

    def _full(self, alloc: Allocation, key: int) -> torch.Tensor:
        """Storage ``key`` as uint8 bytes: the live one in place, else the allocated one (as
        the host writes them: unified memory through its host alias)."""
        if self.inplace and key in self.real:
            return self._host(self.real[key]).view(-1)
        return alloc.full(key)

    @staticmethod
    def _host(real: torch.Tensor) -> torch.Tensor:
        """A live storage as the host writes it: its host alias in unified memory."""
        alias = host_alias(real)
        return real if alias is None else alias

    def written_in_place(self) -> List[str]:
        if not self.inplace or self.match is None:
            return []
        return sorted({j.fqn for j in self.match.jobs
                       if any(o.storage in self.real for o in j.outs)})

    def fill(self, alloc: Allocation, seed: int, loaded: Set[int]) -> int:
        """Zero the storages (unless born zero), draw and quantize the tables no checkpoint
        gives. Returns bytes written."""
        from ...load.ops import default_io_threads
        from .tables import fill_targets

        self.loaded = loaded
        written = fill_support([g for g in self.storages if g.key not in self.real
                                and g.key not in self.mc_keys], [], alloc)
        written += self._fill_caches(alloc)
        written += fill_targets([tg for _, _, tg in self.rank_state if id(tg) not in loaded
                                 and alloc.key_of(tg.tensor) is not None], seed)
        for key in self._shadowed():  # a shadow starts as the live bytes
            alloc.full(key).copy_(self._host(self.real[key]).view(-1))
        threads = default_io_threads()
        sink = DeviceSink(on_device=quant_on() == "device")
        for job in self.init_jobs:
            per = rows_per_piece(job.cols)
            scratch = torch.empty((min(per, job.rows), job.cols), dtype=torch.float32)
            for r in range(0, job.rows, per):
                n = min(per, job.rows - r)
                piece = Target(job.fqn, job.key, job.global_shape, (job.row0 + r, 0),
                               (n, job.cols), torch.float32, job.dist, scratch[:n])
                fill_targets([piece], seed)
                quantize_into(scratch[:n], job, r, threads=threads, sink=sink)
            written += job.nbytes
        sink.finish()
        if self.match is not None:
            written += sum(j.nbytes for j in self.match.jobs)
        return written

    def _fill_caches(self, alloc: Allocation) -> int:
        """The cache buffers of caching TBEs as fbgemm starts them (every slot empty: -1;
        the maps of the cached rows); the rest stay zero. Returns bytes written."""
        n = 0
        with torch.no_grad():
            for tbe_id, bufs in self.caches.items():
                maps = cache_values(self.relaid[tbe_id])
                for name, meta in bufs.items():
                    x = alloc.view(meta)
                    if name in maps:
                        x.copy_(maps[name])
                    elif CACHE_FILL[name]:
                        x.fill_(CACHE_FILL[name])
                    else:
                        continue
                    n += x.numel() * x.element_size()
        return n

    def after_load(self) -> None:
        """Each rank's loaded MC state checked as TorchRec's load hook will check it, before
        anything is swapped in."""
        check_loaded(self.rank_state, self.loaded)

    # -- register ----------------------------------------------------------------------------

    def register(self, alloc: Allocation, loaded: bool = False) -> int:
        """Swap the twins in everywhere; lay every TBE out for the CPU (fbgemm's own host
        layout: buffers, offsets, placements, specs); meta devices become the CPU."""
        twins = alloc.twins()
        # its own twins (bind's); the modules adapter swaps its own (quantized MC state)
        own = {id(t) for t in self.graph.meta_tensors()
               if storage_key(t) in self.keys or storage_key(t) in self.mc_keys}
        n = 0
        for old_id, new in twins.items():
            if old_id not in own:
                continue
            for slot in self.graph.slots.get(old_id, []):
                slot.set(new)
                n += 1
        # (no GPU work is in flight: materialize synchronized after the reads, and does again
        # after the register stage)
        dev = alloc.device
        for t in self.tbes:
            if self._is_live(t.storage):  # the shadow's bytes into the live storage
                key = storage_key(t.storage)
                if key in self._shadowed():
                    with torch.no_grad():  # unified memory: host to host
                        self._host(self.real[key]).copy_(alloc.full(key))
                if key in self.touched and t.module.lxu_cache_weights.numel():
                    empty_cache(t.module)  # cached rows are the old ones: all evicted
                continue
            tbe, twin = t.module, self.twins[id(t.module)]
            weights = twins.get(id(t.storage))
            if weights is None:
                weights = alloc.view(t.storage)
            if self.cuda:
                cache = {n: alloc.view(b) for n, b in self.caches.get(id(tbe), {}).items()}
                device_layout(tbe, twin, weights, dev, self.relaid.get(id(tbe)), cache)
            else:
                host_layout(tbe, twin, weights)
        untouched = {t.owner for t in self.tbes
                     if self._is_live(t.storage) and storage_key(t.storage) not in self.touched}
        for name, m in self.modules:
            if name not in untouched:  # meta copies the constructor kept, or stale old rows
                drop_quantized_weights(m)
        for holder, key in self.graph.device_refs:
            d = holder.__dict__
            v = d.get(key)
            if isinstance(v, torch.device) and v.type == "meta":
                d[key] = dev
            elif isinstance(v, str) and v == "meta":
                d[key] = str(dev)
        if self.ranks:  # devices, placeholders, loggers; TorchRec's load hook after a load
            finish_mc_modules(r.module for r in self.ranks)
            if loaded:
                validate_loaded(self.rank_state, self.loaded)
        return n
