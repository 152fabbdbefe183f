"""The one door to Hugging Face transformers' internals (checked on transformers 5.24).

Every name metamat uses beyond transformers' public model classes is looked up here, once:
``PreTrainedModel``, a model's ``_init_weights`` and ``all_tied_weights_keys``, the init
functions of ``transformers.initialization`` (which every transformers 5 ``_init_weights``
calls, and which ``guard_torch_init_functions`` installs over ``torch.nn.init`` in the modules
listed in ``TORCH_MODULES_TO_PATCH``), and the checkpoint conversion mapping
(``conversion_mapping.get_model_conversion_mapping``, ``core_model_loading``'s
``WeightRenaming``/``WeightConverter``/``MergeModulelist``/``Concatenate`` and its
``apply_renamings``/``apply_converters``). transformers is never imported from here: a model
holding its modules means the user imported it already (``sys.modules``).

A name that is missing where it is needed raises :class:`~metamat.errors.UnsupportedError`
naming it, before anything is allocated; optional features (conversion rules on transformers
4.x) are simply absent.
"""
from __future__ import annotations

import sys
from typing import Any, Callable, Dict, List, Optional, Sequence, Set, Tuple

from torch import nn

from ...errors import UnsupportedError

__all__ = ["CHECKED", "pretrained_class", "is_pretrained", "pretrained_roots", "init_weights_of",
           "tied_targets", "init_functions", "torch_modules_to_patch", "conversion_mapping"]

CHECKED = "5.24"

#: transformers.initialization's functions that write a tensor (torch.nn.init's names, and
#: copy_): replaced by recorders while a model's init is traced.
INIT_NAMES = ("uniform_", "normal_", "constant_", "ones_", "zeros_", "eye_", "dirac_",
              "xavier_uniform_", "xavier_normal_", "kaiming_uniform_", "kaiming_normal_",
              "trunc_normal_", "orthogonal_", "sparse_", "copy_")


def pretrained_class() -> Optional[type]:
    """``transformers.PreTrainedModel`` if transformers is imported, else None."""
    mu = sys.modules.get("transformers.modeling_utils")
    return getattr(mu, "PreTrainedModel", None) if mu is not None else None


def is_pretrained(m: nn.Module) -> bool:
    cls = pretrained_class()
    return cls is not None and isinstance(m, cls)


def pretrained_roots(root: nn.Module) -> List[Tuple[str, nn.Module]]:
    """The outermost ``PreTrainedModel`` modules of ``root`` (``root`` itself if it is one),
    as (name, module)."""
    cls = pretrained_class()
    if cls is None:
        return []
    out: List[Tuple[str, nn.Module]] = []
    stack = [("", root)]
    while stack:
        name, m = stack.pop()
        if isinstance(m, cls):
            out.append((name, m))
            continue
        stack.extend(reversed([(f"{name}.{k}" if name else k, c)
                               for k, c in m._modules.items() if c is not None]))
    return out


def init_weights_of(m: nn.Module) -> Optional[Callable[[nn.Module], Any]]:
    """``m._init_weights`` (bound), if ``m`` is a ``PreTrainedModel`` that has one."""
    if not is_pretrained(m):
        return None
    fn = getattr(m, "_init_weights", None)
    return fn if callable(fn) else None


def tied_targets(m: nn.Module) -> Set[str]:
    """Names (relative to ``m``) that ``m`` ties to another tensor after its init
    (``all_tied_weights_keys``' keys: the tie's source keeps its value)."""
    keys = getattr(m, "all_tied_weights_keys", None)
    return set(keys) if isinstance(keys, dict) else set()


def init_functions():
    """(the ``transformers.initialization`` module, the names to record) or (None, ())."""
    mod = sys.modules.get("transformers.initialization")
    if mod is None:
        return None, ()
    return mod, tuple(n for n in INIT_NAMES if callable(getattr(mod, n, None)))


def torch_modules_to_patch() -> Sequence[str]:
    """The torch modules whose bound ``torch.nn.init`` names transformers guards."""
    mod = sys.modules.get("transformers.initialization")
    names = getattr(mod, "TORCH_MODULES_TO_PATCH", None) if mod is not None else None
    return tuple(names) if names else ("torch.nn.init",)


def conversion_mapping(model: nn.Module):
    """(renamings, converters, helpers) of ``model``'s checkpoint conversion mapping, as
    transformers' loader applies them; None when transformers has none (4.x).

    ``helpers`` holds ``apply_renamings``, ``apply_converters``, ``MergeModulelist`` and
    ``Concatenate``.

    Raises:
        UnsupportedError: the mapping exists but a name metamat needs is gone.
    """
    try:
        from transformers import conversion_mapping as cm
        from transformers import core_model_loading as cml
    except ImportError:
        return None
    need = ("WeightRenaming", "WeightConverter", "MergeModulelist", "Concatenate",
            "apply_renamings", "apply_converters")
    missing = [n for n in need if not hasattr(cml, n)]
    if missing or not hasattr(cm, "get_model_conversion_mapping"):
        raise UnsupportedError(
            "transformers' checkpoint conversion mapping changed (checked on transformers "
            f"{CHECKED}; missing: {', '.join(missing) or 'get_model_conversion_mapping'}); "
            "pass merge=None and give the mappings with merge=[metamat.Merge(...)]")
    mapping = cm.get_model_conversion_mapping(model)
    renamings = [t for t in mapping if isinstance(t, cml.WeightRenaming)]
    converters = [t for t in mapping if isinstance(t, cml.WeightConverter)]
    helpers: Dict[str, Any] = {n: getattr(cml, n) for n in need}
    return renamings, converters, helpers
