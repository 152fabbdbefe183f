"""Keep TorchRec's dense (data-parallel) tables on the host while a DMP is built for the CPU.

TorchRec's ``BatchedDenseEmbeddingBag`` / ``BatchedDenseEmbedding`` (torchrec 1.6.1 and 1.8.0)
decide where fbgemm's ``DenseTableBatchedEmbeddingBagsCodegen`` lives with
``use_cpu = device is None or device.type == "cpu" or not torch.cuda.is_available()``. A DMP
built with ``device=meta`` on a machine with a GPU therefore gets ``use_cpu=False``, and fbgemm
allocates the dense tables' weights and offsets *for real* on ``torch.cuda.current_device()``,
not on meta (seen on an H100 host: a data-parallel table came out of ``shard_on_meta`` on
``cuda:0`` and its forward failed with "Not all tensors were on the same GPU"). While active,
the dense codegen as TorchRec's kernel module sees it is built with ``use_cpu=True``, which is
what the same DMP gets on a machine without a GPU.
"""
from __future__ import annotations

import contextlib
from typing import Any, Iterator

__all__ = ["host_dense_kernels"]


@contextlib.contextmanager
def host_dense_kernels() -> Iterator[None]:
    """While active, TorchRec builds its dense TBEs with ``use_cpu=True`` (module docstring)."""
    import torchrec.distributed.batched_embedding_kernel as bek

    from . import upstream

    real = bek.DenseTableBatchedEmbeddingBagsCodegen

    def dense_on_host(*args: Any, **kwargs: Any):
        kwargs["use_cpu"] = True
        if "use_mtia" in kwargs:
            kwargs["use_mtia"] = False
        return real(*args, **kwargs)

    with upstream.patch(upstream.BEK, "DenseTableBatchedEmbeddingBagsCodegen", dense_on_host):
        yield
