"""The tables of a data mixture (``[[data.sources]]``, ``[[data.eval_sources]]``): one ``SourceConfig`` each, the
name a source gets when its table names none, and the check that names are unique (they label the metrics and the
accounting). Re-exported by ``vlm_sft.config``."""

from __future__ import annotations

from pydantic import Field, field_validator

from vlm_sft.config_base import ConfigError, Section


class SourceConfig(Section):
    """One source of a mixture (``[[data.sources]]``, or ``[[data.eval_sources]]`` for held-out data)."""

    source: str = Field(min_length=1)
    """``shapes``, a local jsonl / json / parquet file or folder of shards, or a hub dataset id (as ``data.source``)."""
    name: str | None = Field(None, min_length=1)
    """Name in logs, ``metrics.jsonl`` (``samples/<name>``, ``eval_loss/<name>``) and the accounting; None: the
    file's (or folder's) stem, or the last part of a hub id."""
    weight: float = 1.0
    """Relative share of the training *samples* drawn from this source (weights 6, 3, 1 draw 60 / 30 / 10 percent).
    To leave a source out, remove its table. Ignored for ``eval_sources``."""
    split: str | None = None
    """Split of a hub dataset; None: ``data.split``."""
    image_root: str | None = None
    """As ``data.image_root``, for this source (None: ``data.image_root``, whose default is the file's folder)."""
    allowed_image_roots: list[str] = []
    """As ``data.allowed_image_roots``, added to those of ``[data]`` for this source."""
    streaming: bool | None = None
    """Read this source while training (as ``data.streaming``); None: ``data.streaming``."""

    @field_validator("weight")
    @classmethod
    def _check_weight(cls, weight: float) -> float:
        if not weight > 0 or weight == float("inf"):
            raise ConfigError(
                f"weight = {weight}: a source's weight must be a positive number (its relative share of the samples); "
                "to leave a source out, remove its table"
            )
        return weight

    @property
    def label(self) -> str:
        """``name``, or the name derived from ``source``."""
        return self.name or source_name(self.source)


SPLIT_STEMS = ("train", "eval", "test", "val", "valid", "validation", "dev", "data")
"""File stems that name a split, not a source: ``ocr/train.jsonl`` is named after its folder, ``ocr``."""


def source_name(source: str) -> str:
    """The default name of a source: a local path's stem (``data/ocr.jsonl`` -> ``ocr``; for a split's file such as
    ``ocr/train.jsonl`` the folder's name), or a hub id's last part."""
    parts = [p for p in source.replace("\\", "/").split("/") if p and p != "."]
    if not parts:
        return source
    tail = parts[-1]
    stem = tail.split(".", 1)[0] if "." in tail and not tail.startswith(".") else tail
    return parts[-2] if stem.lower() in SPLIT_STEMS and len(parts) > 1 else stem


def check_source_names(field: str, sources: list[SourceConfig]) -> None:
    labels = [s.label for s in sources]
    repeated = sorted({n for n in labels if labels.count(n) > 1})
    if repeated:
        raise ConfigError(
            f"data.{field}: the name(s) {repeated} are used by more than one source; give each table its own "
            'name = "..." (names label the metrics and the accounting)'
        )
