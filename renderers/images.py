"""Image loading: every accepted image source to an upright 8-bit RGB PIL image, or a ``RenderError`` saying why not.

Loading is split in two so the cache can skip decoding: ``read_image_source`` turns a source into raw encoded
bytes (files, data URIs, base64, ``{"bytes", "path"}`` dicts) or an already decoded PIL image, and the content hash
is taken on that; only on a cache miss does ``decode_image`` / ``to_rgb`` run.

What "RGB" means for odd modes (so two datasets holding the same picture in different modes train the same way):
CMYK / YCbCr / L / 1 convert directly; P uses its palette (and its transparency, if any); RGBA / LA / PA are
composited on white, since the vision tower has no alpha channel and black (PIL's plain ``convert``) turns
transparent logos into black squares; 16-bit grey (``I;16*``) is scaled to 8 bits by dropping the low byte rather
than clipped at 255 (which makes nearly every pixel white). EXIF orientation is applied, as cameras store
portraits sideways. Note the Hugging Face processor does a plain ``convert("RGB")``: parity with it holds for images
without alpha.
"""

from __future__ import annotations

import base64
import binascii
import hashlib
import io
import logging
import os
import struct
import warnings
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
from PIL import Image, ImageFile, ImageOps, UnidentifiedImageError

from renderers.errors import RenderError

logger = logging.getLogger(__name__)

_EXIF_ORIENTATION = 0x0112
_ALPHA_MODES = frozenset({"RGBA", "LA", "PA", "RGBa", "La"})
_WIDE_GREY_MODES = frozenset({"I;16", "I;16B", "I;16L", "I;16N", "I"})
_PNG_SIGNATURE = b"\x89PNG\r\n\x1a\n"
_warned_truncated = False


@dataclass(frozen=True)
class RawImage:
    """An image source resolved to something hashable, before decoding."""

    data: bytes | None
    """The encoded file bytes (PNG, JPEG, ...), or None when the source was already decoded."""
    image: Image.Image | None
    """The decoded image when the source was a PIL image or an array; None for encoded bytes."""
    origin: str
    """Where it came from, for error messages (a path, ``<bytes>``, ``<data URI>``, ``<PIL.Image>``)."""


def _decode_base64(text: str, origin: str) -> bytes:
    try:
        return base64.b64decode(text, validate=False)
    except (binascii.Error, ValueError) as e:
        raise RenderError("corrupt_image", f"{origin}: invalid base64 ({e})") from e


UNREADABLE_FILE = (FileNotFoundError, IsADirectoryError, PermissionError)
"""The errors of opening a local file that mean the file is missing for the sample (``missing_file``)."""


def missing_file(error: OSError, path: Any, kind: str = "image") -> RenderError:
    """``missing_<kind>`` naming what is wrong with ``path`` (one of ``UNREADABLE_FILE``)."""
    if isinstance(error, FileNotFoundError):
        detail = f"no such {kind} file"
    elif isinstance(error, IsADirectoryError):
        detail = f"{kind} path is a directory"
    else:
        detail = f"{kind} file not readable"
    return RenderError(f"missing_{kind}", f"{detail}: {path}")


def _read_file(path: str) -> bytes:
    try:
        return Path(path).read_bytes()
    except UNREADABLE_FILE as e:
        raise missing_file(e, path) from e


def read_image_source(source: Any, key: str = "image") -> RawImage:
    """Resolve a source to encoded bytes or a decoded image without decoding files (so hashing is cheap)."""
    if isinstance(source, Image.Image):
        return RawImage(None, source, "<PIL.Image>")
    if isinstance(source, np.ndarray):
        try:
            return RawImage(None, Image.fromarray(source), "<ndarray>")
        except (TypeError, ValueError) as e:
            raise RenderError("bad_image_source", f"array of shape {source.shape} / {source.dtype}: {e}") from e
    if isinstance(source, bytes | bytearray | memoryview):
        return RawImage(bytes(source), None, "<bytes>")
    if isinstance(source, dict):
        data, path = source.get("bytes"), source.get("path")
        if isinstance(data, bytes | bytearray | memoryview):
            return RawImage(bytes(data), None, str(path or "<bytes>"))
        if data is not None:  # JSON gives text or numbers here, never bytes (bytes(10**10) would allocate 10 GB)
            raise RenderError("bad_image_source", f"image dict whose 'bytes' is a {type(data).__name__}, not bytes")
        if path:
            return read_image_source(str(path), "path")
        raise RenderError("bad_image_source", f"image dict without bytes or path: {sorted(source)}")
    if isinstance(source, os.PathLike):
        source = os.fspath(source)
    if not isinstance(source, str):
        raise RenderError("bad_image_source", f"image source of type {type(source).__name__}")
    if source.startswith("data:"):
        header, _, payload = source.partition(",")
        if ";base64" not in header:
            raise RenderError("bad_image_source", f"data URI is not base64: {header!r:.60}")
        return RawImage(_decode_base64(payload, "<data URI>"), None, "<data URI>")
    if source.startswith(("http://", "https://")):
        raise RenderError("remote_image", f"remote images are not fetched during training; download first: {source}")
    if source.startswith("file://"):
        return RawImage(_read_file(source[len("file://") :]), None, source)
    if key == "base64" and not os.path.exists(source):
        return RawImage(_decode_base64(source, "<base64>"), None, "<base64>")
    return RawImage(_read_file(source), None, source)


def content_hash(raw: RawImage) -> str:
    """blake2b of the encoded bytes, or of mode + size + EXIF orientation + pixels for a decoded image."""
    if raw.data is not None:
        return hashlib.blake2b(raw.data, digest_size=16).hexdigest()
    img = raw.image
    assert img is not None
    h = hashlib.blake2b(digest_size=16)
    orientation = img.getexif().get(_EXIF_ORIENTATION, 1) if hasattr(img, "getexif") else 1
    h.update(f"{img.mode}|{img.size}|{orientation}|".encode())
    h.update(img.tobytes())
    return h.hexdigest()


def _check_size(img: Image.Image, origin: str, max_pixels: int | None) -> None:
    width, height = img.size
    if width <= 0 or height <= 0:
        raise RenderError("empty_image", f"{origin}: image has {width}x{height} pixels")
    limit = Image.MAX_IMAGE_PIXELS if max_pixels is None else max_pixels
    if limit is not None and width * height > limit:
        raise RenderError("decompression_bomb", f"{origin}: {width}x{height} pixels exceeds the limit of {limit}")


def decode_image(data: bytes, origin: str = "<bytes>", *, max_pixels: int | None = None) -> Image.Image:
    """Decode encoded bytes fully (so truncation shows here, per sample) and return the image in its own mode.

    PIL's decompression-bomb warning is turned into an error: an image that large is never a training sample.
    """
    global _warned_truncated
    if ImageFile.LOAD_TRUNCATED_IMAGES and not _warned_truncated:
        _warned_truncated = True
        logger.warning("PIL.ImageFile.LOAD_TRUNCATED_IMAGES is set: truncated images will load padded, not fail")
    if not data:
        raise RenderError("corrupt_image", f"{origin}: empty file")
    with warnings.catch_warnings():
        warnings.simplefilter("error", Image.DecompressionBombWarning)
        try:
            img = Image.open(io.BytesIO(data))
            if img.width * img.height > 0 and (max_pixels is None or img.width * img.height <= max_pixels):
                img.load()
        except (Image.DecompressionBombError, Image.DecompressionBombWarning) as e:
            raise RenderError("decompression_bomb", f"{origin}: {e}") from e
        except UnidentifiedImageError as e:
            if _png_has_zero_size(data):
                raise RenderError("empty_image", f"{origin}: the PNG header declares zero pixels") from e
            raise RenderError("corrupt_image", f"{origin}: not a readable image") from e
        except (OSError, SyntaxError, ValueError, EOFError) as e:
            # PIL reports truncated / damaged data as OSError, broken headers as SyntaxError or ValueError.
            reason = "truncated_image" if "truncated" in str(e).lower() else "corrupt_image"
            raise RenderError(reason, f"{origin}: {type(e).__name__}: {e}") from e
    _check_size(img, origin, max_pixels)  # before the pixels are decoded (load() above skips over-limit images)
    return img


def _png_has_zero_size(data: bytes) -> bool:
    """PIL refuses to identify a PNG whose header says 0 x N; read the header so the reason says what is wrong."""
    if len(data) < 24 or not data.startswith(_PNG_SIGNATURE) or data[12:16] != b"IHDR":
        return False
    width, height = struct.unpack(">II", data[16:24])
    return width == 0 or height == 0


def _grey16_to_l(img: Image.Image) -> Image.Image:
    arr = np.asarray(img)
    if img.mode == "I" and int(arr.max(initial=0)) <= 255 and int(arr.min(initial=0)) >= 0:
        return Image.fromarray(arr.astype(np.uint8), "L")
    wide = np.clip(arr.astype(np.int64), 0, 65535)
    return Image.fromarray((wide >> 8).astype(np.uint8), "L")


def _float_to_l(img: Image.Image) -> Image.Image:
    arr = np.nan_to_num(np.asarray(img, dtype=np.float32))
    scale = 255.0 if float(arr.max(initial=0.0)) <= 1.0 else 1.0
    return Image.fromarray(np.clip(arr * scale, 0, 255).round().astype(np.uint8), "L")


def to_rgb(img: Image.Image, origin: str = "<image>") -> Image.Image:
    """Upright 8-bit RGB: EXIF orientation applied, alpha composited on white, wide grey scaled to 8 bits."""
    try:
        # exif_transpose copies even an upright image; look at the tag first.
        if img.getexif().get(_EXIF_ORIENTATION, 1) not in (1, None):
            img = ImageOps.exif_transpose(img)
    except (OSError, ValueError, SyntaxError) as e:
        raise RenderError("corrupt_image", f"{origin}: bad EXIF data: {e}") from e
    if img.mode == "RGB":
        return img
    if img.mode == "P":
        img = img.convert("RGBA" if "transparency" in img.info else "RGB")
    elif img.mode in _WIDE_GREY_MODES:
        img = _grey16_to_l(img)
    elif img.mode == "F":
        img = _float_to_l(img)
    if img.mode in _ALPHA_MODES:
        rgba = img.convert("RGBA")
        background = Image.new("RGBA", rgba.size, (255, 255, 255, 255))
        return Image.alpha_composite(background, rgba).convert("RGB")
    return img.convert("RGB")


def load_raw(raw: RawImage, *, max_pixels: int | None = None) -> Image.Image:
    """A resolved source to an upright RGB image, or ``RenderError``."""
    if raw.data is not None:
        img = decode_image(raw.data, raw.origin, max_pixels=max_pixels)
    else:
        assert raw.image is not None
        img = raw.image
        _check_size(img, raw.origin, max_pixels)
    return to_rgb(img, raw.origin)


def load_image(source: Any, key: str = "image", *, max_pixels: int | None = None) -> Image.Image:
    """Any accepted image source to an upright 8-bit RGB PIL image (see the module docstring for the rules)."""
    return load_raw(read_image_source(source, key), max_pixels=max_pixels)
