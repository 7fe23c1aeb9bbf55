"""Served == trained for video, checked on the text: the checkpoint's template, as a server calls it, with its video
wrapper expanded as transformers' processor expands it, tokenizes to exactly the tokens the run trains.

transformers' video processor needs torchvision, which cannot sit beside our CPU torch, so a server's tokens for a
video cannot be made here; their text can. The chat template writes a video block as ``VIDEO_WRAPPER``, and
``Qwen3VLProcessor`` (5.x) replaces that wrapper by ``<{t:.1f} seconds><|vision_start|>`` + pads +
``<|vision_end|>`` per temporal group (``renderers.vision_items``). ``check_served_video`` renders a probe
conversation holding a video through the checkpoint's template (``tokenize=False``), expands each wrapper with the
rendered video's own groups and timestamps, widens each group's pad to its merged-token count, tokenizes with the
checkpoint's tokenizer (the served prompt and the reply apart, as a server tokenizes the prompt alone) and holds the
result to the renderer's ``token_ids`` and ``mm_token_type_ids``. The frames, grids and timestamps themselves are held
to transformers' processor by the committed references (``tests/test_video_processor.py``).
"""

from __future__ import annotations

import logging
import re
from types import SimpleNamespace
from typing import Any

import jinja2
import numpy as np
import torch
from PIL import Image

from renderers import TemplateParityError
from renderers.errors import RenderError
from renderers.vision_items import VIDEO_WRAPPER, expand_video_wrappers

logger = logging.getLogger(__name__)

VIDEO_PROBE_FPS = 1.0
"""Rate of the probe's frames: its two groups are stated as ``<0.5 seconds>`` and ``<2.5 seconds>``."""
_BEFORE, _AFTER = "Watch this clip.", "Which way does the square move?"
"""The probe's text around its video, so an error can quote what the template wrote between them."""


def probe_frames(count: int = 4, size: int = 48) -> list[Image.Image]:
    """``count`` RGB frames of a gradient with a square moving right (each frame differs)."""
    y, x = np.mgrid[0:size, 0:size]
    base = np.stack([x * 255 // (size - 1), y * 255 // (size - 1), (x + y) % 256], axis=-1).astype(np.uint8)
    frames = []
    for k in range(count):
        frame = base.copy()
        left = k * size // (2 * count)
        frame[size // 4 : size // 2, left : left + size // 4] = (240, 200, 30)
        frames.append(Image.fromarray(frame, "RGB"))
    return frames


def video_probe(max_frames: int = 4) -> list[dict]:
    """A user turn with a video (a frame list, so no file or decoder is needed) between two texts, and a reply."""
    video = {"type": "video", "video": probe_frames(4 if max_frames >= 4 else 2), "fps": VIDEO_PROBE_FPS}
    content = [{"type": "text", "text": _BEFORE}, video, {"type": "text", "text": _AFTER}]
    return [{"role": "user", "content": content}, {"role": "assistant", "content": "To the right."}]


def check_served_video(renderer: Any, processor: Any) -> None:
    """Raise ``TemplateParityError("served_video", ...)`` unless the tokens the run trains on the video probe are the
    served prompt's, from ``processor``'s own chat template called with no arguments (a server's default) with each
    video wrapper expanded as ``Qwen3VLProcessor`` does, followed by the reply's."""
    probe = video_probe(renderer.video_settings.max_frames)
    try:
        prompt = processor.apply_chat_template(probe[:-1], tokenize=False, add_generation_prompt=True)
        full = processor.apply_chat_template(probe, tokenize=False)
    except jinja2.TemplateError as e:
        raise TemplateParityError("served_video", -1, f"the checkpoint's chat template refuses a video: {e}") from e
    if processor.video_token not in full:  # a template without video: its runs render no video (a counted skip)
        logger.warning(
            "the chat template writes no video: rows with a video will be skipped (image_count_mismatch); use a "
            "template that writes %r to train on videos",
            VIDEO_WRAPPER,
        )
        return
    for text in (prompt, full):
        if text.count(VIDEO_WRAPPER) != 1:
            raise TemplateParityError(
                "served_video",
                -1,
                f"the checkpoint's chat template writes the probe's video as {_video_text(text)!r}, not as "
                f"{VIDEO_WRAPPER!r}: transformers' Qwen3-VL processor expands only that wrapper into the video's "
                "timestamps and pads, so a server would not prompt a video with the tokens the run trains on "
                "(docs/serving.md)",
            )
    if not full.startswith(prompt):
        raise TemplateParityError(
            "served_video",
            -1,
            f"the served prompt ends {prompt[-40:]!r}, which does not begin the template's text of the conversation",
        )
    try:
        sample = renderer.render(probe)
    except RenderError as e:
        raise TemplateParityError("served_video", -1, f"the run's renderer refuses the video probe: {e}") from e
    mm = sample.multi_modal_data
    assert mm is not None and mm.num_videos == 1
    merge = processor.video_processor.merge_size
    pads = [int(mm.image_grid_thw[i].prod()) // merge**2 for i in mm.videos[0].items]
    videos = [SimpleNamespace(timestamps=mm.videos[0].timestamps)]  # all the expansion reads of a video
    served_prompt = _widen(expand_video_wrappers(prompt, [], videos)[0], processor.video_token, pads)
    served_full = _widen(expand_video_wrappers(full, [], videos)[0], processor.video_token, pads)
    tokenizer = processor.tokenizer
    pieces = (served_prompt, served_full[len(served_prompt) :])
    expected = torch.tensor([t for piece in pieces for t in tokenizer(piece, add_special_tokens=False)["input_ids"]])
    types = torch.where(expected == tokenizer.convert_tokens_to_ids(processor.video_token), 2, 0)
    compared = (("token_ids", sample.token_ids, expected), ("mm_token_type_ids", sample.mm_token_type_ids, types))
    for field, ours, theirs in compared:
        if torch.equal(ours, theirs.to(ours.dtype)):
            continue
        n = min(len(ours), len(theirs))
        diff = torch.nonzero(ours[:n] != theirs[:n])
        pos = int(diff[0, 0]) if len(diff) else n
        context = [repr(tokenizer.decode(t[max(pos - 6, 0) : pos + 6].tolist())) for t in (ours, theirs)]
        raise TemplateParityError(
            "served_video",
            pos,
            f"{field}: the run trains {context[0]} where the served template, its video expanded as transformers' "
            f"processor expands it, gives {context[1]} ({len(ours)} vs {len(theirs)} tokens): a server would show "
            "the model this video otherwise than training did (docs/serving.md)",
        )


def _widen(text: str, pad: str, counts: list[int]) -> str:
    """The k-th ``pad`` of ``text`` repeated ``counts[k]`` times (``Qwen3VLProcessor.replace_video_token``)."""
    parts = text.split(pad)
    assert len(parts) == len(counts) + 1, (len(parts), counts)
    return parts[0] + "".join(pad * n + rest for n, rest in zip(counts, parts[1:], strict=True))


def _video_text(text: str) -> str:
    """What the template wrote between the probe's two texts (or the whole text when they are not found)."""
    match = re.search(re.escape(_BEFORE) + "(.*?)" + re.escape(_AFTER), text, re.DOTALL)
    return match.group(1) if match else text
