"""Model adapters: each finds the tensors of one kind of module and registers real ones back.

* :class:`~metamat.models.torchrec.part.TorchRecPart`: TorchRec sharded modules (tables,
  fused-optimizer state, fbgemm/TorchRec metadata);
* :class:`ModulesPart`: every other module, with plain or DTensor (TP, FSDP2) tensors.

Every adapter is an :class:`~.adapter.Adapter` (``targets``, ``storages``, ``warnings``, and the
hooks of each stage: match, decide, bind, fill, register). The orchestration is
:func:`metamat.materialize`; whatever is the same for every kind lives there.
"""
from __future__ import annotations

import sys
from typing import Dict, List, Mapping, Sequence, Set, Tuple

import torch
from torch import nn

from ..allocate import Allocation
from ..errors import UnsupportedError
from ..plan import Target
from ..support import fill_support
from .adapter import Adapter
from .aliases import find_aliases
from .module_register import bind, register
from .module_values import Decision, decide, fill_values
from .modules import (Entry, claimed_storages, find_entries, has_dtensor, storages_of,
                      targets_of)

__all__ = ["Adapter", "ModulesPart", "find_parts", "has_dtensor"]


class ModulesPart(Adapter):
    """The ordinary modules of a model (outside ``skip``), found."""

    kind = "modules"

    def __init__(self, root: nn.Module, *, skip: Sequence[str], loading: bool,
                 aliases: bool, keep: Sequence[str] = (),
                 renames: Sequence[Tuple[str, str]] = ()) -> None:
        self.root = root
        self.renames = renames  # (prefix, another name's prefix): a checkpoint may use either
        self.entries: List[Entry] = find_entries(root, skip, keep)
        self.targets: List[Target] = targets_of(self.entries, loading)
        if loading and "torchrec" in sys.modules:  # MC state is checked after the read
            from .torchrec.managed_collision import is_hash_zch, is_mch

            for e in self.entries:
                if is_mch(e.owner.module) or is_hash_zch(e.owner.module):
                    for t in e.targets:
                        t.shadowed = True
        self.storages = storages_of(self.entries)
        self.warnings: List[str] = []
        self.decisions: Dict[int, Decision] = {}
        self.resets: list = []
        # Other references to the meta tensors (plain attributes, views kept by a module):
        # found on the object graph and swapped too. With TorchRec present its adapter walks
        # the whole graph already.
        self.aliases = find_aliases(root, self.entries, self.warnings) if aliases else None

    def claimed(self) -> Set[int]:
        """Keys of the meta storages this part owns."""
        return claimed_storages(self.entries)

    def names(self) -> Dict[str, List[str]]:
        """Every persistent tensor's canonical name -> all its names (tied aliases, then the
        names ``renames`` gives them)."""
        out = {e.fqn: e.names for e in self.entries if e.persistent}
        if self.renames:
            for fqn, names in out.items():
                extra = [alt + n[len(p):] for n in names for p, alt in self.renames
                         if n.startswith(p)]
                if extra:
                    out[fqn] = list(names) + extra
        return out

    def nd_shapes(self) -> Dict[str, tuple]:
        """fqn -> global shape of the tensors above 2-D (planned as 2-D views)."""
        return {e.fqn: e.global_shape for e in self.entries if len(e.global_shape) > 2}

    def decide(self, init: Mapping, loaded: Set[int], device: torch.device) -> None:
        """Decide every entry's value source; raises MissingValueError before allocation."""
        loaded_entries = {id(e) for e in self.entries if e.targets
                          and id(e.targets[0]) in loaded}
        # every rule gives the same values on any plan: module resets run on tensors of the
        # global shape (module_values), so sharded ones need no warning
        self.decisions, self.resets = decide(self.entries, init, loaded_entries, self.root,
                                             device, warn=self.warnings)

    def bind(self, alloc: Allocation, device: torch.device) -> None:
        bind(self.entries, self.decisions, alloc, device)
        if self.aliases is not None:
            for t in self.aliases.tensors:
                alloc.twin(t)

    def fill(self, alloc: Allocation, seed: int, loaded: Set[int]) -> int:
        return (fill_support(self.storages, self.targets, alloc)
                + fill_values(self.entries, self.decisions, self.resets, seed))

    def _loaded_mc(self, buffer: str, kind: str = "mch") -> list:
        """(entry, its module) for TorchRec MC buffers ``buffer`` the checkpoint gives, of MCH
        modules (``kind`` "mch") or HashZch ones ("hash_zch")."""

        if "torchrec" not in sys.modules:
            return []
        from .torchrec.managed_collision import is_hash_zch, is_mch

        is_kind = is_mch if kind == "mch" else is_hash_zch
        return [(e, e.owner.module) for e in self.entries
                if e.owner.name == buffer and is_kind(e.owner.module)
                and self.decisions.get(id(e)) is not None
                and self.decisions[id(e)].kind == "checkpoint"]

    def after_load(self) -> None:
        """Unsharded managed-collision modules: the loaded state checked as for sharded ones
        (TorchRec's load-hook condition on the row boundaries of MCH, the bucket count of
        HashZch) before anything is swapped in."""
        from .torchrec.managed_collision import check_buckets, check_segments

        def table(e):
            return e.fqn.rsplit(".", 2)[-2] if e.fqn.count(".") >= 2 else e.fqn

        for e, m in self._loaded_mc("_output_segments_tensor"):
            check_segments(e.fqn, table(e), m, e.targets[0].tensor)
        for e, m in self._loaded_mc("_hash_zch_bucket", "hash_zch"):
            check_buckets(e.fqn, table(e), m, e.targets[0].tensor)

    def register(self, alloc: Allocation, loaded: bool = False) -> int:
        n = register(self.entries, alloc)
        if self.aliases is not None:
            self.aliases.swap(alloc)
        if loaded:  # TorchRec's load hook on loaded MCH modules: their slots sorted again
            with torch.no_grad():
                for _, m in self._loaded_mc("_mch_sorted_raw_ids"):
                    m.validate_state()
        if "torchrec" in sys.modules:  # MC modules built on meta: devices, logger
            from .torchrec.managed_collision import finish_mc_modules

            finish_mc_modules({id(e.owner.module): e.owner.module for e in self.entries}.values())
        return n

    def value_sources(self) -> Dict[str, str]:
        """Buffer fqn -> where its value came from (for the Report)."""
        return {e.fqn: self.decisions[id(e)].kind for e in self.entries
                if not e.is_param and id(e) in self.decisions}

    def sources(self) -> Dict[str, str]:
        """Every tensor's fqn -> where its value came from and by which rule (the Report's
        ``sources``); the same on every rank (the entries are global)."""
        return {e.fqn: self.decisions[id(e)].source for e in self.entries
                if id(e) in self.decisions}

    def shapes(self) -> Dict[str, tuple]:
        """Every persistent tensor's canonical name -> its global shape."""
        return {e.fqn: tuple(e.global_shape) for e in self.entries if e.persistent}

    def dropped_keys(self) -> List[str]:
        """TorchRec's inference HashZch modules drop a checkpoint's eviction metadata."""
        if "torchrec" not in sys.modules:
            return []
        from .torchrec.managed_collision import inference_dropped

        owners = {id(e.owner.module): (e.owner.fqn.rpartition(".")[0], e.owner.module)
                  for e in self.entries}
        return inference_dropped(owners.values())

    def merge_rules(self) -> list:
        """The model's own checkpoint conversion rules (transformers' mapping), if any."""
        from .hf.convert import model_conversions

        return model_conversions(self.root)


def find_parts(model: nn.Module, device: torch.device, init: Mapping, *, loading: bool,
               emulated: bool = False, inplace: bool = False) -> List[Adapter]:
    """The adapters for ``model``: TorchRec's sharded modules (if any) and ordinary modules.
    ``emulated``: ``device`` is the CPU standing in for a CUDA device (:mod:`metamat.emulation`).
    ``inplace``: a checkpoint loads into live quantized tables in place (no shadow).

    Raises:
        UnsupportedError: (and subclasses) anything an adapter cannot handle, before
            anything is allocated.
    """
    from .torchrec.part import TorchRecPart
    from .torchrec.sharded import laid_out_for, root_of, sharded_modules

    sharded = sharded_modules(root_of(model))  # [] unless torchrec was imported
    undo = None
    if sharded and (device.type == "cuda" or emulated) and laid_out_for(model, sharded) is None:
        # fbgemm's CPU layout, all on meta: built again for the GPU (undone on failure)
        from .torchrec.relayout import relayout_for_cuda

        undo = relayout_for_cuda(model, sharded, device)
        sharded = sharded_modules(root_of(model))
    try:
        from .torchrec.quant import has_meta_tables, quant_modules, refreshable

        # TorchRec's quantized inference collections on meta; real ones too when loading, if
        # metamat can refresh them (else they load as plain tensors)
        quant = [(n, m) for n, m in quant_modules(root_of(model), live=loading and not sharded)
                 if has_meta_tables(m) or refreshable(n, m)]
        if quant and sharded:
            raise UnsupportedError("a model holding both TorchRec training collections and "
                                   "quantized inference ones on meta is not supported")
        from .torchrec.managed_collision import mc_collections

        # managed-collision state is the TorchRec adapter's (row-wise sharded buffers)
        mcs = mc_collections(root_of(model)) if sharded else []
        skip = [n for n, _ in sharded] + [n for n, _ in quant] + [n for n, _ in mcs]
        from .torchrec.quant import ordinary_children, training_names

        # the MC collections of quantized MC collections, the feature processors of quantized
        # feature-processed ones: ordinary (unsharded) modules
        keep = [n for n, _ in ordinary_children(quant)]
        modules = ModulesPart(root_of(model) if skip else model, skip=skip, loading=loading,
                              aliases=not sharded, keep=keep, renames=training_names(quant))
        parts: List[Adapter] = []
        if sharded:
            parts.append(TorchRecPart(model, device, init, claimed=modules.claimed(),
                                      loading=loading, sharded=sharded, emulated=emulated))
            parts[0].undo = undo
        if quant:
            from .torchrec.quant_part import QuantPart

            parts.append(QuantPart(model, device, init, modules=quant, loading=loading,
                                   emulated=emulated, inplace=inplace,
                                   claimed=modules.claimed()))
        parts.append(modules)
    except BaseException:
        if undo is not None:
            undo()
        raise
    return parts
