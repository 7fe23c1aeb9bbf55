"""The tables of a data mixture (``[[data.sources]]``, ``[[data.eval_sources]]``): one ``SourceConfig`` each, the
name a source gets when its table names none, and the check that names are unique (they label the metrics and the
accounting). ``RowFormat`` holds how a source's rows are read (subset, schema, column / key / role mapping), shared
with ``[data]``'s one-source form. Re-exported by ``vlm_sft.config``."""

from __future__ import annotations

from typing import Literal

from pydantic import Field, field_validator

from vlm_sft.config_base import ConfigError, Section

SCHEMAS = ("messages", "sharegpt", "pairs", "prompt_completion", "qa")
"""The row schemas the loader reads (``vlm_sft/data/schemas.py``); ``auto`` recognises them from the columns."""
CHAT_ROLES = ("system", "user", "assistant", "tool")
"""The roles a mapped role name can stand for."""


class RowFormat(Section):
    """How a source's rows are read: which subset, which schema, and (for schemas the loader cannot recognise) which
    columns and turn keys hold what. Every field is optional: ``auto`` recognises the public schemas."""

    subset: str | None = None
    """The dataset's subset (``datasets``' config name, e.g. ``ai2d`` of HuggingFaceM4/the_cauldron), for a hub id
    or a local snapshot of one (a folder with a README.md ``configs:`` list, or one subfolder per subset). None: the
    only (or default) subset; a folder without ``configs:`` is read whole."""
    format: Literal["auto", "messages", "sharegpt", "pairs", "prompt_completion", "qa"] = "auto"
    """The row schema: ``messages`` (chat messages with typed blocks), ``sharegpt`` (``conversations`` of
    from/value turns with ``<image>`` markers), ``pairs`` (``texts: [{user, assistant}]``), ``prompt_completion``
    (TRL's form; loss on the completion only), ``qa`` (one question, one or several answers); ``auto`` recognises
    each from its columns and logs which it read and why."""
    conversation_column: str | None = None
    """Column holding the turns (``messages`` / ``sharegpt``) or the pairs (``pairs``); None: the schema's own name
    (``messages``; ``conversations`` / ``conversation``; ``texts``)."""
    images_column: str | None = None
    """Column holding the row's images (a list, or one image); None: ``images``, else ``image``."""
    system_column: str | None = None
    """Column holding a system prompt for the row; None: ``system`` when the rows have it."""
    question_column: str | None = None
    """``qa``: column holding the question; None: the first of ``question``, ``query``, ``prompt``, ``instruction``."""
    answer_column: str | None = None
    """``qa``: column holding the answer (a string, or a list whose first entry trains and whose others are kept as
    references for scoring); None: the first of ``answer``, ``answers``, ``label``, ``response``."""
    options_column: str | None = None
    """``qa``: column holding a multiple-choice row's options (a list, or a list's text); None: ``options`` or
    ``choices``, else one column per letter (``A``, ``B``, ...) where the rows have them. The question is asked with
    the lettered choices and the option's letter is the answer (the ``answer`` column holds a letter or an index)."""
    role_key: str | None = None
    """Key of a turn's role; None: ``role``, else ``from`` (whichever a turn has set)."""
    content_key: str | None = None
    """Key of a turn's text or blocks; None: ``content``, else ``value``."""
    roles: dict[str, str] = {}
    """Role names of the data and the chat role each means (``{customer = "user", agent = "assistant"}``), on top
    of the known ones (human / user, gpt / assistant / bot / model, system, tool / observation)."""
    instruction: str | None = None
    """Text appended, on a line of its own, to the last user turn of every row: a benchmark's answer format, e.g.
    "Answer the question using a single word or phrase." (DocVQA, ChartQA, TextVQA, VQAv2 in lmms-eval) or "Answer
    with the option's letter from the given choices directly." (AI2D, ScienceQA, MMMU). None: the rows as written."""

    @field_validator("roles")
    @classmethod
    def _check_roles(cls, roles: dict[str, str]) -> dict[str, str]:
        wrong = {name: role for name, role in roles.items() if role not in CHAT_ROLES}
        if wrong:
            raise ConfigError(
                f'roles = {wrong}: a role name must map to one of {", ".join(CHAT_ROLES)} (e.g. agent = "assistant")'
            )
        return roles

    def row_format(self) -> RowFormat:
        """These settings alone (to hand from ``[data]`` to the one-source table)."""
        return RowFormat(**{name: getattr(self, name) for name in RowFormat.model_fields})


METRICS = ("exact_match", "anls", "relaxed_accuracy", "vqa_accuracy", "multiple_choice")
"""The scores a held-out source can be judged by (``vlm_sft/trainer/benchmark_metrics.py`` defines each)."""


class Scoring(Section):
    """How a held-out source is scored by generation, as its benchmark scores it. Shared by ``[[data.eval_sources]]``
    tables and ``[data]`` (for ``eval_source``)."""

    metric: Literal["exact_match", "anls", "relaxed_accuracy", "vqa_accuracy", "multiple_choice"] | None = None
    """Score each held-out reply the model generates: ``anls`` (DocVQA / InfoVQA), ``relaxed_accuracy`` (ChartQA),
    ``vqa_accuracy`` (VQAv2 / TextVQA), ``multiple_choice`` (AI2D / MMMU / MMBench / ScienceQA), ``exact_match``;
    logged as ``eval_score/<name>`` at every eval, and by ``python -m vlm_sft.evaluate``. None: not scored (its
    loss, teacher-forced accuracy and the ``train.eval_generate`` replies only)."""
    max_new_tokens: int | None = Field(None, ge=1)
    """Longest scored reply in tokens; None: ``train.eval_generate_max_tokens``."""
    max_scored: int | None = Field(None, ge=1)
    """Rows scored at each eval (the first ones, in the source's order); None: every row."""
    thinking: bool | None = None
    """The thinking mode the source is asked in (a thinking reply is scored on its answer after the think block; one
    cut off inside it scores 0 and counts as unparsed); None: ``data.enable_thinking``."""


class SourceConfig(RowFormat, Scoring):
    """One source of a mixture (``[[data.sources]]``, or ``[[data.eval_sources]]`` for held-out data)."""

    source: str = Field(min_length=1)
    """``shapes``, a local jsonl / json / parquet file or folder of shards, or a hub dataset id (as ``data.source``)."""
    name: str | None = Field(None, min_length=1)
    """Name in logs, ``metrics.jsonl`` (``samples/<name>``, ``eval_loss/<name>``) and the accounting; None: the
    ``subset`` when one is set, else the file's (or folder's) stem, or the last part of a hub id."""
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
        """``name``, or the name derived from ``source`` (a subset's own name when one is set)."""
        return self.name or self.subset or source_name(self.source)


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
