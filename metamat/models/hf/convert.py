"""A transformers model's own checkpoint conversion rules, as metamat merges and renames.

transformers 5 converts checkpoint keys at load time (``conversion_mapping.py``): renames such
as Mixtral's ``.block_sparse_moe.`` -> ``.mlp.``, and converters that stack one tensor per
expert and concatenate gate and up projections into the fused ``gate_up_proj``.
:class:`ModelConversion` applies those rules exactly as transformers' loader names keys (all
renamings, then at most one converter: ``apply_renamings``/``apply_converters``) and turns
what they produce into :class:`~metamat.checkpoint.merge.Assembly` objects when the
converter's operations are stacking and concatenation (``MergeModulelist``, ``Concatenate``);
other operations (transposes, splits, dequantization) are listed in :attr:`notes` and the
tensor stays missing, so the error names it rather than loading something else.
"""
from __future__ import annotations

import re
from typing import Dict, List, Mapping, Optional, Sequence, Set, Tuple, Union

from torch import nn

from ...checkpoint.merge import Assembly
from . import upstream

__all__ = ["ModelConversion", "model_conversions"]


def _index_regex(pattern: str) -> Optional["re.Pattern[str]"]:
    if "*" not in pattern:
        return None
    return re.compile(re.escape(pattern).replace(r"\*", r"(\d+)"))


class ModelConversion:
    """The conversion rules of the ``PreTrainedModel`` at ``path`` inside the model (a rule
    object for :func:`metamat.checkpoint.merge.resolve_merges`)."""

    def __init__(self, path: str, model: nn.Module) -> None:
        self.path = f"{path}." if path else ""
        self.model = model
        self.name = type(model).__name__
        self.notes: Dict[str, str] = {}
        self._mapping = None

    def _rules(self):
        if self._mapping is None:
            self._mapping = upstream.conversion_mapping(self.model) or ([], [], {})
        return self._mapping

    def _ops(self, conv) -> Union[str, Tuple[Optional[int], Optional[int]]]:
        """(stack dim, cat dim) of a converter, or why it cannot be expressed."""
        _r, _c, h = self._rules()
        ops = list(conv.operations)
        kinds = [type(op).__name__ for op in ops]
        merge_t, cat_t = h["MergeModulelist"], h["Concatenate"]
        if len(ops) == 1 and type(ops[0]) is merge_t and len(conv.source_patterns) == 1:
            return int(ops[0].dim), None
        if len(ops) == 2 and type(ops[0]) is merge_t and type(ops[1]) is cat_t:
            return int(ops[0].dim), int(ops[1].dim)
        if len(ops) == 1 and type(ops[0]) is cat_t and not any("*" in p for p in
                                                                conv.source_patterns):
            return None, int(ops[0].dim)
        return f"transformers converts it with {' + '.join(kinds)}, which metamat does not read"

    def match(self, missing: Sequence[str], keys: Mapping[str, object], unused: Set[str],
              prefix: str) -> Dict[str, Union[str, Assembly]]:
        renamings, converters, h = self._rules()
        if not renamings and not converters:
            return {}
        want = {n for n in missing if n.startswith(self.path)}
        if not want:
            return {}
        by_pattern = {p: c for c in converters for p in c.source_patterns}
        out: Dict[str, Union[str, Assembly]] = {}
        groups: Dict[str, Dict[str, List[Tuple[int, str]]]] = {}
        lead = prefix + self.path
        for k in sorted(unused):
            if not k.startswith(lead):
                continue
            rel = k[len(lead):]
            renamed = h["apply_renamings"](rel, renamings)
            conv_key, pat = h["apply_converters"](renamed, converters)
            name = self.path + conv_key
            if name not in want:
                continue
            if pat is None:
                if conv_key != rel:
                    out.setdefault(name, k)
                continue
            rx = _index_regex(pat)
            idx = 0
            if rx is not None:
                m = rx.search(renamed)
                if m is None:
                    self.notes[name] = f"cannot tell which stacked index {k} is ({pat!r})"
                    continue
                idx = int(m.group(1))
            groups.setdefault(name, {}).setdefault(pat, []).append((idx, k))
        for name, by_pat in groups.items():
            conv = by_pattern[next(iter(by_pat))]
            how = self._ops(conv)
            if isinstance(how, str):
                self.notes[name] = how
                continue
            stack, cat = how
            segs: List[List[str]] = []
            for pat in conv.source_patterns:
                got = sorted(by_pat.get(pat, ()))
                if [i for i, _ in got] != list(range(len(got))) or not got:
                    self.notes[name] = (f"the checkpoint's {pat!r} tensors are not numbered "
                                        f"0..n-1 (found {[i for i, _ in got][:10]})")
                    segs = []
                    break
                segs.append([k for _, k in got])
            if segs:
                out[name] = Assembly(name, segs, stack, cat,
                                     rule=f"{self.name}'s transformers conversion mapping")
        return out


def model_conversions(root: nn.Module) -> List[ModelConversion]:
    """One rule object per outermost ``PreTrainedModel`` of ``root`` ([] without any)."""
    return [ModelConversion(name, m) for name, m in upstream.pretrained_roots(root)]
