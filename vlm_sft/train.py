"""Entry point: ``accelerate launch vlm_sft/train.py [--config configs/x.toml] [--section.field value ...]``.

With no arguments it runs ``configs/debug.toml`` (tiny offline model, shapes dataset, CPU). Also runs under
``torchrun`` and as plain ``python vlm_sft/train.py`` (one process). ``--help`` lists every config field.
``--dry-run`` sets everything up as training would, prints the memory per rank (measured and planned) and exits
before the first optimizer step: run it, with the same launcher and processes, before spending GPU hours.

Long runs on a cluster: SIGTERM or SIGUSR1 to any process saves a checkpoint after the next step on every rank and
exits with code 143 (a second signal exits at once); ``--train.resume latest`` continues, also as the restart recipe
``torchrun --max-restarts N ... --train.resume latest`` (``vlm_sft/trainer/preemption.py``).

Exit codes, the same on every process of a run: 0 finished; 1 an error (the data, a checkpoint, a failed rank, a bug:
its traceback); 2 a config error; 3 diverged (``train.max_nonfinite_steps`` non-finite steps in a row,
``vlm_sft/trainer/nonfinite.py``); 130 Ctrl-C; 143 stopped by a stop signal after its checkpoint.
"""

from __future__ import annotations

import logging
import os
import sys
import traceback
from typing import NoReturn

from vlm_sft.cpu_threads import prepare_cpu_env

prepare_cpu_env()  # before anything imports torch: OpenMP reads its settings once, when torch loads it

from vlm_sft.config import ConfigError, cli_parser, parse_cli  # noqa: E402 (after prepare_cpu_env, on purpose)

LOG_FORMAT = "%(asctime)s %(levelname)s {rank}%(name)s: %(message)s"
"""Log line layout; ``{rank}`` is empty on rank 0 and ``[rank N] `` on the others."""


def setup_logging(rank: int, *, all_ranks: bool = False) -> None:
    """INFO on rank 0, WARNING on the other ranks unless ``all_ranks`` (``train.log_all_ranks``).

    Every rank runs the same code, so without this a job of N processes prints every run summary N times. Warnings
    and errors stay on every rank: they may be that rank's own. Sets the root level even when a handler exists
    already (``basicConfig`` alone would then do nothing, e.g. under pytest or in a notebook).
    """
    logging.basicConfig(format=LOG_FORMAT.format(rank="" if rank == 0 else f"[rank {rank}] "))
    logging.getLogger().setLevel(logging.INFO if rank == 0 or all_ranks else logging.WARNING)


def main(argv: list[str] | None = None) -> int:
    parser = cli_parser("python vlm_sft/train.py", __doc__.replace("``", ""))
    parser.add_argument(
        "--dry-run",
        action="store_true",
        help="set up as training would (checkpoint load, wrapping, sharding, self-check, the first step's batches), "
        "print each rank's measured peak memory and planned steady-state memory, and exit 0 before the first "
        "optimizer step (also written to <train.output_dir>/dry_run.json)",
    )
    known, cfg = parse_cli(parser, sys.argv[1:] if argv is None else argv)
    if cfg is None:
        return 2
    from renderers import TemplateParityError
    from vlm_sft.checkpoint.state import CheckpointSaveError
    from vlm_sft.data.pipeline import EmptyPassError, SkipFractionError
    from vlm_sft.parallel.collectives import PeerFailure
    from vlm_sft.parallel.dcp import UnknownMetadataClass
    from vlm_sft.trainer.dry_run import dry_run
    from vlm_sft.trainer.loop import train
    from vlm_sft.trainer.nonfinite import DIVERGED_EXIT_CODE, DivergedError
    from vlm_sft.trainer.preemption import PREEMPTED_EXIT_CODE
    from vlm_sft.trainer.trackers import check_installed

    rank = int(os.environ.get("RANK", "0"))  # set by torchrun / accelerate launch
    is_main = rank == 0
    setup_logging(rank, all_ranks=cfg.train.log_all_ranks)
    if not sys.stderr.isatty():  # datasets' own bars would write a line per update into a job's log file
        import datasets

        datasets.disable_progress_bars()
    try:
        check_installed(cfg.train.report_to)  # a missing tracker package fails now, not after the model is built
        result = dry_run(cfg) if known.dry_run else train(cfg)
    except ConfigError as err:  # settings that only fail against the machine or the data (e.g. bf16 without CUDA)
        print(f"config error: {err}", file=sys.stderr)
        return 2
    except TemplateParityError as err:  # the checkpoint's template would not serve what the run trains on
        print(f"template error: {err}", file=sys.stderr)
        return 2
    except PeerFailure as err:  # another rank failed and printed why; rank 0 says where, the others stop quietly
        if is_main:
            print(err, file=sys.stderr)
        return 1
    except (SkipFractionError, EmptyPassError, FileNotFoundError) as err:  # the data, not the code: no traceback
        print(f"data error: {err}", file=sys.stderr)
        return 1
    except (CheckpointSaveError, UnknownMetadataClass) as err:  # a full disk; a checkpoint this torch cannot read
        print(f"checkpoint error: {err}", file=sys.stderr)
        return 1
    except DivergedError as err:  # every rank stopped at the same step; nothing was saved after it began
        if is_main:
            print(f"diverged: {err}", file=sys.stderr)
        return DIVERGED_EXIT_CODE
    if result.stopped is not None:  # a stop signal: every rank exits with the code that says "resume me"
        if is_main:
            where = result.stopped.checkpoint or "none (no step trained since the start, or one skipped as non-finite)"
            print(
                f"stopped at step {result.stopped.step} on a stop signal; checkpoint: {where}; "
                f"exit code {PREEMPTED_EXIT_CODE}; --train.resume latest continues the run"
            )
        return PREEMPTED_EXIT_CODE
    if not is_main:  # every rank returns the same result; rank 0 reports it
        return 0
    if known.dry_run:  # the report was printed by dry_run(); nothing was trained or saved
        print(f"dry run done: no optimizer step taken; the report is in {cfg.train.output_dir}/dry_run.json")
        return 0
    report(result, cfg.train.output_dir, draw=cfg.train.plot)
    return 0


def report(result, output_dir: str, *, draw: bool = True) -> None:
    """Rank 0's summary of a finished run (a ``trainer.loop.RunResult``): final eval, data, speed, plot."""
    if result.last_eval:
        accs = {k: round(v, 4) for k, v in result.last_eval.items() if k.startswith("eval_acc")}
        print(f"final eval: loss {result.last_eval['eval_loss']:.4f}, accuracy {accs}")
    data = result.data
    reasons = ", ".join(f"{reason} {info['count']}" for reason, info in data["skipped"].items()) or "none"
    print(
        f"data: {data['samples_seen']} samples seen, {data['samples_packed']} packed, {data['samples_skipped']} "
        f"skipped ({reasons}); details in {output_dir}/data_accounting.json"
    )
    print(
        f"finished {result.steps} steps in {result.wall_time_s:.1f} s ({result.real_tokens_per_s:.0f} real tokens/s); "
        f"checkpoint: {result.final_dir}"
    )
    if draw:
        plot(output_dir)


def plot(output_dir: str) -> None:
    """``run.png`` of a finished run (``vlm_sft.plot``); a plot that cannot be drawn is a warning, never a failure."""
    from vlm_sft.plot import plot_run

    try:
        path = plot_run(output_dir)
    except (OSError, ValueError) as err:
        print(f"warning: could not draw the run's plot: {err}", file=sys.stderr)
    else:
        print(f"plot: {path} (python -m vlm_sft.plot {output_dir} redraws it)")


INTERRUPTED_EXIT_CODE = 130
"""Ctrl-C (SIGINT): 128 + 2, what a shell reports for a process that SIGINT ended."""


def cli(argv: list[str] | None = None) -> NoReturn:
    """``main``, then one way out whatever happened, with the code of the module docstring: data workers still alive
    are ended (none may hold the exit), and a process of a multi-process run leaves without the interpreter's
    teardown (``parallel.env.end_process``: on gloo it could abort, SIGABRT, after an error as after a finished
    run)."""
    try:
        code = main(argv)
    except KeyboardInterrupt:
        print(
            "interrupted (Ctrl-C): nothing saved since the last checkpoint; --train.resume latest continues from it",
            file=sys.stderr,
        )
        code = INTERRUPTED_EXIT_CODE
    except SystemExit as exit_:  # argparse's --help and usage errors: their code, as Python would exit
        code = exit_.code if isinstance(exit_.code, int) else int(exit_.code is not None)
        if isinstance(exit_.code, str):
            print(exit_.code, file=sys.stderr)
    except BaseException:  # the process's last handler (DCP's errors are BaseExceptions): the traceback, the exit below
        traceback.print_exc()
        code = 1
    from vlm_sft.parallel.env import end_children, end_process

    end_children()
    if int(os.environ.get("WORLD_SIZE", "1")) > 1:  # a process of a multi-process run: skip the teardown that aborts
        end_process(code)
    sys.exit(code)


if __name__ == "__main__":
    cli()
