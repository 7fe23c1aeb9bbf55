"""Hypothesis strategies for the data-path fuzz test (``test_data_fuzz.py``): random jsonl rows as users' files hold
them (messages and ShareGPT rows, string and block content, system / tool turns, tool calls and reasoning, ``tools``
columns, hostile unicode and control-token strings, 0-4 images per row in many modes, sizes and formats, corrupt /
truncated / missing image files, paths outside the data folder, malformed lines) with the files beside them, and the
run settings each dataset is packed with.
"""

from __future__ import annotations

import base64
import io
import json
import struct
import zlib
from dataclasses import dataclass

from hypothesis import strategies as st
from PIL import Image

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
    b'{"messages": [{"role": "user", "content": {"type": "video", "video": "a.mp4"}}, {"role": "assistant", "content": "a"}]}': (
        "missing_video"
    ),
    b'{"messages": [{"role": "user", "content": {"type": "video", "video": "/etc/hostname"}}, {"role": "assistant", "content": "a"}]}': (
        "image_outside_root"
    ),
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
