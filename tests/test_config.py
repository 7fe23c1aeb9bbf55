"""Config: TOML load, dotted overrides, and every validator's message (it must name the fix)."""

from __future__ import annotations

import re

import pytest

from vlm_sft.config import (
    DEFAULT_CONFIG,
    REPO_ROOT,
    ConfigError,
    RunConfig,
    config_help,
    load_config,
    parse_overrides,
    split_config_arg,
)


def test_default_config_is_debug_and_loads():
    cfg = load_config()
    assert DEFAULT_CONFIG.name == "debug.toml"
    assert cfg.model.name_or_path == "tiny"
    assert cfg.data.source == "shapes"
    assert cfg.model.vlm is not None
    assert cfg.train.device == "cpu"


def test_every_shipped_config_loads():
    configs = sorted((REPO_ROOT / "configs").glob("*.toml"))
    assert len(configs) >= 2
    for path in configs:
        load_config(path)


def test_real_model_example_uses_hub_id_and_bf16():
    cfg = load_config(REPO_ROOT / "configs" / "qwen3_5_0_8b.toml")
    assert cfg.model.name_or_path == "Qwen/Qwen3.5-0.8B"
    assert cfg.model.dtype == "bfloat16"


def test_overrides_parse_types_and_nest():
    got = parse_overrides(
        [
            "--train.max_steps",
            "20",
            "--train.lr=3e-4",
            "--model.vlm.freeze_vision",
            "false",
            "--data.source",
            "my/data.jsonl",
            "--train.betas",
            "[0.9, 0.95]",
            "--train.resume",
            "none",
        ]
    )
    assert got == {
        "train": {"max_steps": 20, "lr": 3e-4, "betas": [0.9, 0.95], "resume": None},
        "model": {"vlm": {"freeze_vision": False}},
        "data": {"source": "my/data.jsonl"},
    }


def test_overrides_apply_on_top_of_file():
    cfg = load_config(None, ["--train.max_steps", "77", "--data.packing", "stack"])
    assert cfg.train.max_steps == 77
    assert cfg.data.packing == "stack"
    assert cfg.data.pack_len == 1280  # untouched fields keep the file's value


def test_split_config_arg():
    assert split_config_arg(["--config", "a.toml", "--x.y", "1"]) == ("a.toml", ["--x.y", "1"])
    assert split_config_arg(["--config=b.toml"]) == ("b.toml", [])
    assert split_config_arg([]) == (None, [])


@pytest.mark.parametrize(
    ("overrides", "needle"),
    [
        (["--model.vlm", "none"], "add a [model.vlm] section"),
        (["--data.seq_len", "4096", "--data.pack_len", "2048"], "set data.pack_len >= 4096"),
        (["--model.dtype", "bfloat16"], "set model.dtype = 'float32'"),
        (["--train.max_steps", "none"], "set train.max_steps or train.epochs"),
        (["--train.epochs", "2"], "unset one of them"),
        (["--train.warmup_steps", "5", "--train.warmup_fraction", "0.1"], "both set; keep one"),
        (["--train.warmup_fraction", "1"], "train.warmup_fraction"),
        (["--train.max_step", "5"], "train.max_step: unknown setting; did you mean train.max_steps?"),
        (["--model.name_or_path", "Qwen/Qwen3.5-0.8B"], "only applies to the tiny preset"),
        (["--data.packing", "stack", "--data.max_image_patches_per_pack", "64"], "Unset it or choose packing"),
        (["--train.lrr", "1"], "train.lrr: unknown setting"),
        (["--train.lr", "-1"], "train.lr"),
        (["--data.packing", "zigzag"], "data.packing"),
    ],
)
def test_validators_raise_with_the_fix(overrides, needle):
    with pytest.raises(ConfigError) as err:
        load_config(None, overrides)
    assert needle in str(err.value)


def test_missing_file_and_bad_override_shape():
    with pytest.raises(ConfigError, match="not found"):
        load_config("configs/nope.toml")
    with pytest.raises(ConfigError, match="has no value"):
        load_config(None, ["--train.max_steps"])
    with pytest.raises(ConfigError, match="overrides look like"):
        load_config(None, ["train.max_steps", "3"])


def test_warmup_longer_than_max_steps_loads():
    """No longer refused at load: the schedule, which knows the run's length, clips it (tests/test_cli.py)."""
    cfg = load_config(None, ["--train.max_steps", "20", "--train.warmup_steps", "5000"])
    assert cfg.train.warmup_steps == 5000


def _dotted_fields(model, prefix=""):
    for name, field in model.model_fields.items():
        yield f"{prefix}{name}"
        sub = next(
            (a for a in (field.annotation, *getattr(field.annotation, "__args__", ())) if hasattr(a, "model_fields")),
            None,
        )
        if sub is not None:
            yield from _dotted_fields(sub, f"{prefix}{name}.")


def test_config_help_lists_every_field_once():
    text = config_help()
    fields = [f for f in _dotted_fields(RunConfig) if "." in f]
    assert len(fields) > 50
    for name in fields:
        assert len(re.findall(rf"^  {re.escape(name)}: ", text, flags=re.M)) == 1, name
    assert "  train.warmup_fraction: float | None = none\n      Linear warmup as a fraction" in text


def test_the_27b_config_fits_80gb_gpus_through_context_parallelism():
    """configs/qwen3_5_27b.toml's lever: cp_size 4 brings the plan at 8 GPUs under 75 GB per rank (from 87 GB at cp
    1), and Qwen3.5-27B's head counts split over 4 ranks (what the run checks at start)."""
    from vlm_sft.checks.memory_plan import plan_for_run
    from vlm_sft.model.presets import qwen3_5_27b_config
    from vlm_sft.model.sequence_split import check_heads

    cfg = load_config(REPO_ROOT / "configs" / "qwen3_5_27b.toml")
    assert cfg.train.cp_size == 4
    gb = 1e9
    assert plan_for_run(cfg, 8).training / gb <= 75
    no_cp = cfg.model_copy(update={"train": cfg.train.model_copy(update={"cp_size": 1})})
    assert plan_for_run(no_cp, 8).training / gb > 80
    check_heads(qwen3_5_27b_config().text_config, cfg.train.cp_size)
