"""Image input from URLs: which hosts and local files a request may name, and how long and how
large a fetch may be. The flags are vLLM's where vLLM has one (--allowed-media-domains,
--allowed-local-media-path, --limit-mm-per-prompt), and vLLM's environment variables are read
below our own settings, so that a deployment written for vLLM keeps its limits here.

`MediaSettings` holds the settings as flags (ServerConfig inherits them); `MediaPolicy` is the
resolved, frozen form that server/media reads for every fetch.
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path

from pydantic import Field, field_validator

from config.engine_config import _Strict

MiB = 1024 * 1024
# vLLM's default when --limit-mm-per-prompt names no limit for a modality.
DEFAULT_IMAGES_PER_PROMPT = 999
MAX_REDIRECTS = 5

# vLLM's environment variable -> our setting. Read below PAGEDSERVE_* variables and flags.
VLLM_ENV_SETTINGS = {
    "VLLM_IMAGE_FETCH_TIMEOUT": "media_fetch_timeout",
    "VLLM_MAX_MEDIA_DOWNLOAD_SIZE_MB": "max_media_download_size_mb",
    "VLLM_MEDIA_FETCH_MAX_RETRIES": "media_fetch_max_retries",
}


def vllm_env_settings(env: Mapping[str, str]) -> dict[str, object]:
    """The media settings vLLM's environment variables give."""
    return {name: env[var] for var, name in VLLM_ENV_SETTINGS.items() if var in env}


@dataclass(frozen=True)
class MediaPolicy:
    """What a request's image reference may make this server do."""

    # Hosts a URL may name, lower case; None: any host with public addresses. A host named here
    # may also resolve to private or loopback addresses (an internal image store).
    allowed_domains: frozenset[str] | None = None
    # file:// URLs are read only under this resolved folder; None: refused.
    local_root: Path | None = None
    timeout_s: float = 10.0  # the whole fetch, redirects and retries included
    max_bytes: int = 20 * MiB
    max_retries: int = 3  # vLLM's VLLM_MEDIA_FETCH_MAX_RETRIES default
    max_redirects: int = MAX_REDIRECTS
    max_images: int = DEFAULT_IMAGES_PER_PROMPT


class MediaSettings(_Strict):
    allowed_media_domains: list[str] | None = Field(
        None,
        description="the only hosts image URLs may name, comma- or space-separated; a host named "
        "here may resolve to a private or loopback address (default: any host whose addresses "
        "are all public)",
    )
    allowed_local_media_path: str | None = Field(
        None,
        description="folder under which requests may name images as file:// URLs (default: "
        "file:// refused)",
    )
    media_fetch_timeout: float = Field(
        10.0,
        gt=0,
        description="seconds one image fetch may take in all, redirects and retries included "
        "(env VLLM_IMAGE_FETCH_TIMEOUT is also read)",
    )
    max_media_download_size_mb: float = Field(
        20.0,
        gt=0,
        description="largest image a fetch or file:// may give, in MiB (env "
        "VLLM_MAX_MEDIA_DOWNLOAD_SIZE_MB is also read)",
    )
    media_fetch_max_retries: int = Field(
        3,
        ge=0,
        le=10,
        description="retries of a fetch that could not connect or got a 5xx answer, within "
        "--media-fetch-timeout (env VLLM_MEDIA_FETCH_MAX_RETRIES is also read)",
    )
    limit_mm_per_prompt: dict[str, int] | None = Field(
        None,
        description="most media items of each kind one prompt may hold, a JSON object such as '{\"image\": 4}' "
        f"(default: {DEFAULT_IMAGES_PER_PROMPT} of each, as in vLLM)",
    )

    @field_validator("allowed_media_domains")
    @classmethod
    def _split_domains(cls, value: list[str] | None) -> list[str] | None:
        if value is None:
            return None
        hosts = [h.strip().lower().strip("[]") for item in value for h in item.split(",")]
        return [h for h in hosts if h]

    @field_validator("allowed_local_media_path")
    @classmethod
    def _existing_folder(cls, value: str | None) -> str | None:
        if value is None:
            return None
        path = Path(value).expanduser().resolve()
        if not path.is_dir():
            raise ValueError(f"--allowed-local-media-path {value!r} is not an existing folder")
        return str(path)

    @field_validator("limit_mm_per_prompt", mode="before")
    @classmethod
    def _parse_limits(cls, value: object) -> object:
        if isinstance(value, str):
            try:
                return json.loads(value)
            except json.JSONDecodeError as exc:
                raise ValueError(f"--limit-mm-per-prompt: not valid JSON ({exc})") from None
        return value

    @field_validator("limit_mm_per_prompt")
    @classmethod
    def _non_negative(cls, value: dict[str, int] | None) -> dict[str, int] | None:
        for kind, limit in (value or {}).items():
            if limit < 0:
                raise ValueError(f"--limit-mm-per-prompt {kind!r}: {limit} is below 0")
        return value

    def media_policy(self) -> MediaPolicy:
        domains = self.allowed_media_domains
        limits = self.limit_mm_per_prompt or {}
        return MediaPolicy(
            allowed_domains=None if domains is None else frozenset(domains),
            local_root=None
            if self.allowed_local_media_path is None
            else Path(self.allowed_local_media_path),
            timeout_s=self.media_fetch_timeout,
            max_bytes=int(self.max_media_download_size_mb * MiB),
            max_retries=self.media_fetch_max_retries,
            max_images=limits.get("image", DEFAULT_IMAGES_PER_PROMPT),
        )
