"""POST /v1/embeddings on the bundled all-MiniLM-L6-v2, served for real (uvicorn on a socket),
against the transformers oracle: the openai SDK (float and its default base64), LangChain's
OpenAIEmbeddings, raw token-id inputs, a retrieval round trip, 64 concurrent mixed-length
inputs, the bad inputs (each a 400 naming its field, the server healthy after), and metrics."""

from __future__ import annotations

import base64
import concurrent.futures

import httpx
import numpy as np
import pytest
import torch

from config import ServerConfig
from server.app import attach_metrics
from tests.support.embedding import cosines, hf_embed, minilm_dir, minilm_tokenizer, mixed_texts
from tests.support.server_harness import (
    RunningServer,
    assert_openai_error,
    scrape,
    start_engine,
    wait_until,
    wait_until_idle,
)

MODEL = "all-MiniLM-L6-v2"
DOCS = [
    "The Eiffel Tower is a wrought-iron lattice tower in Paris.",
    "Photosynthesis turns sunlight, water and carbon dioxide into sugar.",
    "The Great Wall of China stretches thousands of kilometres.",
    "Python is a programming language known for its readability.",
    "Mount Everest is the highest mountain above sea level.",
    "The mitochondria is the powerhouse of the cell.",
    "Jazz originated in New Orleans in the early twentieth century.",
    "A black hole is a region where gravity prevents light from escaping.",
    "The Amazon rainforest is the largest tropical rainforest.",
    "Shakespeare wrote Hamlet, Macbeth and Romeo and Juliet.",
    "Bitcoin is a decentralized digital currency.",
    "The human heart has four chambers.",
    "Tokyo is the capital city of Japan.",
    "Penguins are flightless birds of the southern hemisphere.",
    "The speed of light is about 300,000 kilometres per second.",
    "Coffee beans are the seeds of the Coffea plant.",
    "The Pacific is the largest and deepest ocean.",
    "Vincent van Gogh painted The Starry Night.",
    "Insulin regulates the level of glucose in the blood.",
    "The Roman Colosseum hosted gladiator fights.",
]


@pytest.fixture(scope="module")
def server():
    engine = start_engine(runner="pooling", dtype="float32", max_num_seqs=64)
    config = ServerConfig()
    running = RunningServer(engine, config, attach_metrics(engine, config))
    yield running
    running.stop()
    engine.shutdown()


def _post(server, body: object, path: str = "/v1/embeddings") -> httpx.Response:
    return httpx.post(server.url + path, json=body, timeout=120)


def _client(server):
    import openai

    return openai.OpenAI(base_url=server.url + "/v1", api_key="unused", max_retries=0)


def _assert_healthy(server) -> None:
    assert httpx.get(server.url + "/health", timeout=10).status_code == 200
    state = wait_until_idle(server.engine)
    assert state.free_blocks == state.num_blocks


def test_models_says_it_embeds(server) -> None:
    cards = httpx.get(server.url + "/v1/models", timeout=10).json()["data"]
    assert [(c["id"], c["task"], c["max_model_len"]) for c in cards] == [(MODEL, "embed", 256)]


def test_openai_sdk_float_and_base64(server) -> None:
    client = _client(server)
    texts = ["hello world", "Embeddings are vectors."]
    oracle = hf_embed(texts)
    floats = client.embeddings.create(model=MODEL, input=texts, encoding_format="float")
    # The SDK asks for base64 when none is named (numpy is installed) and decodes it itself.
    default = client.embeddings.create(model=MODEL, input=texts)
    for response in (floats, default):
        assert [d.index for d in response.data] == [0, 1]
        got = torch.tensor([d.embedding for d in response.data])
        assert got.shape == (2, 384)
        assert cosines(got, oracle).min() >= 0.99999
    ids = [minilm_tokenizer()(t).input_ids for t in texts]
    assert floats.usage.prompt_tokens == sum(map(len, ids)) == floats.usage.total_tokens
    assert floats.model == MODEL


def test_base64_is_little_endian_float32(server) -> None:
    body = _post(server, {"input": "bytes on the wire", "encoding_format": "base64"}).json()
    raw = base64.b64decode(body["data"][0]["embedding"])
    assert len(raw) == 384 * 4
    got = torch.from_numpy(np.frombuffer(raw, dtype="<f4").copy())
    floats = _post(server, {"input": "bytes on the wire"}).json()["data"][0]["embedding"]
    assert torch.equal(got, torch.tensor(floats, dtype=torch.float32))


def test_token_id_inputs_single_and_lists(server) -> None:
    ids = [minilm_tokenizer()(t).input_ids for t in ("first input", "a second, longer input")]
    one = _post(server, {"input": ids[0]}).json()
    many = _post(server, {"input": ids}).json()
    assert len(one["data"]) == 1 and len(many["data"]) == 2
    oracle = hf_embed(ids)
    assert cosines(torch.tensor(one["data"][0]["embedding"]), oracle[0]) >= 0.99999
    got = torch.tensor([d["embedding"] for d in many["data"]])
    assert cosines(got, oracle).min() >= 0.99999
    assert many["usage"]["prompt_tokens"] == sum(map(len, ids))


def test_langchain_openai_embeddings(server) -> None:
    """LangChain's default counts tokens with tiktoken and sends OpenAI (cl100k) token ids: here
    tiktoken's vocabulary files cannot be downloaded, and those ids mean nothing to another
    model's vocabulary anyway. What a user of a non-OpenAI server configures instead, both ways:
    `check_embedding_ctx_length=False` (texts sent as they are, vLLM's advice), and
    `tiktoken_enabled=False` with the model's own tokenizer (texts chunked by it)."""
    from langchain_openai import OpenAIEmbeddings

    common = {"model": MODEL, "base_url": server.url + "/v1", "api_key": "unused"}
    plain = OpenAIEmbeddings(**common, check_embedding_ctx_length=False)
    own_tokenizer = OpenAIEmbeddings(
        **common, tiktoken_enabled=False, tiktoken_model_name=str(minilm_dir())
    )
    texts = DOCS[:4]
    oracle = hf_embed(texts)
    for embedder in (plain, own_tokenizer):
        got = torch.tensor(embedder.embed_documents(texts))
        assert cosines(got, oracle).min() >= 0.999  # the chunked path drops [CLS]/[SEP] decode
        query = torch.tensor(embedder.embed_query("Where is the Eiffel Tower?"))
        assert int(torch.argmax(got @ query)) == 0
    exact = torch.tensor(plain.embed_documents(texts))
    assert cosines(exact, oracle).min() >= 0.99999


def test_retrieval_round_trip(server) -> None:
    client = _client(server)
    docs = torch.tensor(
        [
            d.embedding
            for d in client.embeddings.create(model=MODEL, input=DOCS, encoding_format="float").data
        ]
    )
    for query, expected in (
        ("Which organ pumps blood and has chambers?", 11),
        ("What is the tallest mountain in the world?", 4),
        ("Who wrote Hamlet?", 9),
        ("hormone controlling blood sugar", 18),
    ):
        q = torch.tensor(
            client.embeddings.create(model=MODEL, input=query, encoding_format="float")
            .data[0]
            .embedding
        )
        assert int(torch.argmax(docs @ q)) == expected, query


def test_64_mixed_inputs_concurrently(server) -> None:
    """64 requests at once, each one input of its own length: the scheduler batches them, and
    each equals its transformers embedding alone."""
    texts = mixed_texts(64)
    oracle = hf_embed(texts)

    def one(text: str) -> list[float]:
        response = _post(server, {"input": text, "model": MODEL})
        assert response.status_code == 200, response.text
        return response.json()["data"][0]["embedding"]

    with concurrent.futures.ThreadPoolExecutor(64) as pool:
        got = torch.tensor(list(pool.map(one, texts)))
    assert cosines(got, oracle).min() >= 0.99999
    batched = torch.tensor([d["embedding"] for d in _post(server, {"input": texts}).json()["data"]])
    assert cosines(batched, oracle).min() >= 0.99999
    _assert_healthy(server)


BAD = [
    ({"input": ""}, "input"),
    ({"input": []}, "input"),
    ({"input": [[]]}, "input"),
    ({"input": [[101, 30522, 102]]}, "input"),
    ({"input": ["text", 7]}, "input"),
    ({"input": [[101, 102], "text"]}, "input"),
    ({"input": ["a"] * 10_000}, "input"),
    ({"input": "a", "dimensions": 1024}, "dimensions"),
    ({"input": "a", "dimensions": 128}, "dimensions"),
    ({"input": "a", "encoding_format": "binary"}, "encoding_format"),
    ({"input": " ".join(["word"] * 300)}, "input"),
    ({"input": "a", "truncate_prompt_tokens": 100_000}, "truncate_prompt_tokens"),
    ({}, "input"),
]


@pytest.mark.parametrize(("body", "field"), BAD, ids=[f"{i}-{f}" for i, (_, f) in enumerate(BAD)])
def test_bad_input_is_a_400_naming_the_field(server, body, field: str) -> None:
    response = _post(server, body)
    assert response.status_code == 400, response.text
    param = assert_openai_error(response.json())["param"]
    assert param == field or param.startswith(field + "."), param  # "input.1": the item
    _assert_healthy(server)


def test_truncate_prompt_tokens(server) -> None:
    long = " ".join(str(i) for i in range(300))
    body = _post(server, {"input": long, "truncate_prompt_tokens": -1}).json()
    tokenizer = minilm_tokenizer()
    content = tokenizer(long, add_special_tokens=False).input_ids
    ids = [tokenizer.cls_token_id, *content[-254:], tokenizer.sep_token_id]  # the last tokens
    assert body["usage"]["prompt_tokens"] == 256
    assert cosines(torch.tensor(body["data"][0]["embedding"]), hf_embed([ids])[0]) >= 0.99999


def test_user_field_accepted(server) -> None:
    response = _post(server, {"input": "hi", "user": "user-1234"})
    assert response.status_code == 200


def test_generation_routes_say_the_model_embeds(server) -> None:
    for path, body in (
        ("/v1/completions", {"prompt": "hi"}),
        ("/v1/chat/completions", {"messages": [{"role": "user", "content": "hi"}]}),
    ):
        response = _post(server, body, path)
        assert response.status_code == 400, response.text
        error = assert_openai_error(response.json())
        assert "embeds" in error["message"] and error["param"] == "model"
    _assert_healthy(server)


def test_metrics_count_embedding_requests(server) -> None:
    before = scrape(server.url)
    texts = ["one", "two two", "three three three"]
    usage = _post(server, {"input": texts}).json()["usage"]["prompt_tokens"]

    def value(samples, name: str, **labels: str) -> float:
        key = ("pagedserve:" + name, tuple(sorted({"model_name": MODEL, **labels}.items())))
        return samples.get(key, 0.0)

    def delta(name: str, **labels: str) -> float:
        return value(scrape(server.url), name, **labels) - value(before, name, **labels)

    assert delta("prompt_tokens_total") == usage
    assert delta("request_success_total", finished_reason="stop") == 3
    assert delta("e2e_request_latency_seconds_count") == 3
    assert delta("generation_tokens_total") == 0


def test_client_that_leaves_frees_its_work(server) -> None:
    """A request of 1,500 long inputs (many steps on this CPU) whose client hangs up: its
    inputs still queued are aborted, and the engine is left with nothing and every block."""
    before = scrape(server.url)
    body = {"input": [f"document {i}: " + "cats and dogs " * 60 for i in range(1500)]}
    assert len(minilm_tokenizer()(body["input"][-1]).input_ids) <= 256
    with pytest.raises(httpx.ReadTimeout):
        httpx.post(server.url + "/v1/embeddings", json=body, timeout=1.0)
    _assert_healthy(server)
    key = (
        "pagedserve:request_success_total",
        tuple(sorted({"model_name": MODEL, "finished_reason": "abort"}.items())),
    )
    # The aborts are counted when the engine thread next records its stats, which may come
    # just after the engine is seen idle.
    after = wait_until(
        lambda: scrape(server.url),
        10,
        until=lambda now: now.get(key, 0.0) - before.get(key, 0.0) > 0,
        what="the aborted inputs to be counted",
    )
    done = (
        "pagedserve:request_success_total",
        tuple(sorted({"model_name": MODEL, "finished_reason": "stop"}.items())),
    )
    assert after.get(done, 0.0) - before.get(done, 0.0) < 1500


@pytest.fixture(scope="module")
def chat_server(llama_dir, tmp_path_factory):
    from tests.support.server_harness import start_tiny_server

    engine, running = start_tiny_server(llama_dir, tmp_path_factory.mktemp("tok"))
    yield running
    running.stop()
    engine.shutdown()


@pytest.mark.parametrize("encoding_format", ["float", "base64"])
def test_chat_model_refuses_embeddings(chat_server, encoding_format: str) -> None:
    for path, body in (
        ("/v1/embeddings", {"input": "hi", "encoding_format": encoding_format}),
        ("/v1/rerank", {"query": "q", "documents": ["d"]}),
        ("/v1/score", {"text_1": "q", "text_2": "d"}),
    ):
        response = _post(chat_server, body, path)
        assert response.status_code == 400, response.text
        error = assert_openai_error(response.json())
        assert error["param"] == "model" and "--runner pooling" in error["message"]
    assert httpx.get(chat_server.url + "/health", timeout=10).status_code == 200
    cards = httpx.get(chat_server.url + "/v1/models", timeout=10).json()["data"]
    assert [c["task"] for c in cards] == ["generate"]
