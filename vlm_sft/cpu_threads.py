"""How the trainer picks CPU threads: OpenMP's settings before torch loads it, and one intra-op thread count for CPU
training whatever the launcher.

**OpenMP's wait policy.** torch's CPU kernels run on GNU OpenMP, whose idle threads spin by default while they wait
for the next parallel region. On a machine whose cores are shared (another job, the trainer's own data workers) a
spinning thread holds a core that the thread it waits for needs: 2-thread CPU steps of the default run ran 10-40x
slower under load until ``OMP_WAIT_POLICY=PASSIVE`` (2026-12-04; docs/configuration.md, "CPU threads"). ``prepare_cpu_env()`` sets it
unless it is set already, and must run before torch is imported: OpenMP reads its environment once, when torch
loads it. ``vlm_sft/train.py`` calls it before its other imports; the bench harness calls it too.

PASSIVE is the robust choice, not the fastest one: a sleeping thread takes a wake-up at every parallel region. On a
quiet 2-core machine, 2-thread training steps of the tiny model took 2.3x as long under PASSIVE as under OpenMP's
default (spin, then sleep), longer than 1 thread; with two such 2-thread processes sharing the cores, the default
took 3x as long as PASSIVE (2026-12-05, ``bench_vs_transformers.py``'s shapes steps, interleaved probes). One thread
(the choice below on small machines) does not wait at all. On a machine of your own, ``OMP_WAIT_POLICY=ACTIVE`` (or
any value you set) is kept.

**The intra-op thread count.** Launchers write ``OMP_NUM_THREADS`` on their own: ``accelerate launch`` (1.16) sets
1 for its process when the variable is unset (more only with ``--cpu``, from psutil's count of physical cores), and
``torchrun`` sets 1 when it starts several processes per node. So on one 2-core machine ``python vlm_sft/train.py``
trained with 2 threads and ``accelerate launch vlm_sft/train.py`` with 1: other summation orders (the two runs
drifted apart within 40 steps) and another speed. ``choose_cpu_threads`` gives every
launcher the same answer, in this order:

1. ``train.cpu_threads`` when set: the user's choice, always honoured.
2. ``OMP_NUM_THREADS`` when set and no launcher started this process: then only the user can have set it.
3. Otherwise one thread per core left to the process: the cores it may run on (its CPU affinity) divided by the
   training processes on this machine (``LOCAL_WORLD_SIZE``), less its data workers (``data.num_workers``, which
   render and pack on a core each), at least 1. On 2 cores with one process and its one data worker that is 1
   thread: the default run's 100 steps took 16.5-16.9 s with 1 thread and 20.0-22.1 s with 2, which then shared the
   cores with the worker (2026-12-05, another job on the machine; ``OMP_NUM_THREADS`` 1 vs 2, interleaved). Under a
   launcher this replaces ``OMP_NUM_THREADS``, whose value there may be the launcher's default and cannot be told
   from the user's; the log line names the value it replaced and the setting that keeps it.

The choice is applied with ``torch.set_num_threads`` on CPU runs only (a GPU run leaves torch's default alone) and
logged once with its reason. Each data worker runs one thread (``trainer.batches``).
"""

from __future__ import annotations

import logging
import os
from collections.abc import Mapping, MutableMapping
from dataclasses import dataclass

logger = logging.getLogger(__name__)

WAIT_POLICY = "PASSIVE"
"""``OMP_WAIT_POLICY`` unless the user set one: idle OpenMP threads sleep instead of spinning on a shared core."""

LAUNCHER_MARKERS = {
    "ACCELERATE_DYNAMO_BACKEND": "accelerate launch",
    "TORCHELASTIC_RUN_ID": "torchrun",
}
"""Variables a launcher puts into the environment of every process it starts (accelerate launch with one process or
several; torchrun, which accelerate also uses for several), and the launcher each one names."""


def prepare_cpu_env(environ: MutableMapping[str, str] | None = None) -> dict[str, str]:
    """Set the OpenMP environment this process needs unless the user set it; call it before torch is imported.

    Returns the variables it set (empty when the user had set them all), for the caller to log once logging is
    configured."""
    environ = os.environ if environ is None else environ
    added = {}
    if "OMP_WAIT_POLICY" not in environ:
        environ["OMP_WAIT_POLICY"] = added["OMP_WAIT_POLICY"] = WAIT_POLICY
    return added


def usable_cores() -> int:
    """The cores this process may run on: its CPU affinity (a container's or ``taskset``'s limit), else all."""
    if hasattr(os, "sched_getaffinity"):
        return len(os.sched_getaffinity(0))
    return os.cpu_count() or 1


def launcher_of(environ: Mapping[str, str]) -> str | None:
    """The launcher that started this process (``"accelerate launch"``, ``"torchrun"``), or None for plain python."""
    return next((name for var, name in LAUNCHER_MARKERS.items() if var in environ), None)


@dataclass(frozen=True)
class ThreadChoice:
    """The intra-op thread count of a CPU training process, and why."""

    threads: int
    """``torch.set_num_threads`` value, >= 1."""
    reason: str
    """Where the count came from, as the log line says it."""


def choose_cpu_threads(
    setting: int | None, environ: Mapping[str, str] | None = None, cores: int | None = None, data_workers: int = 0
) -> ThreadChoice:
    """The thread count for ``train.cpu_threads = setting`` (None: automatic) of a rank with ``data_workers`` data
    worker processes (module docstring for the rules)."""
    environ = os.environ if environ is None else environ
    omp = environ.get("OMP_NUM_THREADS", "").strip()
    if setting is not None:
        if setting < 1:
            raise ValueError(f"train.cpu_threads = {setting}: use 1 or more threads, or none for the automatic choice")
        unused = f"; OMP_NUM_THREADS={omp} not used" if omp and omp != str(setting) else ""
        return ThreadChoice(setting, f"train.cpu_threads{unused}")
    launcher = launcher_of(environ)
    if omp and launcher is None:
        if not omp.isdigit() or int(omp) < 1:
            raise ValueError(f"OMP_NUM_THREADS={omp!r} is not a thread count: set it to 1 or more, or unset it")
        return ThreadChoice(int(omp), "OMP_NUM_THREADS from the environment")
    cores = usable_cores() if cores is None else cores
    local = max(int(environ.get("LOCAL_WORLD_SIZE", "1")), 1)
    threads = max(cores // local - data_workers, 1)
    reason = f"{cores} core(s) / {local} training process(es) on this machine, less {data_workers} data worker(s)"
    if omp and omp != str(threads):
        reason += (
            f"; replaces OMP_NUM_THREADS={omp}, which {launcher} sets on its own (so that python and launchers "
            "train alike); set train.cpu_threads to choose the count"
        )
    return ThreadChoice(threads, reason)


def set_cpu_threads(setting: int | None, *, data_workers: int = 0, log: bool = False) -> ThreadChoice:
    """Choose the thread count (``choose_cpu_threads``) and apply it to torch; log it once when ``log``."""
    import torch  # here, not at the top: prepare_cpu_env must be importable before torch is

    choice = choose_cpu_threads(setting, data_workers=data_workers)
    torch.set_num_threads(choice.threads)
    if log:
        policy = os.environ.get("OMP_WAIT_POLICY", "unset")
        logger.info("CPU: %d thread(s) per process (%s); OMP_WAIT_POLICY=%s", choice.threads, choice.reason, policy)
    return choice
