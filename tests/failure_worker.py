"""One rank of ``tests/test_failure_board.py``: rank 1 fails between collectives and lingers (as a process with a
data worker or a slow teardown does); rank 0 waits in an all-reduce. ``argv[1]``: ``board`` (the trainer's failure
board is on) or ``none``; ``argv[2]``: the process group's timeout in seconds."""

from __future__ import annotations

import sys
import time

import torch

from vlm_sft.parallel.collectives import all_reduce
from vlm_sft.parallel.env import init_distributed
from vlm_sft.parallel.failure import FailureBoard, doing, stop_peers


def main() -> None:
    mode, timeout_s = sys.argv[1], float(sys.argv[2])
    env = init_distributed("cpu", timeout_s=timeout_s)
    board = FailureBoard.for_process_group(env.rank, env.world_size) if mode == "board" else None
    if board is not None:
        board.start()
    all_reduce(torch.ones(1), env)  # both ranks are in: the failure comes after a collective that worked
    try:
        if env.rank == 1:
            with doing("gathering the export's tensors"):
                raise RuntimeError("the disk went away")
        all_reduce(torch.ones(1), env)  # rank 0 waits here for a peer that never comes
    except BaseException as err:
        stop_peers(board, err)
        if env.rank == 1:
            time.sleep(120)  # lingers: its connections stay open
        raise


if __name__ == "__main__":
    main()
