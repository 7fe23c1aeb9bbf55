"""The served template: what a server's generation prompt looks like, and a saved template whose default matches it.

A server (transformers, vLLM, SGLang) renders a request as ``apply_chat_template(conversation,
add_generation_prompt=True)`` with the checkpoint's own template and no further arguments, tokenizes that text as
one string, and lets the model continue. Training must therefore have shown the model that exact prompt, token for
token, right before every reply it learns. Two things can break that, both measured on this project's default run
(docs/serving.md, "Served as trained"):

- **The template's default mode.** Qwen3.5's template opens a think block in the generation prompt
  (``<|im_start|>assistant\\n<think>\\n``) unless ``enable_thinking=false``, which closes an empty one
  (``...<think>\\n\\n</think>\\n\\n``). A reply without reasoning is trained as ``<think>\\n\\n</think>\\n\\n...``: it
  extends the non-thinking prompt, not the thinking one. Served with the template's default (thinking), the default
  run answered 30 of 70 colour questions; with ``enable_thinking=False`` 70 of 70. ``with_thinking_default`` writes
  the run's mode into the saved template as its default, as Qwen's own small checkpoints do (their template only
  flips this default), so the default serving path is the one the run trained.
- **Token boundaries.** BPE merges across the end of the prompt: ``<think>\\n\\n</think>`` tokenizes as ``<think>``,
  ``\\n\\n``, ``</think>`` while the thinking prompt ends ``<think>``, ``\\n``. ``ServedPrompt.continuations`` gives the
  text the template appends after a turn's role header in each mode, so the renderer can cut its tokenization right
  after the served prompt: the prompt's tokens are then exactly the server's, and the reply's tokens are the
  tokenizer's own encoding of the reply.
"""

from __future__ import annotations

import re
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from transformers.utils.chat_template_utils import render_jinja_template

from renderers.content import TextBlock, normalize_message

THINKING_VARIABLE = "enable_thinking"
"""The template variable that switches Qwen3.5's generation prompt between thinking and non-thinking."""

_DEFAULT_LINE = "{%- if enable_thinking is not defined %}{%- set enable_thinking = {value} %}{%- endif %}\n"
_DEFAULT_RE = re.compile(r"^\{%- if enable_thinking is not defined %\}\{%- set enable_thinking = (true|false) %\}")
_PROBE_USER = {"role": "user", "content": "?"}
_PROBE_REPLY = {"role": "assistant", "content": "!"}


def has_thinking_switch(template: str) -> bool:
    """True when the template reads ``enable_thinking`` (Qwen3 / Qwen3.5 templates do)."""
    return re.search(rf"\b{THINKING_VARIABLE}\b", template) is not None


def with_thinking_default(template: str, enable_thinking: bool) -> str:
    """``template`` whose ``enable_thinking`` defaults to ``enable_thinking`` when the caller passes none.

    A caller's explicit value still wins. Idempotent: a default this function wrote earlier is replaced, not stacked.
    A template without the switch is returned unchanged (there is nothing to default).
    """
    if not has_thinking_switch(template):
        return template
    body = template.split("\n", 1)[1] if _DEFAULT_RE.match(template) else template
    return _DEFAULT_LINE.replace("{value}", "true" if enable_thinking else "false") + body


def default_thinking_mode(template: str, kwargs: Mapping[str, Any] | None = None) -> bool | None:
    """The thinking mode ``template`` serves when called with no ``enable_thinking`` (as servers do): True or
    False, or None when the template has no switch (both modes render alike)."""
    kwargs = dict(kwargs or {})
    prompts = {
        mode: _render(template, [_PROBE_USER], {**kwargs, THINKING_VARIABLE: mode}, add_generation_prompt=True)[0]
        for mode in (True, False)
    }
    if prompts[True] == prompts[False]:
        return None
    default, _ = _render(template, [_PROBE_USER], kwargs, add_generation_prompt=True)
    return default == prompts[True]


def _render(template: str, messages: list[dict], kwargs: Mapping[str, Any], **flags: Any) -> tuple[str, list]:
    rendered, spans = render_jinja_template(
        conversations=[messages], chat_template=template, return_assistant_tokens_mask=True, **flags, **kwargs
    )
    return rendered[0], spans[0]


@dataclass(frozen=True)
class ServedPrompt:
    """How the template's generation prompt continues after an assistant turn's role header, per thinking mode."""

    header: str
    """What opens every assistant turn before its trained content (``<|im_start|>assistant\\n``)."""
    continuations: tuple[str, ...]
    """The generation prompt after ``header``: the run's mode first, then the other one (``<think>\\n\\n</think>\\n\\n``
    and ``<think>\\n`` for Qwen3.5; one entry when the template has no switch, none when it cannot be derived)."""

    @classmethod
    def from_template(cls, template: str, kwargs: Mapping[str, Any], enable_thinking: bool) -> ServedPrompt:
        """Derived by rendering a one-word probe, so it follows whatever the template really writes."""
        bare, _ = _render(template, [_PROBE_USER], kwargs)
        with_reply, spans = _render(template, [_PROBE_USER, _PROBE_REPLY], kwargs)
        header = with_reply[len(bare) : spans[0][0]] if spans and with_reply.startswith(bare) else ""
        continuations: list[str] = []
        modes = (enable_thinking, not enable_thinking) if has_thinking_switch(template) else (enable_thinking,)
        for mode in modes:
            prompt, _ = _render(
                template, [_PROBE_USER], {**kwargs, THINKING_VARIABLE: mode}, add_generation_prompt=True
            )
            tail = prompt[len(bare) :]
            if (
                header
                and prompt.startswith(bare)
                and tail.startswith(header)
                and tail[len(header) :] not in continuations
            ):
                continuations.append(tail[len(header) :])
        return cls(header, tuple(continuations))

    def cut_after_prompt(self, text: str, start: int, end: int) -> int | None:
        """For an assistant span ``text[start:end]`` (its trained content), the index just after the served prompt,
        or None when the span does not begin with one (a history turn the template renders without its think block).

        The cut is where the prompt text ends and the reply begins; an empty continuation (a template whose prompt is
        just the header) cuts at ``start``."""
        for continuation in self.continuations:
            cut = start + len(continuation)
            if cut <= end and text.startswith(continuation, start):
                return cut
        return None


def last_reply_reasons(messages: Sequence[Mapping]) -> bool:
    """True when the conversation's last assistant turn carries reasoning (``reasoning_content`` or one of its
    spellings, or a ``<think>...</think>`` prefix of its text): a reply that only a thinking prompt leads into."""
    replies = [m for m in messages if isinstance(m, Mapping) and m.get("role") == "assistant"]
    if not replies:
        return False
    last = normalize_message(replies[-1])
    if last.reasoning_content and last.reasoning_content.strip():
        return True
    text = "".join(b.text for b in last.blocks if isinstance(b, TextBlock)).lstrip()
    return text.startswith("<think>") and "</think>" in text and bool(text[7 : text.index("</think>")].strip())
