"""Silence third-party noise in the benchmark's processes (the bench only: metamat itself
never touches warning filters or other libraries' loggers).

TorchRec logs "Compute Kernel is dense, caching params will be ignored" (and the same for
data-parallel tables) once per table per sharding, fbgemm and torch.distributed emit
FutureWarnings/UserWarnings about deprecated APIs: hundreds of lines per run that bury the
tables. ``quiet()`` is called by the bench's main process and at the start of every rank
function (spawned rank processes start with fresh filters); ``METAMAT_BENCH_VERBOSE=1``
keeps everything.
"""
from __future__ import annotations

import logging
import os
import warnings

NOISY_LOGGERS = ("torchrec", "fbgemm_gpu", "torch.distributed", "torch._dynamo")
NOISY_MODULES = r"(torchrec|fbgemm_gpu|torch|torchmetrics|tensordict)(\..*)?"


def quiet() -> None:
    if os.environ.get("METAMAT_BENCH_VERBOSE"):
        return
    for cat in (FutureWarning, DeprecationWarning, UserWarning):
        warnings.filterwarnings("ignore", category=cat, module=NOISY_MODULES)
    # Some are raised from the caller's frame (stacklevel > 1) or at import time.
    warnings.filterwarnings("ignore", category=FutureWarning)
    for name in NOISY_LOGGERS:
        logging.getLogger(name).setLevel(logging.ERROR)
