"""The image-fetch settings: vLLM's flags and environment variables, our precedence, and the
policy the media loader reads."""

from __future__ import annotations

from pathlib import Path

import pytest

from config import ConfigError
from config.media_config import DEFAULT_IMAGES_PER_PROMPT, MediaPolicy, MiB
from config.sources import serve_config
from server import cli


def test_defaults_are_a_safe_policy() -> None:
    policy = serve_config({}, {}).server.media_policy()
    assert policy == MediaPolicy(
        allowed_domains=None,
        local_root=None,
        timeout_s=10.0,
        max_bytes=20 * MiB,
        max_retries=3,
        max_images=DEFAULT_IMAGES_PER_PROMPT,
    )


def test_flags_as_typed_on_the_command_line(tmp_path: Path) -> None:
    args = vars(
        cli.build_parser().parse_args(
            [
                "serve",
                "--allowed-media-domains",
                "Images.Example.com,cdn.example.org",
                "--allowed-local-media-path",
                str(tmp_path),
                "--media-fetch-timeout",
                "2.5",
                "--max-media-download-size-mb",
                "1.5",
                "--limit-mm-per-prompt",
                '{"image": 3}',
            ]
        )
    )
    args.pop("command")
    args.pop("config")
    policy = serve_config(args, {}).server.media_policy()
    assert policy.allowed_domains == {"images.example.com", "cdn.example.org"}
    assert policy.local_root == tmp_path.resolve()
    assert policy.timeout_s == 2.5 and policy.max_bytes == int(1.5 * MiB)
    assert policy.max_images == 3


def test_vllm_variables_are_read_below_ours_and_the_flags() -> None:
    vllm = {
        "VLLM_IMAGE_FETCH_TIMEOUT": "4",
        "VLLM_MAX_MEDIA_DOWNLOAD_SIZE_MB": "8",
        "VLLM_MEDIA_FETCH_MAX_RETRIES": "1",
    }
    policy = serve_config({}, vllm).server.media_policy()
    assert (policy.timeout_s, policy.max_bytes, policy.max_retries) == (4.0, 8 * MiB, 1)
    ours = {**vllm, "PAGEDSERVE_MEDIA_FETCH_TIMEOUT": "6"}
    assert serve_config({}, ours).server.media_policy().timeout_s == 6.0
    flagged = serve_config({"media_fetch_timeout": 7.0}, ours).server.media_policy()
    assert flagged.timeout_s == 7.0


@pytest.mark.parametrize(
    ("settings", "problem"),
    [
        ({"allowed_local_media_path": "/no/such/folder"}, "not an existing folder"),
        ({"limit_mm_per_prompt": "{image: 3}"}, "not valid JSON"),
        ({"limit_mm_per_prompt": '{"image": -1}'}, "below 0"),
        ({"media_fetch_timeout": 0}, "--media-fetch-timeout: must be > 0"),
    ],
)
def test_bad_settings_are_refused_before_serving(settings: dict[str, object], problem: str) -> None:
    with pytest.raises(ConfigError, match=problem):
        serve_config(settings, {})
