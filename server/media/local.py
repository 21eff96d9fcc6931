"""file:// image URLs, read only under --allowed-local-media-path: the path is resolved
(symlinks and `..` included) before it is compared with the folder, so none escapes it."""

from __future__ import annotations

from pathlib import Path
from urllib.parse import unquote, urlsplit

from config.media_config import MediaPolicy
from server.media.errors import refused


def read_local(url: str, policy: MediaPolicy, where: str) -> bytes:
    if policy.local_root is None:
        raise refused(
            where, "file:// image URLs are refused: this server has no --allowed-local-media-path"
        )
    parts = urlsplit(url)
    if parts.netloc not in ("", "localhost"):
        raise refused(where, f"file:// URL names another host ({parts.netloc!r})")
    path = Path(unquote(parts.path))
    # Compared before the file is looked at, so that a refusal says nothing of what exists
    # outside the folder.
    resolved = path.resolve() if path.is_absolute() else None
    if resolved is None or not resolved.is_relative_to(policy.local_root):
        raise refused(where, f"{url!r} is not under --allowed-local-media-path")
    if not resolved.is_file():  # (a FIFO or a device would block or never end)
        raise refused(where, f"{url!r} is not a file")
    with resolved.open("rb") as file:
        data = file.read(policy.max_bytes + 1)
    if len(data) > policy.max_bytes:
        raise refused(where, f"image is larger than {policy.max_bytes} bytes")
    return data
