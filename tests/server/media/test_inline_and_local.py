"""Images a request carries inline (data: URLs, Anthropic's base64) or names as file:// under
--allowed-local-media-path: decoded to RGB, or refused with a 400 that names the part."""

from __future__ import annotations

import asyncio
import base64
import io
from pathlib import Path
from typing import Any

import pytest
from PIL import Image

from config.media_config import MediaPolicy
from server.media import MediaError, check_image_count, image_from_base64, load_image
from tests.server.media.image_server import PNG, png_bytes

WHERE = "messages.0.content.1"
POLICY = MediaPolicy(timeout_s=1.0)


def load(source: str, policy: MediaPolicy = POLICY) -> Any:
    return asyncio.run(load_image(source, policy, WHERE))


def refusal(source: str, policy: MediaPolicy = POLICY) -> str:
    with pytest.raises(MediaError) as info:
        load(source, policy)
    assert info.value.param == WHERE and info.value.status == 400
    assert info.value.message.startswith(f"{WHERE}: ")
    return info.value.message


def b64(data: bytes) -> str:
    return base64.b64encode(data).decode()


def test_a_png_data_url_decodes_even_with_line_breaks() -> None:
    text = b64(PNG)
    wrapped = "\n".join(text[i : i + 60] for i in range(0, len(text), 60))
    image = load(f"data:image/png;base64,{wrapped}")
    assert image.mode == "RGB" and image.size == (8, 6)
    assert image.getpixel((0, 0)) == (200, 30, 40)


def test_garbage_data_urls_are_refused() -> None:
    assert "not valid base64" in refusal("data:image/png;base64,@@@not*base64@@@")
    assert "not an image" in refusal(f"data:image/png;base64,{b64(b'plain words, no image')}")
    assert "not an image type" in refusal(f"data:text/plain;base64,{b64(PNG)}")
    assert "no ','" in refusal("data:image/png;base64")


def test_a_truncated_png_is_refused() -> None:
    assert "cannot be decoded" in refusal(f"data:image/png;base64,{b64(PNG[:-30])}")


def test_formats_clients_do_not_send_are_refused() -> None:
    out = io.BytesIO()
    Image.new("RGB", (4, 4)).save(out, format="TGA")
    assert "not an image in a supported format" in refusal(
        f"data:image/x-tga;base64,{b64(out.getvalue())}"
    )


def test_a_data_url_over_the_byte_cap_is_refused() -> None:
    small = MediaPolicy(max_bytes=len(PNG) - 1)
    assert "larger than" in refusal(f"data:image/png;base64,{b64(PNG)}", small)


@pytest.mark.filterwarnings("ignore::PIL.Image.DecompressionBombWarning")  # (Pillow's, expected)
def test_decompression_bombs_are_refused(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(Image, "MAX_IMAGE_PIXELS", 1000)
    # Pillow's own error (over twice its limit), then ours (between the limit and twice it).
    for size in ((100, 100), (40, 40)):
        message = refusal(f"data:image/png;base64,{b64(png_bytes(size))}")
        assert "more than 1000 pixels" in message and "decompression bomb" in message
    assert load(f"data:image/png;base64,{b64(png_bytes((30, 30)))}").size == (30, 30)


def test_anthropic_base64_with_its_media_type() -> None:
    image = image_from_base64(b64(png_bytes(color=(0, 0, 0, 0))), "image/png", WHERE)
    # Transparent pixels come out white, as a viewer shows them, not black.
    assert image.mode == "RGB" and image.getpixel((1, 1)) == (255, 255, 255)
    with pytest.raises(MediaError) as info:
        image_from_base64(b64(PNG), "application/pdf", "messages.2.content.0")
    assert info.value.param == "messages.2.content.0"
    assert info.value.message.startswith("messages.2.content.0: media type 'application/pdf'")


def test_image_count_limit() -> None:
    policy = MediaPolicy(max_images=2)
    check_image_count(2, policy, "messages")
    with pytest.raises(MediaError) as info:
        check_image_count(3, policy, "messages")
    assert info.value.status == 400 and "at most 2" in info.value.message
    assert "--limit-mm-per-prompt" in info.value.message


@pytest.fixture
def media_root(tmp_path: Path) -> Path:
    root = tmp_path / "media"
    root.mkdir()
    (root / "cat.png").write_bytes(PNG)
    (tmp_path / "secret.png").write_bytes(PNG)
    (root / "escape.png").symlink_to(tmp_path / "secret.png")
    return root


def test_file_urls_under_the_allowed_folder(media_root: Path) -> None:
    policy = MediaPolicy(local_root=media_root.resolve())
    assert load((media_root / "cat.png").as_uri(), policy).size == (8, 6)


def test_file_urls_outside_the_allowed_folder_are_refused(media_root: Path) -> None:
    policy = MediaPolicy(local_root=media_root.resolve())
    outside = media_root.parent / "secret.png"
    assert "not under --allowed-local-media-path" in refusal(outside.as_uri(), policy)
    dotted = f"file://{media_root}/../secret.png"
    assert "not under --allowed-local-media-path" in refusal(dotted, policy)
    escape = (media_root / "escape.png").as_uri()
    assert "not under --allowed-local-media-path" in refusal(escape, policy)
    assert "another host" in refusal(f"file://example.com{media_root}/cat.png", policy)
    assert "is not a file" in refusal(media_root.as_uri(), policy)


def test_file_urls_are_refused_without_an_allowed_folder(media_root: Path) -> None:
    assert "no --allowed-local-media-path" in refusal((media_root / "cat.png").as_uri())


def test_a_local_file_over_the_byte_cap_is_refused(media_root: Path) -> None:
    policy = MediaPolicy(local_root=media_root.resolve(), max_bytes=len(PNG) - 1)
    assert "larger than" in refusal((media_root / "cat.png").as_uri(), policy)
