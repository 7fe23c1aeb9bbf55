"""Template parity: does our renderer produce exactly what the checkpoint's own processor produces?

The trainer calls ``check_template_parity`` at start-up with the loaded checkpoint's processor, and refuses to
train on a mismatch: a renderer that disagrees with the chat template by one token trains a model on a format
it will never see at inference. The comparison covers token ids, modality types, pixel values and image grids,
and (for a renderer that trains all assistant turns) the loss mask against the template's
``return_assistant_tokens_mask``. The probe must not contain control-token strings in its text (for those the
renderer deliberately differs; see ``renderers.qwen3_5``).

``check_served_prompt`` holds the contract "served == trained": the tokens a run trains before a conversation's last
reply are exactly the tokens of the generation prompt a server builds with the checkpoint's own template.
"""

from __future__ import annotations

import itertools
import logging
from collections.abc import Mapping, Sequence
from typing import Any

import numpy as np
import torch
from PIL import Image

logger = logging.getLogger(__name__)

_CONTEXT = 12


class TemplateParityError(RuntimeError):
    """The renderer's output differs from ``processor.apply_chat_template`` on the probe conversation."""

    def __init__(self, field: str, position: int, detail: str) -> None:
        self.field = field
        """Which output differs: ``token_ids``, ``mm_token_type_ids``, ``loss_mask``, ``pixel_values``, ``image_grid_thw``,
        ``served_prompt`` (``check_served_prompt``) or ``served_video`` (``vlm_sft.data.served_video``)."""
        self.position = position
        """First differing index along that output (-1 when only shapes differ)."""
        super().__init__(f"template parity failed on {field} at position {position}: {detail}")


def probe_image(width: int = 96, height: int = 64) -> Image.Image:
    """A deterministic RGB picture (a colour gradient with a square), so pixel parity is checked on real data."""
    y, x = np.mgrid[0:height, 0:width]
    arr = np.stack([x * 255 // max(width - 1, 1), y * 255 // max(height - 1, 1), (x + y) % 256], axis=-1)
    arr[height // 4 : height // 2, width // 4 : width // 2] = (240, 200, 30)
    return Image.fromarray(arr.astype(np.uint8), "RGB")


def default_probe() -> list[dict]:
    """A conversation with a system prompt, an image, reasoning, and a second turn."""
    return [
        {"role": "system", "content": "You are a careful assistant."},
        {
            "role": "user",
            "content": [{"type": "image", "image": probe_image()}, {"type": "text", "text": "What is in the picture?"}],
        },
        {"role": "assistant", "reasoning_content": "A yellow square on a gradient.", "content": "A yellow square."},
        {"role": "user", "content": [{"type": "text", "text": "Where is it, roughly?"}]},
        {"role": "assistant", "content": "Near the top left, über the middle: ünïcödé 😀."},
    ]


def served_probes(enable_thinking: bool) -> list[list[dict]]:
    """Conversations whose last reply a server's default prompt must lead into (``check_served_prompt``): the default
    probe (its last reply has no reasoning), and in thinking mode also one whose last reply reasons. A non-thinking
    run cannot serve a reasoning reply by default: its prompt closes the think block."""
    probes = [default_probe()]
    if enable_thinking:
        reasoning = default_probe()
        reasoning[-1] = {**reasoning[-1], "reasoning_content": "Left of centre, near the top."}
        probes.append(reasoning)
    return probes


def _context(tokenizer: Any, ids: torch.Tensor, position: int) -> str:
    lo, hi = max(0, position - _CONTEXT), position + _CONTEXT
    return repr(tokenizer.decode(ids[lo:hi].tolist()))


def _first_difference(a: torch.Tensor, b: torch.Tensor) -> int:
    n = min(len(a), len(b))
    diff = torch.nonzero(a[:n] != b[:n])
    return int(diff[0, 0]) if len(diff) else n


def _images_in(messages: Sequence[Mapping]) -> list[Any]:
    """The image objects of ``messages``' blocks, in order (PIL images, paths, or ``image_url`` blocks' urls)."""
    images = [
        b.get("image", b.get("image_url"))
        for m in messages
        if isinstance(m.get("content"), list)
        for b in m["content"]
        if isinstance(b, Mapping) and ("image" in b or "image_url" in b or b.get("type") == "image")
    ]
    return [image["url"] if isinstance(image, Mapping) else image for image in images]


def served_cuts(processor: Any, messages: Sequence[Mapping], tools: Any, enable_thinking: bool) -> list[int]:
    """Where, in the template's text of ``messages``, a server's generation prompt for the last assistant turn ends
    (``[]`` when none is a prefix): the processor's own ``apply_chat_template(messages[:last],
    add_generation_prompt=True)`` in the run's thinking mode, else in the other one. Independent of the renderer's
    own rule, which the parity check holds to it."""
    text = processor.apply_chat_template(list(messages), tools=tools, tokenize=False)
    last = max(i for i, m in enumerate(messages) if m["role"] == "assistant")
    for mode in (enable_thinking, not enable_thinking):
        prompt = processor.apply_chat_template(
            list(messages[:last]), tools=tools, tokenize=False, add_generation_prompt=True, enable_thinking=mode
        )
        if text.startswith(prompt):
            return [len(prompt)]
    return []


def _reference(processor: Any, messages: Sequence[Mapping], tools: Any, enable_thinking: bool) -> dict[str, Any]:
    """The processor's own tokens, modality types and images for ``messages``, its text tokenized in pieces cut at
    the served prompts (``served_cuts``)."""
    text = processor.apply_chat_template(list(messages), tools=tools, tokenize=False)
    bounds = [0, *served_cuts(processor, messages, tools, enable_thinking), len(text)]
    images = _images_in(messages)
    parts: list[dict] = []
    for start, end in itertools.pairwise(bounds):
        piece = text[start:end]
        n = piece.count(processor.image_token)
        taken, images = images[:n], images[n:]
        parts.append(dict(processor(text=[piece], images=taken or None, return_tensors="pt")))
    ref = {key: torch.cat([p[key][0] for p in parts]) for key in ("input_ids", "mm_token_type_ids")}
    for key in ("pixel_values", "image_grid_thw"):
        found = [p[key] for p in parts if key in p]
        if found:
            ref[key] = torch.cat(found)
    return ref


def check_template_parity(
    renderer: Any,
    processor: Any,
    probe: Sequence[Mapping] | None = None,
    *,
    tools: Sequence[Mapping] | None = None,
) -> None:
    """Raise ``TemplateParityError`` unless rendering ``probe`` equals the processor's own output.

    ``probe`` defaults to ``default_probe()`` (text, an image, reasoning, two turns). The reference is the processor's
    template text, tokenized by the processor in pieces cut where its own served generation prompts end
    (``served_cuts``): the renderer must cut at the same places (``renderers.served``). The loss mask is held to the
    template's ``return_assistant_tokens_mask``: token by token where the cuts change no token, else by the text of
    the trained tokens.
    """
    messages = list(probe) if probe is not None else default_probe()
    tools_ = list(tools) if tools else None
    ours = renderer.render(messages, tools=tools)
    ref = _reference(processor, messages, tools_, getattr(renderer, "enable_thinking", False))
    tokenizer = processor.tokenizer
    ref_ids = ref["input_ids"].long()
    if not torch.equal(ours.token_ids, ref_ids):
        pos = _first_difference(ours.token_ids, ref_ids)
        raise TemplateParityError(
            "token_ids",
            pos,
            f"ours ({len(ours.token_ids)} tokens) {_context(tokenizer, ours.token_ids, pos)} vs the processor's "
            f"({len(ref_ids)} tokens) {_context(tokenizer, ref_ids, pos)}",
        )
    ref_types = ref["mm_token_type_ids"].long()
    if not torch.equal(ours.mm_token_type_ids, ref_types):
        pos = _first_difference(ours.mm_token_type_ids, ref_types)
        raise TemplateParityError("mm_token_type_ids", pos, f"near {_context(tokenizer, ref_ids, pos)}")
    if getattr(renderer, "loss_on", "all_assistant") == "all_assistant":
        _check_loss_mask(renderer, processor, messages, tools_, ours)
    _check_images(ours, ref)
    logger.info("template parity ok: %d tokens, %d images", len(ours), ours.num_images)


def _check_loss_mask(renderer: Any, processor: Any, messages: list, tools: Any, ours: Any) -> None:
    whole = processor.apply_chat_template(
        messages, tools=tools, tokenize=True, return_dict=True, return_tensors="pt", return_assistant_tokens_mask=True
    )
    ids = whole["input_ids"][0].long()
    vision = torch.isin(ids, torch.as_tensor(renderer.vision_ids)) | (ids == renderer.image_token_id)
    ref_mask = whole["assistant_masks"][0].bool() & ~vision
    tokenizer = processor.tokenizer
    if torch.equal(ids, ours.token_ids):
        if not torch.equal(ours.loss_mask, ref_mask):
            pos = _first_difference(ours.loss_mask, ref_mask)
            raise TemplateParityError(
                "loss_mask",
                pos,
                f"ours {bool(ours.loss_mask[pos])} vs template {bool(ref_mask[pos])} near {_context(tokenizer, ids, pos)}",
            )
        return
    trained, expected = (tokenizer.decode(t.tolist()) for t in (ours.token_ids[ours.loss_mask], ids[ref_mask]))
    if trained != expected:
        pos = _first_difference(torch.tensor(list(trained.encode())), torch.tensor(list(expected.encode())))
        raise TemplateParityError("loss_mask", pos, f"trained text {trained!r} vs the template's {expected!r}")


def check_served_prompt(
    renderer: Any,
    processor: Any,
    messages: Sequence[Mapping],
    *,
    tools: Sequence[Mapping] | None = None,
    **serve_kwargs: Any,
) -> None:
    """Raise ``TemplateParityError("served_prompt", ...)`` unless the training tokens of ``messages``' last assistant
    turn are exactly what a server gives: ``processor.apply_chat_template(messages[:last], add_generation_prompt=True,
    tokenize=True, **serve_kwargs)`` followed by the tokenizer's own tokens of the reply.

    ``serve_kwargs`` empty is the server's default call (the template's own default thinking mode). The reply is what
    the run trained the model to produce after the template's generation prompt (``renderer.last_reply_start``: in
    Qwen3.5, after the think block's opening, or after the empty block in non-thinking mode), through the end of the
    turn; a served prompt that stops elsewhere (e.g. a template whose prompt drops the think block) is a failure even
    when it is a prefix of the text, since the model would have to write the template's own scaffolding.
    """
    messages = list(messages)
    last = max(i for i, m in enumerate(messages) if m["role"] == "assistant")
    tools_ = list(tools) if tools else None
    kwargs = {"tools": tools_, "add_generation_prompt": True, **serve_kwargs}
    prompt_text = processor.apply_chat_template(messages[:last], tokenize=False, **kwargs)
    full_text = renderer.render_text(messages[: last + 1], tools=tools)
    reply_start = renderer.last_reply_start(messages[: last + 1], tools=tools)
    tokenizer = processor.tokenizer
    if prompt_text != full_text[:reply_start]:
        raise TemplateParityError(
            "served_prompt",
            reply_start,
            f"the served prompt (arguments {serve_kwargs or 'none'}) ends {prompt_text[-40:]!r}, but the run trains "
            f"the reply after {full_text[max(reply_start - 40, 0) : reply_start]!r}: a server would not prompt the "
            "model with the text training showed before this reply (docs/serving.md)",
        )
    prompt = processor.apply_chat_template(
        messages[:last], tokenize=True, return_dict=True, return_tensors="pt", **kwargs
    )
    reply_images = _images_in(messages[last : last + 1]) or None
    reply_ids = processor(text=[full_text[reply_start:]], images=reply_images, return_tensors="pt")["input_ids"][0]
    expected = torch.cat([prompt["input_ids"][0].long(), reply_ids.long()])
    ours = renderer.render(messages[: last + 1], tools=tools).token_ids
    if not torch.equal(ours, expected):
        pos = _first_difference(ours, expected)
        tokens = [tokenizer.convert_ids_to_tokens(t[max(pos - 3, 0) : pos + 3].tolist()) for t in (ours, expected)]
        raise TemplateParityError(
            "served_prompt",
            pos,
            f"training tokens {tokens[0]} vs the served prompt + reply {tokens[1]} (arguments "
            f"{serve_kwargs or 'none'}; the prompt is {len(prompt['input_ids'][0])} tokens): the run's tokens are not "
            "the served prompt's followed by the reply's (a token that straddles the prompt's end?)",
        )


def _check_images(ours: Any, ref: Mapping) -> None:
    mm = ours.multi_modal_data
    ref_grid = ref.get("image_grid_thw")
    if mm is None or ref_grid is None:
        if (mm is None) != (ref_grid is None):
            raise TemplateParityError(
                "image_grid_thw",
                -1,
                f"ours has {ours.num_images} images, the processor's {0 if ref_grid is None else len(ref_grid)}",
            )
        return
    if not torch.equal(mm.image_grid_thw, ref_grid.long()):
        raise TemplateParityError("image_grid_thw", -1, f"ours {mm.image_grid_thw.tolist()} vs {ref_grid.tolist()}")
    ref_pixels = ref["pixel_values"]
    if mm.pixel_values.shape != ref_pixels.shape:
        raise TemplateParityError(
            "pixel_values", -1, f"shape {tuple(mm.pixel_values.shape)} vs {tuple(ref_pixels.shape)}"
        )
    if not torch.equal(mm.pixel_values, ref_pixels.to(mm.pixel_values.dtype)):
        row = int(torch.nonzero((mm.pixel_values != ref_pixels).any(-1))[0, 0])
        raise TemplateParityError("pixel_values", row, "patch row differs")
