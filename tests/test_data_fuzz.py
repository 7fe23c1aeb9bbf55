"""Property-based fuzzing of the whole data path, as the trainer builds it: random jsonl rows with image files beside
them -> ``load_conversations`` -> ``build_pipeline`` (render -> truncate -> shift -> pack, each of bfd / cat / stack)
-> ``summarize_pass`` -> ``collate`` of every pack.

The rows are what users' files hold: messages and ShareGPT rows, string and block content, system / tool turns,
assistant turns with ``tool_calls`` and reasoning, ``tools`` columns, unicode (RTL, emoji, control characters),
control-token strings typed in text, 0-4 images per row in many modes, sizes and formats, corrupt / truncated /
missing image files, paths outside the data folder, over-long samples, rows with no assistant turn, malformed lines.

Properties, for every generated dataset and packing mode:

- no exception leaves the pipeline: every bad row is a counted skip with a reason;
- the accounting balances: seen == rows == packed + skipped, and every row index is in exactly one pack or skip;
- every packed segment is its row's rendering, cut and shifted (inputs, targets, loss mask, types, pixels);
- in every collated batch: ``<|image_pad|>`` inputs == sum(t*h*w) / merge**2 over the grids; ``mm_token_type_ids``
  is 1 exactly at ``<|image_pad|>`` inputs; each row's ``seq_lens`` sum to the row length; nothing is trained on
  padding, image / vision-marker targets or ``<|im_start|>``; ``PackedBatch.check()`` holds;
- a rendered row opens and closes as many turns and vision blocks as it has (a typed control string never becomes
  a control token).

Profiles: the default suite runs ``DEFAULT_EXAMPLES`` derandomized examples (reproducible in CI, a few seconds).
``VLM_SFT_FUZZ_EXAMPLES=2000`` runs that many with a random seed (hypothesis prints the seed and the falsifying
dataset; ``--hypothesis-seed=N`` replays a run). Four bugs this test found (a lone surrogate in text, an
image ``{"bytes": ...}`` that is not bytes, an integer past Python's 4300-digit limit, a value nested ~600 levels
deep: each left the pipeline with an exception) are fixed, each now one counted skip, and held by the tests at the
end; the generator does not draw those inputs.
"""

from __future__ import annotations

import base64
import dataclasses
import io
import json
import os
import struct
import tempfile
import zlib
from dataclasses import dataclass
from pathlib import Path

import pytest
import torch
from hypothesis import HealthCheck, given, note, settings
from hypothesis import strategies as st
from PIL import Image

from renderers.types import IMAGE_TOKEN_TYPE
from vlm_sft.config import load_config
from vlm_sft.data.accounting import DataAccounting
from vlm_sft.data.batch import PackedBatch
from vlm_sft.data.build import build_pipeline, build_processor, build_renderer
from vlm_sft.data.collate import collate
from vlm_sft.data.pack import Pack
from vlm_sft.data.pipeline import summarize_pass
from vlm_sft.data.sources import load_conversations, render_fn

DEFAULT_EXAMPLES = 50
"""Examples in the default suite (three packing modes each)."""
EXAMPLES_ENV = "VLM_SFT_FUZZ_EXAMPLES"
"""Set to a number to run that many examples with a random seed (the deep profile)."""
_DEEP = int(os.environ.get(EXAMPLES_ENV) or 0)
FUZZ_SETTINGS = settings(
    max_examples=_DEEP or DEFAULT_EXAMPLES,
    derandomize=not _DEEP,
    database=None,
    deadline=None,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large],
)
ROOT, OUTSIDE = "@ROOT@", "@OUT@"
"""Placeholders in generated rows for the data folder and a folder beside it (substituted when written)."""

# --------------------------------------------------------------------------------------------------------- text

CONTROL_STRINGS = [
    "<|image_pad|>", "<|im_end|>", "<|im_start|>", "<|vision_start|>", "<|vision_end|>", "<|video_pad|>",
    "<|endoftext|>", "<think>", "</think>", "<tool_call>", "</tool_call>", "<|image", "_pad|>", "<|im_", "end|>",
]  # fmt: skip
"""Control-token strings typed in text, whole and split across pieces / blocks."""
PLAIN_PIECES = [
    "hello", "the cat", "42", " ", "\n", "\t", "?", "שלום", "مرحبا بك", "\u200f", "\u202e", "\u2066", "😀",
    "👩\u200d👩\u200d👧", "👍🏽", "🇫🇷", "你好", "日本語", "e\u0301", "\x01", "\x1b[31m", "\x7f", "\u0085", "\u2028",
    "\ufeff", "\u200b", "{{ messages }}", "{% if x %}", "\\n", '"', "'",
]  # fmt: skip
"""Text users' data holds: RTL and bidi controls, emoji sequences, combining marks, C0/C1 controls, template
syntax."""


def sometimes(one_in: int) -> st.SearchStrategy[bool]:
    """True one time in ``one_in``; False is the simplest value, so shrinking and hypothesis' bias toward small draws
    land on the common case (``st.integers(0, n) == 0`` would make the rare case the likely one)."""
    return st.sampled_from([False] * (one_in - 1) + [True])


_chars = st.characters(exclude_categories=("Cs",), exclude_characters="\x00")
_piece = st.one_of(*[st.sampled_from(PLAIN_PIECES)] * 5, st.sampled_from([*CONTROL_STRINGS, "<image>"]))
text = st.one_of(st.lists(_piece, min_size=1, max_size=6).map("".join), st.text(_chars, min_size=1, max_size=12)).map(
    lambda t: t if t.strip() else t + "ok"
)
"""Non-blank text (a blank message is a structure skip; ``hostile_text`` makes those)."""
long_text = st.builds(
    lambda piece, n: piece * n, st.sampled_from(["lorem ipsum ", "😀", "<|image_pad|>", "שלום "]), st.integers(30, 200)
)
"""Text that renders to more tokens than the smaller seq_lens (over-long samples)."""
any_text = st.one_of(*[text] * 7, long_text)
hostile_text = st.one_of(any_text, st.sampled_from(["", " ", "\n\t"]))

# ------------------------------------------------------------------------------------------------------- images

MODE_FORMATS = {
    "RGB": ["PNG", "JPEG", "WEBP", "BMP"],
    "RGBA": ["PNG", "WEBP"],
    "L": ["PNG", "JPEG"],
    "LA": ["PNG"],
    "P": ["PNG", "GIF"],
    "1": ["PNG", "BMP"],
    "CMYK": ["JPEG", "TIFF"],
    "I;16": ["PNG", "TIFF"],
    "I": ["TIFF"],
    "F": ["TIFF"],
}
"""Image modes and the formats PIL writes them in."""


def png_header_only(width: int, height: int) -> bytes:
    """A PNG whose header declares ``width`` x ``height`` RGB pixels, with an empty image stream."""

    def chunk(kind: bytes, data: bytes) -> bytes:
        return struct.pack(">I", len(data)) + kind + data + struct.pack(">I", zlib.crc32(kind + data))

    ihdr = struct.pack(">IIBBBBB", width, height, 8, 2, 0, 0, 0)
    return b"\x89PNG\r\n\x1a\n" + chunk(b"IHDR", ihdr) + chunk(b"IDAT", zlib.compress(b"")) + chunk(b"IEND", b"")


_side = st.one_of(st.integers(8, 64), st.integers(8, 64), st.integers(1, 320))


@st.composite
def good_image(draw) -> tuple[bytes, str]:
    """(encoded bytes, file suffix) of a decodable image: 1x1 to a few hundred pixels, any mode PIL can write."""
    mode = draw(st.sampled_from(sorted(MODE_FORMATS)))
    fmt = draw(st.sampled_from(MODE_FORMATS[mode]))
    w, h = draw(_side), draw(_side)
    if max(w, h) > 150 * min(w, h):  # keep within the processor's aspect limit (200:1) but for the slivers below
        w, h = max(w, h // 150), max(h, w // 150)
    size = draw(st.sampled_from([(1, 250), (300, 1)])) if draw(sometimes(40)) else (w, h)
    value = draw(st.integers(0, 255))
    img = Image.new(mode, size, value if mode in ("L", "LA", "P", "1", "I;16", "I", "F") else (value,) * len(mode))
    if size[0] > 2 and size[1] > 2:  # some structure, so images differ beyond their fill
        img.paste(Image.new(mode, (size[0] // 2, size[1] // 2)), (size[0] // 4, size[1] // 4))
    kwargs: dict = {}
    if mode == "P" and fmt == "PNG" and draw(st.booleans()):
        kwargs["transparency"] = 0
    if fmt == "JPEG" and draw(st.booleans()):
        exif = Image.Exif()
        exif[0x0112] = draw(st.sampled_from([1, 3, 6, 8]))  # EXIF orientation
        kwargs["exif"] = exif
    buf = io.BytesIO()
    img.save(buf, fmt, **kwargs)
    return buf.getvalue(), fmt.lower()


@st.composite
def broken_image(draw) -> tuple[bytes, str]:
    """Random bytes, a truncated file, an empty one, or a PNG header declaring 0 or 10**10 pixels."""
    kind = draw(st.sampled_from(["random", "truncated", "empty", "header"]))
    if kind == "random":
        return draw(st.binary(min_size=1, max_size=64)), "png"
    if kind == "truncated":
        data, suffix = draw(good_image())
        return data[: draw(st.integers(1, max(1, len(data) - 1)))], suffix
    if kind == "empty":
        return b"", "png"
    return png_header_only(draw(st.sampled_from([0, 1, 100_000])), draw(st.sampled_from([0, 1, 100_000]))), "png"


@dataclass
class Files:
    """Files a generated dataset needs: relative path -> bytes, under the data folder and under a folder beside it."""

    inside: dict[str, bytes]
    outside: dict[str, bytes]
    links: dict[str, str]
    """Symlinks in the data folder: name -> target under the outside folder."""
    eol: bytes = b"\n"
    """Line ending of the jsonl (CRLF as written on Windows, or LF)."""
    final_newline: bool = True
    """Whether the last line ends with ``eol``."""


@st.composite
def image_ref(draw, files: Files, hostile: bool) -> str:
    """An image path as a row spells it, registering the file it needs: relative, in a subfolder, ``./``, absolute,
    ``file://``, a data URI; ``hostile`` also: a broken file, a missing one, a folder, a path outside the data folder,
    a symlink out, a URL, a NUL byte."""
    kinds = ["file"] * 6 + ["data"]
    if hostile:
        kinds += ["broken"] * 3 + ["missing", "dir", "outside", "abs_outside", "link", "url", "nul"]
    kind = draw(st.sampled_from(kinds))
    n = len(files.inside) + len(files.outside) + len(files.links)
    if kind in ("file", "broken", "data"):
        if files.inside and kind == "file" and draw(sometimes(5)):  # the same image twice (cache hits)
            return draw(st.sampled_from(sorted(files.inside)))
        data, suffix = draw(broken_image() if kind == "broken" else good_image())
        if kind == "data":
            return f"data:image/{suffix};base64,{base64.b64encode(data).decode()}"
        name = draw(st.sampled_from([f"img{n}.{suffix}", f"sub/img{n}.{suffix}", f"é 图 {n}.{suffix}"]))
        files.inside[name] = data
        return draw(st.sampled_from([name, f"./{name}", f"{ROOT}/{name}", f"file://{ROOT}/{name}"]))
    if kind == "missing":
        return f"nope{n}.png"
    if kind == "dir":
        return draw(st.sampled_from([".", "sub", ROOT]))
    if kind in ("outside", "abs_outside", "link"):
        files.outside[f"o{n}.png"] = draw(good_image())[0]
        if kind == "link":
            files.links[f"link{n}.png"] = f"o{n}.png"
            return f"link{n}.png"
        return f"../outside/o{n}.png" if kind == "outside" else f"{OUTSIDE}/o{n}.png"
    if kind == "url":
        return "https://example.com/cat.png"
    return "img\x00.png"


# --------------------------------------------------------------------------------------------------------- rows


@st.composite
def image_block(draw, ref: str) -> dict:
    """One image block in any accepted spelling."""
    return draw(
        st.sampled_from(
            [
                {"type": "image", "image": ref},
                {"type": "image_url", "image_url": {"url": ref}},
                {"type": "image_url", "image_url": ref},
                {"image": ref},
                {"type": "image", "path": ref},
                {"type": "input_image", "image_url": ref},
            ]
        )
    )


@st.composite
def content(draw, files: Files, n_images: int, placeholders: bool, hostile: bool) -> object:
    """Message content with ``n_images`` images: a string (no images), blocks or a single block; ``hostile``: also
    numbers (trained as their JSON text), blank text, empty block lists, bare strings in the list."""
    words = hostile_text if hostile else any_text
    if n_images == 0 and not draw(sometimes(3)):
        return draw(st.one_of(words, st.integers(-5, 10**6), st.floats(allow_nan=False)) if hostile else words)
    blocks: list = [{"type": "text", "text": draw(words)} for _ in range(draw(st.integers(0 if hostile else 1, 2)))]
    if hostile and draw(sometimes(4)):
        blocks.append(draw(words))  # a bare string entry
    for _ in range(n_images):
        block = {"type": "image"} if placeholders else draw(image_block(draw(image_ref(files, hostile))))
        blocks.insert(draw(st.integers(0, len(blocks))), block)
    if len(blocks) == 1 and draw(st.booleans()):
        return blocks[0]
    return blocks


def nested(depth: int, leaf: object) -> object:
    """``leaf`` inside ``depth`` alternating objects and arrays."""
    for level in range(depth):
        leaf = {"k": leaf} if level % 2 else [leaf]
    return leaf


@st.composite
def extra_keys(draw) -> dict:
    """Message keys the template passes through: a ``name``, and nested metadata (shallow: deep nesting is the
    known bug pinned by ``test_deeply_nested_value_is_a_skip``)."""
    return {"name": draw(text), "meta": nested(draw(st.integers(0, 40)), draw(text))}


def tool_schema(name: str) -> dict:
    return {
        "type": "function",
        "function": {
            "name": name,
            "description": "Look something up.",
            "parameters": {"type": "object", "properties": {"q": {"type": "string"}}, "required": ["q"]},
        },
    }


@st.composite
def tool_call(draw, hostile: bool) -> dict:
    """A tool call, OpenAI-shaped or bare, arguments as a dict or a JSON string (``hostile``: or broken JSON)."""
    name = draw(st.sampled_from(["lookup", "get_weather", "搜索"]))
    args = {"q": draw(text)} if draw(st.booleans()) else {}
    if draw(sometimes(5)):
        args["filters"] = nested(
            draw(st.integers(1, 40)), draw(st.one_of(text, st.integers(), st.none(), st.booleans()))
        )
    spelled = draw(st.sampled_from(["dict", "json", "bad"] if hostile else ["dict", "json"]))
    arguments = {"dict": args, "json": json.dumps(args, ensure_ascii=False), "bad": "{not json"}[spelled]
    call = {"name": name, "arguments": arguments}
    return call if draw(sometimes(4)) else {"type": "function", "function": call}


@st.composite
def messages_row(draw, files: Files, hostile: bool) -> dict:
    """A messages row: an optional system turn, 1-3 user / assistant exchanges (tool calls and results, reasoning),
    0-4 images in all, inline or as ``{"type": "image"}`` placeholders filled from an ``images`` column (or that
    column alone: front-loaded). ``hostile``: every part may be one of the bad spellings."""
    row: dict = {}
    total_images = draw(st.integers(0, 4))
    placeholders = total_images > 0 and draw(sometimes(4))
    front_load = placeholders and draw(sometimes(4))
    messages: list = []
    if draw(st.booleans()):
        messages.append({"role": "system", "content": draw(content(files, 0, False, hostile))})
    left = total_images
    turns = draw(st.integers(1, 3))
    for turn in range(turns):
        k = 0 if front_load else draw(st.integers(0, left)) if turn < turns - 1 else left
        left -= k
        messages.append({"role": "user", "content": draw(content(files, k, placeholders, hostile))})
        if draw(sometimes(6)):
            messages[-1].update(draw(extra_keys()))
        if draw(sometimes(4)):  # a tool-calling turn and its results (an image among them now and then)
            calls = draw(st.lists(tool_call(hostile), min_size=1, max_size=2))
            said = draw(st.sampled_from(["", None, "Let me look."]))
            messages.append({"role": "assistant", "content": said, "tool_calls": calls})
            for k, _ in enumerate(calls):
                result = draw(content(files, int(not placeholders and draw(sometimes(6))), False, hostile))
                messages.append({"role": "tool", "content": result, "tool_call_id": f"call_{k}"})
        # images in replies too (the template renders them; their slots are never trained)
        n_reply_images = int(not placeholders and draw(sometimes(8)))
        reply: dict = {"role": "assistant", "content": draw(content(files, n_reply_images, False, hostile))}
        if draw(sometimes(3)):
            reply[draw(st.sampled_from(["reasoning_content", "thinking", "reasoning"]))] = draw(any_text)
        messages.append(reply)
    row["messages"] = messages
    if placeholders:
        extra = draw(st.sampled_from([-1, 0, 0, 1])) if hostile else 0  # one image too few or too many
        refs: list = [draw(image_ref(files, hostile)) for _ in range(max(0, total_images + extra))]
        if draw(sometimes(3)):  # the datasets Image feature's spelling
            refs = [{"path": r} if draw(st.booleans()) else {"bytes": None, "path": r} for r in refs]
        row[draw(st.sampled_from(["images", "image"]))] = refs if len(refs) != 1 or draw(st.booleans()) else refs[0]
    if any("tool_calls" in m for m in messages) or draw(sometimes(6)):
        tools = [tool_schema(n) for n in ("lookup", "get_weather")]
        spellings = [tools, json.dumps(tools), tools[:1]] + (["not json", [], {"a": 1}] if hostile else [])
        row["tools"] = draw(st.sampled_from(spellings))
    return row


@st.composite
def sharegpt_row(draw, files: Files, hostile: bool) -> dict:
    """A ShareGPT / LLaVA row: ``conversations`` of {from, value} with ``<image>`` markers (or none: front-loaded),
    an ``image`` / ``images`` column, optional ``system``. ``hostile``: also unknown speakers, marker counts that
    do not match the images, bad image files."""
    n_images = draw(st.integers(0, 4))
    markers = n_images > 0 and draw(st.booleans())
    turns = []
    left = n_images
    n_turns = draw(st.integers(1, 3))
    for turn in range(n_turns):
        value = draw(any_text if hostile else text.map(lambda t: t.replace("<image>", "image")))
        if markers:
            k = draw(st.integers(0, left)) if turn < n_turns - 1 else left
            left -= k
            value = "<image>\n" * k + value
        turns.append({"from": draw(st.sampled_from(["human", "user"])), "value": value})
        if hostile and draw(sometimes(4)):
            turns.append({"from": "function_call", "value": draw(text)})  # a speaker the reader does not know
        speaker = draw(st.sampled_from(["from", "role"]))
        turns.append({speaker: draw(st.sampled_from(["gpt", "assistant", "model"])), "value": draw(any_text)})
    row: dict = {"conversations": turns}
    if n_images:
        refs = [draw(image_ref(files, hostile)) for _ in range(n_images)]
        row[draw(st.sampled_from(["images", "image"]))] = refs if n_images > 1 or draw(st.booleans()) else refs[0]
    if draw(sometimes(3)):
        row["system"] = draw(hostile_text if hostile else any_text)
    return row


MALFORMED = {
    b"{not json": "malformed_row",
    b"[]": "malformed_row",
    b"42": "malformed_row",
    b'"a string"': "malformed_row",
    b"null": "malformed_row",
    b"": "malformed_row",
    b"   ": "malformed_row",
    b"\xff\xfe{}": "malformed_row",
    b"[" * 3000: "malformed_row",
    b'{"messages": "hi"}': "bad_message",
    b'{"messages": [1, 2]}': "bad_message",
    b'{"messages": [{"content": "no role"}]}': "unknown_role",
    b'{"messages": [{"role": "narrator", "content": "x"}]}': "unknown_role",
    b'{"messages": [{"role": "user", "content": {"type": "video", "video": "a.mp4"}}]}': "video_not_supported",
    b'{"messages": [{"role": "user", "content": [{"type": "text", "text": ["a"]}]}]}': "bad_content",
    b'{"messages": [{"role": "user", "content": [{"type": ["x"]}]}, {"role": "assistant", "content": "a"}]}': (
        "unknown_block_type"
    ),
    b'{"messages": [{"role": "user", "content": "q"}, {"role": "assistant", "content": "a", "tool_calls": "x"}]}': (
        "bad_tool_call"
    ),
    b'{"messages": [{"role": "user", "content": "q"}, {"role": "assistant", "content": "a", "thinking": {}}]}': (
        "bad_content"
    ),
    b'{"conversations": [{"from": "human", "value": ["x"]}, {"from": "gpt", "value": "a"}]}': "bad_message",
    b'{"conversations": "nope"}': "bad_message",
    b'{"neither": 1}': "bad_message",
}
"""Lines no reader can use as a row, and their skip reason in a messages file (a ShareGPT row there lacks
``messages``)."""
MALFORMED_LINES = sorted(MALFORMED)


@st.composite
def messy_messages_row(draw, files: Files) -> dict:
    """Role orders and contents the structure check must refuse: no assistant, assistant first, a late system
    turn, a tool result without a call, empty content, unknown roles."""
    roles = draw(st.lists(st.sampled_from(["system", "user", "assistant", "tool", "narrator", None]), max_size=5))
    messages: list = []
    for role in roles:
        m: dict = {"content": draw(st.one_of(st.just(""), st.just([]), st.none(), content(files, 0, False, True)))}
        if role is not None:
            m["role"] = role
        messages.append(m)
    return {"messages": messages}


@st.composite
def messy_sharegpt_row(draw) -> dict:
    """ShareGPT turns the reader or the structure check must refuse: unknown or missing speakers, turns that are not
    objects, values that are not text, no reply, a reply first."""
    speakers = st.sampled_from(["human", "gpt", "system", "observation", "narrator", None])
    values = st.one_of(hostile_text, st.none(), st.integers(), st.lists(st.integers(), max_size=2))
    turns: list = []
    for _ in range(draw(st.integers(0, 4))):
        if draw(sometimes(8)):
            turns.append(draw(st.sampled_from(["hi", 3, None, ["human", "hi"]])))
            continue
        turn = {"value": draw(values)}
        if (speaker := draw(speakers)) is not None:
            turn["from"] = speaker
        turns.append(turn)
    return {"conversations": turns}


ROW_KINDS = ["clean"] * 12 + ["hostile"] * 4 + ["messy", "malformed", "other_shape"]
"""How often each kind of row is drawn: most rows are usable, so packs hold several samples and images."""


@st.composite
def dataset(draw) -> tuple[list[bytes], Files]:
    """Rows of one jsonl file (as bytes lines) and the image files they need."""
    files = Files({}, {}, {})
    shape = draw(st.sampled_from(["messages", "messages", "sharegpt"]))
    good, other = (messages_row, sharegpt_row) if shape == "messages" else (sharegpt_row, messages_row)
    lines: list[bytes] = []
    for _ in range(draw(st.integers(1, 8))):
        kind = draw(st.sampled_from(ROW_KINDS))
        if kind == "malformed":
            lines.append(draw(st.sampled_from(MALFORMED_LINES)))
            continue
        if kind == "other_shape" and (shape == "messages" or draw(sometimes(4))):
            row = draw(other(files, False))  # one messages row makes a whole ShareGPT file a messages file
        elif kind in ("messy", "other_shape"):
            row = draw(messy_messages_row(files) if shape == "messages" else messy_sharegpt_row())
        else:
            row = draw(good(files, kind == "hostile"))
        lines.append(json.dumps(row, ensure_ascii=draw(st.booleans())).encode())
    if draw(sometimes(6)):
        lines[0] = b"\xef\xbb\xbf" + lines[0]  # a UTF-8 byte order mark
    files.eol = draw(st.sampled_from([b"\n", b"\n", b"\r\n"]))
    files.final_newline = not draw(sometimes(5)) or lines[-1] == b""  # else an empty last line is no line
    return lines, files


@st.composite
def run_settings(draw) -> list[str]:
    """Dotted overrides of the data settings the data path reads (``data.packing`` is added per mode)."""
    seq_len = draw(st.sampled_from([1024, 512, 1024, 96]))
    pack_len = seq_len + draw(st.sampled_from([0, 0, 32, seq_len]))
    budget = draw(st.sampled_from([None, None, None, 64, 300, 1024]))
    return [
        *([f"--data.max_image_patches_per_pack={budget}"] if budget else []),
        f"--data.seq_len={seq_len}",
        f"--data.pack_len={pack_len}",
        f"--data.truncation={draw(st.sampled_from(['drop', 'truncate']))}",
        f"--data.loss_on={draw(st.sampled_from(['all_assistant', 'last_assistant', 'stable_prefix']))}",
        f"--data.special_text={draw(st.sampled_from(['escape', 'escape', 'escape', 'drop', 'error']))}",
        f"--data.enable_thinking={str(draw(st.booleans())).lower()}",
        f"--data.bfd_buffer={draw(st.integers(1, 8))}",
        f"--data.stack_batch_size={draw(st.integers(1, 4))}",
        f"--data.shuffle={str(draw(st.booleans())).lower()}",
        f"--train.seed={draw(st.integers(0, 3))}",
        f"--model.vlm.freeze_vision={str(draw(st.booleans())).lower()}",
    ]


# ------------------------------------------------------------------------------------------------------ helpers


def write_dataset(root: Path, lines: list[bytes], files: Files) -> Path:
    """The jsonl and its files under ``root/data``, outside files under ``root/outside``; returns the jsonl path."""
    data, outside = root / "data", root / "outside"
    for folder, entries in ((data, files.inside), (outside, files.outside)):
        for name, payload in entries.items():
            (folder / name).parent.mkdir(parents=True, exist_ok=True)
            (folder / name).write_bytes(payload)
    (data / "sub").mkdir(parents=True, exist_ok=True)
    outside.mkdir(exist_ok=True)
    for name, target in files.links.items():
        (data / name).symlink_to(outside / target)
    path = data / "rows.jsonl"
    subst = {ROOT.encode(): str(data).encode(), OUTSIDE.encode(): str(outside).encode()}
    text = files.eol.join(lines) + (files.eol if files.final_newline else b"")
    for key, value in subst.items():
        text = text.replace(key, value)
    path.write_bytes(text)
    return path


def row_shape(line: bytes) -> bool:
    """Whether ``line`` is a JSON object with a ``messages`` or ``conversations`` key (what names a file's shape)."""
    try:
        row = json.loads(line.removeprefix(b"\xef\xbb\xbf"))
    except (ValueError, RecursionError):
        return False
    return isinstance(row, dict) and ("messages" in row or "conversations" in row)


_BUILT: dict[tuple, tuple] = {}


def processor_and_renderer(cfg) -> tuple:
    """The run's processor and renderer (built once per rendering setting, so the image cache carries over)."""
    d = cfg.data
    key = (d.loss_on, d.special_text, d.enable_thinking)
    if key not in _BUILT:
        processor = build_processor(cfg)
        _BUILT[key] = (processor, build_renderer(cfg, processor))
    return _BUILT[key]


@dataclass(frozen=True)
class Ids:
    """Token ids the checks need."""

    image_pad: int
    vision: tuple[int, ...]
    im_start: int
    im_end: int
    pad: int

    @classmethod
    def of(cls, tokenizer) -> Ids:
        tid = tokenizer.convert_tokens_to_ids
        return cls(
            image_pad=tid("<|image_pad|>"),
            vision=(tid("<|vision_start|>"), tid("<|vision_end|>"), tid("<|image_pad|>")),
            im_start=tid("<|im_start|>"),
            im_end=tid("<|im_end|>"),
            pad=tokenizer.pad_token_id,
        )


def check_batch(batch: PackedBatch, pack: Pack, ids: Ids, merge: int) -> None:
    """The collated batch's invariants, checked from its own tensors (independently of ``PackedBatch.check``)."""
    b, length = batch.shape
    inputs, targets, mask, types = batch.input_ids, batch.target_ids, batch.loss_mask, batch.mm_token_type_ids
    grids = batch.image_grid_thw
    slots = int(grids.prod(-1).sum()) // merge**2 if grids is not None else 0
    assert int((inputs == ids.image_pad).sum()) == slots, "<|image_pad|> inputs != sum(t*h*w) / merge**2"
    if grids is not None:
        assert bool((grids.prod(-1) % merge**2 == 0).all()), f"a grid not divisible by merge**2: {grids.tolist()}"
        assert batch.num_patches == int(grids.prod(-1).sum()), "pixel rows != sum(t*h*w)"
    expected_types = torch.where(inputs == ids.image_pad, IMAGE_TOKEN_TYPE, 0)
    assert torch.equal(types, expected_types), "mm_token_type_ids is not 1 exactly at image pads"
    real = torch.zeros(b, length, dtype=torch.bool)
    if batch.seq_lens is not None:
        ends = batch.seq_lens.cumsum(0)
        for r in range(b):
            row_segments = batch.seq_lens[(ends > r * length) & (ends <= (r + 1) * length)]
            assert int(row_segments.sum()) == length, f"row {r}: seq_lens sum to {int(row_segments.sum())}"
            used = sum(len(s) for s in pack.rows[r])
            assert [int(n) for n in row_segments[: len(pack.rows[r])]] == [len(s) for s in pack.rows[r]]
            real[r, :used] = True
    else:
        assert pack.stacked and batch.attention_mask is not None
        for r, row in enumerate(pack.rows):
            real[r, : len(row[0])] = True
        assert torch.equal(batch.attention_mask, real), "attention mask != the rows' real tokens"
    assert not bool(mask[~real].any()), "loss on padding"
    assert bool((inputs[~real] == ids.pad).all()) and not bool(types[~real].any()), "padding is not <|endoftext|>"
    never = torch.isin(targets, torch.tensor([*ids.vision, ids.im_start]))
    assert not bool(mask[never].any()), "a vision marker, image slot or <|im_start|> is trained as a target"
    assert batch.num_trainable_tokens == int(mask.sum()) == pack.num_trainable_tokens
    assert batch.num_real_tokens == int(real.sum()) == pack.num_real_tokens
    batch.check()


def check_segments(batch: PackedBatch, pack: Pack, render, seq_len: int, ids: Ids) -> None:
    """Every segment is its row rendered again on its own, cut to at most ``seq_len`` inputs and shifted."""
    patch_start = 0
    for r, row in enumerate(pack.rows):
        start = 0
        for s in row:
            ref = render(s.sample_index)
            n = len(s)
            full = len(ref) - 1
            assert n <= min(full, seq_len), f"row {s.sample_index}: {n} inputs of {full}, seq_len {seq_len}"
            seg = slice(start, start + n)
            assert torch.equal(batch.input_ids[r, seg], ref.token_ids[:n]), f"row {s.sample_index}: inputs differ"
            assert torch.equal(batch.target_ids[r, seg], ref.token_ids[1 : n + 1]), f"row {s.sample_index}: targets"
            assert torch.equal(batch.loss_mask[r, seg], ref.loss_mask[1 : n + 1]), f"row {s.sample_index}: loss mask"
            assert torch.equal(batch.mm_token_type_ids[r, seg], ref.mm_token_type_ids[:n])
            tokens = ref.token_ids
            # every turn opens and closes, every image block too: a typed control string never became a token
            assert int((tokens == ids.im_start).sum()) == int((tokens == ids.im_end).sum()), "unbalanced turns"
            vs, ve = (int((tokens == v).sum()) for v in ids.vision[:2])
            assert vs == ve == ref.num_images, (
                f"row {s.sample_index}: {vs} / {ve} vision markers, {ref.num_images} images"
            )
            mm = ref.multi_modal_data
            kept = [p for p in (mm.placeholders if mm else ()) if p.end <= n]
            rows_kept = int(mm.image_grid_thw[: len(kept)].prod(-1).sum()) if kept else 0
            assert s.num_images == len(kept) and s.num_patches == rows_kept
            if kept:
                got = batch.pixel_values[patch_start : patch_start + rows_kept]
                assert torch.equal(got, mm.pixel_values[:rows_kept]), f"row {s.sample_index}: pixels out of order"
            patch_start += rows_kept
            start += n
    assert patch_start == batch.num_patches


def run_mode(cfg, source, renderer, ids: Ids, merge: int, n_rows: int) -> dict[int, str]:
    """One pass of ``cfg.data.packing`` through ``summarize_pass``, every pack collated and checked; returns where
    each row went (``"packed"`` or its skip reason)."""
    pipeline = build_pipeline(cfg, source, renderer, epochs=1)
    pipeline.accounting.skips.max_examples = n_rows  # keep every skipped row, not the first few per reason
    packs: list[Pack] = []
    pop = pipeline.packer.pop

    def recording_pop() -> Pack | None:
        pack = pop()
        if pack is not None:
            packs.append(pack)
        return pack

    pipeline.packer.pop = recording_pop
    summary = summarize_pass(pipeline)  # any exception here is a bug: bad rows must become counted skips

    reasons = {e["row"]: reason for reason, info in summary["skipped"].items() for e in info["examples"]}
    skipped = [e["row"] for info in summary["skipped"].values() for e in info["examples"]]
    packed = [i for p in packs for s in p.samples for i in [s.sample_index]]
    assert summary["samples_seen"] == n_rows, f"{summary['samples_seen']} seen of {n_rows} rows"
    assert summary["samples_packed"] == len(packed) and summary["packs"] == len(packs)
    assert summary["samples_seen"] == summary["samples_packed"] + sum(v["count"] for v in summary["skipped"].values())
    assert sorted(skipped + packed) == list(range(n_rows)), f"rows lost or doubled: packed {packed}, skipped {skipped}"
    assert all(reason and isinstance(reason, str) for reason in summary["skipped"])
    assert summary["real_tokens"] == sum(p.num_real_tokens for p in packs)
    assert summary["images"] == sum(p.num_images for p in packs)

    render = render_fn(source, renderer)
    budget = cfg.data.max_image_patches_per_pack
    for pack in packs:
        assert budget is None or pack.num_patches <= budget, f"{pack.num_patches} patches, budget {budget}"
        batch = collate([pack], pad_id=ids.pad, spatial_merge_size=merge)  # as the trainer's loader does
        check_batch(batch, pack, ids, merge)
        check_segments(batch, pack, render, cfg.data.seq_len, ids)
    return {**reasons, **dict.fromkeys(packed, "packed")}


# -------------------------------------------------------------------------------------------------------- tests


@FUZZ_SETTINGS
@given(data=dataset(), overrides=run_settings())
def test_random_datasets_through_the_whole_data_path(data, overrides):
    lines, files = data
    note(f"overrides: {overrides}")
    note("rows:\n" + "\n".join(repr(line) for line in lines))
    # the config a run of each mode loads (a vision budget only applies to packed rows: stack refuses it)
    cfgs = {
        mode: load_config(
            None, [*(o for o in overrides if mode != "stack" or "max_image" not in o), f"--data.packing={mode}"]
        )
        for mode in ("bfd", "cat", "stack")
    }
    processor, renderer = processor_and_renderer(cfgs["bfd"])
    ids = Ids.of(processor.tokenizer)
    merge = int(processor.image_processor.merge_size)
    with tempfile.TemporaryDirectory() as tmp:
        path = write_dataset(Path(tmp), lines, files)
        if not any(row_shape(line) for line in lines):  # a file, not a row, the trainer cannot use: an error
            with pytest.raises(ValueError, match="no 'messages' or 'conversations' column"):
                load_conversations(path, cache_dir=str(Path(tmp) / "cache"))
            return
        source = load_conversations(path, cache_dir=str(Path(tmp) / "cache"))
        assert len(source) == len(lines)
        went = {mode: run_mode(cfg, source, renderer, ids, merge, len(lines)) for mode, cfg in cfgs.items()}
    # which rows a pass keeps, and why it skips the others, does not depend on how it packs them; stack (no vision
    # budget) also keeps the rows whose own images exceed the budget
    assert went["bfd"] == went["cat"]
    over = {row for row, reason in went["bfd"].items() if reason == "image_patches_over_budget"}
    assert {row: r for row, r in went["bfd"].items() if row not in over} == {
        row: r for row, r in went["stack"].items() if row not in over
    }
    assert all(went["stack"][row] == "packed" for row in over)


def test_the_checks_fail_on_a_broken_batch(tmp_path, monkeypatch):
    """The batch checks can fail: a type id off by one position, and a skip the accounting lost."""
    cfg = load_config(None, ["--data.seq_len=96", "--data.pack_len=96"])
    processor, renderer = processor_and_renderer(cfg)
    ids, merge = Ids.of(processor.tokenizer), int(processor.image_processor.merge_size)
    image = io.BytesIO()
    Image.new("RGB", (64, 64), (200, 10, 10)).save(image, "PNG")
    row = {"messages": [{"role": "user", "content": [{"type": "image", "image": "a.png"}, {"type": "text", "text": "?"}]}, {"role": "assistant", "content": "Red."}]}  # fmt: skip
    lines = [json.dumps(row).encode(), b"{not json"]
    path = write_dataset(tmp_path, lines, Files({"a.png": image.getvalue()}, {}, {}))
    source = load_conversations(path, cache_dir=str(tmp_path / "cache"))
    assert run_mode(cfg, source, renderer, ids, merge, 2) == {0: "packed", 1: "malformed_row"}

    pack = next(iter(build_pipeline(cfg, source, renderer, epochs=1, packing="cat")))
    batch = collate([pack], pad_id=ids.pad, spatial_merge_size=merge)
    shifted = dataclasses.replace(batch, mm_token_type_ids=batch.mm_token_type_ids.roll(1, dims=1))
    with pytest.raises(AssertionError, match="mm_token_type_ids"):
        check_batch(shifted, pack, ids, merge)
    with monkeypatch.context() as m:
        m.setattr(DataAccounting, "count_skip", lambda self, err, source=None, row=None: None)  # a lost skip
        with pytest.raises(AssertionError, match="accounting"):
            run_mode(cfg, source, renderer, ids, merge, 2)


def _render_rows(tmp_path: Path, lines: list[bytes], *, max_examples: int = 5) -> dict:
    """``summarize_pass`` of one bfd pass over ``lines`` (the call a data report makes)."""
    cfg = load_config(None, ["--data.seq_len=96", "--data.pack_len=96"])
    _, renderer = processor_and_renderer(cfg)
    path = write_dataset(tmp_path, lines, Files({}, {}, {}))
    source = load_conversations(path, cache_dir=str(tmp_path / "cache"))
    pipeline = build_pipeline(cfg, source, renderer, epochs=1, packing="bfd")
    pipeline.accounting.skips.max_examples = max_examples
    return summarize_pass(pipeline)


def test_malformed_lines_are_skipped_with_their_reason(tmp_path):
    """The generator's malformed lines, each with the skip it must become (a readable failure when one regresses)."""
    ok = {"messages": [{"role": "user", "content": "q"}, {"role": "assistant", "content": "a"}]}
    lines = [json.dumps(ok).encode(), *MALFORMED]
    summary = _render_rows(tmp_path, lines, max_examples=len(lines))
    assert summary["samples_packed"] == 1 and summary["samples_seen"] == len(lines)
    got = {e["row"]: reason for reason, info in summary["skipped"].items() for e in info["examples"]}
    assert [got[row] for row in range(1, len(lines))] == list(MALFORMED.values())


# ---------------------------------------------------------------------------- bugs it found, fixed


OK_LINE = json.dumps({"messages": [{"role": "user", "content": "q"}, {"role": "assistant", "content": "a"}]}).encode()
"""A usable row, so a file whose other row is bad still has a messages column."""


def assert_one_skip(summary: dict, reason: str) -> None:
    assert summary["samples_seen"] == 2 and summary["samples_packed"] == 1
    assert [e["row"] for info in summary["skipped"].values() for e in info["examples"]] == [1]
    assert list(summary["skipped"]) == [reason]


@pytest.mark.parametrize(
    "line",
    [
        b'{"messages": [{"role": "user", "content": "hi \\ud800"}, {"role": "assistant", "content": "yo"}]}',
        b'{"messages": [{"role": "user", "content": "q"}, {"role": "assistant", "content": "a \\udfff b"}]}',
        b'{"messages": [{"role": "user", "content": "q"}, {"role": "assistant", "content": "a", "thinking": "\\ud83d"}]}',
    ],
    ids=["user", "assistant", "reasoning"],
)
def test_lone_surrogate_in_text_is_a_skip(tmp_path, line):
    """JSON may escape a lone UTF-16 surrogate (``"\\ud800"``, half of an emoji cut by a JavaScript writer); Python
    reads it into a str the tokenizer refuses with a TypeError, which leaves the pipeline (training stops)."""
    assert_one_skip(_render_rows(tmp_path, [OK_LINE, line]), "lone_surrogate")


@pytest.mark.parametrize("value", ['"iVBORw0KGgo="', "[300]", "-1", '{"a": 1}'])
def test_image_dict_with_non_bytes_is_a_skip(tmp_path, value):
    """An image ``{"bytes": ...}`` read from JSON holds a string or numbers, never bytes; ``read_image_source`` calls
    ``bytes(data)``, which raises TypeError / ValueError out of the pipeline instead of a ``bad_image_source`` skip."""
    line = '{"messages": [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "yo"}], "image": {"bytes": %s}}'
    assert_one_skip(_render_rows(tmp_path, [OK_LINE, (line % value).encode()]), "bad_image_source")


def test_integer_literal_past_the_conversion_limit_is_a_malformed_row(tmp_path):
    """``json.loads`` refuses an integer of more than 4300 digits with a plain ValueError (not JSONDecodeError), which
    ``json_rows._jsonl_records`` does not catch: the whole file fails to load, not one ``malformed_row``."""
    line = b'{"messages": [{"role": "user", "content": "q"}, {"role": "assistant", "content": ' + b"7" * 5000 + b"}]}"
    assert_one_skip(_render_rows(tmp_path, [OK_LINE, line], max_examples=2), "malformed_row")


@pytest.mark.parametrize("where", ["tool_arguments", "message_key"])
def test_deeply_nested_value_is_a_skip(tmp_path, where):
    """A value nested 600 deep loads (``json.loads`` and ``json_rows`` allow about 1000 levels) but
    ``renderers.content.map_strings`` recurses two frames per level: a RecursionError leaves the pipeline."""
    deep = nested(600, "x")
    if where == "tool_arguments":
        call = {"function": {"name": "f", "arguments": {"a": deep}}}
        messages = [{"role": "user", "content": "q"}, {"role": "assistant", "content": "a", "tool_calls": [call]}]
    else:
        messages = [{"role": "user", "content": "q", "meta": deep}, {"role": "assistant", "content": "a"}]
    line = json.dumps({"messages": messages}).encode()
    assert_one_skip(_render_rows(tmp_path, [OK_LINE, line]), "nested_too_deeply")
