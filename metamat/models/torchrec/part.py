"""The TorchRec adapter: tables, optimizer state and TorchRec/fbgemm metadata of sharded modules.

It only *finds* (:mod:`.walk`) and *registers* (:mod:`.register`); the orchestration
(:func:`metamat.materialize`) plans, validates, allocates, fills and agrees for it.
"""
from __future__ import annotations

from typing import Dict, List, Mapping, Optional, Sequence, Set, Tuple

import torch
from torch import nn

from ...allocate import Allocation
from ...checkpoint.view import Rename, make_rename
from ...plan import Target
from ...support import fill_support
from ..adapter import Adapter
from .optim_keys import (OptimMatch, finish_means, match_optimizer, renamed_state,
                         renamed_weights)
from .register import register
from .tables import fill_targets, needs_write
from .graph import slot_names
from .managed_collision import (check_loaded_segments, finish_mc_modules, inference_dropped,
                                mc_named_modules, validate_loaded)
from .sharded import pec_aliases, root_of
from .walk import build_plan

__all__ = ["TorchRecPart"]


def _copy_tensor_state(graph_meta: Sequence[torch.Tensor], alloc: Allocation) -> None:
    """Copy the python-side state (``__dict__``, slots) of tensor subclasses to their twins,
    mapping tensors to twins (TableBatchedEmbeddingSlice keeps ``_original_tensor``)."""
    twins = alloc.twins()
    for t in graph_meta:
        new = twins[id(t)]
        d = getattr(t, "__dict__", None)
        if d:
            for k, v in d.items():
                if k not in ("_metamat_value", "_metamat_version"):
                    new.__dict__[k] = twins.get(id(v), v)
        for name in slot_names(t):  # per type, cached
            try:
                v = object.__getattribute__(t, name)
            except AttributeError:
                continue
            object.__setattr__(new, name, twins.get(id(v), v))


def aliased(name: str, aliases: Sequence[Tuple[str, str]]) -> List[str]:
    """``name`` and its other names: each (prefix, alternative prefix) it starts with."""
    return [name] + [alt + name[len(p):] for p, alt in aliases if name.startswith(p)]


class TorchRecPart(Adapter):
    """The sharded modules of one model, found and planned on ``device``."""

    kind = "torchrec"

    def __init__(self, model: nn.Module, device: torch.device, init, *, claimed: Set[int],
                 loading: bool, sharded: Optional[list] = None, emulated: bool = False) -> None:
        self.model = model
        self.plan = build_plan(model, device, init, claimed=claimed, loading=loading,
                               sharded=sharded, emulated=emulated)
        self.targets: List[Target] = self.plan.targets
        self.storages = list(self.plan.storages.values())
        self.warnings: List[str] = list(self.plan.warnings)
        self.optim: Optional[OptimMatch] = None
        self.loaded: Set[int] = set()  # ids of the targets a checkpoint provides
        self.undo = None  # set by find_parts when the tables were laid out again (relayout)
        self._pec: Optional[List[Tuple[str, str]]] = None

    def dropped_keys(self) -> List[str]:
        """The eviction metadata of inference HashZch modules: TorchRec's load hook drops a
        training checkpoint's."""
        return inference_dropped(mc_named_modules(self.plan.mcs)) if self.plan.mcs else []

    def _aliases(self) -> List[Tuple[str, str]]:
        if self._pec is None:
            self._pec = pec_aliases(root_of(self.model), self.plan.sharded)
        return self._pec

    def names(self) -> Dict[str, List[str]]:
        """Every checkpointable name of the sharded modules (global: with or without a block
        on this rank) -> its names: its own, then an EmbeddingCollection's with PEC toggled
        (:func:`.sharded.pec_aliases`)."""
        return {n: aliased(n, self._aliases()) for n in self.plan.names}

    def match_optimizer(self, keys: Mapping[str, object], *, strict: bool,
                        ckpt_path: str, rename: Rename = None) -> OptimMatch:
        """Match the fused-optimizer state to the checkpoint (:mod:`.optim_keys`); with
        ``rename``, each table's state is looked for under its renamed weight first
        (:func:`.optim_keys.renamed_state`)."""
        rows = {t.fqn: int(t.global_shape[0]) for t in self.targets
                if not t.optimizer and t.global_shape}
        aliases = self._aliases()
        tables = {a for n in self.plan.names if n.endswith(".weight")
                  for a in aliased(n, aliases)}
        optim = [(f"state.{p}", f"state.{alt}") for p, alt in aliases]
        names = {n: aliased(n, optim) for n in self.plan.optim_names}
        if rename is not None:
            fn = make_rename(rename)
            names = {n: list(dict.fromkeys([r for a in al for r in renamed_state(a, tables, fn)]
                                           + al)) for n, al in names.items()}
            tables |= {r for w in tables for r in renamed_weights(w, fn)}
        self.optim = match_optimizer([t for t in self.targets if t.optimizer], keys, rows,
                                     names=names, tables=tables, strict=strict,
                                     ckpt_path=ckpt_path)
        self.warnings += self.optim.warnings
        return self.optim

    def bind(self, alloc: Allocation, device: Optional[torch.device] = None) -> None:
        """Twins of every meta tensor of the graph; targets point into the new storages."""
        meta = self.plan.graph.meta_tensors()
        for t in meta:
            alloc.twin(t)
        _copy_tensor_state(meta, alloc)
        twins = alloc.twins()
        for tg in self.targets:
            if tg.tensor.is_meta:
                tg.tensor = twins.get(id(tg.tensor)) if id(tg.tensor) in twins \
                    else alloc.view(tg.tensor)
        if self.optim is not None:
            for _dst, parts in self.optim.means:  # scratch blocks to average
                for p in parts:
                    p.tensor = torch.empty(p.local_shape, dtype=p.dtype, device=alloc.device)

    def fill(self, alloc: Allocation, seed: int, loaded: Set[int]) -> int:
        """Write every byte the checkpoint does not provide. Returns bytes written."""
        self.loaded = loaded
        written = fill_support(self.storages, self.targets, alloc)
        # DMP(device=meta) still builds DATA_PARALLEL tables on CPU with torch's RNG: those
        # real targets (plan.refill) get plan-invariant values in place too.
        todo = [tg for tg in self.targets if id(tg) not in loaded
                and (alloc.key_of(tg.tensor) is not None or id(tg) in self.plan.refill)]
        return written + fill_targets(needs_write(todo, alloc), seed, alloc)

    def _live_caches(self) -> list:
        """fbgemm TBEs of a live (already real) model whose LXU cache holds rows."""
        return [t.emb for t in self.plan.cuda_tbes
                if not t.emb.lxu_cache_weights.is_meta and t.emb.lxu_cache_weights.numel()]

    def before_read(self) -> None:
        """Write the LXU caches of a live model's UVM-caching tables back to their rows before
        the checkpoint's bytes arrive: fbgemm's cache is write-back, so rows trained in the
        cache alone would be lost by the reset after the load (:meth:`register`). The model's
        values do not change (cache and rows agree after it)."""
        with torch.no_grad():
            for emb in self._live_caches():
                emb.flush()

    def _loaded_mc(self) -> Dict[str, torch.Tensor]:
        """fqn -> loaded block of the managed-collision state."""
        mc = {id(t) for t in self.plan.mc_targets}
        return {t.fqn: t.tensor for t in self.targets if id(t) in mc and id(t) in self.loaded}

    def after_load(self) -> None:
        """Store averaged row-wise optimizer state (after the read); check loaded
        managed-collision state as TorchRec's load hook will (before anything is swapped in)."""
        if self.optim is not None:
            finish_means(self.optim.means)
        if self.plan.mcs:
            check_loaded_segments(self.plan.mcs, self._loaded_mc())

    def peers(self, devices: Dict[int, str]) -> None:
        self.plan.peer_devices = dict(devices)

    def register(self, alloc: Allocation, loaded: bool = False) -> int:
        """Swap every twin in everywhere, fix devices, rebuild DDPs; after a load into a live
        model, empty its LXU caches (the rows they hold are the old values: the next forward
        must fetch the loaded rows, and no flush may write the old ones over them)."""
        register(self.model, self.plan, alloc)
        if self.plan.mcs:
            finish_mc_modules(m for _, m in mc_named_modules(self.plan.mcs))
        if loaded:
            for emb in self._live_caches():
                reset_cache(emb)
            if self.plan.mcs:
                validate_loaded(self.plan.mcs, set(self._loaded_mc()))
        return len(self.plan.graph.meta_tensors())


def reset_cache(emb: nn.Module) -> None:
    """Empty fbgemm TBE ``emb``'s LXU cache without writing it back, as fbgemm's constructor
    leaves it (``reset_cache_states`` and the prefetch state of ``_apply_cache_state``: the
    attributes declared in ``upstream.TBE_CACHE_STATE``, checked when the model was planned)."""
    with torch.no_grad():
        emb.reset_cache_states()
    emb.timesteps_prefetched = []
    emb.lxu_cache_locations_list = []
    emb.lxu_cache_locations = emb.lxu_cache_locations_empty
