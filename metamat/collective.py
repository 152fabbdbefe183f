"""What the ranks do together: agree on success, within a bounded time, and hold SIGINT while
the model is swapped.

Every model kind goes through :meth:`Agreement.agree` twice (after validation, after filling):
if any rank failed, every rank raises, and no rank registers anything while another has
failed. The agreement runs on a gloo group of its own (CPU tensors, so it works beside NCCL and
never waits for GPU work) whose timeout bounds how long a rank waits for a peer that died or
hangs: a dead peer is noticed at once (its connection closes), a hung one after ``timeout``
seconds (``materialize(timeout=...)``, default :data:`DEFAULT_TIMEOUT` or the
``METAMAT_TIMEOUT`` environment variable), instead of the process group's 30 minutes.
"""
from __future__ import annotations

import atexit
import contextlib
import datetime
import os
import signal
import threading
from typing import Any, Dict, List, Optional, Tuple

from .checkpoint.errors import CheckpointError
from .errors import PeerCheckpointError, PeerFailedError

__all__ = ["Agreement", "rank", "defer_sigint", "DEFAULT_TIMEOUT"]

#: Seconds a rank waits for its peers at an agreement point (the slowest rank's whole load
#: runs between the two points: raise it for very large loads on slow storage).
DEFAULT_TIMEOUT = 600.0

# The agreement groups made so far, by timeout: (the default group they were made under, the
# group). A group made under a default group that was destroyed since is stale: made again.
_GROUPS: Dict[float, Tuple[Any, Any]] = {}


def _agreement_group(timeout: float) -> Any:
    import torch.distributed as dist

    world = dist.group.WORLD
    hit = _GROUPS.get(timeout)
    if hit is None or hit[0] is not world:
        _GROUPS.pop(timeout, None)
        hit = _GROUPS[timeout] = (world, dist.new_group(
            backend="gloo", timeout=datetime.timedelta(seconds=timeout)))
    return hit[1]


@atexit.register
def _drop_groups() -> None:
    """Destroys the agreement groups while the interpreter is whole. Held until its
    finalization instead, a gloo worker thread could drop its last tensor there and abort the
    process ("terminate called without an active exception") after the program's last line."""
    groups = [g for _w, g in _GROUPS.values()]
    _GROUPS.clear()
    if groups and _initialized():
        import torch.distributed as dist

        for g in groups:
            with contextlib.suppress(Exception):  # a group the program destroyed already
                dist.destroy_process_group(g)


def _initialized() -> bool:
    import torch.distributed as dist

    return dist.is_available() and dist.is_initialized()


def rank() -> int:
    """This process's rank (0 without a process group)."""
    import torch.distributed as dist

    return dist.get_rank() if _initialized() else 0


def resolve_timeout(timeout: Optional[float]) -> float:
    """``timeout`` if given, else ``METAMAT_TIMEOUT``, else :data:`DEFAULT_TIMEOUT`.

    Raises:
        ValueError: not a positive number.
    """
    if timeout is None:
        env = os.environ.get("METAMAT_TIMEOUT")
        try:
            timeout = float(env) if env else DEFAULT_TIMEOUT
        except ValueError:
            raise ValueError(f"METAMAT_TIMEOUT must be a number of seconds, got {env!r}") from None
    if isinstance(timeout, bool) or not isinstance(timeout, (int, float)) or not timeout > 0:
        raise ValueError(f"timeout must be a positive number of seconds, got {timeout!r}")
    return float(timeout)


class Agreement:
    """The ranks of one ``materialize`` call agreeing on each stage's success.

    Created at the start of the call, before any rank-specific work (creating its group is
    itself collective). Without a process group, or with one rank, it only re-raises.

    Args:
        timeout: seconds to wait for the peers at each agreement point.
    """

    def __init__(self, timeout: Optional[float] = None) -> None:
        self.timeout = resolve_timeout(timeout)
        self.group = None
        if _initialized():
            import torch.distributed as dist

            if dist.get_world_size() > 1:
                self.group = _agreement_group(self.timeout)

    def agree(self, error: Optional[BaseException], stage: str,
              payload: Any = None) -> List[Any]:
        """Every rank says whether ``stage`` succeeded; if any failed, every rank raises.

        The failing rank raises its own error; the others raise :class:`PeerFailedError`
        naming the rank(s), the stage and the first error (:class:`PeerCheckpointError`, also
        a ``CheckpointError``, when that was a checkpoint problem), or that a peer died or did
        not answer within the timeout.

        Args:
            error: this rank's failure, or None.
            stage: named in the peers' errors.
            payload: a small picklable object sent along in the same collective (the
                Report's per-rank summary); every rank gets every rank's.

        Returns:
            Every rank's ``payload``, in rank order (``[payload]`` without a process group).

        Raises:
            BaseException: ``error`` itself on the failing rank.
            PeerFailedError, PeerCheckpointError: on the other ranks.
        """
        if self.group is None:
            if error is not None:
                raise error
            return [payload]
        import torch.distributed as dist

        mine = None if error is None else (isinstance(error, CheckpointError),
                                           f"{type(error).__name__}: {error}")
        everyone: List[Any] = [None] * dist.get_world_size(self.group)
        try:
            dist.all_gather_object(everyone, (mine, payload), group=self.group)
        except RuntimeError as e:  # a peer died (connection closed) or did not answer
            # Drop the group: after a failed collective it cannot be trusted again.
            _GROUPS.pop(self.timeout, None)
            if error is not None:
                raise error
            raise PeerFailedError(
                f"materialize: a peer rank did not reach the {stage} agreement within "
                f"{self.timeout:g} s or its process died ({type(e).__name__}: "
                f"{str(e).splitlines()[0] if str(e) else ''}); this rank's model is unchanged. "
                "Raise the wait with materialize(timeout=...) or METAMAT_TIMEOUT.") from None
        if error is not None:
            raise error
        failed = [(r, m) for r, (m, _p) in enumerate(everyone) if m is not None]
        if failed:
            r, (is_ckpt, msg) = failed[0]
            cls = PeerCheckpointError if is_ckpt else PeerFailedError
            raise cls(f"materialize failed during {stage} on rank(s) "
                      f"{[r for r, _ in failed]}; this rank's model is unchanged. "
                      f"Rank {r}: {msg}")
        return [p for _m, p in everyone]


@contextlib.contextmanager
def defer_sigint():
    """Hold SIGINT while the real tensors are swapped into the model (a KeyboardInterrupt
    halfway through would leave it half meta, half real): raised once the block is done.
    Only in the main thread and while Python's default SIGINT handler is installed."""
    if (threading.current_thread() is not threading.main_thread()
            or signal.getsignal(signal.SIGINT) is not signal.default_int_handler):
        yield
        return
    got = []
    prev = signal.signal(signal.SIGINT, lambda signum, frame: got.append(signum))
    try:
        yield
    finally:
        signal.signal(signal.SIGINT, prev)
    if got:
        raise KeyboardInterrupt
