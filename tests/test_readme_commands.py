"""Every command in the README's and the docs pages' code blocks works: each is run here, tiny and offline, or names the
test that runs it.

The README and ``docs/*.md`` are what users copy, and a command in them that no test runs rots unseen. The fenced
```bash and plain ``` blocks are parsed into commands (``doc_pages``: backslash continuations joined, comments
dropped, ``&&`` chains split), and ``COMMANDS`` says for each one, by its exact text, how it is covered:

- ``Run``: run as written from the repository root, through its own launcher (``accelerate launch``, ``torchrun``,
  ``python -m``), with overrides appended that make it tiny, offline and CPU-only (``tiny_overrides``). A command on
  a config that names a real checkpoint (``configs/qwen3_5_0_8b.toml``: a hub id, bf16, CUDA) gets a local HF
  checkpoint directory of the tiny model instead, in float32 on the CPU; ``data/train.jsonl`` becomes a small jsonl
  of shapes rows with their images beside it. ``Run("plan")`` runs a command that needs nothing made tiny as written.
- ``Covered``: run by CI or by another test, named together with a line of that file which must still be there;
  ``needs`` marks what a user's run of it needs that this machine lacks (a GPU, the hub, Slurm).

A documented command missing from the table fails with the fix, and so does a table entry no page has any more.
Every ``vlm_sft/train.py`` command's ``--config`` and dotted overrides must also load as a config, covered or run,
so a misspelt setting in a page fails here. The TOML blocks and the links are checked in ``tests/test_docs.py``.
"""

from __future__ import annotations

import itertools
import json
import os
import shlex
import signal
import socket
import string
import subprocess
import sys
import time
import tomllib
from dataclasses import dataclass, field
from pathlib import Path

import pytest
from doc_pages import PAGES, pages_commands, parse_page, train_overrides
from train_helpers import launch_env, tiny_run_args

from vlm_sft.checkpoint.export import save_pretrained
from vlm_sft.config import REPO_ROOT, load_config, split_config_arg

DEFAULT_CONFIG = "configs/debug.toml"
USER_DATA = "data/train.jsonl"
"""The pages' example of the user's own data file: replaced by a small jsonl of shapes rows."""

COMMAND_TIMEOUT_S = 180.0
"""Per command; a tiny run takes 10 to 45 s on 2 cores, so this only stops a hang (e.g. a rendezvous never met)."""

PROCESSES_PER_CORE = 2
"""A tiny run spends most of its life importing and reading files, so two processes per core keep the cores busy
(measured on 2 cores: 132 s for every command against 167 s at one per core)."""

TINY_STEPS = 2
USER_ROWS = 16
"""Rows of the stand-in for ``data/train.jsonl``."""

SHAPES = {"num_train": 48, "num_eval": 8, "seed": 0, "image_size": 64}
"""The shapes set every debug-config command trains on; written once, before any command starts, so that commands
running side by side never race to write it (``tiny_overrides`` passes the same counts)."""


# ---------------------------------------------------------------------------------------------------------------
# The table: how each documented command is covered.


@dataclass(frozen=True)
class Run:
    """Run the command as written, made tiny; then check what it must leave behind."""

    expect: str
    """``train`` (``final/`` and ``metrics.jsonl`` in the output dir), ``report`` (its JSON), ``check_packing``
    (exit 0 and its table printed once), or ``plan`` (run as written, nothing appended: exit 0 and the plan's
    ``training`` line printed)."""
    procs: int = 1
    """Processes the command starts on this machine; the scheduler runs no more than the cores at once."""
    nodes: int = 1
    """> 1: the command is launched this many times at once on localhost, with ``NODE_RANK`` 0, 1, ... (one
    "machine" each)."""
    set_flags: tuple[tuple[str, str], ...] = ()
    """(flag, value) pairs whose value replaces the page's (``{port}``: a free port)."""
    env: tuple[tuple[str, str], ...] = ()
    """Shell variables the command names (``$MASTER``), as (name, value)."""


@dataclass(frozen=True)
class Covered:
    """Run somewhere else; ``evidence`` is (file, text it must contain), so a renamed test fails here."""

    by: str
    evidence: tuple[str, str]
    needs: str = ""
    """What a user's run of the command needs that the test machine lacks ("a GPU", "the hub", "Slurm"): the reason
    it is covered elsewhere rather than run here."""


def _ci(part: str) -> Covered:
    return Covered("CI: .ci/run runs the quickstart's install parts on a clean checkout", (".ci/run", part))


COMMANDS: dict[str, Run | Covered] = {
    "python3 -m venv .venv": _ci("python3 -m venv .venv"),
    ". .venv/bin/activate": _ci(". .venv/bin/activate"),
    "pip install -q torch==2.13.0": _ci("pip install -q torch==2.13.0"),
    "pip install -q -e .": Covered(
        'CI: .ci/run installs -e ".[dev]", which is -e . plus the dev extras', (".ci/run", 'pip install -q -e ".[dev]"')
    ),
    'pip install -q -e ".[dev]"': _ci('pip install -q -e ".[dev]"'),
    'HF_HUB_OFFLINE=1 python -m pytest -m "not gpu"': Covered(
        "tests/test_readme.py::test_ci_runs_exactly_the_readme_test_command (CI runs it)",
        ("tests/test_readme.py", "def test_ci_runs_exactly_the_readme_test_command"),
    ),
    "accelerate launch vlm_sft/train.py": Run("train"),
    "accelerate launch vlm_sft/train.py --config configs/debug.toml --train.max_steps 20 --data.packing cat": Run(
        "train"
    ),
    "python -m vlm_sft.report --config configs/qwen3_5_0_8b.toml --data.source data/train.jsonl": Run("report"),
    (
        "srun torchrun --nproc_per_node 8 --signals-to-handle SIGTERM,SIGINT,SIGHUP,SIGQUIT,SIGUSR1 --shutdown-timeout "
        "600 vlm_sft/train.py --config configs/qwen3_5_0_8b.toml --train.resume latest --train.save_every 200"
    ): Covered(
        "tests/test_preemption.py runs what it relies on: the stop signal's save on one process and on one rank of "
        "two, and torchrun's restart resuming from the latest checkpoint",
        ("tests/test_preemption.py", "def test_sigterm_to_one_rank_stops_both_at_the_same_step"),
        needs="Slurm and 8 GPUs",
    ),
    (
        "torchrun --standalone --nproc_per_node 2 --max-restarts 3 vlm_sft/train.py --config configs/debug.toml "
        "--train.resume latest --train.save_every 100"
    ): Covered(
        "tests/test_preemption.py kills one worker of this recipe (tiny) after a checkpoint and checks the restart",
        ("tests/test_preemption.py", "def test_torchrun_restart_resumes_from_the_latest_checkpoint"),
    ),
    (
        'hf download HuggingFaceM4/the_cauldron --repo-type dataset --include "README.md" --include "ai2d/*" '
        "--local-dir data/the_cauldron"
    ): Covered(
        "tests/test_snapshots.py writes the layout it leaves (README.md configs, one subfolder of parquet shards per "
        "subset, the_cauldron's features) and reads each subset",
        ("tests/test_snapshots.py", "def test_each_subset_of_a_readme_snapshot_loads_alone_by_name"),
        needs="the hub",
    ),
    "python -m vlm_sft.report --data.source data/the_cauldron --data.subset ai2d --show 2": Covered(
        "tests/test_snapshots.py runs the page's line, as written, in a folder holding such a snapshot",
        ("tests/test_snapshots.py", "def test_the_readme_show_command_runs_on_the_snapshot"),
    ),
    "python -m vlm_sft.data.mixture_example": Covered(
        "tests/test_mixture_example.py runs the CLI's main (into a temporary folder) and loads what it writes",
        ("tests/test_mixture_example.py", "assert main(argv) == 0"),
    ),
    "accelerate launch vlm_sft/train.py --config configs/debug_mixture.toml": Covered(
        "tests/test_mixture_example.py trains the shipped config, made tiny, on the example's files",
        ("tests/test_mixture_example.py", "def test_the_config_trains_on_the_mixture_and_scores_each_eval_source"),
    ),
    "python -m vlm_sft.check_packing --config configs/qwen3_5_0_8b.toml": Run("check_packing"),
    "accelerate launch --multi_gpu --num_processes 2 vlm_sft/train.py --config configs/debug.toml": Run(
        "train", procs=2
    ),
    "torchrun --nproc_per_node 2 vlm_sft/train.py --config configs/debug.toml": Run("train", procs=2),
    (
        "accelerate launch --multi_gpu --num_machines 2 --machine_rank $NODE_RANK --main_process_ip $MASTER "
        "--main_process_port 29500 --num_processes 16 vlm_sft/train.py --config configs/qwen3_5_0_8b.toml"
    ): Run(
        "train",
        procs=2,
        nodes=2,
        set_flags=(("--main_process_port", "{port}"), ("--num_processes", "2")),
        env=(("MASTER", "127.0.0.1"),),
    ),
    "python -m vlm_sft.generate outputs/debug/final --data data/shapes/seed0-size64/eval.jsonl": Covered(
        "tests/test_generation.py asks a trained tiny run's final/ over its held-out file with the same arguments",
        ("tests/test_generation.py", '_generate_cli(str(final), "--data"'),
    ),
    (
        "python -m vlm_sft.generate outputs/debug/final --image data/shapes/seed0-size64/images/eval-000001.png "
        '--prompt "What colour is the shape?"'
    ): Covered(
        "tests/test_generation.py::test_one_question_about_an_image_from_the_command_line",
        ("tests/test_generation.py", "def test_one_question_about_an_image_from_the_command_line"),
    ),
    "python -m vlm_sft.evaluate outputs/debug/final --data.metric exact_match": Covered(
        "tests/test_generation.py runs it on a trained run's final/ (with its shapes settings) on 1 and 2 processes",
        ("tests/test_generation.py", "def test_the_evaluate_cli_on_final_scores_what_the_last_eval_scored"),
    ),
    (
        "python -m vlm_sft.evaluate outputs/debug/final --source data/chartqa.parquet --metric relaxed_accuracy "
        '--instruction "Answer the question using a single word or phrase."'
    ): Covered(
        "tests/test_generation.py runs the page's line as written next to a ChartQA-schema file and a final/",
        ("tests/test_generation.py", "def test_the_readme_scores_a_chartqa_file_as_written"),
    ),
    "bash bench/gpu.sh": Covered(
        "the GPU session runs it; its parts run on the CPU in tests/test_gpu_check.py",
        ("tests/test_gpu_check.py", '"bench/gpu.sh", "--cpu-smoke"'),
        needs="a GPU",
    ),
    "bash bench/gpu.sh --cpu-smoke": Covered(
        "tests/test_gpu_check.py (the smoke fixture)", ("tests/test_gpu_check.py", '"bench/gpu.sh", "--cpu-smoke"')
    ),
    "python vlm_sft/train.py --help": Covered(
        "tests/test_cli.py runs --help on every entry point and checks the fields it lists",
        ("tests/test_cli.py", "def test_help_lists_every_config_field_and_exits_0"),
    ),
    "python vlm_sft/train.py --config configs/debug.toml --dry-run": Covered(
        "tests/test_dry_run.py runs --dry-run on the debug config (tiny overrides) on 2 ranks",
        ("tests/test_dry_run.py", '"--dry-run"'),
    ),
    "python -m vlm_sft.checks.memory_plan --config configs/qwen3_5_35b_a3b.toml --world-size 8": Run("plan"),
    "python -m vlm_sft.plot outputs/debug": Covered(
        "tests/test_plot.py runs the CLI on a run folder",
        ("tests/test_plot.py", 'cli = [sys.executable, "-m", "vlm_sft.plot"]'),
    ),
    "accelerate launch vlm_sft/train.py --config configs/debug_video.toml": Covered(
        "tests/test_video_task.py trains the shipped config, made small, and scores its video task",
        ("tests/test_video_task.py", "def test_the_video_config_trains_and_scores_the_video_task"),
    ),
    "python -m vlm_sft.generate outputs/debug_video/final --data data/shapes/seed0-size64-video0.3/eval.jsonl": Covered(
        "tests/test_video_task.py asks that run's final/ over its held-out file, clips included, the same way",
        ("tests/test_video_task.py", '[str(run / "final"), "--data", str(held_out)'),
    ),
    'python -m vlm_sft.generate outputs/debug/final --video clip.mp4 --prompt "What moves?"': Covered(
        "tests/test_video_render.py asks a checkpoint about a clip with the same arguments",
        ("tests/test_video_render.py", '"--video", CLIP, "--prompt", "What moves?"'),
    ),
    "accelerate launch vlm_sft/train.py --config configs/debug_lora.toml": Covered(
        "VLM_SFT_LEARNING_CHECKS=1 tests/test_lora.py trains the shipped config as it is (about 4 minutes)",
        ("tests/test_lora.py", '"--config", "configs/debug_lora.toml"'),
    ),
    "accelerate launch vlm_sft/train.py --config configs/debug_moe.toml": Covered(
        "VLM_SFT_LEARNING_CHECKS=1 tests/test_moe_train.py trains the shipped config as it is (about 4 minutes)",
        ("tests/test_moe_train.py", '"--config", "configs/debug_moe.toml"'),
    ),
    "accelerate launch --multi_gpu --num_processes 8 vlm_sft/train.py --config configs/qwen3_5_9b_lora.toml": Covered(
        "tests/test_config.py loads every shipped config; LoRA on several processes runs in tests/test_lora.py",
        ("tests/test_config.py", "def test_every_shipped_config_loads"),
        needs="8 GPUs and the hub",
    ),
    (
        "accelerate launch --multi_gpu --num_processes 8 vlm_sft/train.py --config configs/qwen3_5_9b_long_context.toml"
    ): Covered(
        "tests/test_config.py loads every shipped config; CP training runs on the CPU in tests/test_context_parallel.py",
        ("tests/test_config.py", "def test_every_shipped_config_loads"),
        needs="8 GPUs and the hub",
    ),
    "python3 -m venv .venv-interpret": _ci("python3 -m venv .venv-interpret"),
    ". .venv-interpret/bin/activate": _ci(". .venv-interpret/bin/activate"),
    'pip install -q -e ".[dev,interpret]"': _ci('pip install -q -e ".[dev,interpret]"'),
    "HF_HUB_OFFLINE=1 python -m pytest -m interpret": _ci("HF_HUB_OFFLINE=1 python -m pytest -m interpret"),
}


# ---------------------------------------------------------------------------------------------------------------
# The pages' commands against the table.


def table_problems(commands: list[str], table: dict[str, object]) -> list[str]:
    """Both directions: a documented command with no table entry, and a table entry no page has any more."""
    missing = [
        f"documented command not covered by any test: {c!r}; add it to COMMANDS in tests/test_readme_commands.py "
        "(Run: how to make it tiny, or Covered: which test runs it)"
        for c in commands
        if c not in table
    ]
    stale = [
        f"COMMANDS entry {c!r} is not in README.md or docs/ any more: remove it, or update it to the page's new text"
        for c in table
        if c not in commands
    ]
    return missing + stale


PAGE_COMMANDS, PAGE_PROBLEMS = pages_commands()
DOC_COMMANDS = list(PAGE_COMMANDS)
RUN_COMMANDS = [c for c in DOC_COMMANDS if isinstance(COMMANDS.get(c), Run)]


# ---------------------------------------------------------------------------------------------------------------
# Making a command tiny, and running it.


@dataclass(frozen=True)
class StandIns:
    """What the fixture built for the commands: the shapes set, the user's jsonl, a local HF checkpoint."""

    shapes_root: Path
    user_jsonl: Path
    checkpoint: Path


def _config_of(argv: list[str]) -> dict:
    """The TOML the command names (``{}`` for a missing file: the command itself then fails with its own error)."""
    path = REPO_ROOT / (argv[argv.index("--config") + 1] if "--config" in argv else DEFAULT_CONFIG)
    if not path.is_file():
        return {}
    with path.open("rb") as f:
        return tomllib.load(f)


def tiny_overrides(argv: list[str], out: Path, stand_ins: StandIns) -> list[str]:
    """Overrides appended to a documented command (the last of a repeated override wins): a seconds-long run, and for a
    config that names a real model, the tiny local checkpoint in float32 on the CPU, on the stand-in jsonl."""
    shapes = {f"data.shapes.{k}": v for k, v in SHAPES.items()}
    extra = tiny_run_args(
        out, **shapes, **{"data.shapes.root": str(stand_ins.shapes_root), "train.max_steps": TINY_STEPS}
    )
    config = _config_of(argv)
    if config.get("model", {}).get("name_or_path", "tiny") != "tiny":
        extra += ["--model.name_or_path", str(stand_ins.checkpoint)]
    if config.get("model", {}).get("dtype") == "bfloat16":
        extra += ["--model.dtype", "float32"]
    if config.get("train", {}).get("device", "cpu") != "cpu":
        extra += ["--train.device", "cpu"]
    if config.get("data", {}).get("source", "shapes") != "shapes" and "--data.source" not in argv:
        extra += ["--data.source", str(stand_ins.user_jsonl)]
    return extra


def command_argv(command: str, run: Run, variables: dict[str, str], stand_ins: StandIns) -> list[str]:
    """The page's words, ``$VARS`` expanded (an unknown one raises), ``set_flags`` applied, the data path swapped."""
    argv = [string.Template(word).substitute(variables) for word in shlex.split(command)]
    for flag, value in run.set_flags:
        argv[argv.index(flag) + 1] = value.format(**variables)
    return [str(stand_ins.user_jsonl) if word == USER_DATA else word for word in argv]


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@dataclass
class Job:
    """One documented command: its launches (one per node), their processes and what they printed."""

    command: str
    run: Run
    out: Path
    launches: list[tuple[list[str], dict[str, str]]]
    procs: list[subprocess.Popen] = field(default_factory=list)
    started: float = 0.0
    seconds: float = 0.0
    timed_out: bool = False

    def start(self) -> None:
        self.started = time.monotonic()
        for i, (argv, env) in enumerate(self.launches):
            with (self.out / f"stdout{i}.txt").open("w") as o, (self.out / f"stderr{i}.txt").open("w") as e:
                self.procs.append(
                    subprocess.Popen(argv, cwd=REPO_ROOT, env=env, stdout=o, stderr=e, start_new_session=True)
                )

    def finished(self, timeout: float) -> bool:
        """Polls; past ``timeout`` kills this job's own process groups (launchers and their ranks)."""
        if all(p.poll() is not None for p in self.procs):
            self.seconds = time.monotonic() - self.started
            return True
        if time.monotonic() - self.started > timeout:
            self.timed_out = True
            self.kill()
            self.seconds = time.monotonic() - self.started
            return True
        return False

    def kill(self) -> None:
        """SIGKILL to the process groups this job started (each launch is a session of its own), then reap them."""
        for p in self.procs:
            if p.poll() is None:
                os.killpg(p.pid, signal.SIGKILL)
        for p in self.procs:
            p.wait()

    def stdout(self) -> str:
        return "".join((self.out / f"stdout{i}.txt").read_text() for i in range(len(self.launches)))

    def failure(self) -> str:
        """Empty when every launch exited 0, else the exit codes and the tail of what each printed."""
        codes = [p.returncode for p in self.procs]
        if not self.timed_out and all(c == 0 for c in codes):
            return ""
        tails = [
            f"--- launch {i} ({shlex.join(argv)}):\n{(self.out / f'stdout{i}.txt').read_text()[-3000:]}\n"
            f"{(self.out / f'stderr{i}.txt').read_text()[-6000:]}"
            for i, (argv, _) in enumerate(self.launches)
        ]
        return f"exit codes {codes}, timed out: {self.timed_out}\n" + "\n".join(tails)


def make_job(index: int, command: str, run: Run, tmp: Path, stand_ins: StandIns) -> Job:
    out = tmp / f"cmd{index}"
    out.mkdir()
    env = launch_env()
    env["PATH"] = f"{Path(sys.executable).parent}{os.pathsep}{env.get('PATH', '')}"  # the venv's python, accelerate
    env["HF_DATASETS_CACHE"] = str(tmp / "datasets_cache")
    env["PET_MASTER_PORT"] = str(_free_port())  # torchrun's default 29500 may be taken by another job on the machine
    port = str(_free_port())
    launches = []
    for node in range(run.nodes):
        shell_vars = {**dict(run.env), **({"NODE_RANK": str(node)} if run.nodes > 1 else {})}
        argv = command_argv(command, run, {**shell_vars, "port": port}, stand_ins)
        extra = [] if run.expect == "plan" else tiny_overrides(argv, out, stand_ins)
        launches.append((argv + extra, {**env, **shell_vars}))
    return Job(command, run, out, launches)


def run_jobs(jobs: list[Job], slots: int, timeout: float) -> None:
    """Runs the jobs side by side, never more processes than ``slots`` at once (a bigger job runs alone); jobs with
    more processes start first, since they take longest."""
    pending, running = sorted(jobs, key=lambda j: -j.run.procs), []
    try:
        while pending or running:
            for job in list(pending):
                if not running or sum(j.run.procs for j in running) + job.run.procs <= slots:
                    job.start()
                    running.append(job)
                    pending.remove(job)
            time.sleep(0.2)
            running = [j for j in running if not j.finished(timeout)]
    finally:  # an interrupted session must not leave training processes behind
        for job in running:
            job.kill()


def write_tiny_checkpoint(directory: Path) -> Path:
    """A local HF checkpoint directory of the tiny model (random init, float32) with the tiny processor: what a
    hub id like ``Qwen/Qwen3.5-0.8B`` resolves to, offline."""
    import torch

    from processors import load_tiny_processor, save_processor
    from vlm_sft.model import build_model
    from vlm_sft.model.presets import tiny_qwen3_5_config

    processor = load_tiny_processor()
    torch.manual_seed(0)
    save_pretrained(build_model(tiny_qwen3_5_config()), directory)
    save_processor(directory, processor, processor.tokenizer)
    return directory


@pytest.fixture(scope="module")
def ran(tmp_path_factory) -> dict[str, Job]:
    """Every ``Run`` command of the pages, run once, side by side as the cores allow; timings printed."""
    from vlm_sft.data.shapes import materialize_shapes

    tmp = tmp_path_factory.mktemp("readme_commands")
    materialize_shapes(tmp / "shapes", **SHAPES, progress=False)
    user = materialize_shapes(tmp / "user_data", num_train=USER_ROWS, num_eval=0, progress=False)["train"]
    stand_ins = StandIns(tmp / "shapes", user, write_tiny_checkpoint(tmp / "checkpoint"))
    jobs = [make_job(i, c, COMMANDS[c], tmp, stand_ins) for i, c in enumerate(RUN_COMMANDS)]
    t0 = time.monotonic()
    run_jobs(jobs, slots=PROCESSES_PER_CORE * (os.cpu_count() or 1), timeout=COMMAND_TIMEOUT_S)
    print(f"\ndocumented commands ({time.monotonic() - t0:.0f} s in all):")
    for job in jobs:
        print(f"  {job.seconds:6.1f} s  {job.command}")
    return {job.command: job for job in jobs}


# ---------------------------------------------------------------------------------------------------------------
# The tests.


def test_every_documented_command_is_in_the_table_and_every_entry_on_a_page():
    assert not PAGE_PROBLEMS, "\n".join(PAGE_PROBLEMS)
    assert len(PAGES) > 1 and all(PAGE_COMMANDS.get(c) for c in ("accelerate launch vlm_sft/train.py",)), (
        f"the parser no longer finds the pages' code blocks: {[p.name for p in PAGES]}"
    )
    problems = table_problems(DOC_COMMANDS, COMMANDS)
    assert not problems, "\n".join(problems)


def test_every_page_but_the_readme_opens_with_what_a_user_copies():
    """A docs page is a task page: a code block comes before its first section heading."""
    late = []
    for path in PAGES[1:]:
        text = path.read_text()
        first_block, first_section = text.find("\n```"), text.find("\n## ")
        if first_block < 0 or 0 <= first_section < first_block:
            late.append(path.name)
    assert not late, f"these pages do not open with a command or TOML block: {late}"


def config_problems(command: str) -> str:
    """Empty when a ``vlm_sft/train.py`` command's ``--config`` and overrides load as a config (or the command is
    another one); else the config error."""
    from vlm_sft.config import ConfigError

    args = train_overrides(command)
    if args is None:
        return ""
    config, overrides = split_config_arg(args)
    try:
        load_config(REPO_ROOT / config if config else None, overrides)
    except ConfigError as err:
        return f"{command!r}: {err}"
    return ""


def test_every_documented_training_command_names_settings_that_exist():
    """Covered or run, a training command's config and overrides must load: a misspelt setting in a page fails."""
    problems = [p for c in DOC_COMMANDS if (p := config_problems(c))]
    assert not problems, "\n".join(problems)


def test_covered_commands_on_a_gpu_config_say_what_they_need():
    """A documented training command on a CUDA config that no test runs is marked as needing a GPU (``needs``)."""
    unmarked = []
    for command, how in COMMANDS.items():
        args = train_overrides(command)
        if isinstance(how, Covered) and args is not None and not how.needs:
            config, overrides = split_config_arg(args)
            if load_config(REPO_ROOT / config if config else None, overrides).train.device == "cuda":
                unmarked.append(command)
    assert not unmarked, f"set Covered(needs=...) for these GPU commands: {unmarked}"


def test_a_misspelt_setting_in_a_page_fails_both_checks():
    """A copy of docs/cluster.md with one setting misspelt: the command is no longer the table's, and its
    overrides no longer load."""
    page = (REPO_ROOT / "docs" / "cluster.md").read_text()
    wrong = page.replace("--train.save_every 100", "--train.save_evry 100")
    assert wrong != page
    commands, _ = parse_page(wrong, "docs/cluster.md")
    misspelt = next(c for c in commands if "save_evry" in c)
    assert any("not covered by any test" in p for p in table_problems(commands, COMMANDS))
    assert "train.save_evry: unknown setting; did you mean train.save_every?" in config_problems(misspelt)


@pytest.mark.parametrize("command", [c for c, how in COMMANDS.items() if isinstance(how, Covered)])
def test_covered_commands_name_a_test_that_still_runs_them(command):
    how = COMMANDS[command]
    path, text = how.evidence
    assert text in (REPO_ROOT / path).read_text(), (
        f"{command!r} is said to be covered by {how.by}, but {path} no longer contains {text!r}"
    )


def test_the_parser_joins_continuations_drops_comments_splits_chains_and_skips_diagrams():
    text = (
        '```bash\npython3 -m venv .venv && . .venv/bin/activate && pip install -e ".[dev]"  # install\n```\n'
        "```\n # a comment line\nrun a --x 'b && c' \\\n    --y 1   # trailing\nrun 'a # not a comment'\n```\n"
        "```\n rows (jsonl)\n   |\n   v\n```\n```toml\n[x]\ny = 1\n```\n"
    )
    commands, problems = parse_page(text)
    assert commands == [
        "python3 -m venv .venv",
        ". .venv/bin/activate",
        'pip install -e ".[dev]"',
        "run a --x 'b && c' --y 1",
        "run 'a # not a comment'",
    ]
    assert problems == []


def test_the_parser_reports_a_broken_command_instead_of_taking_it_for_a_diagram():
    commands, problems = parse_page("```\npython -m vlm_sft.report --config (x\n```\n", "docs/data.md")
    assert commands == [] and len(problems) == 1 and "docs/data.md:1" in problems[0]


def test_table_problems_name_missing_commands_and_stale_entries():
    problems = table_problems(["a", "b"], {"b": Run("train"), "c": Run("train")})
    assert len(problems) == 2
    assert "'a'" in problems[0] and "add it to COMMANDS" in problems[0]
    assert "'c'" in problems[1] and "not in README.md or docs/" in problems[1]


def test_multi_node_command_becomes_one_local_launch_per_node(tmp_path):
    """$NODE_RANK and $MASTER are filled in per node, the port and the process count replaced, the rest kept."""
    command = next(c for c, how in COMMANDS.items() if isinstance(how, Run) and how.nodes > 1)
    stand_ins = StandIns(tmp_path / "shapes", tmp_path / "train.jsonl", tmp_path / "ckpt")
    job = make_job(0, command, COMMANDS[command], tmp_path, stand_ins)
    assert len(job.launches) == 2
    for node, (argv, env) in enumerate(job.launches):
        value = {flag: v for flag, v in itertools.pairwise(argv) if flag.startswith("--")}  # last one wins
        assert value["--machine_rank"] == str(node) == env["NODE_RANK"]
        assert value["--main_process_ip"] == "127.0.0.1" and value["--num_processes"] == "2"
        assert value["--main_process_port"] != "29500" and value["--model.name_or_path"] == str(tmp_path / "ckpt")
        assert value["--model.dtype"] == "float32" and value["--train.device"] == "cpu"
    with pytest.raises(KeyError):  # a variable the table does not set is an error, never an empty string
        command_argv(command, Run("train"), {}, stand_ins)


def test_a_failing_or_hanging_command_is_reported_and_its_processes_killed(tmp_path):
    """The runner itself: a non-zero exit and a hang past the timeout both come back as failures."""
    jobs = []
    for i, code in enumerate(["import sys; print('bad input'); sys.exit(3)", "import time; time.sleep(60)"]):
        (tmp_path / f"cmd{i}").mkdir()
        jobs.append(Job(f"cmd{i}", Run("train"), tmp_path / f"cmd{i}", [([sys.executable, "-c", code], launch_env())]))
    run_jobs(jobs, slots=2, timeout=2.0)
    exits, hangs = jobs
    assert "exit codes [3]" in exits.failure() and "bad input" in exits.failure() and not exits.timed_out
    assert hangs.timed_out and hangs.procs[0].returncode == -signal.SIGKILL and hangs.failure()


@pytest.mark.slow
@pytest.mark.parametrize("command", RUN_COMMANDS)
def test_documented_command_runs(ran, command):
    job = ran[command]
    assert not job.failure(), f"documented command failed: {command}\n{job.failure()}"
    out = job.out / "run"
    if job.run.expect == "train":
        assert (out / "final" / "config.json").is_file(), f"no final/ checkpoint in {out}"
        steps = [json.loads(line).get("step") for line in (out / "metrics.jsonl").read_text().splitlines()]
        assert max(s for s in steps if s is not None) == TINY_STEPS
        ranks = json.loads((out / "data_accounting.json").read_text())["per_rank"]
        assert len(ranks) == job.run.procs, f"{command!r} trained on {len(ranks)} ranks, not {job.run.procs}"
    elif job.run.expect == "report":
        report = json.loads((out / "data_report.json").read_text())
        assert report["samples_seen"] == report["samples_packed"] == USER_ROWS  # the stand-in data, every row packed
    elif job.run.expect == "check_packing":
        assert job.stdout().count("packing check:") == 1, job.stdout()
    elif job.run.expect == "plan":
        assert "training" in job.stdout(), job.stdout()
    else:
        raise AssertionError(f"unknown expectation {job.run.expect!r} for {command!r}")
