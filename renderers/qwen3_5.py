"""The Qwen3.5 chat renderer: a conversation to training tokens, loss mask, modality types and image tensors.

How one conversation is rendered (each step once, so the result is exact and cheap):

1. normalize the messages into typed blocks and check their structure (``renderers.content``);
2. apply the special-text policy to every user-written string (below);
3. render the text with the processor's own chat template, once, with ``{% generation %}`` tracking, which gives
   the character spans of every assistant turn (its content through its ``<|im_end|>``);
4. tokenize that text with the fast tokenizer, with character offsets, in two pieces cut right after the last
   assistant turn's served generation prompt (``renderers.served``): a server tokenizes its prompt as one string, so
   the tokens before the last reply are exactly the served prompt's and the reply's are the tokenizer's own;
5. expand each ``<|image_pad|>`` to ``prod(grid_thw) // merge**2`` copies. ``<|image_pad|>`` is an added token,
   so the tokenizer splits the text around it and expanding ids equals tokenizing the expanded text;
6. the loss mask is every token that overlaps a trained generation span (the rule transformers uses for
   ``return_assistant_tokens_mask``), minus vision tokens.

So ``token_ids`` equal the processor's tokens of the template's text (``processor.apply_chat_template(messages,
tokenize=True)`` wherever BPE merges nothing across a cut), the tokens before the last reply equal
``apply_chat_template(messages[:-1], add_generation_prompt=True, tokenize=True)``, and the images equal the
processor's (``renderers.parity`` checks both against a loaded checkpoint).

Which assistant turns train (``loss_on``): ``all_assistant`` every turn as the template renders it (history turns
before the last user query without their reasoning: Qwen3.5's template drops it), ``last_assistant`` the last one,
``stable_prefix`` only turns whose rendering begins with the served generation prompt, i.e. the turns a server's
prompt can lead into (the final reply and the tool-calling turns after the last user query).

Special text ("phantom placeholders"). A user who types ``<|image_pad|>`` or ``<|im_end|>`` in a message would,
through the template and tokenizer, produce a real image slot (misaligning image features: a multi-GPU run hangs)
or end the turn early. Every special added token found in user-written text (content, reasoning, tool calls,
tools) is handled by ``special_text``: ``"escape"`` (default) tokenizes its characters as ordinary text (the string
is split after its first character, so the tokenizer cannot match the special token) and lists it in
``metadata["escaped_special_text"]``; ``"drop"`` removes it (``metadata["dropped_special_text"]``);
``"error"`` raises ``RenderError("special_token_in_text")``. A string split across adjacent text blocks (which the
template concatenates) is found too.

Where parity with ``apply_chat_template`` is not defined, on purpose:
- text containing control-token strings (the stock processor turns them into control tokens, which is the bug);
  with ``escape`` the text around an escaped string is also tokenized as separate pieces, so BPE merges across
  those boundaries can differ from tokenizing the whole string;
- images with alpha (we composite on white, HF's ``convert("RGB")`` drops alpha), 16-bit grey (we scale, HF
  clips), and in-memory PIL images with an EXIF orientation (we apply it; HF only does for files);
- tool-call arguments given as a JSON string (we parse them; the template refuses them).
"""

from __future__ import annotations

import itertools
import logging
import re
from collections.abc import Mapping, Sequence
from typing import Any, Literal

import jinja2
import numpy as np
import torch
from transformers.utils.chat_template_utils import render_jinja_template

from renderers.content import (
    ImageBlock,
    Message,
    VideoBlock,
    iter_text,
    map_message_text,
    map_strings,
    merge_text_runs,
    normalize_messages,
    normalize_tools,
    text_runs,
    to_template_message,
)
from renderers.errors import RenderError
from renderers.image_cache import CachedImageProcessor, ImageCache, ProcessedImage
from renderers.served import THINKING_VARIABLE, ServedPrompt
from renderers.types import MultiModalData, PlaceholderRange, RenderedSample, vision_slots
from renderers.video import ProcessedVideo, VideoSettings, load_video
from renderers.vision_items import VisionItems, expand_video_wrappers, vision_items

logger = logging.getLogger(__name__)

LossOn = Literal["all_assistant", "last_assistant", "stable_prefix"]
SpecialText = Literal["escape", "drop", "error"]

_MARK_OPEN = "\ufdd0"
"""Noncharacters (never valid in interchanged text) that bracket an escaped special string through the template."""
_MARK_CLOSE = "\ufdd1"
_MARK_RE = re.compile(f"[{_MARK_OPEN}{_MARK_CLOSE}]")
_SURROGATE_RE = re.compile("[\ud800-\udfff]")
"""A lone UTF-16 surrogate: valid in a Python str read from JSON, refused by every tokenizer."""
_GENERATION_RE = re.compile(r"\{%-?\s*generation\s*-?%\}")
_JINJA_COMMENT_RE = re.compile(r"\{#.*?#\}", re.DOTALL)


def _resolve_template(processor: Any, chat_template: str | None) -> str:
    template = chat_template if chat_template is not None else getattr(processor, "chat_template", None)
    if isinstance(template, Mapping):
        template = template.get("default")
    if not isinstance(template, str) or not template:
        raise ValueError("the processor has no chat template; pass chat_template= or load a checkpoint that has one")
    return template


class Qwen3_5Renderer:
    """Renders chat conversations for Qwen3.5 (and any Qwen2-VL-style processor with the same placeholders)."""

    def __init__(
        self,
        processor: Any,
        *,
        loss_on: LossOn = "all_assistant",
        special_text: SpecialText = "escape",
        image_cache_size: int = 2048,
        image_cache_bytes: int = 512 * 2**20,
        max_image_pixels: int | None = None,
        chat_template: str | None = None,
        template_kwargs: Mapping[str, Any] | None = None,
        enable_thinking: bool = False,
        video_settings: VideoSettings | None = None,
    ) -> None:
        if loss_on not in ("all_assistant", "last_assistant", "stable_prefix"):
            raise ValueError(f"loss_on={loss_on!r}; use 'all_assistant', 'last_assistant' or 'stable_prefix'")
        if special_text not in ("escape", "drop", "error"):
            raise ValueError(f"special_text={special_text!r}; use 'escape', 'drop' or 'error'")
        self.processor = processor
        self.loss_on: LossOn = loss_on
        self.special_text: SpecialText = special_text
        self.tokenizer = processor.tokenizer
        self._backend = self.tokenizer.backend_tokenizer
        self.chat_template = _resolve_template(processor, chat_template)
        if not _GENERATION_RE.search(_JINJA_COMMENT_RE.sub("", self.chat_template)):
            raise ValueError(
                "the chat template has no {% generation %} block, so the assistant spans (the loss mask) cannot be "
                "derived from it; use a template that marks assistant turns with {% generation %}"
            )
        self.template_kwargs = {**self.tokenizer.special_tokens_map, **(template_kwargs or {})}
        """Variables the template sees, as ``processor.apply_chat_template`` passes them (plus ours)."""
        self.enable_thinking = enable_thinking
        """The thinking mode the run trains for: its generation prompts (``render_prompt``) and the served prompt
        after which each reply's tokenization starts (``served``)."""
        self.served = ServedPrompt.from_template(self.chat_template, self.template_kwargs, enable_thinking)
        """The template's generation prompt after an assistant header, in this mode first (``renderers.served``)."""
        image_processor = processor.image_processor
        self.merge_size = int(image_processor.merge_size)
        image_token = getattr(processor, "image_token", "<|image_pad|>")
        self.image_token_id = self._token_id(image_token)
        self.video_token_id = self._token_id(getattr(processor, "video_token", "<|video_pad|>"))
        self.video_settings = video_settings or VideoSettings.from_processor(processor.video_processor.to_dict())
        """Frame sampling and pixel budget of videos (the checkpoint's video processor config unless overridden)."""
        self.vision_ids = np.array(
            [self._token_id(getattr(processor, name, default)) for name, default in _VISION_TOKENS], dtype=np.int64
        )
        self.images = CachedImageProcessor(
            image_processor, ImageCache(image_cache_size, image_cache_bytes), max_pixels=max_image_pixels
        )
        """Loads, checks and processes images once per content hash."""
        specials = sorted(
            {t.content for t in self.tokenizer.added_tokens_decoder.values() if t.special} | {image_token},
            key=len,
            reverse=True,
        )
        self.special_strings: tuple[str, ...] = tuple(specials)
        """Control-token strings that user text may not produce (the tokenizer's special added tokens)."""
        self._special_re = re.compile("|".join(re.escape(s) for s in specials))

    def _token_id(self, token: str) -> int:
        token_id = self.tokenizer.convert_tokens_to_ids(token)
        if not isinstance(token_id, int) or token_id == self.tokenizer.unk_token_id:
            raise ValueError(f"the tokenizer has no {token!r} token; is this a Qwen-VL processor?")
        return token_id

    # ----------------------------------------------------------------------------------------------- public

    def render(
        self, messages: Sequence[Mapping], *, tools: Sequence[Mapping] | str | None = None, sample_index: int = -1
    ) -> RenderedSample:
        """One conversation to a ``RenderedSample``; bad input raises ``RenderError`` naming ``sample_index``."""
        try:
            return self._render(messages, tools, sample_index)
        except RenderError as e:
            if sample_index >= 0 and e.sample_index != sample_index:
                raise e.with_index(sample_index) from e
            raise
        except RecursionError as e:  # a value nested hundreds deep: the walks over the conversation recurse per level
            raise RenderError(
                "nested_too_deeply", "a value nested too deeply to render", sample_index=sample_index
            ) from e

    def render_text(self, messages: Sequence[Mapping], *, tools: Sequence[Mapping] | str | None = None) -> str:
        """The chat-template text of a conversation (after normalization and the special-text policy)."""
        conversation, tools_, _ = self._prepare(messages, tools)
        return self._template(conversation, tools_)[0].replace(_MARK_OPEN, "").replace(_MARK_CLOSE, "")

    def last_reply_start(self, messages: Sequence[Mapping], *, tools: Sequence[Mapping] | str | None = None) -> int:
        """Where, in ``render_text(messages)``, the last assistant turn's reply begins: just after the generation
        prompt a server gives in this run's thinking mode (``renderers.served``). ``ValueError`` when that turn does
        not begin with a served prompt (a turn no server prompt leads into), or the text holds escaped control
        strings."""
        conversation, tools_, found = self._prepare(messages, tools)
        if found:
            raise ValueError(f"the conversation holds control-token strings {found[:3]}; use one without them")
        text, spans = self._template(conversation, tools_)
        cut = self.served.cut_after_prompt(text, *spans[-1])
        if cut is None:
            raise ValueError(
                f"the last assistant turn renders as {text[spans[-1][0] : spans[-1][0] + 40]!r}, which no generation "
                f"prompt of this template ({self.served.continuations}) leads into"
            )
        return cut

    # ---------------------------------------------------------------------------------------------- stages

    def _prepare(
        self, messages: Any, tools: Any, *, prompt: bool = False
    ) -> tuple[tuple[Message, ...], list[dict] | None, list[str]]:
        """Normalized messages (``prompt``: a conversation awaiting its reply, which needs no assistant turn)."""
        normalized = normalize_messages(messages, require_assistant=not prompt)
        conversation = tuple(self._join_split_specials(m) for m in normalized)
        tools_ = normalize_tools(tools)
        texts = iter_text(conversation, tools_)
        for s in texts:
            if _SURROGATE_RE.search(s):  # JSON may escape half a UTF-16 pair ("\ud800"); tokenizers refuse it
                raise RenderError("lone_surrogate", f"text holds a lone UTF-16 surrogate: {s[:40]!r}")
        found = [m.group(0) for s in texts if "<" in s for m in self._special_re.finditer(s)]
        if not found:
            return conversation, tools_, []
        if self.special_text == "error":
            raise RenderError(
                "special_token_in_text", f"text contains the control token {found[0]!r} ({len(found)} in all)"
            )
        if self.special_text == "drop":
            fn = self._drop
        else:
            if any(_MARK_RE.search(s) for s in texts):
                raise RenderError("reserved_character", "text contains U+FDD0 / U+FDD1, reserved for escaping")
            fn = self._escape
        conversation = tuple(map_message_text(m, fn) for m in conversation)
        if tools_ is not None:
            tools_ = map_strings(tools_, fn)
        return conversation, tools_, found

    def _join_split_specials(self, message: Message) -> Message:
        """Merge adjacent text blocks when a control-token string only forms across their boundary.

        The template concatenates adjacent text blocks, so ``"<|image"`` + ``"_pad|>"`` would render a real image
        slot that no single block contains; merged, the string is found and handled like any other.
        """
        if isinstance(message.content, str):
            return message
        for run in text_runs(message):
            if len(run) > 1 and "<" in "".join(run):
                whole = len(self._special_re.findall("".join(run)))
                if whole > sum(len(self._special_re.findall(t)) for t in run):
                    return merge_text_runs(message)
        return message

    def _drop(self, text: str) -> str:
        # Repeat: removing "<|image_pad|>" from "<|im_<|image_pad|>end|>" leaves a new "<|im_end|>".
        while self._special_re.search(text):
            text = self._special_re.sub("", text)
        return text

    def _escape(self, text: str) -> str:
        return self._special_re.sub(lambda m: _MARK_OPEN + m.group(0) + _MARK_CLOSE, text)

    def _template(
        self,
        conversation: Sequence[Message],
        tools: list[dict] | None,
        *,
        generation_prompt: bool = False,
        thinking: bool | None = None,
    ) -> tuple[str, list[list[int]]]:
        """The template's text and its assistant spans; ``generation_prompt`` renders a server's prompt (the run's
        thinking mode, or ``thinking``, passed explicitly, so it never depends on the template's default)."""
        mode = self.enable_thinking if thinking is None else thinking
        flags = {"add_generation_prompt": True, THINKING_VARIABLE: mode} if generation_prompt else {}
        try:
            rendered, spans = render_jinja_template(
                conversations=[[to_template_message(m) for m in conversation]],
                tools=tools,
                chat_template=self.chat_template,
                return_assistant_tokens_mask=True,
                **{**self.template_kwargs, **flags},
            )
        except jinja2.TemplateError as e:
            raise RenderError("template_error", f"the chat template refused the conversation: {e}") from e
        return rendered[0], spans[0]

    def _tokenize(self, text: str, cuts: Sequence[int] = ()) -> tuple[np.ndarray, np.ndarray]:
        """Token ids and ``[T, 2]`` character offsets into ``text`` (which may hold escape marks), tokenized in
        separate pieces at ``cuts`` (ascending character positions): the ends of served generation prompts, so
        that no token straddles the point where a server's prompt stops and the reply starts."""
        bounds = [0, *cuts, len(text)]
        if len(bounds) == 2:
            return self._tokenize_piece(text)
        ids, offsets = [], []
        for start, end in itertools.pairwise(bounds):
            piece_ids, piece_offsets = self._tokenize_piece(text[start:end])
            ids.append(piece_ids)
            offsets.append(piece_offsets + start)
        return np.concatenate(ids), np.concatenate(offsets)

    def _tokenize_piece(self, text: str) -> tuple[np.ndarray, np.ndarray]:
        if _MARK_OPEN not in text:
            enc = self._backend.encode(text, add_special_tokens=False)
            return np.asarray(enc.ids, dtype=np.int64), np.asarray(enc.offsets, dtype=np.int64).reshape(-1, 2)
        pieces = re.split(f"[{_MARK_OPEN}{_MARK_CLOSE}]", text)
        if len(pieces) % 2 == 0 or any(p not in self.special_strings for p in pieces[1::2]):
            raise RenderError("template_error", "the chat template altered escaped special text")
        ids: list[int] = []
        offsets: list[tuple[int, int]] = []
        position = 0
        for k, piece in enumerate(pieces):
            # Outside pieces are ordinary text; an escaped special string is split after its first character
            # so that neither half can match an added token.
            parts = [(piece, 0)] if k % 2 == 0 else [(piece[:1], 0), (piece[1:], 1)]
            for part, shift in parts:
                if not part:
                    continue
                enc = self._backend.encode(part, add_special_tokens=False)
                ids += enc.ids
                offsets += [(s + position + shift, e + position + shift) for s, e in enc.offsets]
            position += len(piece) + 1  # the mark that followed this piece
        return np.asarray(ids, dtype=np.int64), np.asarray(offsets, dtype=np.int64).reshape(-1, 2)

    def _trained_spans(
        self, text: str, spans: list[list[int]], conversation: Sequence[Message]
    ) -> tuple[list[list[int]], list[int]]:
        """(the spans ``loss_on`` trains, the tokenization cut after the last span's served prompt).

        A span whose text begins with the served generation prompt (``renderers.served``) is a *stable prefix*:
        the conversation up to it, rendered as a server renders a request, is a prefix of this rendering. History
        turns before the last user query are not (the template renders them without their think block).

        Only the last span is cut: a server tokenizes each request's whole prompt as one string, so the earlier turns
        of a later request's prompt are tokenized whole, and so are they here (a thinking run's empty think block in
        an earlier tool-calling turn is ``<think>``, ``\n\n``, ... in the next request's prompt, as in training)."""
        cuts = [self.served.cut_after_prompt(text, start, end) for start, end in spans]
        if self.loss_on == "all_assistant":
            trained = spans
        elif self.loss_on == "last_assistant":
            trained = spans[-1:]
        else:
            trained = [span for span, cut in zip(spans, cuts, strict=True) if cut is not None]
        context = _context_spans(spans, conversation)
        trained = [span for span in trained if tuple(span) not in context]
        return trained, [cuts[-1]] if cuts and cuts[-1] is not None else []

    def _render(self, messages: Any, tools: Any, sample_index: int) -> RenderedSample:
        conversation, tools_, found = self._prepare(messages, tools)
        text, spans = self._template(conversation, tools_)
        visuals = self._load_visuals(conversation)
        text, spans = expand_video_wrappers(text, spans, [v for v in visuals if isinstance(v, ProcessedVideo)])
        trained, cuts = self._trained_spans(text, spans, conversation)
        ids, offsets = self._tokenize(text, cuts)

        starts, ends = offsets[:, 0], offsets[:, 1]
        mask = np.zeros(len(ids), dtype=bool)
        for start, end in trained:
            mask |= (starts < end) & (ends > start)
        sample = self._with_vision(visuals, ids, mask, sample_index, found)
        if not sample.loss_mask.any():
            raise RenderError("no_trainable_tokens", "the rendered conversation has no assistant tokens to train on")
        return sample

    def render_prompt(
        self,
        messages: Sequence[Mapping],
        *,
        tools: Sequence[Mapping] | str | None = None,
        sample_index: int = -1,
        thinking: bool | None = None,
    ) -> RenderedSample:
        """A server's generation prompt for ``messages`` (a conversation that ends before the reply to generate):
        the template with ``add_generation_prompt`` in the run's thinking mode (or ``thinking``, a caller's explicit
        one), tokenized as one string, images expanded; the loss mask is all False. ``metadata["text"]`` holds the
        prompt text."""
        try:
            conversation, tools_, found = self._prepare(messages, tools, prompt=True)
            text, _ = self._template(conversation, tools_, generation_prompt=True, thinking=thinking)
            visuals = self._load_visuals(conversation)
            text, _ = expand_video_wrappers(text, [], [v for v in visuals if isinstance(v, ProcessedVideo)])
            ids, _ = self._tokenize(text)
            sample = self._with_vision(visuals, ids, np.zeros(len(ids), dtype=bool), sample_index, found)
        except RenderError as e:
            if sample_index >= 0 and e.sample_index != sample_index:
                raise e.with_index(sample_index) from e
            raise
        sample.metadata["text"] = text.replace(_MARK_OPEN, "").replace(_MARK_CLOSE, "")
        return sample

    def _load_visuals(self, conversation: Sequence[Message]) -> list[ProcessedImage | ProcessedVideo]:
        """Every image (cached) and video of the conversation, processed, in the order the template renders them."""
        out: list[ProcessedImage | ProcessedVideo] = []
        for block in (b for m in conversation for b in m.visuals):
            if isinstance(block, VideoBlock):
                out.append(load_video(block.source, self.video_settings, fps=block.fps))
            else:
                assert isinstance(block, ImageBlock)
                out.append(self.images.process(block.source, block.key))
        return out

    def _with_vision(
        self,
        visuals: list[ProcessedImage | ProcessedVideo],
        ids: np.ndarray,
        mask: np.ndarray,
        sample_index: int,
        found: list[str],
    ) -> RenderedSample:
        """Each image pad and each video group's pad widened to its merged-token count, slot types set (1 image, 2
        video), vision tokens never trained."""
        settings = self.video_settings
        items = vision_items(visuals, -(-settings.min_frames // settings.temporal_patch_size))
        pad_positions = np.flatnonzero((ids == self.image_token_id) | (ids == self.video_token_id))
        kinds = np.where(ids[pad_positions] == self.video_token_id, 2, 1)
        if len(pad_positions) != len(items.kinds) or not np.array_equal(kinds, items.kinds):
            raise RenderError(
                "image_count_mismatch",
                f"the template rendered {int((kinds == 1).sum())} image and {int((kinds == 2).sum())} video-group "
                f"slots for {items.kinds.count(1)} images and {items.kinds.count(2)} video groups",
            )
        lengths = [int(np.prod(g)) // self.merge_size**2 for g in items.grids]
        types = np.zeros(len(ids), dtype=np.int64)
        if items.kinds:
            repeats = np.ones(len(ids), dtype=np.int64)
            repeats[pad_positions] = lengths
            types[pad_positions] = kinds
            ids, mask, types = np.repeat(ids, repeats), np.repeat(mask, repeats), np.repeat(types, repeats)
            mask &= ~vision_slots(torch.from_numpy(types)).numpy() & ~np.isin(ids, self.vision_ids)
        metadata: dict[str, Any] = {}
        if found:
            metadata["escaped_special_text" if self.special_text == "escape" else "dropped_special_text"] = tuple(found)
        return RenderedSample(
            token_ids=torch.from_numpy(ids),
            loss_mask=torch.from_numpy(mask),
            mm_token_type_ids=torch.from_numpy(types),
            multi_modal_data=_multi_modal_data(items, pad_positions, lengths) if items.kinds else None,
            sample_index=sample_index,
            metadata=metadata,
        )


def _multi_modal_data(items: VisionItems, pad_positions: np.ndarray, lengths: list[int]) -> MultiModalData:
    # Each earlier item's single pad became `length` tokens, shifting later ones by length - 1.
    shift = np.concatenate([[0], np.cumsum(np.asarray(lengths) - 1)[:-1]])
    placeholders = tuple(
        PlaceholderRange(int(p + s), int(n)) for p, s, n in zip(pad_positions, shift, lengths, strict=True)
    )
    return MultiModalData(
        # A copy, so cached tensors stay untouched. numpy, not torch.cat: with several intra-op threads on a
        # busy machine torch.cat of two small tensors measured ~3 ms here, np.concatenate ~30 us.
        pixel_values=torch.from_numpy(np.concatenate(items.pixel_values)),
        image_grid_thw=torch.tensor(items.grids, dtype=torch.long),
        placeholders=placeholders,
        image_hashes=tuple(items.hashes),
        videos=items.videos,
    )


def _context_spans(spans: list[list[int]], conversation: Sequence[Message]) -> set[tuple[int, int]]:
    """The generation spans of assistant turns given ``weight: 0`` (the template marks one span per assistant turn,
    in order; a template that does not cannot say which span is whose, so such a turn is refused)."""
    assistant = [m for m in conversation if m.role == "assistant"]
    if all(m.trained for m in assistant):
        return set()
    if len(assistant) != len(spans):
        raise RenderError(
            "template_error",
            f"the chat template marks {len(spans)} generation spans for {len(assistant)} assistant turns, so the "
            "turns given weight 0 cannot be told apart",
        )
    return {tuple(span) for span, m in zip(spans, assistant, strict=True) if not m.trained}


_VISION_TOKENS = (("vision_start_token", "<|vision_start|>"), ("vision_end_token", "<|vision_end|>"))
