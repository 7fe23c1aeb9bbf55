"""What the trainer will see: the first rows of each training source rendered as text, image and video placeholders
collapsed (``<|image_pad|> x 64``, ``<|video_pad|> x 16``) and the trained spans marked (``[TRAIN]...[/TRAIN]``), with the schema each source was read
as. ``python -m vlm_sft.report --show N`` prints it; a row that cannot train prints its skip reason instead.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

from renderers.errors import RenderError
from renderers.types import RenderedSample
from vlm_sft.data.schemas import Conversation, RowConverter
from vlm_sft.data.sources import ConversationSource, render_conversation

TRAIN_OPEN, TRAIN_CLOSE = "[TRAIN]", "[/TRAIN]"
"""Marks around the tokens a sample trains on (its loss mask)."""


def format_sample(sample: RenderedSample, tokenizer: Any) -> str:
    """The sample's text as its tokens decode, each run of image (video) slots as ``<|image_pad|> x N``
    (``<|video_pad|> x N``), each trained run of tokens between ``TRAIN_OPEN`` and ``TRAIN_CLOSE``."""
    ids = sample.token_ids.tolist()
    trained = sample.loss_mask.tolist()
    image = sample.mm_token_type_ids.tolist()  # 0 text, 1 image slot, 2 video slot
    pieces: list[str] = []
    start = 0
    for end in range(1, len(ids) + 1):
        if end < len(ids) and (trained[end], image[end]) == (trained[start], image[start]):
            continue
        run = ids[start:end]
        if image[start]:
            text = f"{tokenizer.convert_ids_to_tokens(run[0])} x {len(run)}"
        else:
            text = tokenizer.decode(run, skip_special_tokens=False)
        pieces.append(f"{TRAIN_OPEN}{text}{TRAIN_CLOSE}" if trained[start] else text)
        start = end
    return "".join(pieces)


def show_source(name: str, source: Any, renderer: Any, count: int) -> str:
    """The first ``count`` rows of one training source (prepared or streamed) as ``format_sample`` prints them."""
    lines = [f"=== source {name!r}: read as {source.schema.describe() if source.schema else 'per row'}; {source.files}"]
    for index, conversation in _first_rows(source, count):
        if isinstance(conversation, RenderError):
            lines.append(f"--- row {index}: skipped: {conversation.reason}: {conversation.detail}")
            continue
        try:
            sample = render_conversation(renderer, conversation)
        except RenderError as err:
            lines.append(f"--- row {index}: skipped: {err.reason}: {err.detail}")
            continue
        header = (
            f"--- row {index}: {len(sample)} tokens, {int(sample.loss_mask.sum())} trained, {sample.num_images} images"
        )
        if sample.num_videos:
            header += f", {sample.num_videos} videos"
        references = f" (reference answers: {list(conversation.references)})" if conversation.references else ""
        lines += [header + references, format_sample(sample, renderer.tokenizer)]
    return "\n".join(lines)


def _first_rows(source: Any, count: int) -> Iterator[tuple[int, Conversation | RenderError]]:
    """``(row index, conversation or the error converting it)`` of the first ``count`` rows."""
    if isinstance(source, ConversationSource):
        for index in range(min(count, len(source))):
            try:
                yield index, source[index]
            except RenderError as err:
                yield index, err
        return
    from vlm_sft.data.streaming import local_files, open_stream

    files = local_files(source.path, subset=source.subset, split=source.split)
    kwargs = {"name": source.subset} if files is None and source.subset else {}
    convert = RowConverter(source.schema, source.images)
    rows = open_stream(source.path, split=source.split, files=files, load_kwargs=kwargs)
    for index, row in zip(range(count), rows, strict=False):
        try:
            yield index, convert(row, index)
        except RenderError as err:
            yield index, err
