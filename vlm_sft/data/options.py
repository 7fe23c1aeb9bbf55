"""Multiple-choice rows as the benchmarks publish them, and the lettered prompt they are asked with.

Stored forms, read as the files hold them (the ``qa`` schema of ``vlm_sft.data.schemas``):

- AI2D (lmms-lab/ai2d): ``options: [str]``, ``answer: "1"`` (the option's index, as text);
- ScienceQA: ``choices: [str]``, ``answer: 1`` (the index);
- MMMU: ``options: "['12', '15']"`` (a Python list's text), ``answer: "B"`` (the letter);
- MMBench: a column per option, ``A`` ... ``E`` (null past the last), ``answer: "B"``.

The prompt is the question, then one line per option, ``"A. text"`` (lmms-eval's AI2D / MMMU / ScienceQA format);
the reply trained on and scored is the option's letter.
"""

from __future__ import annotations

import ast
import string
from collections.abc import Mapping, Sequence
from typing import Any

from renderers.errors import RenderError

OPTION_COLUMNS = ("options", "choices")
"""Columns that hold a row's options as one list, in the order ``auto`` looks for them."""
LETTER_COLUMNS = "letters"
"""``Schema.options`` value of a source whose options are one column per letter (``A``, ``B``, ...; MMBench)."""
LETTERS = string.ascii_uppercase

REASON_BAD_OPTIONS = "bad_options"
"""Skip: a multiple-choice row whose options or answer cannot be read."""


def letter_columns(columns: set[str]) -> bool:
    """Whether a source keeps its options one column per letter (at least ``A`` and ``B``)."""
    return {"A", "B"} <= columns


def read_options(row: Mapping, column: str) -> tuple[str, ...]:
    """A row's option texts: from a list column, its Python-list text (MMMU), or the letter columns (MMBench)."""
    if column == LETTER_COLUMNS:
        values = []
        for letter in LETTERS:
            value = row.get(letter)
            if value is None or (isinstance(value, str) and not value.strip()):
                break
            values.append(value)
    else:
        values = row.get(column)
        if isinstance(values, str):
            try:
                values = ast.literal_eval(values)
            except (ValueError, SyntaxError) as e:
                raise RenderError(REASON_BAD_OPTIONS, f"{column!r} is not a list: {values!r:.80}") from e
    if not isinstance(values, list | tuple) or not 2 <= len(values) <= len(LETTERS):
        raise RenderError(REASON_BAD_OPTIONS, f"{column!r} holds {values!r:.80}, not a list of 2 to 26 options")
    return tuple(str(v) for v in values)


def answer_letter(answer: Any, options: Sequence[str]) -> str:
    """The correct option's letter from the answer as stored: a letter, an index (int or its text), or the option's
    own text."""
    letters = LETTERS[: len(options)]
    if isinstance(answer, list | tuple) and len(answer) == 1:
        answer = answer[0]
    if isinstance(answer, bool):
        raise RenderError(REASON_BAD_OPTIONS, f"answer {answer!r} for {len(options)} options")
    if isinstance(answer, int) and 0 <= answer < len(options):
        return letters[answer]
    text = str(answer).strip() if answer is not None else ""
    if len(text) == 1 and text.upper() in letters:
        return text.upper()
    if text.isdigit() and int(text) < len(options):
        return letters[int(text)]
    if text in options:
        return letters[list(options).index(text)]
    raise RenderError(REASON_BAD_OPTIONS, f"answer {answer!r} names none of the {len(options)} options")


def format_options(question: str, options: Sequence[str]) -> str:
    """The question with its lettered choices, one per line: ``"question\\nA. opt1\\nB. opt2"`` (lmms-eval's AI2D
    ``prompt_format: mcq``, ScienceQA and MMMU ``parse_options``); the instruction suffix is appended by the caller."""
    letters = option_letters(options)
    return "\n".join([question, *(f"{letter}. {option}" for letter, option in zip(letters, options, strict=True))])


def option_letters(options: Sequence[str]) -> str:
    """The letters of ``options``: ``"ABCD"`` for four."""
    if isinstance(options, str) or not 1 <= len(options) <= len(LETTERS):
        raise ValueError(f"multiple choice needs 1 to 26 option texts in a list, got {options!r:.80}")
    return LETTERS[: len(options)]
