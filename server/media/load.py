"""What the routes call: a request's image reference to a decoded RGB image, and the count of
images one prompt may hold."""

from __future__ import annotations

import asyncio

from PIL import Image

from config.media_config import MediaPolicy
from server.media.decode import base64_bytes, check_media_type, data_url_bytes, decode_image
from server.media.errors import refused
from server.media.fetch import fetch_url
from server.media.local import read_local


async def load_image(source: str, policy: MediaPolicy, where: str = "image_url") -> Image.Image:
    """The image a data:, http(s):// or file:// URL gives; MediaError (a 400 naming `where`,
    e.g. messages.0.content.1) for any reason it cannot be had."""
    scheme = source[: source.find(":")].strip().lower() if ":" in source else ""
    if scheme == "data":
        return await asyncio.to_thread(
            lambda: decode_image(data_url_bytes(source, where, policy.max_bytes), where)
        )
    if scheme in ("http", "https"):
        data = await fetch_url(source.strip(), policy, where)
    elif scheme == "file":
        data = await asyncio.to_thread(read_local, source, policy, where)
    else:
        raise refused(where, "an image URL must be a data:, http(s):// or file:// URL")
    return await asyncio.to_thread(decode_image, data, where)


def image_from_base64(data: str, media_type: str | None, where: str) -> Image.Image:
    """Anthropic's `{"type": "base64", "media_type": ..., "data": ...}` image source. Decoding
    is CPU work: call it off the event loop for large images."""
    check_media_type(media_type, where)
    return decode_image(base64_bytes(data, where), where)


def check_image_count(count: int, policy: MediaPolicy, param: str) -> None:
    if count > policy.max_images:
        raise refused(
            param,
            f"{count} images in one prompt; this server takes at most {policy.max_images} "
            "(--limit-mm-per-prompt)",
        )
