"""Progress and logging as a log file sees them: a tqdm bar only in a terminal, one plain line per metrics record
elsewhere (a cluster job's log got a line per step from the bar), and INFO lines from rank 0 only."""

from __future__ import annotations

import io
import logging

import pytest

from vlm_sft.train import setup_logging
from vlm_sft.trainer.metrics import MetricsLogger


class _Terminal(io.StringIO):
    def isatty(self) -> bool:
        return True


def _record(step: int) -> dict:
    return {"step": step, "loss": 1.5 / step, "lr": 1e-3, "grad_norm": 0.5, "tokens_per_s": 1234.4, "images": 3}


def _drive(metrics: MetricsLogger, steps: int, log_every: int) -> None:
    """What the training loop does: advance every step, log a record every ``log_every`` steps."""
    for step in range(1, steps + 1):
        metrics.advance(1, loss=1.0, lr=1e-3, tok_s=100.0)
        if step % log_every == 0:
            metrics.log(_record(step))


def test_log_file_gets_one_line_per_record_and_nothing_per_step(tmp_path):
    stream = io.StringIO()  # not a terminal: detected, not passed
    metrics = MetricsLogger(tmp_path, enabled=True, total_steps=30, stream=stream)
    assert not metrics.is_tty
    for _ in range(9):
        metrics.advance(1, loss=1.0)
    assert stream.getvalue() == ""  # the bar used to write here on every step
    metrics.log(_record(10))
    _drive(metrics, 20, log_every=10)
    metrics.log({"step": 30, "eval_loss": 0.7})  # an eval record: its line comes from write()
    metrics.write("eval step 30: loss 0.7000")
    metrics.close()
    lines = stream.getvalue().splitlines()
    assert len(lines) == 4 and "\r" not in stream.getvalue()
    assert lines[0].startswith("step 10/30 loss 0.1500 lr 0.001 grad_norm 0.5 tok/s 1234 elapsed ")
    assert [line.split()[1] for line in lines[:3]] == ["10/30", "10/30", "20/30"]
    assert "left" in lines[0] and lines[3] == "eval step 30: loss 0.7000"
    assert len((tmp_path / "metrics.jsonl").read_text().splitlines()) == 4


def test_terminal_gets_the_tqdm_bar(tmp_path):
    stream = _Terminal()
    metrics = MetricsLogger(tmp_path, enabled=True, total_steps=30, stream=stream)
    assert metrics.is_tty and metrics._bar is not None
    _drive(metrics, 20, log_every=10)
    metrics.close()
    out = stream.getvalue()
    assert "\r" in out and "train:" in out and "20/30" in out
    assert "step 10/30 loss" not in out  # no plain lines beside the bar


def test_is_tty_can_be_forced(tmp_path):
    stream = io.StringIO()
    metrics = MetricsLogger(tmp_path, enabled=True, total_steps=5, stream=stream, is_tty=True)
    assert metrics._bar is not None
    metrics.close()


def test_other_ranks_write_nothing(tmp_path):
    stream = io.StringIO()
    metrics = MetricsLogger(tmp_path / "r1", enabled=False, total_steps=30, stream=stream)
    _drive(metrics, 20, log_every=10)
    metrics.write("eval")
    metrics.close()
    assert stream.getvalue() == "" and not (tmp_path / "r1").exists()


@pytest.fixture
def root_logger():
    root = logging.getLogger()
    level, handlers = root.level, list(root.handlers)
    yield root
    for h in root.handlers:
        if h not in handlers:
            root.removeHandler(h)
    root.setLevel(level)


@pytest.mark.parametrize(
    ("rank", "all_ranks", "level"),
    [(0, False, logging.INFO), (1, False, logging.WARNING), (3, False, logging.WARNING), (1, True, logging.INFO)],
)
def test_only_rank_0_logs_info_unless_asked(root_logger, rank, all_ranks, level):
    root_logger.setLevel(logging.DEBUG)  # whatever was there before: setup_logging decides
    setup_logging(rank, all_ranks=all_ranks)
    assert root_logger.level == level
    assert logging.getLogger("vlm_sft.trainer.loop").isEnabledFor(logging.INFO) == (level == logging.INFO)
    assert logging.getLogger("vlm_sft.trainer.loop").isEnabledFor(logging.WARNING)
