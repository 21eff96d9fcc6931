"""The one failure of image input: the client's reference is at fault (a refused or unreachable
address, a fetch past its limits, bytes that are no image), so it is a 400 naming the part."""

from __future__ import annotations

from server.errors import APIError


class MediaError(APIError):
    def __init__(self, message: str, param: str | None = None) -> None:
        super().__init__(400, message, param=param)


def refused(where: str, reason: str) -> MediaError:
    """`reason` about the part at `where` (e.g. messages.0.content.1), as the client reads it."""
    return MediaError(f"{where}: {reason}", param=where)
