"""How the trainer picks CPU threads (``vlm_sft.cpu_threads``): the user's choice first, then the same count under
``python`` and under a launcher that writes ``OMP_NUM_THREADS`` itself, and OpenMP's passive wait policy unless the
user set another."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from concurrent.futures import ThreadPoolExecutor

import pytest

from vlm_sft.config import REPO_ROOT
from vlm_sft.cpu_threads import choose_cpu_threads, launcher_of, prepare_cpu_env

ACCELERATE = {"ACCELERATE_DYNAMO_BACKEND": "NO", "ACCELERATE_MIXED_PRECISION": "no"}
"""What ``accelerate launch`` (1.16) puts into a single CPU process's environment, besides OMP_NUM_THREADS=1."""
TORCHRUN = {"TORCHELASTIC_RUN_ID": "x", "LOCAL_WORLD_SIZE": "2", "LOCAL_RANK": "0", "RANK": "0", "WORLD_SIZE": "2"}


def test_passive_wait_policy_unless_the_user_chose_one():
    env: dict[str, str] = {}
    assert prepare_cpu_env(env) == {"OMP_WAIT_POLICY": "PASSIVE"} and env["OMP_WAIT_POLICY"] == "PASSIVE"
    mine = {"OMP_WAIT_POLICY": "ACTIVE"}
    assert prepare_cpu_env(mine) == {} and mine == {"OMP_WAIT_POLICY": "ACTIVE"}


def test_launchers_are_recognised_by_what_they_put_in_the_environment():
    assert launcher_of({}) is None and launcher_of({"OMP_NUM_THREADS": "1"}) is None
    assert launcher_of(ACCELERATE) == "accelerate launch"
    assert launcher_of(TORCHRUN) == "torchrun"


def test_python_and_accelerate_launch_get_the_same_count():
    python = choose_cpu_threads(None, {}, cores=2)
    accelerate = choose_cpu_threads(None, {**ACCELERATE, "OMP_NUM_THREADS": "1"}, cores=2)
    assert python.threads == accelerate.threads == 2
    assert "replaces OMP_NUM_THREADS=1, which accelerate launch sets" in accelerate.reason
    assert "train.cpu_threads" in accelerate.reason  # the log line names the setting that keeps another count


def test_processes_and_their_data_workers_share_the_cores():
    assert choose_cpu_threads(None, {**TORCHRUN, "OMP_NUM_THREADS": "1"}, cores=8).threads == 4
    assert choose_cpu_threads(None, {**TORCHRUN, "OMP_NUM_THREADS": "1"}, cores=8, data_workers=1).threads == 3
    assert choose_cpu_threads(None, {**TORCHRUN, "LOCAL_WORLD_SIZE": "4"}, cores=2).threads == 1  # never 0
    # The default run on 2 cores: one process, one data worker, one thread, whichever the launcher.
    python = choose_cpu_threads(None, {}, cores=2, data_workers=1)
    accelerate = choose_cpu_threads(None, {**ACCELERATE, "OMP_NUM_THREADS": "1"}, cores=2, data_workers=1)
    assert python.threads == accelerate.threads == 1 and "less 1 data worker" in python.reason


def test_the_users_choice_is_honoured():
    chosen = choose_cpu_threads(3, {**ACCELERATE, "OMP_NUM_THREADS": "1"}, cores=2)  # train.cpu_threads
    assert chosen.threads == 3 and chosen.reason == "train.cpu_threads; OMP_NUM_THREADS=1 not used"
    own = choose_cpu_threads(None, {"OMP_NUM_THREADS": "1"}, cores=2)  # no launcher: only the user can have set it
    assert own.threads == 1 and own.reason == "OMP_NUM_THREADS from the environment"
    with pytest.raises(ValueError, match=r"train\.cpu_threads = 0"):
        choose_cpu_threads(0, {}, cores=2)
    with pytest.raises(ValueError, match="OMP_NUM_THREADS='two'"):
        choose_cpu_threads(None, {"OMP_NUM_THREADS": "two"}, cores=2)


PROBE = """
import json, os, sys
sys.path.insert(0, {root!r})
from vlm_sft.cpu_threads import prepare_cpu_env, set_cpu_threads
prepare_cpu_env()
import torch
before = torch.get_num_threads()
set_cpu_threads(None)
print(json.dumps({{"omp": os.environ.get("OMP_NUM_THREADS"), "before": before, "after": torch.get_num_threads(),
                  "wait": os.environ.get("OMP_WAIT_POLICY")}}))
"""


def test_accelerate_launch_trains_with_as_many_threads_as_python(tmp_path):
    """The real launcher: it hands its process OMP_NUM_THREADS=1 (torch starts with 1 thread, where python starts
    with the cores), and the trainer's choice brings both to the same count."""
    script = tmp_path / "probe.py"
    script.write_text(PROBE.format(root=str(REPO_ROOT)))
    env = {k: v for k, v in os.environ.items() if not k.startswith(("OMP_", "ACCELERATE_", "LOCAL_", "TORCHELASTIC"))}
    env.pop("RANK", None), env.pop("WORLD_SIZE", None)

    def run(cmd: list[str]) -> dict:
        out = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=120, check=True).stdout
        return json.loads(out.strip().splitlines()[-1])

    launches = (
        [sys.executable, str(script)],
        [sys.executable, "-m", "accelerate.commands.launch", "--num_processes", "1", str(script)],
    )
    with ThreadPoolExecutor(2) as pool:  # side by side: each is one process at a time, mostly importing
        python, accelerate = pool.map(run, launches)
    assert accelerate["omp"] == "1" and python["omp"] is None  # what the launchers did
    assert accelerate["before"] == 1  # ... and what torch would have used
    assert accelerate["after"] == python["after"] == len(os.sched_getaffinity(0))
    assert accelerate["wait"] == python["wait"] == "PASSIVE"
