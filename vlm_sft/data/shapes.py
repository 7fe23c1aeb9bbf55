"""The embedded "shapes" dataset: seeded pictures of coloured geometric shapes with chat conversations about them.

It exists so that the default run, the tests and the notebooks have real image + text data with no download, and so
that learning can be checked end to end: a colour question can only be answered if image features really reach the
language model (the text alone says nothing about the colour; chance is 1/6).

Tasks (one conversation each): colour of the single shape, its kind, its position, how many shapes, a two-image
comparison, and a text-only question; with ``video_share``, also a clip whose shape changes colour halfway, asked
the colour at its start or its end (only the order of the frames tells them apart). Every sample records ``task`` and ``answer`` so eval can score the answer
tokens. Generation is deterministic for a seed: sample ``i`` depends only on ``(seed, split, i)``.
"""

from __future__ import annotations

import hashlib
import json
import logging
import random
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
from PIL import Image, ImageDraw
from tqdm.auto import tqdm

logger = logging.getLogger(__name__)

COLOURS: dict[str, tuple[int, int, int]] = {
    "red": (220, 40, 40),
    "green": (40, 180, 60),
    "blue": (40, 70, 220),
    "yellow": (235, 210, 40),
    "purple": (150, 60, 190),
    "orange": (245, 140, 30),
}
SHAPES = ("circle", "square", "triangle")
POSITIONS = ("left", "right", "top", "bottom")
NUMBER_WORDS = ("zero", "one", "two", "three", "four")

TASK_WEIGHTS: dict[str, float] = {
    "colour": 0.6,
    "shape": 0.1,
    "position": 0.08,
    "count": 0.08,
    "compare": 0.07,
    "text": 0.07,
}
"""Share of each task. Colour dominates: it is the held-out accuracy the default run must reach."""

_COLOUR_QUESTIONS = (
    "What colour is the shape?",
    "Which colour does the shape in this picture have?",
    "Tell me the colour of the shape.",
    "What is the colour of the object in the image?",
)
_SHAPE_QUESTIONS = ("What shape is this?", "Which kind of shape is in the picture?", "Name the shape you see.")
_POSITION_QUESTIONS = ("Where is the shape in the image?", "In which part of the picture is the shape?")
_COUNT_QUESTIONS = ("How many shapes are in the picture?", "Count the shapes in this image.")
_COMPARE_QUESTIONS = ("Do these two shapes have the same colour?", "Are the shapes in the two images the same colour?")
_VIDEO_QUESTIONS = {
    "start": ("What colour is the shape at the start of the video?", "Which colour does the shape have first?"),
    "end": ("What colour is the shape at the end of the video?", "Which colour does the shape change to?"),
}
VIDEO_FPS = 2
"""Frame rate of the video task's clips: 4 frames (2 seconds), two temporal groups of one colour each."""
_SYSTEM_PROMPTS = ("You are a helpful assistant.", "You describe pictures briefly and accurately.")


@dataclass(frozen=True)
class ShapesSample:
    """One generated conversation with its images (in memory, before materialization)."""

    messages: list[dict]
    """Chat messages; image blocks hold an ``"images/<name>.png"`` path relative to the dataset folder."""
    images: dict[str, Image.Image]
    """Relative path -> picture, for every image block of ``messages``."""
    task: str
    """One of ``TASK_WEIGHTS``."""
    answer: str
    """The key answer word (a colour, shape, position, number word, yes/no), scored by the eval."""
    videos: dict[str, list[Image.Image]] = field(default_factory=dict)
    """Relative path -> frames (at ``VIDEO_FPS``), for every video block of ``messages``."""


def _background(rng: random.Random, size: int) -> Image.Image:
    """A pale noisy background, so colour is a property of the shape, not of a flat image."""
    base = np.array([rng.randint(200, 255) for _ in range(3)], dtype=np.int16)
    noise = np.random.default_rng(rng.getrandbits(32)).integers(-25, 26, size=(size, size, 3), dtype=np.int16)
    return Image.fromarray(np.clip(base + noise, 0, 255).astype(np.uint8), "RGB")


def _draw_shape(draw: ImageDraw.ImageDraw, shape: str, box: tuple[int, int, int, int], colour: tuple[int, int, int]):
    x0, y0, x1, y1 = box
    if shape == "circle":
        draw.ellipse(box, fill=colour)
    elif shape == "square":
        draw.rectangle(box, fill=colour)
    else:
        draw.polygon([((x0 + x1) // 2, y0), (x1, y1), (x0, y1)], fill=colour)


def _shape_box(rng: random.Random, size: int, region: str | None) -> tuple[int, int, int, int]:
    side = rng.randint(size // 4, size // 2 - 2)
    lo, hi = 1, size - side - 1
    x = rng.randint(lo, hi)
    y = rng.randint(lo, hi)
    half = size // 2
    if region == "left":
        x = rng.randint(lo, max(lo, half - side - 1))
    elif region == "right":
        x = rng.randint(half + 1, hi)
    elif region == "top":
        y = rng.randint(lo, max(lo, half - side - 1))
    elif region == "bottom":
        y = rng.randint(half + 1, hi)
    return (x, y, x + side, y + side)


def _picture(rng: random.Random, size: int, items: list[tuple[str, str, str | None]]) -> Image.Image:
    """Draw ``(shape, colour, region)`` items on a noisy background."""
    img = _background(rng, size)
    draw = ImageDraw.Draw(img)
    for shape, colour, region in items:
        _draw_shape(draw, shape, _shape_box(rng, size, region), COLOURS[colour])
    return img


def _user(rng: random.Random, image_paths: list[str], question: str) -> dict:
    blocks = [{"type": "image", "image": p} for p in image_paths]
    text = {"type": "text", "text": question}
    # Most users put the image first; some ask first. Both orders must work.
    return {"role": "user", "content": [*blocks, text] if rng.random() < 0.8 else [text, *blocks]}


def _assistant(text: str) -> dict:
    return {"role": "assistant", "content": [{"type": "text", "text": text}]}


def _is_video(seed: int, split: str, index: int, video_share: float) -> bool:
    """Whether sample ``index`` is the video task: a stream of its own, so the other samples stay as without it."""
    digest = hashlib.blake2b(f"shapes-video/{seed}/{split}/{index}".encode(), digest_size=8).digest()
    return int.from_bytes(digest, "little") < video_share * 2**64


def _video_sample(rng: random.Random, name: str, image_size: int) -> ShapesSample:
    """A shape that holds one colour for the first two frames and another for the last two."""
    first, last = rng.sample(list(COLOURS), 2)
    shape, box, background = rng.choice(SHAPES), _shape_box(rng, image_size, None), _background(rng, image_size)
    frames = []
    for colour in (first, first, last, last):
        frame = background.copy()
        _draw_shape(ImageDraw.Draw(frame), shape, box, COLOURS[colour])
        frames.append(frame)
    when = rng.choice(list(_VIDEO_QUESTIONS))
    answer = first if when == "start" else last
    path = f"videos/{name}.mp4"
    question = {"type": "text", "text": rng.choice(_VIDEO_QUESTIONS[when])}
    turns = [
        {"role": "user", "content": [{"type": "video", "video": path}, question]},
        _assistant(f"At the {when} it is {answer}."),  # the colour only: the shape task is scored on its own
    ]
    return ShapesSample(messages=turns, images={}, task="video", answer=answer, videos={path: frames})


def write_clip(path: Path, frames: list[Image.Image], fps: int) -> None:
    """Encode ``frames`` as an H.264 mp4 at ``fps`` (near lossless; one thread, so the bytes repeat)."""
    import av

    tmp = path.with_name(f"{path.stem}.tmp{path.suffix}")
    with av.open(str(tmp), mode="w") as container:
        stream = container.add_stream("libx264", rate=fps)
        stream.width, stream.height, stream.pix_fmt = *frames[0].size, "yuv420p"
        stream.options = {"crf": "12", "preset": "medium", "threads": "1"}
        for frame in frames:
            container.mux(stream.encode(av.VideoFrame.from_image(frame.convert("RGB"))))
        container.mux(stream.encode())
    tmp.replace(path)


def make_sample(seed: int, split: str, index: int, image_size: int = 64, video_share: float = 0.0) -> ShapesSample:
    """Sample ``index`` of ``split``; a pure function of its arguments."""
    if video_share and _is_video(seed, split, index, video_share):
        digest = hashlib.blake2b(f"shapes-video/{seed}/{split}/{index}/sample".encode(), digest_size=8).digest()
        return _video_sample(random.Random(int.from_bytes(digest, "little")), f"{split}-{index:06d}", image_size)
    digest = hashlib.blake2b(f"shapes/{seed}/{split}/{index}".encode(), digest_size=8).digest()
    rng = random.Random(int.from_bytes(digest, "little"))
    task = rng.choices(list(TASK_WEIGHTS), weights=list(TASK_WEIGHTS.values()))[0]
    name = f"images/{split}-{index:06d}"
    colour = rng.choice(list(COLOURS))
    shape = rng.choice(SHAPES)
    images: dict[str, Image.Image] = {}
    if task == "text":
        a, b = rng.randint(1, 9), rng.randint(1, 9)
        question = rng.choice([f"What is {a} plus {b}?", f"Add {a} and {b}."])
        answer = str(a + b)
        turns = [
            {"role": "user", "content": [{"type": "text", "text": question}]},
            _assistant(f"{a} plus {b} is {answer}."),
        ]
    elif task == "compare":
        other = colour if rng.random() < 0.5 else rng.choice([c for c in COLOURS if c != colour])
        for suffix, c in (("a", colour), ("b", other)):
            images[f"{name}{suffix}.png"] = _picture(rng, image_size, [(rng.choice(SHAPES), c, None)])
        answer = "yes" if other == colour else "no"
        detail = f"both are {colour}" if answer == "yes" else f"the first is {colour} and the second is {other}"
        question = rng.choice(_COMPARE_QUESTIONS)
        turns = [_user(rng, list(images), question), _assistant(f"{answer.capitalize()}, {detail}.")]
    elif task == "count":
        n = rng.randint(1, 3)
        items = [(rng.choice(SHAPES), rng.choice(list(COLOURS)), None) for _ in range(n)]
        images[f"{name}.png"] = _picture(rng, image_size, items)
        answer = NUMBER_WORDS[n]
        noun = "shape" if n == 1 else "shapes"
        turns = [
            _user(rng, list(images), rng.choice(_COUNT_QUESTIONS)),
            _assistant(f"There {'is' if n == 1 else 'are'} {answer} {noun}."),
        ]
    else:
        region = rng.choice(POSITIONS) if task == "position" else None
        images[f"{name}.png"] = _picture(rng, image_size, [(shape, colour, region)])
        if task == "colour":
            question, answer, reply = rng.choice(_COLOUR_QUESTIONS), colour, f"The shape is {colour}."
        elif task == "shape":
            question, answer, reply = rng.choice(_SHAPE_QUESTIONS), shape, f"It is a {colour} {shape}."
        else:
            assert region is not None
            question, answer, reply = rng.choice(_POSITION_QUESTIONS), region, f"The {shape} is on the {region}."
        turns = [_user(rng, list(images), question), _assistant(reply)]
    messages = turns
    if rng.random() < 0.3:
        messages = [{"role": "system", "content": [{"type": "text", "text": rng.choice(_SYSTEM_PROMPTS)}]}, *turns]
    return ShapesSample(messages=messages, images=images, task=task, answer=answer)


def shapes_dir(root: str | Path, seed: int, image_size: int, video_share: float = 0.0) -> Path:
    """Folder of one materialized variant of the dataset."""
    return Path(root) / (f"seed{seed}-size{image_size}" + (f"-video{video_share:g}" if video_share else ""))


def materialize_shapes(
    root: str | Path,
    *,
    num_train: int,
    num_eval: int,
    seed: int = 0,
    image_size: int = 64,
    video_share: float = 0.0,
    progress: bool = True,
) -> dict[str, Path]:
    """Write ``train.jsonl`` / ``eval.jsonl`` and their png files once; return the jsonl paths.

    A ``manifest.json`` records the counts; an existing folder with a matching manifest is reused as is, and a
    partial one (a crash mid-write) is completed, since every file is a pure function of its name.
    """
    out = shapes_dir(root, seed, image_size, video_share)
    manifest_path = out / "manifest.json"
    manifest = {"seed": seed, "image_size": image_size, "num_train": num_train, "num_eval": num_eval, "version": 1}
    manifest |= {"video_share": video_share} if video_share else {}
    paths = {"train": out / "train.jsonl", "eval": out / "eval.jsonl"}
    if manifest_path.is_file() and json.loads(manifest_path.read_text()) == manifest:
        return paths
    (out / "images").mkdir(parents=True, exist_ok=True)
    (out / "videos").mkdir(exist_ok=True)
    total = num_train + num_eval
    bar = tqdm(total=total, desc=f"generating shapes dataset in {out}", disable=not progress, unit="sample")
    for split, count in (("train", num_train), ("eval", num_eval)):
        tmp = paths[split].with_suffix(".jsonl.tmp")
        with tmp.open("w") as f:
            for i in range(count):
                sample = make_sample(seed, split, i, image_size, video_share)
                for rel, img in sample.images.items():
                    target = out / rel
                    if not target.exists():
                        img.save(target, format="PNG", optimize=False)
                for rel, frames in sample.videos.items():
                    if not (out / rel).exists():
                        write_clip(out / rel, frames, VIDEO_FPS)
                row = {"messages": sample.messages, "task": sample.task, "answer": sample.answer, "id": f"{split}-{i}"}
                f.write(json.dumps(row) + "\n")
                bar.update(1)
        tmp.replace(paths[split])
    bar.close()
    manifest_path.write_text(json.dumps(manifest))
    logger.info("shapes dataset ready: %d train + %d eval conversations in %s", num_train, num_eval, out)
    return paths
