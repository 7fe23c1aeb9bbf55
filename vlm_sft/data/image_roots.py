"""Where a dataset may read images and videos from: paths resolve against one root and must stay inside the allowed
folders.

A dataset row is untrusted input. Without a policy a row holding ``"../../../../etc/hostname"`` or
``"/root/.ssh/id_rsa"`` makes the renderer open that file (and, if it decodes, train on it). So every image given
as a path (a plain string, a ``file://`` URI, a ``{"bytes": None, "path": ...}`` dict, the ``image`` / ``url`` /
``path`` / ``image_url`` keys of a block; a video block's ``video`` / ``video_url`` / ``path`` / ``url``, each frame
of a frame list included) is:

1. resolved: a relative path joins the root (by default the data file's folder, not the working directory, so a
   dataset means the same thing wherever training is started from);
2. checked with ``os.path.realpath``, which follows symlinks and ``..`` without opening the file, against the real
   paths of the root and of the allowed extra roots. Anything else raises ``RenderError("image_outside_root")``
   before any file is opened: the pipeline counts it as a skip.

Sources that are not paths pass through untouched: data URIs, base64, embedded bytes, decoded images. Remote
``http(s)`` URLs pass through too, and the renderer refuses them (``remote_image``). A source with no root at all
(a hub dataset without ``image_root``) accepts local paths only under an allowed root.
"""

from __future__ import annotations

import os
import urllib.parse
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any

from renderers.errors import RenderError

FIX_HINT = "add its folder to data.allowed_image_roots (or set data.image_root)"
"""What the ``image_outside_root`` error tells the user to do."""

_PASS_THROUGH = ("data:", "http://", "https://")
_FILE_URI = "file://"
_IMAGE_BLOCK_TYPES = frozenset({"image", "image_url", "input_image"})
"""Block types the renderer reads an image from (and untyped blocks, when they carry an image key)."""
_PATH_KEYS = ("image", "url", "path")
_VIDEO_BLOCK_TYPES = frozenset({"video", "video_url", "input_video"})
"""Block types the renderer reads a video from (and untyped blocks with a ``video`` key)."""
_VIDEO_PATH_KEYS = ("video", "path", "url")


@dataclass(frozen=True)
class ImageRoots:
    """The image-path policy of one data source (plain strings, so dataloader workers can pickle it)."""

    root: str | None = None
    """Folder relative paths resolve against and images may lie in (absolute, ``~`` expanded); None: no local
    images except under the allowed roots."""
    allowed: tuple[str, ...] = ()
    """Further folders images may be read from (absolute, ``~`` expanded)."""
    real: tuple[str, ...] = field(init=False)
    """``os.path.realpath`` of ``root`` and of each allowed folder, taken once: where a resolved image must lie."""

    def __post_init__(self) -> None:
        root = None if self.root is None else _absolute(self.root)
        allowed = tuple(_absolute(a) for a in self.allowed)
        object.__setattr__(self, "root", root)
        object.__setattr__(self, "allowed", allowed)
        object.__setattr__(self, "real", tuple(os.path.realpath(p) for p in ((root,) if root else ()) + allowed))

    def check_path(self, path: str, shown: str | None = None) -> str:
        """``path`` resolved against the root, if its real path lies inside an allowed folder; else ``RenderError``.

        The returned path is the joined one (not the real one) so error messages and file names read as the data
        wrote them; the OS resolves it to the real path that was checked.
        """
        if "\x00" in path:
            raise RenderError("bad_image_source", f"image path contains a NUL byte: {path!r:.120}")
        joined = os.path.join(self.root, path) if self.root is not None else os.path.abspath(path)
        real = os.path.realpath(joined)
        for folder in self.real:
            if real == folder or real.startswith(folder.rstrip(os.sep) + os.sep):
                return joined
        where = f"the image root {self.root}" if self.root is not None else "any image root (none is set)"
        if self.allowed:
            where += f" and the allowed roots {', '.join(self.allowed)}"
        raise RenderError("image_outside_root", f"{shown or path} resolves to {real} outside {where}; {FIX_HINT}")

    def resolve(self, source: Any) -> Any:
        """An image source with any local path resolved and checked; other sources unchanged."""
        if isinstance(source, os.PathLike):
            source = os.fspath(source)
        if isinstance(source, Mapping):
            if source.get("bytes") is None and isinstance(source.get("path"), str):
                return {"bytes": None, "path": self.resolve(source["path"])}
            return source
        if not isinstance(source, str) or source.startswith(_PASS_THROUGH):
            return source
        if source.startswith(_FILE_URI):
            return self.check_path(urllib.parse.unquote(source[len(_FILE_URI) :]), shown=source)
        return self.check_path(source)

    def resolve_base64(self, value: Any) -> Any:
        """The ``base64`` key: the renderer reads a string naming an existing file (or a ``file://`` URI) as a
        path, so such strings are checked like paths (cwd-relative, as the renderer would open them)."""
        if not isinstance(value, str) or value.startswith(_PASS_THROUGH):
            return value
        if value.startswith(_FILE_URI):
            return self.resolve(value)
        if "\x00" not in value and os.path.exists(value):
            self.check_path(os.path.abspath(value), shown=value)
        return value

    def resolve_video(self, source: Any) -> Any:
        """A video source (a path, a ``{"bytes", "path"}`` dict, or a list of frame sources) resolved and checked."""
        if isinstance(source, list | tuple):
            return [self.resolve(frame) for frame in source]
        return self.resolve(source)

    def resolve_block(self, block: Any) -> Any:
        """A content block with every image or video path in it resolved and checked (text blocks unchanged)."""
        if not isinstance(block, Mapping):
            return block
        kind = block.get("type")
        if (isinstance(kind, str) and kind in _VIDEO_BLOCK_TYPES) or (kind is None and block.get("video") is not None):
            return _resolved(block, _VIDEO_PATH_KEYS, "video_url", self.resolve_video)
        if kind is not None and (not isinstance(kind, str) or kind not in _IMAGE_BLOCK_TYPES):
            return block
        out = _resolved(block, _PATH_KEYS, "image_url", self.resolve)
        if out.get("base64") is not None:
            out["base64"] = self.resolve_base64(out["base64"])
        return out


def _resolved(block: Mapping, keys: tuple[str, ...], url_key: str, resolve: Callable[[Any], Any]) -> dict:
    """``block`` with the sources under ``keys`` and under ``url_key`` (a string or ``{"url": ...}``) resolved."""
    out = dict(block)
    for key in keys:
        if out.get(key) is not None:
            out[key] = resolve(out[key])
    url = out.get(url_key)
    if isinstance(url, Mapping) and url.get("url") is not None:
        out[url_key] = {**url, "url": resolve(url["url"])}
    elif url is not None:
        out[url_key] = resolve(url)
    return out


def _absolute(path: str | os.PathLike) -> str:
    return os.path.abspath(os.path.expanduser(os.fspath(path)))
