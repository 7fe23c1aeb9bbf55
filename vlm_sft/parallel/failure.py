"""No silent hang: a rank that fails outside an agreement tells its peers through the store, and they stop at once.

``collectives.all_ranks_or_none`` covers the sections that are known to fail on one rank (loading data, reading a
checkpoint, writing files on rank 0): every rank learns of the failure in the agreement's all-reduce. Anything else,
an error raised between two collectives of the export, of the self-check's gathers or of a training step, leaves the
other ranks inside their next collective, where they wait for the process group's timeout (``train.
collective_timeout_s``), or for ever when the failed rank's process lingers (a data worker, a slow teardown).

So every rank of a multi-process run holds a ``FailureBoard`` on the launcher's key-value store (the one the process
group was built on: a TCP connection that works whatever the collectives' state):

- the rank that fails posts ``what it was doing: the error`` under its rank (``post``), unless its error came out of
  an agreement (every rank knows already) or a peer posted first (then it raises ``PeerFailure`` naming that peer);
- a watcher thread on every rank polls one counter every ``POLL_S``; when a peer posted, rank 0 prints which rank
  failed while doing what, and every process ends at once with ``PEER_FAILED_EXIT`` (its main thread may be blocked
  in a C++ collective, which no Python exception can interrupt), its data workers first. A store that does not
  answer (a timeout) is logged once and polled again, never a silent end of the watch.

A rank that dies without a word (SIGKILL, the OOM killer) posts nothing: its peers' gloo collectives fail as soon as
its connections close, and NCCL's watchdog ends them after ``collective_timeout_s``. What each rank is doing is the
``phase`` the trainer sets (``doing``): the step, the export, the self-check, the agreement's own ``what``.
"""

from __future__ import annotations

import logging
import sys
import threading
from collections.abc import Iterator
from contextlib import contextmanager

import torch.distributed as dist

from vlm_sft.parallel.env import end_children, end_process

logger = logging.getLogger(__name__)

POLL_S = 1.0
"""Seconds between two looks at the board (one small store request each)."""
PEER_FAILED_EXIT = 1
"""Exit code of a rank stopped because a peer failed (as for an agreed failure)."""
STORE_ERRORS = (RuntimeError, OSError)
"""What a store request raises when the store does not answer (torch's ``DistStoreError`` and ``DistNetworkError`` are
RuntimeErrors; a closed socket may be an OSError)."""
_COUNT = "failures"
_phase = "starting"


class PeerFailure(RuntimeError):
    """Raised on the ranks that did not fail when another rank did, so that every rank stops at the same point."""

    def __init__(self, what: str, failures: dict[int, str]) -> None:
        self.what = what
        self.failures = failures
        ranks = ", ".join(str(r) for r in sorted(failures))
        super().__init__(f"stopped: rank {ranks} failed while {what} (its error is printed by that rank)")


def mark_agreed(error: BaseException) -> None:
    """Record that every rank learned of ``error`` (``collectives.check_peers``): nobody needs to be told again."""
    error.vlm_sft_agreed = True


def agreed(error: BaseException) -> bool:
    return bool(getattr(error, "vlm_sft_agreed", False))


def set_phase(what: str) -> None:
    """Record what this rank is doing now (named in the failure message if it fails)."""
    global _phase
    _phase = what


def phase() -> str:
    return _phase


@contextmanager
def doing(what: str) -> Iterator[None]:
    """``set_phase(what)`` for the duration of a block, then the phase before it again."""
    before = _phase
    set_phase(what)
    try:
        yield
    except BaseException as err:  # the phase it failed in travels with the error (the phase is reset on the way out)
        if not hasattr(err, "vlm_sft_phase"):
            err.vlm_sft_phase = what
        raise
    finally:
        set_phase(before)


class FailureBoard:
    """Failures posted by ranks on the store, and the watcher that stops this rank when a peer posts one."""

    def __init__(self, store: dist.Store, rank: int, world_size: int, *, poll_s: float = POLL_S) -> None:
        self.store, self.rank, self.world_size, self.poll_s = store, rank, world_size, poll_s
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    @classmethod
    def for_process_group(cls, rank: int, world_size: int, *, attempt: int = 0) -> FailureBoard | None:
        """The board of the current process group (None when there is no multi-process group)."""
        if world_size < 2 or not dist.is_initialized():
            return None
        from torch.distributed.distributed_c10d import _get_default_store

        return cls(dist.PrefixStore(f"vlm_sft/failures/{attempt}/", _get_default_store()), rank, world_size)

    def post(self, error: BaseException) -> None:
        """Tell the peers this rank failed, with what it was doing."""
        message = f"{getattr(error, 'vlm_sft_phase', phase())}: {type(error).__name__}: {error}"
        try:
            self.store.set(f"rank{self.rank}", message.encode())
            self.store.add(_COUNT, 1)
        except STORE_ERRORS as exc:  # the store itself is gone (the launcher died): nothing more to tell
            logger.warning("could not tell the other ranks about the failure: %s", exc)

    def first(self) -> tuple[int, str] | None:
        """The lowest-ranked posted failure of another rank, or None."""
        if self.store.add(_COUNT, 0) == 0:
            return None
        for r in range(self.world_size):
            if r != self.rank and self.store.check([f"rank{r}"]):
                return r, self.store.get(f"rank{r}").decode()
        return None

    def start(self) -> None:
        """Start the watcher (a daemon thread)."""
        self._thread = threading.Thread(target=self._watch, name="vlm-sft-failure-watch", daemon=True)
        self._thread.start()

    def stop(self) -> None:
        self._stop.set()

    def _watch(self) -> None:
        """Poll until ``stop``. A store that does not answer (a timeout, a restarting launcher) is logged once and
        polled again: the run keeps fail-fast stopping, and says so while it cannot."""
        failing = None
        while not self._stop.wait(self.poll_s):
            try:
                posted = self.first()
            except STORE_ERRORS as exc:
                if failing is None and not self._stop.is_set():
                    logger.warning(
                        "rank %d: the failure board's store does not answer (%s: %s); still trying every %g s (until "
                        "it does, a peer's failure stops this rank only through its collectives or their timeout)",
                        self.rank, type(exc).__name__, exc, self.poll_s,
                    )  # fmt: skip
                failing = exc
                continue
            if failing is not None:
                logger.warning("rank %d: the failure board's store answers again", self.rank)
                failing = None
            if posted is not None and not self._stop.is_set():
                _stop_process(self.rank, *posted)


def stop_peers(board: FailureBoard | None, error: BaseException) -> None:
    """On a rank that failed: post ``error`` for the peers, unless they know already (an agreement's error, a
    ``PeerFailure``, Ctrl-C) or a peer failed first, in which case raise ``PeerFailure`` naming that peer (this
    rank's own error, typically its collective failing because the peer left, follows from it)."""
    if board is None or isinstance(error, PeerFailure | KeyboardInterrupt | SystemExit) or agreed(error):
        return
    try:
        posted = board.first()
    except STORE_ERRORS:  # no answer: post anyway (post says so when that fails too)
        posted = None
    if posted is not None:
        raise PeerFailure(posted[1], {posted[0]: posted[1]}) from error
    board.post(error)


def _stop_process(rank: int, failed: int, message: str) -> None:
    """End this process because rank ``failed`` failed (rank 0 says so), its data workers first
    (``env.end_process``)."""
    if rank == 0:
        print(f"stopped: rank {failed} failed while {message}", file=sys.stderr)
    end_children()
    end_process(PEER_FAILED_EXIT)
