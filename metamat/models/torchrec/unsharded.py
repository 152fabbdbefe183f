"""TorchRec's table collections that are not sharded (an EmbeddingBagCollection or
EmbeddingCollection used as a plain module): their tables' initial values.

The modules adapter gives an unsharded table what TorchRec's constructor gives it: the table
config's ``init_fn`` (a known distribution fused, else the callable), or TorchRec's default
U(+-sqrt(1/num_embeddings)), keyed by the table's name, so the values equal those of the same
table sharded on any plan. (The table's ``nn.EmbeddingBag`` / ``nn.Embedding`` would give
N(0, 1): not TorchRec's values.)
"""
from __future__ import annotations

from typing import Any, Dict, Tuple

from torch import nn

__all__ = ["unsharded_tables"]


def unsharded_tables(root: nn.Module) -> Dict[int, Tuple[str, Any]]:
    """id(the nn.EmbeddingBag / nn.Embedding of a table of an unsharded TorchRec collection
    under ``root``) -> (table name, its config)."""
    from torchrec.modules.embedding_modules import EmbeddingBagCollection, EmbeddingCollection

    out: Dict[int, Tuple[str, Any]] = {}
    for m in root.modules():
        if isinstance(m, EmbeddingBagCollection):
            tables, configs = m.embedding_bags, m.embedding_bag_configs()
        elif isinstance(m, EmbeddingCollection):
            tables, configs = m.embeddings, m.embedding_configs()
        else:
            continue
        for cfg in configs:
            if cfg.name in tables:
                out[id(tables[cfg.name])] = (cfg.name, cfg)
    return out
