"""Stopping a run on request: SIGTERM or SIGUSR1 -> every rank saves one checkpoint at the same step and exits with
``PREEMPTED_EXIT_CODE``.

1. **The handler only records the request** (``StopRequest.handle``): no collective, no file, no lock, one
   ``os.write`` to stderr; Python runs it on the main thread between bytecodes, never inside a collective.
2. **Every rank agrees at the next step boundary**: the flag rides, summed over ranks, on the step's one
   control-plane all-reduce (``trainer.step_batches``); one signalled rank is enough and no collective is added.
3. **The agreed step is trained, then saved as a periodic checkpoint** (``trainer.loop``; its batches were drawn, so
   the end of the step is the first consistent point); the final eval and export are skipped. A stop before this
   attempt trained a step saves nothing (nothing is newer than its start).
4. **A second signal exits at once** by its default action; a repeat within ``REPEAT_WINDOW_S`` is the same request
   delivered twice (a scheduler signalling every process reaches a worker directly and through its launcher).
5. **Data worker processes ignore the first signal** (``data_worker_init``): torch's worker SIGTERM handler would end
   them, and their training process would fail instead of saving.

The step and the save must fit in the launcher's and the scheduler's grace time. Launchers, grace times and the
Slurm recipe: docs/cluster.md, "Stop signals".
"""

from __future__ import annotations

import os
import signal
import threading
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

STOP_SIGNALS = (signal.SIGTERM, signal.SIGUSR1)
"""The signals that ask a run to save and stop (SIGINT keeps Python's KeyboardInterrupt: a person at a terminal)."""
PREEMPTED_EXIT_CODE = 143
"""Exit code of every process of a run stopped by a stop signal after it saved its checkpoint (or had nothing new to
save): 128 + SIGTERM, the code a shell reports for a process that SIGTERM ended. Tools that already treat "ended by
SIGTERM" as "terminated, may run again" read it so: torchelastic restarts on any non-zero code, Kubeflow's
``ExitCode`` restart policy retries 128-255 and fails 1-127, and requeue scripts test for 143. The same code for
SIGUSR1: what matters to a scheduler is that the run stopped on request and resumes with ``--train.resume latest``."""
REPEAT_WINDOW_S = 2.0
"""A stop signal within this many seconds of the first is the same request delivered twice (module docstring, 4)."""


def _say(message: str) -> None:
    """One line to stderr from a signal handler: ``os.write``, since the main thread may be inside a write to
    ``sys.stderr`` (a buffered stream raises on a reentrant call) or hold the logging lock."""
    os.write(2, f"{message}\n".encode())


def _die_by(signum: int) -> None:
    """End this process by ``signum`` itself, with its default action (what the signal would have done unhandled)."""
    signal.signal(signum, signal.SIG_DFL)
    os.kill(os.getpid(), signum)


class StopRequest:
    """Whether this process was asked to stop (``requested``, ``signal``); ``handle`` is the signal handler.

    ``clock`` and ``die`` are parameters so a test can drive the repeat window and the second signal without timing
    or killing anything."""

    def __init__(
        self,
        *,
        rank: int = 0,
        clock: Callable[[], float] = time.monotonic,
        die: Callable[[int], None] = _die_by,
    ) -> None:
        self.rank = rank
        self.signal: str | None = None
        """Name of the first stop signal this process got (None: none yet)."""
        self._at: float | None = None
        self._clock, self._die = clock, die
        self._owner = os.getpid()

    @property
    def requested(self) -> bool:
        return self.signal is not None

    def handle(self, signum: int, frame: object = None) -> None:
        name = signal.Signals(signum).name
        if os.getpid() != self._owner:  # a process forked inside the block inherits this: it is not the run
            _ignore_once(signum, frame)
            return
        now = self._clock()
        if self._at is None:
            self.signal, self._at = name, now
            _say(
                f"rank {self.rank}: got {name}: the run saves a checkpoint after the next step and exits with code "
                f"{PREEMPTED_EXIT_CODE} (a second signal ends it at once, without a checkpoint)"
            )
        elif now - self._at < REPEAT_WINDOW_S:
            _say(f"rank {self.rank}: got {name} again within {REPEAT_WINDOW_S:g} s: the same stop request")
        else:
            _say(f"rank {self.rank}: got {name} a second time: exiting now, without a checkpoint")
            self._die(signum)


def _ignore_once(signum: int, frame: object = None) -> None:
    """Ignore this stop signal; the next one gets the default action (ends the process)."""
    signal.signal(signum, signal.SIG_DFL)


def data_worker_init(worker_id: int) -> None:
    """``worker_init_fn`` of the training data's DataLoader: the worker ignores the first stop signal (module
    docstring, 5). Runs after torch installed its own worker SIGTERM handler, which this replaces."""
    for sig in STOP_SIGNALS:
        signal.signal(sig, _ignore_once)


@contextmanager
def stop_signals(rank: int = 0) -> Iterator[StopRequest]:
    """``STOP_SIGNALS`` recorded by a ``StopRequest`` inside the block; the previous handlers are restored after it.

    Outside the main thread (a caller that runs ``train`` in a thread) nothing is installed, since Python only lets
    the main thread set handlers: the request is never set and the signals keep their actions."""
    request = StopRequest(rank=rank)
    if threading.current_thread() is not threading.main_thread():
        yield request
        return
    previous = {sig: signal.signal(sig, request.handle) for sig in STOP_SIGNALS}
    try:
        yield request
    finally:
        for sig, handler in previous.items():
            signal.signal(sig, handler)


@dataclass(frozen=True)
class Stopped:
    """How a run that a stop signal ended early stopped (``RunResult.stopped``)."""

    step: int
    """Optimizer steps completed (and saved, when ``checkpoint`` is set)."""
    signalled_ranks: int
    """How many ranks had received a stop signal when they agreed to stop."""
    checkpoint: Path | None
    """The checkpoint written for the stop; None when this attempt had trained no step yet (nothing new to save)."""
