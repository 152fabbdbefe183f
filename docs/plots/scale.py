"""Draw docs/scale.png from the recorded `--mode scale` sweeps (docs/PERFORMANCE.md, "Scale").

    python docs/plots/scale.py

The numbers are the ones measured on the AMD EPYC (Zen 4) 2-core VM by
`python bench/materialize.py --mode scale` (its `ranks` and `modules` cases; the "before"
curve of `shard_on_meta` is the same measurement without the placement-check fix);
`--out DIR` of that command draws the same curves from a new run.
"""
import os

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402

RANKS = [64, 256, 1024, 4096]
EAGER_RANKS = [0.066, 0.250, 1.715, 10.61]
META_RANKS = [0.059, 0.165, 0.604, 2.35]
BEFORE_RANKS = ([256, 1024, 2048, 4096], [0.21, 1.30, 2.84, 8.02])
MODULES = [10, 40, 160, 640]
EAGER_MODULES = [0.107, 0.424, 2.068, 8.706]
META_MODULES = [0.101, 0.383, 1.413, 6.020]


def main() -> None:
    fig, (a, b) = plt.subplots(1, 2, figsize=(10, 4))
    a.loglog(RANKS, EAGER_RANKS, "s--", label="eager DistributedModelParallel")
    a.loglog(*BEFORE_RANKS, "^:", label="shard_on_meta, torch's placement check")
    a.loglog(RANKS, META_RANKS, "o-", label="shard_on_meta")
    a.set(xlabel="world size (rank 0 of a fake group)", ylabel="seconds",
          title="20 row-wise tables against the world size")
    b.loglog(MODULES, EAGER_MODULES, "s--", label="eager DistributedModelParallel")
    b.loglog(MODULES, META_MODULES, "o-", label="shard_on_meta + materialize")
    b.set(xlabel="EmbeddingBagCollections of 10 tables", ylabel="seconds",
          title="many collections, world size 1")
    for ax in (a, b):
        ax.grid(True, which="both", alpha=0.3)
        ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))),
                             "scale.png"), dpi=110)


if __name__ == "__main__":
    main()
