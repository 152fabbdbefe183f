"""The adapter interface: what :func:`metamat.materialize` asks of each kind of module.

An adapter finds the tensors of one kind of module (its constructor), says what they need, and
registers real ones back. ``materialize`` calls the stages in this order, on every adapter:

* **find**: the constructor sets ``targets`` (checkpointable blocks), ``storages`` (meta
  storages to allocate) and ``warnings``;
* **match** (with a checkpoint): :meth:`names`, :meth:`shapes`, :meth:`nd_shapes`,
  :meth:`merge_rules`, :meth:`checkpoint_targets`, :meth:`match_checkpoint`,
  :meth:`match_optimizer`, :meth:`plan_reads`;
* **decide** every value source (:meth:`decide`), before anything is allocated;
* **bind** the allocation (:meth:`bind`), then :meth:`before_read`, :meth:`fill` (what no
  checkpoint provides), the reads, :meth:`after_load`;
* **register** the real tensors (:meth:`register`), after every rank agreed;
* **report**: :meth:`value_sources`, :meth:`sources`; on failure, :attr:`undo`.

Adapters subclass :class:`Adapter`: the four abstract methods are required, every other hook
has a default that does nothing.
"""
from __future__ import annotations

from abc import abstractmethod
from typing import TYPE_CHECKING, Any, Callable, Dict, List, Mapping, Optional, Protocol, Set

import torch

from ..plan import StorageGroup, Target

if TYPE_CHECKING:
    from ..allocate import Allocation

__all__ = ["Adapter"]


class Adapter(Protocol):
    """One kind of module of a model, found (see the module docstring for the stages).

    Attributes:
        kind: ``"modules"``, ``"torchrec"``, ``"torchrec_quant"``.
        targets: the checkpointable blocks found.
        storages: the meta storages to allocate.
        warnings: what the Report should say.
        undo: puts back what finding changed in the model (TorchRec tables laid out again for
            a GPU), called when the call fails before registering; None when nothing changed.
    """

    kind: str
    targets: List[Target]
    storages: List[StorageGroup]
    warnings: List[str]
    undo: Optional[Callable[[], None]] = None

    # -- match (with a checkpoint) -----------------------------------------------------------
    @abstractmethod
    def names(self) -> Dict[str, List[str]]:
        """Every persistent tensor's canonical name -> all its names (global: with or without
        a block on this rank)."""

    def shapes(self) -> Dict[str, tuple]:
        """Canonical name -> global shape, for merge rules (tensors assembled from several)."""
        return {}

    def nd_shapes(self) -> Dict[str, tuple]:
        """fqn -> global shape of the tensors above 2-D (planned as 2-D views)."""
        return {}

    def merge_rules(self) -> list:
        """The model's own checkpoint conversion rules (``merge="auto"``)."""
        return []

    def peers(self, devices: Dict[int, str]) -> None:
        """Every rank's device (rank -> ``"cuda:N"``), known once the ranks agreed the fill
        succeeded, before register (TorchRec's shard placements name other ranks')."""

    def dropped_keys(self) -> List[str]:
        """Model names of checkpoint tensors the model's own load hooks drop (so a checkpoint
        holding them loads, as with ``load_state_dict``)."""
        return []

    def checkpoint_targets(self) -> List[Target]:
        """The targets matched to checkpoint tensors by name (not those the adapter matches
        itself in :meth:`match_checkpoint`, nor fused-optimizer state)."""
        return [t for t in self.targets if not t.optimizer and t.persistent]

    def match_checkpoint(self, keys: Mapping[str, object], found: Mapping[str, str], *,
                         ckpt_path: str) -> Optional[Any]:
        """The adapter's own matching (quantized tables): an object with ``load`` (targets to
        read), ``keys`` (fqn -> checkpoint key) and ``used`` (checkpoint keys taken), or None.
        Its loaded targets are then :meth:`loaded_targets`."""
        return None

    def loaded_targets(self) -> List[Target]:
        """The targets :meth:`match_checkpoint` found a checkpoint value for."""
        return []

    def match_optimizer(self, keys: Mapping[str, object], *, strict: bool,
                        ckpt_path: str, rename: Any = None) -> Optional[Any]:
        """Fused-optimizer state matched to the checkpoint (an ``OptimMatch``), or None;
        ``rename`` is :func:`metamat.materialize`'s (the weights' renames apply to their
        state)."""
        return None

    def plan_reads(self, view: Any, dtype: Any) -> Optional[Any]:
        """Reads the adapter runs itself (rows quantized while read), planned and validated;
        None when it has none."""
        return None

    # -- decide, bind, fill --------------------------------------------------------------------
    def decide(self, init: Mapping, loaded: Set[int], device: torch.device) -> None:
        """Decide the value source of everything not ``loaded`` (ids of targets); raises
        :class:`~metamat.errors.MissingValueError` before allocation."""

    @abstractmethod
    def bind(self, alloc: "Allocation", device: Optional[torch.device] = None) -> None:
        """Point the targets at the new storages (real twins of the meta tensors)."""

    def before_read(self) -> None:
        """After binding, before the checkpoint's bytes arrive (write-back caches flushed)."""

    @abstractmethod
    def fill(self, alloc: "Allocation", seed: int, loaded: Set[int]) -> int:
        """Write every byte no checkpoint provides. Returns the bytes written."""

    def after_load(self) -> None:
        """After the reads (averaged optimizer state stored)."""

    def transient_keys(self) -> Set[int]:
        """Keys of the allocation's storages that are shadows of live tensors (copied in,
        then freed): the Report's ``bytes_transient``, not ``bytes_allocated``."""
        return set()

    def written_in_place(self) -> List[str]:
        """Names of the live tensors this adapter's own writes (not the read plan's targets)
        go into in place (``inplace=True``): what a failed load may have changed."""
        return []

    # -- register, report ----------------------------------------------------------------------
    @abstractmethod
    def register(self, alloc: "Allocation", loaded: bool = False) -> int:
        """Swap the real tensors in. Returns the number of tensors registered."""

    def value_sources(self) -> Dict[str, str]:
        """Buffer fqn -> where its value came from (the Report's ``buffers``)."""
        return {}

    def sources(self) -> Dict[str, str]:
        """Tensor fqn -> where its value came from and by which rule (the Report's
        ``sources``)."""
        return {}
