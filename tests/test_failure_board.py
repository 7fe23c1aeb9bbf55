"""No silent hang (``vlm_sft/parallel/failure.py``): a rank that fails between collectives stops its peers within
about a second, and rank 0 names the failed rank and what it was doing; without the board the same peer waits for
the process group's timeout (``train.collective_timeout_s``), which still bounds a hung peer."""

from __future__ import annotations

import socket
import subprocess
import sys
import time

from train_helpers import launch_env

from vlm_sft.config import REPO_ROOT

WORKER = str(REPO_ROOT / "tests" / "failure_worker.py")
BOARD_TIMEOUT_S = 120
"""The group's timeout with the board on: far above what the board takes, so only the board can end rank 0 early."""
CONTROL_TIMEOUT_S = 3


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _run(mode: str, timeout_s: float) -> tuple[float, int, str]:
    """Seconds rank 0 took to end after both ranks joined, its exit code and stderr (rank 1 is killed after)."""
    port, procs = _free_port(), []
    for rank in (0, 1):
        env = launch_env() | {
            "RANK": str(rank), "LOCAL_RANK": str(rank), "WORLD_SIZE": "2",
            "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port),
        }  # fmt: skip
        cmd = [sys.executable, WORKER, mode, str(timeout_s)]
        procs.append(subprocess.Popen(cmd, env=env, cwd=REPO_ROOT, stderr=subprocess.PIPE, text=True))
    start = time.monotonic()
    try:
        _, err = procs[0].communicate(timeout=60)
        return time.monotonic() - start, procs[0].returncode, err
    finally:
        for p in procs:
            p.kill()
            p.communicate()


def test_a_rank_that_fails_between_collectives_stops_its_peers_at_once_naming_itself():
    elapsed, code, err = _run("board", BOARD_TIMEOUT_S)
    assert code == 1, err[-3000:]
    assert "stopped: rank 1 failed while gathering the export's tensors: RuntimeError: the disk went away" in err
    assert elapsed < 30, elapsed  # import and join included; the board itself answers within ~1 s


def test_without_the_board_the_peer_waits_for_the_timeout_which_bounds_it():
    """The control, and the bound for a rank that hangs: rank 0 waits the whole timeout, then stops."""
    elapsed, code, err = _run("none", CONTROL_TIMEOUT_S)
    assert code != 0 and "stopped: rank 1" not in err
    assert CONTROL_TIMEOUT_S <= elapsed < CONTROL_TIMEOUT_S + 30, (elapsed, err[-2000:])
