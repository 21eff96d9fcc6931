"""Bytes to an RGB image, and the inline forms that carry bytes (a data: URL, Anthropic's
base64). Decoding runs in a worker thread: it is CPU work on input of a client's choosing."""

from __future__ import annotations

import base64
import binascii
import io
import re
from urllib.parse import unquote_to_bytes

from PIL import Image

from server.media.errors import refused

# The formats clients send. Pillow opens many more, some through parsers rarely exercised (or,
# for EPS, an external program): those are refused rather than offered to any client.
IMAGE_FORMATS = ("PNG", "JPEG", "GIF", "WEBP", "BMP")  # (a JPEG may open as MPO)
_WHITESPACE = re.compile(rb"\s+")


def base64_bytes(text: str | bytes, where: str, max_bytes: int | None = None) -> bytes:
    """Standard or URL-safe base64, whitespace (line breaks) and missing padding tolerated."""
    raw = _WHITESPACE.sub(b"", text.encode("ascii", "replace") if isinstance(text, str) else text)
    if max_bytes is not None and len(raw) // 4 * 3 > max_bytes:
        raise refused(where, f"image is larger than {max_bytes} bytes")
    raw = raw.replace(b"-", b"+").replace(b"_", b"/")
    raw += b"=" * (-len(raw) % 4)
    try:
        return base64.b64decode(raw, validate=True)
    except binascii.Error as exc:
        raise refused(where, f"image data is not valid base64 ({exc})") from None


def check_media_type(media_type: str | None, where: str) -> None:
    if media_type and not media_type.strip().lower().startswith("image/"):
        raise refused(where, f"media type {media_type!r} is not an image type")


def data_url_bytes(url: str, where: str, max_bytes: int) -> bytes:
    """The bytes of `data:[<media type>][;base64],<data>`."""
    header, comma, payload = url[len("data:") :].partition(",")
    if not comma:
        raise refused(where, "data: URL has no ',' before its data")
    media_type, *params = header.split(";")
    check_media_type(media_type, where)
    if "base64" in (p.strip().lower() for p in params):
        return base64_bytes(payload, where, max_bytes)
    data = unquote_to_bytes(payload)
    if len(data) > max_bytes:
        raise refused(where, f"image is larger than {max_bytes} bytes")
    return data


def decode_image(data: bytes, where: str) -> Image.Image:
    """The image fully decoded, in RGB (transparency over white, as a viewer shows it)."""
    try:
        with Image.open(io.BytesIO(data), formats=IMAGE_FORMATS) as image:
            limit = Image.MAX_IMAGE_PIXELS
            if limit is not None and image.width * image.height > limit:
                raise Image.DecompressionBombError(f"{image.width}x{image.height}")
            image.load()
            return _rgb(image)
    except Image.DecompressionBombError:
        raise refused(
            where,
            f"image has more than {Image.MAX_IMAGE_PIXELS} pixels: refused as a possible "
            "decompression bomb",
        ) from None
    except Image.UnidentifiedImageError:
        formats = ", ".join(IMAGE_FORMATS)
        raise refused(where, f"data is not an image in a supported format ({formats})") from None
    except Exception as exc:  # noqa: BLE001 - Pillow raises many types on corrupt data
        # (OSError, SyntaxError, ValueError, struct.error, ...): each is the client's bad data.
        raise refused(where, f"image cannot be decoded ({type(exc).__name__}: {exc})") from None


def _rgb(image: Image.Image) -> Image.Image:
    if image.mode == "RGB":
        return image.copy()  # (the opened image is closed when decoding returns)
    if "A" in image.getbands() or "transparency" in image.info:
        rgba = image.convert("RGBA")
        white = Image.new("RGBA", rgba.size, (255, 255, 255, 255))
        return Image.alpha_composite(white, rgba).convert("RGB")
    return image.convert("RGB")
