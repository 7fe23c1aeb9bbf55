"""Image paths are confined to the data folder (or allowed roots), and a refused file is never opened.

The bug these guard against: a row's ``"../../../../etc/hostname"``, ``"/etc/passwd"``, a symlink out of the data
folder or a ``file://`` URI was opened (and trained on, if it decoded); a relative ``image_url`` resolved against
the working directory instead of the data file's folder.
"""

from __future__ import annotations

import base64
import builtins
import io
import json
import os
import pathlib
import pickle
from pathlib import Path

import datasets
import pytest
import torch
from PIL import Image

import renderers.images
from renderers import RenderError
from vlm_sft.data.image_roots import ImageRoots
from vlm_sft.data.sources import ConversationSource, load_conversations, render_fn, rows_to_dataset


def row(*blocks) -> dict:
    return {
        "messages": [
            {"role": "user", "content": [*blocks, {"type": "text", "text": "Colour?"}]},
            {"role": "assistant", "content": "Red."},
        ]
    }


@pytest.fixture
def layout(tmp_path) -> dict[str, Path]:
    """data/ (the root, with images/red.png and a symlink out), outside/secret.png (unreadable), extra/ok.png."""
    data, outside, extra = tmp_path / "data", tmp_path / "outside", tmp_path / "extra"
    for folder in (data / "images", outside, extra):
        folder.mkdir(parents=True)
    Image.new("RGB", (64, 64), "red").save(data / "images" / "red.png")
    Image.new("RGB", (64, 64), "red").save(extra / "ok.png")
    Image.new("RGB", (64, 64), "blue").save(outside / "secret.png")
    (data / "images" / "link.png").symlink_to(outside / "secret.png")
    (data / "images" / "outlink").symlink_to(outside, target_is_directory=True)
    (outside / "secret.png").chmod(0o000)  # as root this stops nothing: hence the recorder below
    return {"data": data, "outside": outside, "extra": extra, "secret": outside / "secret.png"}


@pytest.fixture
def opened(monkeypatch) -> list[str]:
    """Real paths of every file opened through open / Path.read_bytes / the renderer's reader, in order."""
    seen: list[str] = []

    def recording(fn):
        def wrapper(target, *args, **kwargs):
            if isinstance(target, str | os.PathLike):
                seen.append(os.path.realpath(os.fspath(target)))
            return fn(target, *args, **kwargs)

        return wrapper

    monkeypatch.setattr(builtins, "open", recording(builtins.open))
    monkeypatch.setattr(pathlib.Path, "read_bytes", recording(pathlib.Path.read_bytes))
    monkeypatch.setattr(renderers.images, "_read_file", recording(renderers.images._read_file))
    return seen


def load(rows: list[dict], data: Path, **kwargs):
    path = data / "train.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return load_conversations(path, cache_dir=str(data.parent / "cache"), **kwargs)


def refused_blocks(secret: Path) -> list[dict]:
    """Every way a row can name a file outside the root."""
    return [
        {"type": "image", "image": "../outside/secret.png"},
        {"type": "image", "image": "../../../../../../../../../../etc/hostname"},
        {"type": "image", "image": str(secret)},
        {"type": "image", "image": "/etc/passwd"},
        {"type": "image", "image": "images/link.png"},  # a symlink inside the root pointing out of it
        {"type": "image", "image": "images/outlink/secret.png"},  # through a symlinked folder
        {"type": "image", "image": "file://" + str(secret)},
        {"type": "image_url", "image_url": {"url": "../outside/secret.png"}},
        {"type": "image_url", "image_url": "file://" + str(secret)},
        {"type": "image", "path": str(secret)},
        {"type": "image", "url": str(secret)},
        {"image": str(secret)},  # untyped: the renderer reads it as an image block
        {"type": "image", "base64": str(secret)},  # the renderer reads an existing path under `base64` as a file
        {"type": "image", "image": {"bytes": None, "path": str(secret)}},
    ]


def test_paths_outside_the_root_are_refused_without_opening_them(renderer, layout, opened):
    blocks = refused_blocks(layout["secret"])
    source = load([row(b) for b in blocks] + [row({"type": "image", "image": "images/red.png"})], layout["data"])
    fn = render_fn(source, renderer)
    opened.clear()
    details = []
    for i, block in enumerate(blocks):
        with pytest.raises(RenderError) as info:
            fn(i)
        assert info.value.reason == "image_outside_root", (block, info.value)
        assert info.value.sample_index == i
        assert "data.allowed_image_roots" in info.value.detail and str(layout["data"]) in info.value.detail
        details.append(info.value.detail)
    assert details[4].startswith(f"images/link.png resolves to {layout['secret']} outside the image root")
    assert fn(len(blocks)).num_images == 1  # the recorder does see files that are opened...
    assert str(layout["data"] / "images" / "red.png") in opened
    assert str(layout["secret"]) not in opened  # ...and the refused one never was
    assert not any(p.startswith(("/etc/", str(layout["outside"]))) for p in opened)


def test_image_columns_outside_the_root_are_refused(layout, opened):
    sharegpt = [
        {
            "conversations": [{"from": "human", "value": "<image> Colour?"}, {"from": "gpt", "value": "Blue."}],
            "image": path,
        }
        for path in ("../outside/secret.png", str(layout["secret"]), "images/link.png")
    ]
    source = load(sharegpt, layout["data"])
    placeholders = row({"type": "image"})
    placeholders["images"] = ["../outside/secret.png"]
    messages = load([placeholders], layout["data"])
    ds = rows_to_dataset([{**row({"type": "image"}), "images": [str(layout["secret"])]}])
    typed = ConversationSource(ds.cast_column("images", datasets.List(datasets.Image())), image_root=layout["data"])
    for src, index in [(source, 0), (source, 1), (source, 2), (messages, 0), (typed, 0)]:
        with pytest.raises(RenderError) as info:
            src[index]
        assert info.value.reason == "image_outside_root"
    assert str(layout["secret"]) not in opened


def test_relative_image_url_resolves_against_the_root_not_the_working_directory(
    renderer, layout, tmp_path, monkeypatch
):
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    monkeypatch.chdir(elsewhere)
    red = str(layout["data"] / "images" / "red.png")
    blocks = [
        {"type": "image_url", "image_url": {"url": "images/red.png"}},
        {"type": "image_url", "image_url": "images/red.png"},
        {"type": "image", "image": "file://" + red},
        {"type": "image", "image": "./images/../images/red.png"},
    ]
    source = load([row(b) for b in blocks], layout["data"])
    reference = renderer.render(row({"type": "image", "image": red})["messages"])
    for i in range(len(blocks)):
        sample = render_fn(source, renderer)(i)
        assert torch.equal(sample.token_ids, reference.token_ids)
        assert torch.equal(sample.multi_modal_data.pixel_values, reference.multi_modal_data.pixel_values)


def test_allowed_roots_and_non_path_sources(renderer, layout):
    ok = str(layout["extra"] / "ok.png")
    buffer = io.BytesIO()
    Image.new("RGB", (64, 64), "red").save(buffer, format="PNG")
    data_uri = "data:image/png;base64," + base64.b64encode(buffer.getvalue()).decode()
    rows = [
        row({"type": "image", "image": ok}),
        row({"type": "image", "image": "../extra/ok.png"}),
        row({"type": "image", "image": data_uri}),
        row({"type": "image", "base64": base64.b64encode(buffer.getvalue()).decode()}),
        row({"type": "image", "image": "https://example.com/red.png"}),
    ]
    refused = load(rows[:2], layout["data"])
    for i in range(2):
        with pytest.raises(RenderError, match="image_outside_root"):
            refused[i]
    source = load(rows, layout["data"], allowed_image_roots=[layout["extra"]])
    fn = render_fn(source, renderer)
    reference = renderer.render(row({"type": "image", "image": ok})["messages"])
    for i in range(4):
        assert torch.equal(fn(i).multi_modal_data.pixel_values, reference.multi_modal_data.pixel_values)
    with pytest.raises(RenderError) as info:
        fn(4)
    assert info.value.reason == "remote_image"  # remote URLs stay refused, by the renderer


def test_no_root_refuses_every_local_path_but_allowed_roots(renderer, layout):
    """A hub dataset has no data folder: its rows may name no local file outside an allowed root."""
    red = str(layout["data"] / "images" / "red.png")
    ds = rows_to_dataset([row({"type": "image", "image": red})])
    with pytest.raises(RenderError) as info:
        ConversationSource(ds)[0]
    assert info.value.reason == "image_outside_root" and "none is set" in info.value.detail
    allowed = ConversationSource(ds, allowed_image_roots=[layout["data"]])
    assert render_fn(allowed, renderer)(0).num_images == 1


def test_image_roots_policy_pickles_and_follows_symlinked_roots(layout, tmp_path):
    """A data folder reached through a symlink is still its own root (both sides are compared as real paths)."""
    alias = tmp_path / "alias"
    alias.symlink_to(layout["data"], target_is_directory=True)
    roots = ImageRoots(alias)
    assert roots.resolve("images/red.png") == str(alias / "images" / "red.png")
    with pytest.raises(RenderError, match="image_outside_root"):
        roots.resolve("images/link.png")
    assert pickle.loads(pickle.dumps(roots)) == roots
