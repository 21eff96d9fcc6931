"""Images in chat, Responses and Messages requests, over real HTTP with the official clients, on a
tiny random LLaVA: greedy answers equal transformers' on the same rendered text and images (one
image, two in a message, images across turns), streamed as whole, the three APIs agree, usage
and /tokenize count the expanded prompt, an image fetched from a local server, and the 400s (a
text-only model, bad bytes, a refused host, the per-prompt limit, the render routes)."""

from __future__ import annotations

import asyncio
import base64
import io
import threading
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import numpy as np
import pytest
import torch
from PIL import Image

from config import ServerConfig
from engine.async_engine import AsyncEngine
from tests.server.media.image_server import PNG, image_server
from tests.support.server_harness import (
    RunningServer,
    assert_openai_error,
    start_engine,
    start_tiny_server,
)
from tests.support.vision_models import build_llava

MODEL = "tiny-llava"
MAX_TOKENS = 6
# ignore_eos: a random model could end early on one side's stop token and not the other's.
GREEDY: dict[str, Any] = {"temperature": 0, "max_tokens": MAX_TOKENS}
EXTRA = {"ignore_eos": True}


def random_image(seed: int, size: tuple[int, int] = (40, 52)) -> Image.Image:
    pixels = np.random.RandomState(seed).randint(0, 256, (size[1], size[0], 3), dtype=np.uint8)
    return Image.fromarray(pixels, "RGB")


def png(image: Image.Image) -> bytes:
    out = io.BytesIO()
    image.save(out, format="PNG")  # lossless: the server decodes the very pixels
    return out.getvalue()


def data_url(image: Image.Image) -> str:
    return "data:image/png;base64," + base64.b64encode(png(image)).decode()


def image_part(image: Image.Image) -> dict[str, Any]:
    return {"type": "image_url", "image_url": {"url": data_url(image)}}


def text_part(text: str) -> dict[str, Any]:
    return {"type": "text", "text": text}


@pytest.fixture(scope="module")
def llava_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return build_llava(tmp_path_factory.mktemp("llava"))


@pytest.fixture(scope="module")
def llava_engine(llava_dir: Path) -> Iterator[AsyncEngine]:
    engine = start_engine(
        model=str(llava_dir), max_model_len=128, num_kv_blocks=64, attention_backend="torch"
    )
    yield engine
    engine.shutdown()


def serve(engine: AsyncEngine, **settings: Any) -> Iterator[RunningServer]:
    running = RunningServer(engine, ServerConfig(served_model_name=[MODEL], **settings))
    yield running
    running.stop()


@pytest.fixture(scope="module")
def server(
    llava_engine: AsyncEngine, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[RunningServer]:
    store = tmp_path_factory.mktemp("responses") / "responses.sqlite3"
    yield from serve(
        llava_engine, allowed_media_domains=["127.0.0.1"], responses_store=f"sqlite://{store}"
    )


@pytest.fixture(scope="module")
def openai_client(server: RunningServer) -> Iterator[Any]:
    import openai

    with openai.OpenAI(
        base_url=server.url + "/v1", api_key="unused", max_retries=0, timeout=60
    ) as client:
        yield client


@pytest.fixture(scope="module")
def oracle(llava_dir: Path) -> Any:
    """transformers' greedy tokens, and the prompt's length, for chat messages with images: the
    conversation rendered by the model's own template, then its processor and `generate`."""
    from transformers import AutoModelForImageTextToText, AutoProcessor

    processor = AutoProcessor.from_pretrained(llava_dir, backend="pil")
    model = AutoModelForImageTextToText.from_pretrained(llava_dir, dtype=torch.float32).eval()

    def greedy(messages: list[dict[str, Any]], images: list[Image.Image]) -> tuple[str, int]:
        text = processor.tokenizer.apply_chat_template(
            messages, tokenize=False, add_generation_prompt=True
        )
        # The template writes every special token itself; the server adds no BOS either.
        inputs = processor(
            images=images, text=[text], return_tensors="pt", add_special_tokens=False
        )
        with torch.no_grad():
            out = model.generate(**inputs, max_new_tokens=MAX_TOKENS, do_sample=False)
        prompt_len = inputs["input_ids"].shape[1]
        tokens = out[0, prompt_len:].tolist()
        assert len(tokens) == MAX_TOKENS  # (no stop token cut it short)
        return processor.tokenizer.decode(tokens, skip_special_tokens=True), prompt_len

    return greedy


def template_messages(messages: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Chat messages as transformers' templates take them: an image part is `{"type": "image"}`."""
    return [
        {
            **m,
            "content": [{"type": "image"} if p["type"] == "image_url" else p for p in m["content"]]
            if isinstance(m["content"], list)
            else m["content"],
        }
        for m in messages
    ]


def chat(client: Any, messages: list[dict[str, Any]], model: str = MODEL) -> Any:
    return client.chat.completions.create(
        model=model, messages=messages, extra_body=EXTRA, **GREEDY
    )


def assert_equals_transformers(
    client: Any, oracle: Any, messages: list[dict[str, Any]], images: list[Image.Image]
) -> Any:
    answer = chat(client, messages)
    text, prompt_len = oracle(template_messages(messages), images)
    assert answer.choices[0].message.content == text
    # Usage counts the prompt as the model reads it: every image's span, not its placeholder.
    assert answer.usage.prompt_tokens == prompt_len
    assert answer.usage.completion_tokens == MAX_TOKENS
    return answer


def test_one_image_equals_transformers(openai_client: Any, oracle: Any) -> None:
    image = random_image(1)
    messages = [{"role": "user", "content": [text_part("what is "), image_part(image)]}]
    answer = assert_equals_transformers(openai_client, oracle, messages, [image])
    # The image matters: another one gives another prompt, and with it other logits.
    other = chat(
        openai_client,
        [{"role": "user", "content": [text_part("what is "), image_part(random_image(2))]}],
    )
    assert other.usage.prompt_tokens == answer.usage.prompt_tokens
    assert other.choices[0].message.content != answer.choices[0].message.content


def test_two_images_in_one_message_keep_their_order(openai_client: Any, oracle: Any) -> None:
    first, second = random_image(3), random_image(4, (64, 30))
    messages = [
        {
            "role": "user",
            "content": [
                text_part("compare "),
                image_part(first),
                text_part(" with "),
                image_part(second),
            ],
        }
    ]
    assert_equals_transformers(openai_client, oracle, messages, [first, second])
    swapped = [
        {"role": "user", "content": [messages[0]["content"][i] for i in (0, 3, 2, 1)]},
    ]
    assert_equals_transformers(openai_client, oracle, swapped, [second, first])


def test_images_in_two_turns(openai_client: Any, oracle: Any) -> None:
    first, second = random_image(5), random_image(6)
    messages = [
        {"role": "user", "content": [text_part("look "), image_part(first)]},
        {"role": "assistant", "content": "a cat"},
        {"role": "user", "content": [image_part(second), text_part(" and now?")]},
    ]
    assert_equals_transformers(openai_client, oracle, messages, [first, second])


def test_a_stream_with_an_image_says_what_the_whole_answer_says(openai_client: Any) -> None:
    messages = [{"role": "user", "content": [text_part("what is "), image_part(random_image(13))]}]
    whole = chat(openai_client, messages)
    chunks = list(
        openai_client.chat.completions.create(
            model=MODEL,
            messages=messages,
            stream=True,
            stream_options={"include_usage": True},
            extra_body=EXTRA,
            **GREEDY,
        )
    )
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert text == whole.choices[0].message.content
    assert chunks[-1].usage.prompt_tokens == whole.usage.prompt_tokens


def test_the_image_processor_runs_off_the_event_loop(
    llava_engine: AsyncEngine, monkeypatch: pytest.MonkeyPatch
) -> None:
    ran_on = []
    expand = llava_engine.engine.expand_images

    def recording(prompt: Any, images: Any) -> Any:
        ran_on.append(threading.get_ident())
        return expand(prompt, images)

    monkeypatch.setattr(llava_engine.engine, "expand_images", recording)

    async def main() -> tuple[int, list[int], Any]:
        ids, mm = await llava_engine.expand_images("see <image> now", [random_image(14)])
        return threading.get_ident(), ids, mm

    loop_thread, ids, mm = asyncio.run(main())
    assert ran_on and ran_on[0] != loop_thread
    (item,) = mm.items
    text_ids = llava_engine.info.tokenizer("see <image> now")["input_ids"]
    assert len(ids) == len(text_ids) - 1 + item.length  # the placeholder became the span
    assert ids[: item.offset] == text_ids[: item.offset]


def test_tokenize_counts_the_images_spans(server: RunningServer, openai_client: Any) -> None:
    messages = [{"role": "user", "content": [text_part("what is "), image_part(random_image(16))]}]
    body = {"model": MODEL, "messages": messages}
    response = httpx.post(f"{server.url}/tokenize", json=body, timeout=60)
    assert response.status_code == 200, response.text
    assert response.json()["count"] == chat(openai_client, messages).usage.prompt_tokens


def test_the_render_route_refuses_images(server: RunningServer) -> None:
    body = {
        "model": MODEL,
        "messages": [{"role": "user", "content": [text_part("a"), image_part(random_image(15))]}],
    }
    response = httpx.post(f"{server.url}/v1/chat/completions/render", json=body, timeout=60)
    assert response.status_code == 400, response.text
    error = assert_openai_error(response.json())
    assert error["param"] == "messages.0.content.1"
    assert "cannot carry images" in error["message"]


def test_a_fetched_image_equals_the_same_bytes_inline(openai_client: Any) -> None:
    with image_server() as images:
        fetched = _one_image_answer(openai_client, images.url("/png"))
        assert images.seen.requests == [("/png", f"127.0.0.1:{images.port}")]
    inline = _one_image_answer(
        openai_client, "data:image/png;base64," + base64.b64encode(PNG).decode()
    )
    assert fetched == inline


def _one_image_answer(client: Any, url: str) -> str:
    messages = [
        {
            "role": "user",
            "content": [text_part("see "), {"type": "image_url", "image_url": {"url": url}}],
        }
    ]
    return chat(client, messages).choices[0].message.content


def test_responses_input_image_answers_as_chat(openai_client: Any) -> None:
    import openai

    first, second = random_image(9), random_image(10)
    want = chat(
        openai_client,
        [
            {"role": "system", "content": "be brief"},
            {"role": "user", "content": [image_part(first), text_part(" or "), image_part(second)]},
        ],
    )
    got = openai_client.responses.create(
        model=MODEL,
        instructions="be brief",
        input=[
            {
                "role": "user",
                "content": [
                    {"type": "input_image", "image_url": data_url(first), "detail": "low"},
                    {"type": "input_text", "text": " or "},
                    {"type": "input_image", "image_url": data_url(second), "detail": "auto"},
                ],
            }
        ],
        temperature=0,
        max_output_tokens=MAX_TOKENS,
        extra_body=EXTRA,
    )
    assert got.output_text == want.choices[0].message.content
    assert got.usage.input_tokens == want.usage.prompt_tokens
    # A bad image names its input part, past the instructions and an earlier item.
    with pytest.raises(openai.BadRequestError) as caught:
        openai_client.responses.create(
            model=MODEL,
            instructions="be brief",
            input=[
                {"role": "user", "content": "hello"},
                {
                    "role": "user",
                    "content": [
                        {"type": "input_text", "text": "see"},
                        {"type": "input_image", "image_url": "data:image/png;base64,AAAA"},
                    ],
                },
            ],
            max_output_tokens=MAX_TOKENS,
        )
    error = assert_openai_error(caught.value.response.json())
    assert error["param"] == "input.1.content.1"
    assert error["message"].startswith("input.1.content.1: ")


def test_a_responses_continuation_reads_the_earlier_turns_image(openai_client: Any) -> None:
    image = random_image(17)
    first = openai_client.responses.create(
        model=MODEL,
        input=[
            {"role": "user", "content": [{"type": "input_image", "image_url": data_url(image)}]}
        ],
        temperature=0,
        max_output_tokens=MAX_TOKENS,
        extra_body=EXTRA,
    )
    second = openai_client.responses.create(
        model=MODEL,
        previous_response_id=first.id,
        input="and again?",
        temperature=0,
        max_output_tokens=MAX_TOKENS,
        extra_body=EXTRA,
    )
    want = chat(
        openai_client,
        [
            {"role": "user", "content": [image_part(image)]},
            {"role": "assistant", "content": first.output_text},
            {"role": "user", "content": "and again?"},
        ],
    )
    assert second.output_text == want.choices[0].message.content
    assert second.usage.input_tokens == want.usage.prompt_tokens


def test_anthropic_image_blocks_answer_as_chat(server: RunningServer, openai_client: Any) -> None:
    import anthropic

    first, second = random_image(11), random_image(12)
    want = chat(
        openai_client,
        [
            {"role": "system", "content": "be brief"},
            {"role": "user", "content": [text_part("a "), image_part(first)]},
            {"role": "assistant", "content": "ok"},
            {"role": "user", "content": [image_part(second), text_part(" b")]},
        ],
    )

    def base64_block(image: Image.Image) -> dict[str, Any]:
        data = base64.b64encode(png(image)).decode()
        return {
            "type": "image",
            "source": {"type": "base64", "media_type": "image/png", "data": data},
        }

    messages: list[Any] = [
        {"role": "user", "content": [{"type": "text", "text": "a "}, base64_block(first)]},
        {"role": "assistant", "content": "ok"},
        {"role": "user", "content": [base64_block(second), {"type": "text", "text": " b"}]},
    ]
    with anthropic.Anthropic(base_url=server.url, api_key="unused", max_retries=0) as claude:
        got = claude.messages.create(
            model=MODEL,
            system="be brief",
            messages=messages,
            max_tokens=MAX_TOKENS,
            extra_body={"temperature": 0, **EXTRA},
        )
        assert got.content[0].text == want.choices[0].message.content  # type: ignore[union-attr]
        assert got.usage.input_tokens == want.usage.prompt_tokens
        counted = claude.messages.count_tokens(model=MODEL, system="be brief", messages=messages)
        assert counted.input_tokens == want.usage.prompt_tokens
        # A bad image names its block in Anthropic's own numbering (the system prompt is no
        # message there).
        messages[2]["content"][0]["source"]["data"] = base64.b64encode(b"not a png").decode()
        with pytest.raises(anthropic.BadRequestError) as caught:
            claude.messages.create(
                model=MODEL, system="be brief", messages=messages, max_tokens=MAX_TOKENS
            )
        body: Any = caught.value.body
        assert body["error"]["message"].startswith("messages.2.content.0: ")


# --------------------------------------------------------------------------- refusals


def refusal(client: Any, messages: list[dict[str, Any]], model: str = MODEL) -> dict[str, Any]:
    """The 400 a chat request gets: OpenAI's error object, as the official client raises it."""
    import openai

    with pytest.raises(openai.BadRequestError) as caught:
        chat(client, messages, model)
    error = assert_openai_error(caught.value.response.json())
    assert error["type"] == "invalid_request_error"
    return error


def test_a_text_only_model_refuses_an_image_naming_itself(llama_dir: Path, tmp_path: Path) -> None:
    import openai

    engine, running = start_tiny_server(llama_dir, tmp_path)
    try:
        with openai.OpenAI(base_url=running.url + "/v1", api_key="unused", max_retries=0) as c:
            name = c.models.list().data[0].id
            messages = [
                {"role": "user", "content": [text_part("hi "), image_part(random_image(0))]}
            ]
            error = refusal(c, messages, name)
            assert error["message"] == f"the model {name} reads no images"
            assert error["param"] == "messages.0.content.1"
            # Text parts are still served, joined as before.
            answer = c.chat.completions.create(
                model=name, messages=[{"role": "user", "content": [text_part("hi")]}], max_tokens=2
            )
            assert answer.choices[0].finish_reason == "length"
    finally:
        running.stop()
        engine.shutdown()


@pytest.mark.parametrize(
    ("url", "reason"),
    [
        ("data:image/png;base64,@@not base64@@", "not valid base64"),
        ("data:image/png;base64," + base64.b64encode(b"GIF? no: plain text").decode(), "image"),
        ("data:text/plain;base64,aGVsbG8=", "not an image type"),
    ],
)
def test_bad_image_data_is_a_400_naming_the_part(openai_client: Any, url: str, reason: str) -> None:
    messages = [
        {"role": "system", "content": "be brief"},
        {
            "role": "user",
            "content": [
                image_part(random_image(7)),
                text_part("and "),
                {"type": "image_url", "image_url": {"url": url}},
            ],
        },
    ]
    error = refusal(openai_client, messages)
    assert error["param"] == "messages.1.content.2"
    assert error["message"].startswith("messages.1.content.2: ")
    assert reason in error["message"]


def test_of_two_bad_images_the_first_in_order_is_named(openai_client: Any) -> None:
    with image_server() as images:
        messages = [
            {
                "role": "user",
                "content": [
                    # A fetch answers later than bad base64 fails; still, the fetch is named.
                    {"type": "image_url", "image_url": {"url": images.url("/text")}},
                    {"type": "image_url", "image_url": {"url": "data:image/png;base64,@"}},
                ],
            }
        ]
        error = refusal(openai_client, messages)
        assert error["param"] == "messages.0.content.0"
        assert images.seen.requests == [("/text", f"127.0.0.1:{images.port}")]


def test_a_host_outside_the_allowed_domains_is_refused(openai_client: Any) -> None:
    with image_server() as images:
        url = images.url("/png", host="localhost")
        messages = [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": url}}]}]
        error = refusal(openai_client, messages)
        assert error["param"] == "messages.0.content.0"
        assert "--allowed-media-domains" in error["message"]
        assert images.seen.requests == []  # refused before any connection


def test_limit_mm_per_prompt_counts_the_whole_conversation(llava_engine: AsyncEngine) -> None:
    import openai

    for running in serve(llava_engine, limit_mm_per_prompt='{"image": 1}', responses_store="none"):
        with openai.OpenAI(base_url=running.url + "/v1", api_key="unused", max_retries=0) as c:
            one = [{"role": "user", "content": [image_part(random_image(8))]}]
            assert chat(c, one).usage.completion_tokens == MAX_TOKENS
            two = [*one, {"role": "assistant", "content": "ok"}, *one]
            error = refusal(c, two)
            assert error["param"] == "messages"
            assert "2 images in one prompt" in error["message"]
            assert "--limit-mm-per-prompt" in error["message"]


def test_the_docs_http_example_runs(
    server: RunningServer, openai_client: Any, tmp_path: Path
) -> None:
    """The "Image input" HTTP example (docs/image-input.md), as written, against this server: chat
    and Responses print the answers the client gets itself for the same image and text."""
    from tests.support.readme import python_examples, run_example

    _, example = python_examples("Image input", page="image-input.md")
    image = random_image(21)
    (tmp_path / "cat.png").write_bytes(png(image))
    source = example.replace('"cat.png"', repr(str(tmp_path / "cat.png")))
    printed = run_example(server.url, "python", source.replace('"llava"', repr(MODEL)))
    chat = openai_client.chat.completions.create(
        model=MODEL,
        max_tokens=32,
        temperature=0,
        messages=[
            {"role": "user", "content": [text_part("What is in the picture?"), image_part(image)]}
        ],
    )
    # Greedy on both sides only where asked: the example samples at the default temperature,
    # so only the shape of what it printed is compared.
    lines = printed.split("\n")
    assert len(lines) >= 3 and chat.choices[0].message.content


def test_the_dashboards_image_panels_answer_from_a_real_prometheus(
    llava_dir: Path, tmp_path: Path
) -> None:
    """The dashboard's image-input panels, answered by a real Prometheus scraping a server of
    an engine of its own (its counters start at 0 in the window, so a ratio of rates is the
    ratio of counts): one image sent twice is one lookup missed (encoded) and one hit, a hit
    rate of 0.5."""
    import openai
    from prometheus_client.parser import text_string_to_metric_families

    from server.app import attach_metrics
    from tests.server.metrics.test_prometheus_scrape import (
        answer,
        dashboard_queries,
        scraping,
        wait_for_answer,
    )

    def total(name: str) -> float:
        text = httpx.get(server.url + "/metrics", timeout=10).text
        return next(
            s.value
            for f in text_string_to_metric_families(text)
            for s in f.samples
            if s.name == f"pagedserve:{name}"
        )

    engine = start_engine(
        model=str(llava_dir), max_model_len=128, num_kv_blocks=64, attention_backend="torch"
    )
    config = ServerConfig(served_model_name=[MODEL])
    server = RunningServer(engine, config, attach_metrics(engine, config))
    client = openai.OpenAI(base_url=server.url + "/v1", api_key="unused", max_retries=0)
    image = random_image(31)
    with scraping(server.port, tmp_path) as prometheus, client:
        wait_for_answer(prometheus, 'up{job="pagedserve"}', 1.0)  # a scrape from before
        for _ in range(2):
            client.chat.completions.create(
                model=MODEL,
                messages=[{"role": "user", "content": [text_part("what"), image_part(image)]}],
                extra_body=EXTRA,
                **GREEDY,
            )
        selector = f'{{model_name="{MODEL}"}}'
        queries = total("mm_cache_queries_total")
        wait_for_answer(prometheus, "pagedserve:mm_cache_queries_total" + selector, queries)
        hit_rate, encoded, p50, p99 = dashboard_queries(images=True)
        [[_, got]] = [r["value"] for r in answer(prometheus, hit_rate, MODEL)]
        assert float(got) == pytest.approx(0.5)
        [[_, got]] = [r["value"] for r in answer(prometheus, encoded, MODEL)]
        assert float(got) > 0
        for quantile in (p50, p99):
            [[_, got]] = [r["value"] for r in answer(prometheus, quantile, MODEL)]
            assert float(got) > 0
    server.stop()
    engine.shutdown()
