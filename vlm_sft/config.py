"""Typed run configuration: TOML files in ``configs/`` plus dotted command-line overrides.

The public config module: import every config name from here. The typed sections (``RunConfig`` and the models it
nests, their validators and constants) live in ``vlm_sft/config_sections.py`` (a mixture's source tables in
``config_sources.py``, ``ConfigError`` and the sections' base in ``config_base.py``) and are re-exported below; this
module holds what turns text into them: the TOML loader with dotted overrides, the shared command-line front of the
entry points, and the ``--help`` text generated from the models. The split follows the one dependency: loading and
help read the models, the models know nothing of files or argv, so the sections modules import nothing from here.

``load_config("configs/debug.toml", ["--train.max_steps", "20"])`` is the one entry point the trainer, the data
report and the packing check share.
"""

from __future__ import annotations

import argparse
import difflib
import functools
import json
import re
import sys
import textwrap
import tomllib
from collections.abc import Callable
from pathlib import Path
from typing import Any, get_args

from pydantic import BaseModel, ValidationError

from vlm_sft.config_sections import (
    DEFAULT_WARMUP_STEPS,
    LORA_FUSED_GROUPS,
    LORA_SAVE_MODULES,
    LORA_TEXT_TARGETS,
    LORA_VISION_NAMES,
    SHAPES_DATASET,
    TINY_MODEL,
    TINY_MODELS,
    TINY_MOE_MODEL,
    ConfigError,
    DataConfig,
    LoraSettings,
    ModelConfig,
    RunConfig,
    ShapesConfig,
    SourceConfig,
    TrainConfig,
    VLMConfig,
)
from vlm_sft.config_sources import METRICS, RowFormat, Scoring, source_name

__all__ = [
    "DEFAULT_CONFIG",
    "DEFAULT_WARMUP_STEPS",
    "LORA_FUSED_GROUPS",
    "LORA_SAVE_MODULES",
    "LORA_TEXT_TARGETS",
    "LORA_VISION_NAMES",
    "METRICS",
    "ONE_SETTING_TWO_UNITS",
    "REPO_ROOT",
    "SHAPES_DATASET",
    "TINY_MODEL",
    "TINY_MODELS",
    "TINY_MOE_MODEL",
    "ConfigError",
    "DataConfig",
    "LoraSettings",
    "ModelConfig",
    "RowFormat",
    "RunConfig",
    "Scoring",
    "ShapesConfig",
    "SourceConfig",
    "TrainConfig",
    "VLMConfig",
    "cli_parser",
    "config_from_cli",
    "config_help",
    "exits_cleanly",
    "load_config",
    "parse_cli",
    "parse_overrides",
    "source_name",
    "split_config_arg",
]

REPO_ROOT = Path(__file__).resolve().parent.parent
DEFAULT_CONFIG = REPO_ROOT / "configs" / "debug.toml"


def parse_overrides(argv: list[str]) -> dict[str, Any]:
    """``["--train.max_steps", "20", "--model.vlm.freeze_vision=false"]`` -> nested dict.

    Values are parsed as TOML literals (numbers, booleans, arrays, quoted strings); anything else stays a string,
    so ``--data.source my.jsonl`` needs no quotes.
    """
    out: dict[str, Any] = {}
    i = 0
    while i < len(argv):
        arg = argv[i]
        if not arg.startswith("--"):
            raise ConfigError(f"unexpected argument {arg!r}: overrides look like --section.field value")
        key, eq, value = arg[2:].partition("=")
        if not eq:
            if i + 1 >= len(argv):
                raise ConfigError(f"override {arg!r} has no value")
            value = argv[i + 1]
            i += 1
        i += 1
        node = out
        parts = key.split(".")
        for part in parts[:-1]:
            node = node.setdefault(part, {})
            if not isinstance(node, dict):
                raise ConfigError(f"override --{key} conflicts with another override of {part}")
        node[parts[-1]] = _parse_value(value)
    return out


def _parse_value(text: str) -> Any:
    if text.lower() in ("none", "null"):
        return None
    try:
        return tomllib.loads(f"v = {text}")["v"]
    except tomllib.TOMLDecodeError:
        return text


def _merge(base: dict[str, Any], extra: dict[str, Any]) -> dict[str, Any]:
    merged = dict(base)
    for key, value in extra.items():
        if isinstance(value, dict) and isinstance(merged.get(key), dict):
            merged[key] = _merge(merged[key], value)
        else:
            merged[key] = value
    return merged


ONE_SETTING_TWO_UNITS = (("train", "warmup_steps", "warmup_fraction"),)
"""Field pairs that spell one setting in two units. An override of one replaces the file's other (``--train.warmup_steps
10`` on a file that sets ``warmup_fraction`` means 10 steps); both set in the same place is a ConfigError."""


def _drop_replaced(data: dict[str, Any], extra: dict[str, Any]) -> dict[str, Any]:
    """``data`` without the fields whose other unit ``extra`` sets (see ``ONE_SETTING_TWO_UNITS``)."""
    for section, a, b in ONE_SETTING_TWO_UNITS:
        given = extra.get(section)
        if not isinstance(given, dict) or not isinstance(data.get(section), dict):
            continue
        for new, old in ((a, b), (b, a)):
            if given.get(new) is not None and old not in given:
                data = {**data, section: {k: v for k, v in data[section].items() if k != old}}
    return data


def load_config(path: str | Path | None = None, overrides: list[str] | None = None) -> RunConfig:
    """Load a TOML config (default ``configs/debug.toml``) and apply dotted overrides; raise ConfigError on problems."""
    path = Path(path) if path is not None else DEFAULT_CONFIG
    if not path.is_file():
        raise ConfigError(f"config file {str(path)!r} not found; pass --config configs/debug.toml or another file")
    with path.open("rb") as f:
        data = tomllib.load(f)
    extra = parse_overrides(overrides or [])
    data = _merge(_drop_replaced(data, extra), extra)
    try:
        return RunConfig.model_validate(data)
    except ValidationError as err:
        raise ConfigError(f"invalid config {path}:\n{_explain(err)}") from None


def split_config_arg(argv: list[str]) -> tuple[str | None, list[str]]:
    """Pull ``--config X`` / ``--config=X`` out of argv; return (path or None, remaining overrides)."""
    rest: list[str] = []
    config = None
    i = 0
    while i < len(argv):
        arg = argv[i]
        if arg == "--config":
            if i + 1 >= len(argv):
                raise ConfigError("--config needs a path")
            config = argv[i + 1]
            i += 2
            continue
        if arg.startswith("--config="):
            config = arg.split("=", 1)[1]
        else:
            rest.append(arg)
        i += 1
    return config, rest


def config_from_cli(argv: list[str]) -> RunConfig | None:
    """``--config X`` plus dotted overrides -> config; prints the error and returns None when it is invalid.

    The shared front of every command-line entry point (train, data report, packing check): each exits with
    status 2 on None.
    """
    try:
        config_path, overrides = split_config_arg(argv)
        return load_config(config_path, overrides)
    except ConfigError as err:
        print(f"config error: {err}", file=sys.stderr)
        return None


USAGE_EXIT_CODE = 2
"""Exit code of an entry point stopped by a config or data error (argparse's own for bad arguments)."""


def exits_cleanly(main: Callable[..., int]) -> Callable[..., int]:
    """Decorates an entry point's ``main``: a ``ConfigError`` (settings, a source that cannot be read, an unknown
    subset or column) or a missing file ends it with one line on stderr and ``USAGE_EXIT_CODE``, never a traceback."""

    @functools.wraps(main)
    def run(*args: Any, **kwargs: Any) -> int:
        try:
            return main(*args, **kwargs)
        except ConfigError as err:
            print(f"config error: {err}", file=sys.stderr)
        except FileNotFoundError as err:
            print(f"error: {err}", file=sys.stderr)
        return USAGE_EXIT_CODE

    return run


def cli_parser(prog: str, description: str) -> argparse.ArgumentParser:
    """The parser every entry point starts from, so that ``-h`` / ``--help`` lists every config field.

    An entry point adds its own options, then calls ``parse_cli``; the config arguments are not argparse options
    (there are too many, and they nest), they pass through ``parse_known_args`` to ``config_from_cli``.
    """
    parser = argparse.ArgumentParser(
        prog=prog,
        description=description,
        epilog=config_help(),
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    default = DEFAULT_CONFIG.relative_to(REPO_ROOT)
    parser.add_argument("--config", metavar="FILE", help=f"TOML config file (default {default}); the fields below")
    return parser


def parse_cli(parser: argparse.ArgumentParser, argv: list[str]) -> tuple[argparse.Namespace, RunConfig | None]:
    """The entry point's own options, and the config from ``--config`` plus overrides (None: error printed)."""
    parser.usage = parser.format_usage().removeprefix("usage: ").strip() + " [--section.field VALUE ...]"
    known, rest = parser.parse_known_args(argv)
    return known, config_from_cli(rest if known.config is None else ["--config", known.config, *rest])


def config_help() -> str:
    """Every config field as ``--help`` lists it: dotted name, type, default and its docstring.

    Generated from the models, so the help can never list a setting the loader refuses or miss one it accepts.
    """
    lines = ["config fields (TOML sections; override any of them on the command line as --section.field VALUE):"]
    for name, field in RunConfig.model_fields.items():
        lines += ["", f"[{name}]"]
        _describe_fields(_section_model(field.annotation), f"{name}.", lines)
    return "\n".join(lines)


def _describe_fields(model: type[BaseModel], prefix: str, lines: list[str]) -> None:
    for name, field in model.model_fields.items():
        sub = _section_model(field.annotation)
        if field.is_required():
            default = "(required)"
        elif isinstance(field.default, BaseModel):
            default = f"[{prefix}{name}] section"
        else:
            default = _toml_text(field.default)
        lines.append(f"  {prefix}{name}: {_type_name(field.annotation)} = {default}")
        doc = " ".join((field.description or "").replace("``", "").split())
        lines += textwrap.wrap(doc, width=116, initial_indent=" " * 6, subsequent_indent=" " * 6)
        if sub is not None:
            _describe_fields(sub, f"{prefix}{name}.", lines)


def _type_name(annotation: Any) -> str:
    if isinstance(annotation, type):
        return annotation.__name__
    # ``VLMConfig | None`` prints with the models' module path; the help shows the bare names.
    return re.sub(r"\b(?:typing|vlm_sft\.config_(?:sections|sources|base))\.", "", str(annotation))


def _toml_text(value: Any) -> str:
    """A default as it is written in TOML (None, which TOML lacks, as on the command line: none)."""
    if value is None:
        return "none"
    if isinstance(value, bool | str):
        return json.dumps(value)
    if isinstance(value, list | tuple):
        return "[" + ", ".join(_toml_text(v) for v in value) + "]"
    return repr(value)


def _section_model(annotation: Any) -> type[BaseModel] | None:
    """The section model a field holds (``VLMConfig`` for ``VLMConfig | None``), or None for a plain value."""
    for candidate in (annotation, *get_args(annotation)):
        if isinstance(candidate, type) and issubclass(candidate, BaseModel):
            return candidate
    return None


def _did_you_mean(loc: tuple[Any, ...]) -> str:
    """The closest field of the same section (``train.max_step`` -> ``; did you mean train.max_steps?``), or ""."""
    model: type[BaseModel] | None = RunConfig
    for part in loc[:-1]:
        field = model.model_fields.get(str(part)) if model is not None else None
        model = _section_model(field.annotation) if field is not None else None
    if model is None:
        return ""
    close = difflib.get_close_matches(str(loc[-1]), list(model.model_fields), n=1)
    return f"; did you mean {'.'.join([*map(str, loc[:-1]), close[0]])}?" if close else ""


def _explain(err: ValidationError) -> str:
    lines = []
    for e in err.errors():
        loc = ".".join(str(p) for p in e["loc"])
        ctx_err = (e.get("ctx") or {}).get("error")
        if isinstance(ctx_err, ConfigError):
            lines.append(f"  {ctx_err}")
        elif e["type"] == "extra_forbidden":
            hint = _did_you_mean(e["loc"]) or " (python vlm_sft/train.py --help lists every field)"
            lines.append(f"  {loc}: unknown setting{hint}")
        else:
            lines.append(f"  {loc}: {e['msg']} (got {e.get('input')!r})")
    return "\n".join(lines)
