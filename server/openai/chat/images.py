"""The images of a chat conversation: its messages' `image_url` parts, found in order, loaded
together (server/media, within --limit-mm-per-prompt) and expanded by the engine into the
rendered prompt, where the chat template wrote one placeholder per image part."""

from __future__ import annotations

import asyncio
from collections.abc import Mapping
from dataclasses import dataclass

from PIL.Image import Image

from engine import InvalidRequestError
from engine.multimodal import MultiModalInputs
from server.errors import invalid
from server.media import check_image_count, load_image
from server.openai.protocol import ChatMessage
from server.state import ServerState

IMAGE_PART = "image_url"


@dataclass(frozen=True)
class ImagePart:
    url: str
    where: str  # the request field that holds it (messages.0.content.1), for its errors


def image_parts(
    messages: list[ChatMessage], names: Mapping[str, str] | None = None
) -> list[ImagePart]:
    """Every image part of the conversation, in order of appearance. `names`: the field each
    part was in the client's own request (`input.2.content.1`, where another API's request
    runs as this chat request), by its place here (`messages.3.content.1`)."""
    parts = []
    for i, message in enumerate(messages):
        if not isinstance(message.content, list):
            continue
        for j, part in enumerate(message.content):
            if part.type != IMAGE_PART:
                continue
            where = f"messages.{i}.content.{j}"
            where = names.get(where, where) if names else where
            if part.image_url is None:
                raise invalid("an image_url part needs image_url.url", f"{where}.image_url")
            parts.append(ImagePart(part.image_url.url, where))
    return parts


def check_reads_images(state: ServerState, parts: list[ImagePart]) -> None:
    """A 400 naming the first image part, for a model that reads text only."""
    if parts and not state.engine.info.accepts_images:
        raise invalid(f"the model {state.model_names[0]} reads no images", parts[0].where)


async def load_images(state: ServerState, parts: list[ImagePart]) -> list[Image]:
    """The images, fetched and decoded concurrently. Every load ends before this returns or
    raises (none is left running behind a 400), and the error is the first part's in order,
    whichever failed first."""
    policy = state.config.media_policy()
    check_image_count(len(parts), policy, "messages")
    loaded = await asyncio.gather(
        *(load_image(p.url, policy, p.where) for p in parts), return_exceptions=True
    )
    images = []
    for image in loaded:
        if isinstance(image, BaseException):
            raise image
        images.append(image)
    return images


async def expand_images(
    state: ServerState, prompt_ids: list[int], images: list[Image]
) -> tuple[list[int], MultiModalInputs]:
    """The rendered prompt with each image's span in place of its placeholder."""
    try:
        return await state.engine.expand_images(prompt_ids, images)
    except InvalidRequestError as exc:  # the text itself held a placeholder: the messages' fault
        raise invalid(str(exc), "messages") from None
