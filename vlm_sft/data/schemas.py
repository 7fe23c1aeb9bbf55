"""Row schemas: every dataset row shape the loader reads, recognised per source and turned into one canonical
conversation before rendering, so the same rows in two schemas train on the same tokens, images and loss mask.

Schemas (``format``), as the public datasets store them:

- ``messages``: ``messages: [{role, content}]`` (OpenAI / HF chat), content a string or typed blocks; an image block
  holds its source, or is a bare ``{"type": "image"}`` placeholder (with the ``index`` of its image, as
  HuggingFaceH4/llava-instruct-mix-vsft writes it, or in order) filled from the images column. Optional ``tools``.
- ``sharegpt``: ``conversations: [{from, value}]`` with ``<image>`` markers (LLaVA, LLaVA-OneVision).
- ``pairs``: ``texts: [{user, assistant, ...}]``, one element per turn, other keys (``source``) ignored, the keys in
  any order (HuggingFaceM4/the_cauldron, FineVision, Docmatix).
- ``prompt_completion``: ``prompt`` (messages before the reply, or a string) + ``completion`` (the reply's messages,
  or a string), as TRL trains it: only the completion's turns train.
- ``qa``: one question and one answer, or a list of reference answers (VQA-style data): the first trains, all are
  kept on the conversation (``references``) for scoring; with options (``options`` / ``choices`` or one column per
  letter, ``vlm_sft.data.options``) the question is asked with lettered choices and the letter is the answer.

Turns are read one way in every schema: the role under ``role`` or ``from``, the text or blocks under ``content`` or
``value``, whichever is set (Arrow's merged structs, e.g. LLaVA-OneVision-1.5's ``{content, from, role, value}``, hold
the other two as null), role names through ``ROLE_NAMES`` and the source's own ``roles``. Numbers where text is
expected train as their JSON text.

The canonical form is chat messages with typed blocks, every image resolved through the image-root policy; an
assistant turn that must not train carries ``weight: 0`` (OpenAI's fine-tuning convention, accepted in data too).

Images vs placeholders follow one rule for every schema: ``vlm_sft.data.placeholders``.
"""

from __future__ import annotations

import json
from collections.abc import Collection, Mapping
from dataclasses import dataclass, field
from typing import Any, NamedTuple

from renderers.content import normalize_tools
from renderers.errors import RenderError
from vlm_sft.config_base import ConfigError
from vlm_sft.data.image_roots import ImageRoots
from vlm_sft.data.options import (
    LETTER_COLUMNS,
    OPTION_COLUMNS,
    answer_letter,
    format_options,
    letter_columns,
    read_options,
)
from vlm_sft.data.placeholders import place_images

ROLE_NAMES: dict[str, str] = {
    "human": "user",
    "user": "user",
    "gpt": "assistant",
    "assistant": "assistant",
    "model": "assistant",
    "bot": "assistant",
    "chatgpt": "assistant",
    "system": "system",
    "tool": "tool",
    "observation": "tool",
    "function_response": "tool",
}
"""Role names found in public data (lowercased) and the chat role each means."""

FORMATS = ("messages", "sharegpt", "pairs", "prompt_completion", "qa")
"""The schemas, in the order ``auto`` tries them."""
TURN_COLUMNS: dict[str, tuple[str, ...]] = {
    "messages": ("messages",),
    "sharegpt": ("conversations", "conversation"),
    "pairs": ("texts",),
}
"""Where each turn-list schema keeps its turns by default."""
IMAGE_COLUMNS = ("images", "image")
VIDEO_COLUMNS = ("videos", "video")
QUESTION_COLUMNS = ("question", "query", "prompt", "instruction")
ANSWER_COLUMNS = ("answer", "answers", "label", "response")

REASON_NO_ANSWER = "no_answer"
"""Skip: a ``qa`` row without an answer."""
REASON_UNRECOGNISED = "unrecognised_row"
"""Skip: a streamed row whose keys fit no schema."""

_TURN_KEYS = ("role", "from", "content", "value")


class SchemaError(ConfigError):
    """A source whose columns fit no schema, or a mapping that names a column the source does not have."""


@dataclass(frozen=True)
class RowMapping:
    """What a config says about a source's rows (``[data]`` / ``[[data.sources]]``: ``format`` and the ``*_column``,
    ``*_key`` and ``roles`` settings); every field None / ``auto`` means: recognise it."""

    format: str = "auto"
    conversation_column: str | None = None
    images_column: str | None = None
    system_column: str | None = None
    question_column: str | None = None
    answer_column: str | None = None
    options_column: str | None = None
    role_key: str | None = None
    content_key: str | None = None
    roles: tuple[tuple[str, str], ...] = ()
    """The data's own role names and the chat role each means."""
    instruction: str | None = None
    """Appended, on a line of its own, to the last user turn of every row (a benchmark's answer-format suffix)."""

    @classmethod
    def from_settings(cls, settings: Mapping[str, Any]) -> RowMapping:
        """From a config section's fields (extra fields ignored); ``roles`` as a dict."""
        values = {k: settings[k] for k in cls.__dataclass_fields__ if k in settings}
        values["roles"] = tuple(sorted(dict(values.get("roles") or {}).items()))
        return cls(**values)


AUTO = RowMapping()
"""The mapping of a source whose config sets nothing: every schema recognised from its columns."""


@dataclass(frozen=True)
class Schema:
    """How one source's rows are read, decided once per source by ``detect_schema``."""

    format: str
    """One of ``FORMATS``."""
    reason: str
    """Why: the columns that decided it, or the setting that named it (logged and in the data report)."""
    turns: str | None = None
    """Column of the turns (``messages`` / ``sharegpt``), pairs (``pairs``) or prompt (``prompt_completion``)."""
    completion: str | None = None
    """``prompt_completion``: the completion's column."""
    question: str | None = None
    answer: str | None = None
    options: str | None = None
    """``qa``: the options' column (``options.LETTER_COLUMNS``: one column per letter), None for open questions."""
    images: tuple[str, ...] = IMAGE_COLUMNS
    """Columns looked in for the row's images, in order (the first that is set)."""
    videos: tuple[str, ...] = VIDEO_COLUMNS
    """Columns looked in for the row's videos, in order (the first that is set)."""
    system: str | None = "system"
    """Column of a system prompt (used where a row has it)."""
    role_key: str | None = None
    content_key: str | None = None
    roles: dict[str, str] = field(default_factory=dict)
    instruction: str | None = None
    """Appended to the last user turn of every row."""

    def describe(self) -> str:
        """``pairs (column 'texts' ...)``: what the start log and the data report print."""
        return f"{self.format} ({self.reason})"


def detect_schema(columns: Collection[str], mapping: RowMapping = AUTO, *, name: str = "source") -> Schema:
    """The schema of a source with ``columns``: the one ``mapping.format`` names, else the first of ``FORMATS`` whose
    columns are there. A mapped column the source lacks, or columns that fit nothing, raise ``SchemaError`` naming
    the source and the columns it has."""
    columns = set(columns)
    have = f"its columns: {', '.join(sorted(columns)) or 'none'}"
    for setting in _COLUMN_SETTINGS:
        column = getattr(mapping, setting)
        if column is not None and column not in columns:
            raise SchemaError(f"{name}: {setting} = {column!r} is not a column of this source ({have})")
    common = {
        "images": (mapping.images_column,) if mapping.images_column else IMAGE_COLUMNS,
        "system": mapping.system_column or "system",
        "role_key": mapping.role_key,
        "content_key": mapping.content_key,
        "roles": dict(mapping.roles),
        "instruction": mapping.instruction,
    }
    formats = FORMATS if mapping.format == "auto" else (mapping.format,)
    for fmt in formats:
        found = _columns_of(fmt, columns, mapping)
        if found is not None:
            reason = found.pop("reason")
            if mapping.format != "auto":
                reason = f"format = {fmt!r}; {reason}"
            return Schema(fmt, reason, **found, **common)
    if mapping.format != "auto":
        raise SchemaError(f"{name}: format = {mapping.format!r} needs {_needs(mapping.format)} ({have})")
    raise SchemaError(
        f"{name}: no schema fits ({have}); the loader reads messages, conversations (ShareGPT), texts (pairs), "
        "prompt + completion, or a question + answer column; for anything else set format and the *_column / "
        "role_key / content_key / roles settings (docs/data.md)"
    )


_COLUMN_SETTINGS = (
    "conversation_column", "images_column", "system_column", "question_column", "answer_column", "options_column",
)  # fmt: skip


def _columns_of(fmt: str, columns: set[str], mapping: RowMapping) -> dict | None:
    """The columns schema ``fmt`` would read, with the reason, or None when the source lacks them."""
    if fmt in TURN_COLUMNS:
        column = mapping.conversation_column or next((c for c in TURN_COLUMNS[fmt] if c in columns), None)
        if column is None:
            return None
        return {"turns": column, "reason": f"column {column!r} holds the {_WHAT[fmt]}"}
    if fmt == "prompt_completion":
        if not {"prompt", "completion"} <= columns:
            return None
        return {"turns": "prompt", "completion": "completion", "reason": "columns 'prompt' + 'completion'"}
    question = mapping.question_column or next((c for c in QUESTION_COLUMNS if c in columns), None)
    answer = mapping.answer_column or next((c for c in ANSWER_COLUMNS if c in columns), None)
    if question is None or answer is None:
        return None
    options = mapping.options_column or next((c for c in OPTION_COLUMNS if c in columns), None)
    if options is None and letter_columns(columns):
        options = LETTER_COLUMNS
    shown = {None: "", LETTER_COLUMNS: " + option columns A, B, ..."}.get(options, f" + options {options!r}")
    return {
        "question": question,
        "answer": answer,
        "options": options,
        "reason": f"columns {question!r} + {answer!r}{shown}",
    }


_WHAT = {
    "messages": "chat messages",
    "sharegpt": "ShareGPT turns",
    "pairs": "[{user, assistant}] pairs",
}


def _needs(fmt: str) -> str:
    if fmt in TURN_COLUMNS:
        return f"a {' / '.join(repr(c) for c in TURN_COLUMNS[fmt])} column or conversation_column"
    if fmt == "prompt_completion":
        return "'prompt' and 'completion' columns"
    return (
        f"a question column ({' / '.join(QUESTION_COLUMNS)}, or question_column) and an answer column "
        f"({' / '.join(ANSWER_COLUMNS)}, or answer_column)"
    )


@dataclass(frozen=True)
class Conversation:
    """One dataset row as a chat conversation, in the canonical form."""

    messages: list[dict]
    """Messages in the OpenAI / HF chat shape (roles system / user / assistant / tool, typed blocks, images
    resolved); an assistant turn with ``weight: 0`` is context, not trained."""
    tools: list[dict] | None
    """Tool schemas offered in this conversation, or None."""
    index: int
    """Row index in the source dataset, for error reports and accounting."""
    references: tuple[str, ...] = ()
    """Reference answers of a ``qa`` row (the first is the one trained; the letter of a multiple-choice row), for
    scoring; empty otherwise."""
    options: tuple[str, ...] = ()
    """The option texts of a multiple-choice row, in letter order; empty otherwise."""


def as_text(value: Any) -> Any:
    """A raw JSON number or boolean where text is expected, as its JSON text (``12`` -> ``"12"``, ``true`` ->
    ``"true"``): the answer the data meant, where a type error would only skip the row. Anything else unchanged."""
    if isinstance(value, bool | int | float):
        return json.dumps(value)
    return value


_REASONING_KEYS = ("reasoning_content", "thinking", "reasoning")


def message_numbers_as_text(message: Mapping) -> dict:
    """The message with ``as_text`` applied to its content (a scalar, text blocks, bare list entries) and its
    reasoning; a single block dict as content becomes a one-block list (``normalize_content`` reads it so too)."""
    out = dict(message)
    content = out.get("content")
    if isinstance(content, Mapping):
        content = [content]
    if isinstance(content, list):
        out["content"] = [
            {**b, "text": as_text(b["text"])} if isinstance(b, Mapping) and "text" in b else as_text(b) for b in content
        ]
    elif "content" in out:
        out["content"] = as_text(content)
    for key in _REASONING_KEYS:
        if key in out:
            out[key] = as_text(out[key])
    return out


@dataclass(frozen=True)
class RowConverter:
    """One raw row (a dict as the data holds it) to a canonical ``Conversation``: the schema's rules, numbers as
    text, every image through the image-root policy. Picklable; usable on rows from anywhere (a streamed row too)."""

    schema: Schema | None
    """How the rows are read; None: recognised per row from its keys (``auto``)."""
    images: ImageRoots
    """Where images may be read from."""

    def __call__(self, row: Mapping, index: int = -1) -> Conversation:
        """The conversation of ``row``; ``RenderError`` naming ``index`` when the row cannot be one."""
        try:
            schema = self.schema or _row_schema(row)
            read = _READERS[schema.format](row, schema)
            messages = _with_instruction(_with_system(row, schema, read.messages), schema.instruction)
            images, videos = self._column(row, schema.images), self._column(row, schema.videos, video=True)
            messages = place_images(messages, images, self.images, videos)
            tools = normalize_tools(row.get("tools"))
        except RenderError as e:
            raise e.with_index(index) from e
        return Conversation(messages, tools, index, references=read.references, options=read.options)

    def _column(self, row: Mapping, columns: tuple[str, ...], *, video: bool = False) -> list:
        """The row's images (or videos) from the first of ``columns`` that is set, each through the root policy."""
        resolve = self.images.resolve_video if video else self.images.resolve
        for column in columns:
            value = row.get(column)
            if value is not None:
                return [resolve(v) for v in (value if isinstance(value, list) else [value]) if v is not None]
        return []


def _row_schema(row: Mapping) -> Schema:
    try:
        return detect_schema(row.keys(), name="row")
    except SchemaError as e:
        raise RenderError(REASON_UNRECOGNISED, str(e).removeprefix("row: ")) from e


# ----------------------------------------------------------------------------------------------- readers


def _turn(turn: Any, schema: Schema) -> dict:
    """One turn as a chat message: role and content from whichever key holds them, the role name mapped."""
    if not isinstance(turn, Mapping):
        raise RenderError("bad_message", f"a turn of type {type(turn).__name__}, not an object {{role, content}}")
    role_keys = (schema.role_key,) if schema.role_key else ("role", "from")
    content_keys = (schema.content_key,) if schema.content_key else ("content", "value")
    speaker = next((turn[k] for k in role_keys if turn.get(k) is not None), None)
    content = next((turn[k] for k in content_keys if turn.get(k) is not None), None)
    role = _role(speaker, schema)
    skip = {*_TURN_KEYS, *role_keys, *content_keys}
    message = {k: v for k, v in turn.items() if k not in skip and v is not None}
    return message_numbers_as_text({"role": role, **message, "content": "" if content is None else content})


def _role(speaker: Any, schema: Schema) -> str:
    name = str(speaker) if speaker is not None else ""
    role = schema.roles.get(name) or ROLE_NAMES.get(name.lower())
    if role is None:
        known = ", ".join([*schema.roles, *ROLE_NAMES])
        raise RenderError("unknown_role", f"role {speaker!r}; known: {known} (map others with roles = {{...}})")
    return role


def _turn_list(value: Any, what: str, schema: Schema) -> list[dict]:
    if isinstance(value, Mapping):
        value = [value]
    if not isinstance(value, list):
        kind = "missing" if value is None else type(value).__name__
        raise RenderError("bad_message", f"{what} is {kind}, not a list of turns")
    return [_turn(t, schema) for t in value]


class Reading(NamedTuple):
    """What a schema's reader takes from a row."""

    messages: list[dict]
    references: tuple[str, ...] = ()
    options: tuple[str, ...] = ()


def _read_turns(row: Mapping, schema: Schema) -> Reading:
    return Reading(_turn_list(row.get(schema.turns), repr(schema.turns), schema))


def _read_pairs(row: Mapping, schema: Schema) -> Reading:
    pairs = row.get(schema.turns)
    if not isinstance(pairs, list) or not all(isinstance(p, Mapping) for p in pairs):
        raise RenderError("bad_message", f"{schema.turns!r} is not a list of {{user, assistant}} objects")
    messages = []
    for pair in pairs:
        by_role = {_pair_role(k, schema): v for k, v in pair.items()}
        for role in ("user", "assistant"):
            text = by_role.get(role)
            messages.append({"role": role, "content": "" if text is None else as_text(text)})
    return Reading(messages)


def _pair_role(key: str, schema: Schema) -> str | None:
    """The role a pair's key names (``user``, ``assistant`` or a mapped name); None for other keys (``source``)."""
    role = schema.roles.get(key) or ROLE_NAMES.get(key.lower())
    return role if role in ("user", "assistant") else None


def _read_prompt_completion(row: Mapping, schema: Schema) -> Reading:
    prompt, completion = row.get(schema.turns), row.get(schema.completion)
    if isinstance(prompt, str):
        context = [{"role": "user", "content": prompt}]
    else:
        context = _turn_list(prompt, "'prompt'", schema)
    if isinstance(completion, str):
        reply = [{"role": "assistant", "content": completion}]
    else:
        reply = _turn_list(completion, "'completion'", schema)
    # TRL trains the completion only: the prompt's own assistant turns are context.
    context = [{**m, "weight": 0} if m["role"] == "assistant" else m for m in context]
    return Reading(context + reply)


def _read_qa(row: Mapping, schema: Schema) -> Reading:
    question = as_text(row.get(schema.question))
    question = "" if question is None else question
    if schema.options is not None:
        options = read_options(row, schema.options)
        letter = answer_letter(row.get(schema.answer), options)
        question = format_options(question, options)
        return Reading(
            [{"role": "user", "content": question}, {"role": "assistant", "content": letter}], (letter,), options
        )
    answers = _answers(row.get(schema.answer))
    if not answers:
        raise RenderError(REASON_NO_ANSWER, f"{schema.answer!r} holds no answer ({row.get(schema.answer)!r:.60})")
    return Reading([{"role": "user", "content": question}, {"role": "assistant", "content": answers[0]}], answers)


def _answers(value: Any) -> tuple[str, ...]:
    """Reference answers: a string, or a list of strings / numbers / ``{"answer": ...}`` objects (VQAv2's)."""
    values = value if isinstance(value, list | tuple) else [value]
    out = []
    for v in values:
        v = v.get("answer") if isinstance(v, Mapping) else v
        v = as_text(v)
        if isinstance(v, str) and v.strip():
            out.append(v)
    return tuple(out)


_READERS = {
    "messages": _read_turns,
    "sharegpt": _read_turns,
    "pairs": _read_pairs,
    "prompt_completion": _read_prompt_completion,
    "qa": _read_qa,
}


def _with_instruction(messages: list[dict], instruction: str | None) -> list[dict]:
    """``instruction`` on a line of its own after the last user turn's text (lmms-eval's ``post_prompt``)."""
    if not instruction:
        return messages
    last = max((i for i, m in enumerate(messages) if m.get("role") == "user"), default=None)
    if last is None:
        return messages
    content = messages[last].get("content")
    if isinstance(content, list):
        content = [*content, {"type": "text", "text": f"\n{instruction}"}]
    else:
        content = f"{'' if content is None else content}\n{instruction}"
    return [*messages[:last], {**messages[last], "content": content}, *messages[last + 1 :]]


def _with_system(row: Mapping, schema: Schema, messages: list[dict]) -> list[dict]:
    """A system column's prompt in front, when the row has one and its turns hold none."""
    system = as_text(row.get(schema.system)) if schema.system else None
    if not isinstance(system, str) or not system.strip():
        return messages
    if any(m.get("role") == "system" for m in messages):
        raise RenderError("two_system_prompts", f"a {schema.system!r} column and a system turn; keep one")
    return [{"role": "system", "content": system}, *messages]
