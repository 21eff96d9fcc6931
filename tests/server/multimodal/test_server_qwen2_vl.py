"""A tiny random Qwen2-VL served over real HTTP: a chat with images in two turns, sent as PNG
data URLs through the official client, answers what transformers' `generate` answers for the
same conversation rendered by the model's template and read by Qwen2VLProcessor; usage counts
the expanded image tokens."""

from __future__ import annotations

import base64
import io
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from PIL import Image

from config import ServerConfig
from tests.support.qwen2_vl_models import (
    build_qwen_vl,
    hf_qwen_vl_greedy,
    random_image,
    reference_processor,
)
from tests.support.server_harness import RunningServer, start_engine

MODEL = "tiny-qwen2-vl"
MAX_TOKENS = 12


def data_url(image: Image.Image) -> str:
    out = io.BytesIO()
    image.save(out, format="PNG")  # lossless: the server decodes the very pixels
    return "data:image/png;base64," + base64.b64encode(out.getvalue()).decode()


@pytest.fixture(scope="module")
def folder(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return build_qwen_vl(tmp_path_factory.mktemp("qwen2_vl"), "qwen2_vl", seed=9)


@pytest.fixture(scope="module")
def client(folder: Path) -> Iterator[Any]:
    import openai

    engine = start_engine(model=str(folder), dtype="float32", max_model_len=256)
    running = RunningServer(engine, ServerConfig(served_model_name=[MODEL]))
    try:
        with openai.OpenAI(
            base_url=running.url + "/v1", api_key="unused", max_retries=0, timeout=60
        ) as openai_client:
            yield openai_client
    finally:
        running.stop()
        engine.shutdown()


def test_images_in_two_turns_answer_as_transformers(client: Any, folder: Path) -> None:
    first, second = random_image(1, (112, 84)), random_image(2, (56, 112))
    turns: list[tuple[str, list[Any]]] = [
        ("user", [first, "What is this?"]),
        ("assistant", ["Noise."]),
        ("user", ["And this?", second]),
    ]
    sent = [
        {
            "role": role,
            "content": [
                {"type": "text", "text": part}
                if isinstance(part, str)
                else {"type": "image_url", "image_url": {"url": data_url(part)}}
                for part in parts
            ],
        }
        for role, parts in turns
    ]
    answer = client.chat.completions.create(
        model=MODEL,
        messages=sent,
        temperature=0,
        max_tokens=MAX_TOKENS,
        extra_body={"ignore_eos": True},
    )

    tok = reference_processor(folder).tokenizer  # the one the oracle below reads
    rendered = [
        {
            "role": role,
            "content": [
                {"type": "text", "text": p} if isinstance(p, str) else {"type": "image"}
                for p in parts
            ],
        }
        for role, parts in turns
    ]
    text = tok.apply_chat_template(rendered, tokenize=False, add_generation_prompt=True)
    prompt_ids, tokens = hf_qwen_vl_greedy(folder, "qwen2_vl", text, [first, second], MAX_TOKENS)
    expected = tok.decode(tokens, skip_special_tokens=True)
    assert expected and answer.choices[0].message.content == expected
    # 12 + 8 image tokens in place of the two placeholders
    assert answer.usage.prompt_tokens == len(prompt_ids)
    assert prompt_ids.count(tok.convert_tokens_to_ids("<|image_pad|>")) == 20
    assert answer.usage.completion_tokens == MAX_TOKENS
