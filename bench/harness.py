"""What every bench script needs: the CPU environment, timers, interleaved contenders, tables and JSON results.

Import it **before torch** (``import harness`` then ``# isort: split``): it sets ``OMP_WAIT_POLICY=PASSIVE`` unless
set, which OpenMP reads once, when torch loads it (busy-waiting threads made 2-thread steps 10-40x slower under load).
Method (bench/README.md, "Machine and method"): contenders run interleaved in a rotating order (A B C, B C A, ...) so
load from other jobs hits them alike; a figure is the median over repetitions; a ratio is taken within each
repetition, then the median, with its (min, max) range. bench/ is not a package: ``python bench/x.py`` puts this
folder on ``sys.path``.
"""

from __future__ import annotations

import contextlib
import ctypes
import gc
import importlib.metadata
import itertools
import json
import os
import platform
import statistics
import sys
import time
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

BENCH = Path(__file__).resolve().parent
REPO = BENCH.parent
RESULTS_DIR = BENCH / "results"


def prepare_cpu_env() -> None:
    """``OMP_WAIT_POLICY=PASSIVE`` unless the user set it (``vlm_sft.cpu_threads.prepare_cpu_env``, as the trainer
    does): idle OpenMP threads sleep instead of spinning on a shared core. Must run before torch is imported (OpenMP
    reads it once); this module runs it on import."""
    if str(REPO) not in sys.path:  # python bench/x.py puts bench/ on the path; vlm_sft may not be installed
        sys.path.append(str(REPO))
    from vlm_sft.cpu_threads import prepare_cpu_env as prepare

    prepare()


prepare_cpu_env()


def set_threads(threads: int) -> None:
    """torch's intra-op threads, and ``OMP_NUM_THREADS`` for the child processes this script starts."""
    import torch

    os.environ["OMP_NUM_THREADS"] = str(threads)
    torch.set_num_threads(threads)


# ------------------------------------------------------------------------------------------------ timing


class Timer:
    """``with Timer() as t: ...`` then ``t.seconds``: wall time (``perf_counter``) and this process's CPU time
    (``process_time``, all threads), to tell a slow step from a step that waited for a core."""

    def __enter__(self) -> Timer:
        self.seconds = self.cpu_seconds = 0.0
        self._wall, self._cpu = time.perf_counter(), time.process_time()
        return self

    def __exit__(self, *exc: object) -> None:
        self.seconds = time.perf_counter() - self._wall
        self.cpu_seconds = time.process_time() - self._cpu


def seconds(fn: Callable[[], Any]) -> float:
    """Wall seconds of one call of ``fn``."""
    start = time.perf_counter()
    fn()
    return time.perf_counter() - start


# ------------------------------------------------------------------------------------------------ interleaving


def rotation(names: Sequence[str], rep: int) -> list[str]:
    """The order of repetition ``rep``: ``names`` rotated by ``rep``, so no contender always runs first (after a
    pause, on a cold cache) or last."""
    shift = rep % len(names) if names else 0
    return [*names[shift:], *names[:shift]]


def slices(items: Sequence, n: int) -> list[list]:
    """``items`` cut into ``n`` consecutive slices of about equal length (some empty when ``items`` is short): slice k
    of every contender runs before slice k + 1 of any, so a long pass is interleaved too."""
    bounds = [round(i * len(items) / n) for i in range(n + 1)]
    return [list(items[a:b]) for a, b in itertools.pairwise(bounds)]


def interleave_records(contenders: Mapping[str, Callable[[], Any]], reps: int, warmup: int = 0) -> dict[str, list]:
    """Call every contender once per repetition, in ``rotation`` order, ``reps`` times; each name's return values,
    one per repetition. ``warmup`` untimed rounds first (imports, allocator, caches). For contenders that measure
    more than one figure per call (forward and backward, samples and seconds)."""
    names = list(contenders)
    for rep in range(warmup):
        for name in rotation(names, rep):
            contenders[name]()
    out: dict[str, list] = {name: [] for name in names}
    for rep in range(reps):
        for name in rotation(names, rep):
            out[name].append(contenders[name]())
    return out


def interleave(
    contenders: Mapping[str, Callable[[], float | None]], reps: int, warmup: int = 0
) -> dict[str, list[float]]:
    """Seconds per repetition of each contender, run in a rotating order (``interleave_records``). A contender that
    returns a float has timed itself (its setup left out) and that float is its time; one that returns None is
    timed here, around the whole call."""

    def timed(fn: Callable[[], float | None]) -> Callable[[], float]:
        def call() -> float:
            start = time.perf_counter()
            own = fn()
            return float(own) if own is not None else time.perf_counter() - start

        return call

    return interleave_records({name: timed(fn) for name, fn in contenders.items()}, reps, warmup)


def ratio_stats(num: Sequence[float], den: Sequence[float]) -> dict:
    """``num[i] / den[i]`` within each repetition i (both measured under the same load), then the ``median``,
    ``min`` and ``max`` of those ratios, and the ratios themselves as ``per_rep``. With seconds, pass
    ``(slow_s, fast_s)`` for how many times faster ``fast`` is; with rates (tokens/s) the other way round."""
    if len(num) != len(den) or not num:
        raise ValueError(f"ratio_stats needs equally many repetitions on both sides, got {len(num)} and {len(den)}")
    per_rep = [n / d for n, d in zip(num, den, strict=True)]
    return {"median": statistics.median(per_rep), "min": min(per_rep), "max": max(per_rep), "per_rep": per_rep}


def medians(records: Iterable[Mapping[str, float]], keys: Iterable[str]) -> dict[str, float]:
    """``{key: median over records}`` for each key: a figure per repetition collapsed into the reported one."""
    records = list(records)
    return {k: statistics.median(r[k] for r in records) for k in keys}


def fmt_range(stats: Mapping[str, float], spec: str = ".2f") -> str:
    """``1.25 (1.10-1.31)``: a ``ratio_stats`` median with its range, as the tables print it."""
    return f"{stats['median']:{spec}} ({stats['min']:{spec}}-{stats['max']:{spec}})"


# ------------------------------------------------------------------------------------------------ tables


def format_table(title: str | None, columns: Sequence[tuple], rows: Iterable[Mapping[str, Any] | Sequence[Any]]) -> str:
    """An aligned table as text: the title, a header, a rule, one line per row.

    ``columns``: ``(key, header)`` or ``(key, header, spec)``; ``key`` indexes a row (a dict key, or a list index),
    ``spec`` is a format spec without width (``".1f"``, ``".0f"``, ``".1%"``). A column is as wide as its widest cell;
    strings align left, numbers right; a missing or None cell prints ``-``.
    """
    values = [[row.get(c[0]) if isinstance(row, Mapping) else row[c[0]] for c in columns] for row in rows]
    cells = [
        ["-" if v is None else format(v, col[2] if len(col) > 2 else "") for v, col in zip(line, columns, strict=True)]
        for line in values
    ]
    left = [all(isinstance(line[i], str) for line in values if line[i] is not None) for i in range(len(columns))]
    widths = [max([len(str(c[1]))] + [len(line[i]) for line in cells]) for i, c in enumerate(columns)]

    def join(parts: Sequence[str]) -> str:
        return " ".join(p.ljust(w) if lft else p.rjust(w) for p, w, lft in zip(parts, widths, left, strict=True))

    header = join([str(c[1]) for c in columns]).rstrip()
    lines = ([title] if title else []) + [header, "-" * len(header)] + [join(line).rstrip() for line in cells]
    return "\n".join(lines)


def print_table(title: str | None, columns: Sequence[tuple], rows: Iterable[Mapping[str, Any] | Sequence[Any]]) -> str:
    """Print ``format_table(title, columns, rows)`` and return it (a script may save the text too)."""
    text = format_table(title, columns, rows)
    print(text, flush=True)
    return text


# ------------------------------------------------------------------------------------------------ memory


def trim_heap() -> None:
    """Collect garbage and hand glibc's free lists back to the OS, so an RSS baseline or high-water mark taken next
    counts what is held, not what earlier work freed (no-op off glibc)."""
    gc.collect()
    with contextlib.suppress(OSError, AttributeError):
        ctypes.CDLL("libc.so.6").malloc_trim(0)


def rss_mb(field: str = "VmRSS") -> float:
    """A ``/proc/self/status`` memory field in MiB: ``VmRSS`` (resident now) or ``VmHWM`` (its high-water mark)."""
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith(f"{field}:"):
            return int(line.split()[1]) / 1024
    raise RuntimeError(f"no {field} in /proc/self/status (Linux only)")


def peak_rss_mb() -> float:
    """This process's resident-set high-water mark (``VmHWM``) in MiB, since start or the last ``reset_peak_rss``."""
    return rss_mb("VmHWM")


def reset_peak_rss() -> bool:
    """Restart the high-water mark from the resident set now (``/proc/self/clear_refs``, Linux >= 4.0), after
    ``trim_heap``, so a peak measures one phase; False where the kernel does not allow it."""
    trim_heap()
    try:
        Path("/proc/self/clear_refs").write_text("5")
    except OSError:
        return False
    return True


# ------------------------------------------------------------------------------------------------ results


def package_version(package: str) -> str | None:
    """An installed package's version without importing it (importing transformers takes seconds)."""
    try:
        return importlib.metadata.version(package)
    except importlib.metadata.PackageNotFoundError:
        return None


def machine_facts() -> dict:
    """What the figures depend on besides the code: the machine, its load, the versions and the thread settings."""
    torch = sys.modules.get("torch")
    return {
        "date": datetime.now(UTC).isoformat(timespec="seconds"),
        "platform": platform.platform(),
        "processor": platform.processor() or platform.machine(),
        "python": platform.python_version(),
        "cpu_count": os.cpu_count(),
        "cpus_usable": len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count(),
        "loadavg": list(os.getloadavg()),
        "torch": package_version("torch"),
        "transformers": package_version("transformers"),
        "threads": torch.get_num_threads() if torch is not None else None,
        "omp": {k: os.environ.get(k) for k in ("OMP_NUM_THREADS", "OMP_WAIT_POLICY")},
    }


def results_path(name: str) -> Path:
    """``bench/results/<name>.json``, the file a README table cites."""
    return RESULTS_DIR / f"{name}.json"


def write_results(name: str, payload: dict, path: Path | None = None, indent: int = 2, quiet: bool = False) -> Path:
    """Write ``payload`` to ``bench/results/<name>.json`` (or ``path``) with ``machine_facts()`` under ``machine``
    (kept if the payload has its own), print where (unless ``quiet``: a partial write during the run), return it."""
    out = Path(path) if path is not None else results_path(name)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps({"machine": machine_facts()} | payload, indent=indent) + "\n")
    if not quiet:
        print(f"wrote {out.resolve().relative_to(REPO) if out.resolve().is_relative_to(REPO) else out}", flush=True)
    return out


@contextlib.contextmanager
def wall_clock() -> Iterator[dict]:
    """``with wall_clock() as meta:`` fills ``meta`` with ``wall_s`` and the load average at start and end, for a
    script's ``meta`` block: a busy machine explains drifting absolute times."""
    meta: dict = {"loadavg_start": list(os.getloadavg())}
    start = time.perf_counter()
    yield meta
    meta["wall_s"], meta["loadavg_end"] = time.perf_counter() - start, list(os.getloadavg())
