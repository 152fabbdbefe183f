"""named_modules_pruned: torch's named_modules order and names, without the pruned subtrees
(the adapters skip TorchRec's ~1 module per table instead of walking them)."""
from __future__ import annotations

import random

import pytest
import torch
from hypothesis import given, settings, strategies as st
from torch import nn

from metamat.models.modules import find_entries, named_modules_pruned


def random_tree(seed: int) -> nn.Module:
    """Nested modules with shared children, None children and a few tensors."""
    rng = random.Random(seed)
    pool = []
    root = nn.Module()
    pool.append(root)
    for i in range(rng.randrange(1, 25)):
        parent = rng.choice(pool)
        if pool[1:] and rng.random() < 0.2:
            child = rng.choice(pool[1:])  # shared: reachable under two names
            if child is parent:
                continue
            # no cycles: only share a module that is not an ancestor of parent
            if any(m is parent for _, m in child.named_modules()):
                continue
        elif rng.random() < 0.1:
            child = None
        else:
            child = nn.Linear(2, 2, device="meta") if rng.random() < 0.3 else nn.Module()
            pool.append(child)
        parent._modules[f"c{i}"] = child
    return root


@settings(max_examples=150, deadline=None)
@given(st.integers(0, 10**6), st.booleans())
def test_no_pruning_is_named_modules(seed, remove_duplicate):
    root = random_tree(seed)
    got = [(n, id(m)) for n, m in named_modules_pruned(root, lambda n, m: False,
                                                        remove_duplicate=remove_duplicate)]
    want = [(n, id(m)) for n, m in root.named_modules(remove_duplicate=remove_duplicate)]
    assert got == want


@settings(max_examples=150, deadline=None)
@given(st.integers(0, 10**6), st.integers(0, 10**6))
def test_pruning_drops_exactly_the_subtrees(seed, pick):
    root = random_tree(seed)
    names = [n for n, _ in root.named_modules(remove_duplicate=False) if n]
    if not names:
        return
    cut = names[pick % len(names)]
    got = [n for n, _ in named_modules_pruned(root, lambda n, m: n == cut,
                                              remove_duplicate=False)]
    want = [n for n, _ in root.named_modules(remove_duplicate=False)
            if not n.startswith(cut + ".")]
    assert got == want


def test_find_entries_skips_subtrees_and_keeps_order():
    torch.manual_seed(0)
    shared = nn.Linear(3, 3, device="meta")
    root = nn.Module()
    root.a = nn.Sequential(nn.Linear(2, 2, device="meta"), shared)
    root.skipme = nn.Sequential(nn.Linear(4, 4, device="meta"), shared)
    root.b = nn.Linear(5, 5, device="meta")
    got = [(e.fqn, e.names) for e in find_entries(root, skip=["skipme"])]
    # the shared module's tensors keep their name outside the skipped subtree only
    assert got == [("a.0.weight", ["a.0.weight"]), ("a.0.bias", ["a.0.bias"]),
                   ("a.1.weight", ["a.1.weight"]), ("a.1.bias", ["a.1.bias"]),
                   ("b.weight", ["b.weight"]), ("b.bias", ["b.bias"])]
    assert find_entries(root, skip=[""]) == []
    every = [e.fqn for e in find_entries(root)]
    assert every[:4] == ["a.0.weight", "a.0.bias", "a.1.weight", "a.1.bias"]
    assert "skipme.0.weight" in every and "skipme.1.weight" not in every  # tied: one entry


def test_a_cycle_ends_as_in_torch():
    # torch's walk ends on a cycle because it removes duplicates; so does this one
    a, b = nn.Module(), nn.Module()
    a.b = b
    b.a = a
    got = [n for n, _ in named_modules_pruned(a, lambda n, m: False)]
    assert got == [n for n, _ in a.named_modules()] == ["", "b"]
    # keeping duplicates, torch's walk never ends on a cycle (RecursionError): nor this one
    with pytest.raises(RecursionError):
        list(a.named_modules(remove_duplicate=False))
    with pytest.raises(RecursionError, match="a cycle"):
        list(named_modules_pruned(a, lambda n, m: False, remove_duplicate=False))
