"""The command line a user meets: ``--help`` on every entry point, did-you-mean for misspelt settings, and the
documented override example (docs/configuration.md: ``--train.max_steps 20`` on debug.toml, once refused because of
its 50 warmup steps).
"""

from __future__ import annotations

import logging
import re
import shlex
import subprocess
import sys
from concurrent.futures import ThreadPoolExecutor

import pytest
import torch
from doc_pages import PAGES, block

from vlm_sft.checkpoint.state import TrainerState, capture_rng, save_checkpoint
from vlm_sft.config import REPO_ROOT, ConfigError, config_from_cli, load_config
from vlm_sft.parallel.env import DistEnv
from vlm_sft.trainer.optim import build_scheduler

DOCS = "\n".join(page.read_text() for page in PAGES)
"""README.md and docs/*.md."""


ENTRY_POINTS = [
    ("vlm_sft/train.py",),
    ("-m", "vlm_sft.report"),
    ("-m", "vlm_sft.check_packing"),
    ("-m", "vlm_sft.evaluate"),
]


def _help(*entry: str) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, *entry, "--help"], cwd=REPO_ROOT, capture_output=True, text=True, timeout=120
    )


@pytest.fixture(scope="module")
def helps() -> dict[tuple[str, ...], subprocess.CompletedProcess]:
    """``--help`` of every entry point, launched side by side (each is one process, mostly importing), once for the
    tests below that read it."""
    with ThreadPoolExecutor(len(ENTRY_POINTS)) as pool:
        return dict(zip(ENTRY_POINTS, pool.map(lambda entry: _help(*entry), ENTRY_POINTS), strict=True))


@pytest.mark.parametrize("entry", ENTRY_POINTS, ids=str)
def test_help_lists_every_config_field_and_exits_0(entry, helps):
    proc = helps[entry]
    assert proc.returncode == 0, proc.stderr
    out = proc.stdout
    assert "usage:" in out and "--config FILE" in out and "--section.field VALUE" in out
    # Every field, dotted, with its type, default and docstring (generated from the models, so none is missing).
    assert "train.max_steps: int | None = 300" in out
    assert "Optimizer steps to run; None to run epochs instead." in out
    assert re.search(r"data\.packing: Literal\['bfd', 'cat', 'stack'\] = \"bfd\"", out)
    assert "model.vlm.freeze_vision: bool = true" in out
    assert "train.warmup_fraction: float | None = none" in out and "train.log_all_ranks: bool = false" in out


def test_check_packing_help_states_the_calibrated_bound(helps):
    """``--help`` names the bound without importing the model stack (which took 13 s); the number must stay true."""
    from vlm_sft.checks.packing_check import RATIO_BOUND

    assert f"RATIO_BOUND, {RATIO_BOUND:g};" in " ".join(helps[("-m", "vlm_sft.check_packing")].stdout.split())


def test_help_is_not_read_as_an_override(helps):
    """The bug: ``--help`` went to the override parser, which said ``override '--help' has no value``."""
    proc = helps[("vlm_sft/train.py",)]
    assert "config error" not in proc.stderr and "has no value" not in proc.stderr


@pytest.mark.parametrize(
    ("override", "message"),
    [
        ("--train.max_step", "train.max_step: unknown setting; did you mean train.max_steps?"),
        ("--trian.max_steps", "trian: unknown setting; did you mean train?"),
        (
            "--model.vlm.freeze_visoin",
            "model.vlm.freeze_visoin: unknown setting; did you mean model.vlm.freeze_vision?",
        ),
        ("--data.shapes.num_trian", "data.shapes.num_trian: unknown setting; did you mean data.shapes.num_train?"),
    ],
)
def test_misspelt_setting_suggests_the_closest_field(override, message, capsys):
    assert config_from_cli(["--config", "configs/debug.toml", override, "5"]) is None
    assert message in capsys.readouterr().err


def test_a_name_close_to_nothing_points_at_help():
    with pytest.raises(ConfigError) as err:
        load_config(None, ["--train.zzzzzz", "1"])
    assert "train.zzzzzz: unknown setting (python vlm_sft/train.py --help lists every field)" in str(err.value)
    assert "did you mean" not in str(err.value)


def _lrs(cfg, total_steps: int) -> list[float]:
    """The lr of each of the run's optimizer steps, from the real scheduler over one parameter."""
    opt = torch.optim.AdamW([torch.nn.Parameter(torch.zeros(1))], lr=cfg.train.lr)
    sched = build_scheduler(opt, cfg.train, total_steps)
    lrs = []
    for _ in range(total_steps):
        lrs.append(opt.param_groups[0]["lr"])
        opt.step()
        sched.step()
    return lrs


def _warmup_length(lrs: list[float], peak: float) -> int:
    """Steps before the first one at the peak lr (the warmup's last step reaches the peak)."""
    return next(k for k, lr in enumerate(lrs) if lr == pytest.approx(peak)) + 1


def test_documented_override_example_loads_and_warms_up_for_its_fraction(caplog):
    command = next(line for line in block("bash", "--train.max_steps 20").splitlines() if "--train.max_steps" in line)
    args = shlex.split(command)
    assert args[:3] == ["accelerate", "launch", "vlm_sft/train.py"] and "--train.max_steps" in args
    cfg = config_from_cli(args[3:])
    assert cfg is not None and cfg.train.max_steps == 20 and cfg.data.packing == "cat"
    with caplog.at_level(logging.WARNING):
        lrs = _lrs(cfg, cfg.train.max_steps)
    assert caplog.records == []  # the fraction scales: nothing to clip, nothing to warn about
    peak = cfg.train.lr
    assert _warmup_length(lrs, peak) == round(cfg.train.warmup_fraction * 20) == 2
    assert lrs[0] == pytest.approx(peak / 2) and lrs[-1] < peak


def test_debug_toml_keeps_its_75_warmup_steps_at_900():
    cfg = load_config("configs/debug.toml")
    assert cfg.train.max_steps == 900 and cfg.train.warmup_steps is None
    assert _warmup_length(_lrs(cfg, 900), cfg.train.lr) == 75


@pytest.mark.parametrize(("name", "warmup"), [("debug.toml", 75), ("gpu_check.toml", 5), ("qwen3_5_0_8b.toml", 100)])
def test_every_shipped_config_keeps_its_warmup(name, warmup):
    cfg = load_config(REPO_ROOT / "configs" / name)
    assert _warmup_length(_lrs(cfg, cfg.train.max_steps), cfg.train.lr) == warmup


def test_explicit_warmup_longer_than_the_run_is_clipped_with_one_warning(caplog):
    cfg = load_config(None, ["--train.max_steps", "20", "--train.warmup_steps", "50"])
    with caplog.at_level(logging.WARNING):
        lrs = _lrs(cfg, 20)
    warnings = [r for r in caplog.records if r.levelno == logging.WARNING]
    assert len(warnings) == 1
    message = warnings[0].getMessage()
    assert "train.warmup_steps (50)" in message and "20 steps" in message and "train.warmup_fraction" in message
    assert _warmup_length(lrs, cfg.train.lr) == 2  # 20 // 10


def test_warmup_override_replaces_the_files_other_unit():
    cfg = load_config(None, ["--train.warmup_steps", "10"])  # debug.toml sets warmup_fraction
    assert cfg.train.warmup_steps == 10 and cfg.train.warmup_fraction is None
    assert _warmup_length(_lrs(cfg, 600), cfg.train.lr) == 10


def test_warmup_steps_and_fraction_set_together_is_an_error(tmp_path):
    with pytest.raises(ConfigError, match=r"both set; keep one"):
        load_config(None, ["--train.warmup_steps", "10", "--train.warmup_fraction", "0.1"])
    toml = (REPO_ROOT / "configs" / "debug.toml").read_text().replace("[train]\n", "[train]\nwarmup_steps = 10\n")
    (tmp_path / "both.toml").write_text(toml)
    with pytest.raises(ConfigError, match=r"train.warmup_steps \(10\) and train.warmup_fraction \(0.0834\)"):
        load_config(tmp_path / "both.toml")


def test_the_docs_name_checkpoints_as_they_are_written(tmp_path):
    named = re.search(r"`checkpoints/(step-\d+)/`", DOCS).group(1)
    model = torch.nn.Linear(2, 2)
    state = TrainerState(step=int(named.split("-")[1]), scheduler={}, data={}, rng=capture_rng())
    env = DistEnv(rank=0, world_size=1, local_rank=0, device=torch.device("cpu"))
    written = save_checkpoint(
        tmp_path, model=model, optimizer=torch.optim.AdamW(model.parameters()), state=state, env=env, keep_last=1
    )
    assert written.name == named


def test_check_packing_prints_its_table_once(tmp_path, capsys, caplog):
    """``python -m vlm_sft.check_packing`` prints the table on stdout and nowhere else at its INFO log level."""
    from vlm_sft.check_packing import main as check_packing_main

    tiny = {"data.shapes.root": str(tmp_path / "shapes"), "data.shapes.num_train": 16, "data.shapes.num_eval": 0}
    tiny |= {"data.seq_len": 128, "data.pack_len": 160}
    args = [a for k, v in tiny.items() for a in (f"--{k}", str(v))]
    with caplog.at_level(logging.INFO):
        assert (
            check_packing_main(["--config", "configs/debug.toml", "--train.device", "cpu", "--rows", "1", *args]) == 0
        )
    out = capsys.readouterr().out
    logged = "\n".join(r.getMessage() for r in caplog.records)
    header = re.compile(r"^check\s+floor\s+leak\s+ratio\s+worst$", flags=re.M)
    assert len(header.findall(out)) == 1 and out.count("packing check:") == 1
    assert len(header.findall(logged)) == 0
