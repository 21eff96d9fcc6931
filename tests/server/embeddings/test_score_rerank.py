"""POST /v1/score and /v1/rerank (and the /score, /rerank, /v2/rerank aliases) on the bundled
embedding model: scores equal the cosine similarity of the oracle's embeddings, computed here,
and their order is that cosine order."""

from __future__ import annotations

import httpx
import pytest
import torch

from config import ServerConfig
from tests.support.embedding import hf_embed
from tests.support.server_harness import RunningServer, assert_openai_error, start_engine

QUERY = "How do plants make their food?"
DOCS = [
    "Jazz originated in New Orleans.",
    "Photosynthesis lets plants turn sunlight, water and CO2 into sugar.",
    "Plants need light to grow.",
    "The stock market fell sharply today.",
    "Leaves contain chlorophyll, which captures light energy.",
]
LONG = "word " * 600


@pytest.fixture(scope="module")
def server():
    engine = start_engine(runner="pooling", dtype="float32")
    running = RunningServer(engine, ServerConfig(max_embedding_inputs=8))
    yield running
    running.stop()
    engine.shutdown()


def _oracle_scores(query: str, docs: list[str]) -> list[float]:
    vectors = hf_embed([query, *docs])
    return torch.nn.functional.cosine_similarity(vectors[:1], vectors[1:]).tolist()


def _post(server, path: str, body: object) -> httpx.Response:
    return httpx.post(server.url + path, json=body, timeout=60)


@pytest.mark.parametrize("path", ["/v1/rerank", "/rerank", "/v2/rerank"])
def test_rerank_orders_by_cosine(server, path: str) -> None:
    expected = _oracle_scores(QUERY, DOCS)
    order = sorted(range(len(DOCS)), key=lambda i: -expected[i])
    body = _post(server, path, {"query": QUERY, "documents": DOCS}).json()
    results = body["results"]
    assert [r["index"] for r in results] == order
    assert results[0]["index"] == 1
    for r in results:
        assert r["relevance_score"] == pytest.approx(expected[r["index"]], abs=1e-5)
        assert r["document"]["text"] == DOCS[r["index"]]
    assert body["usage"]["total_tokens"] > 0 and body["model"] == "all-MiniLM-L6-v2"


def test_rerank_top_n_and_no_documents(server) -> None:
    expected = _oracle_scores(QUERY, DOCS)
    order = sorted(range(len(DOCS)), key=lambda i: -expected[i])
    body = _post(
        server,
        "/v1/rerank",
        {"query": QUERY, "documents": DOCS, "top_n": 2, "return_documents": False},
    ).json()
    assert [r["index"] for r in body["results"]] == order[:2]
    assert all(r["document"] is None for r in body["results"])


@pytest.mark.parametrize("path", ["/v1/score", "/score"])
def test_score_one_to_many_and_pairwise(server, path: str) -> None:
    expected = _oracle_scores(QUERY, DOCS)
    body = _post(server, path, {"text_1": QUERY, "text_2": DOCS}).json()
    assert [d["index"] for d in body["data"]] == list(range(len(DOCS)))
    got = [d["score"] for d in body["data"]]
    assert got == pytest.approx(expected, abs=1e-5)
    assert sorted(range(len(got)), key=lambda i: -got[i]) == sorted(
        range(len(expected)), key=lambda i: -expected[i]
    )
    pairs = _post(server, path, {"text_1": [QUERY, "music"], "text_2": [DOCS[1], DOCS[0]]}).json()
    second = _oracle_scores("music", [DOCS[0]])[0]
    assert [d["score"] for d in pairs["data"]] == pytest.approx([expected[1], second], abs=1e-5)


@pytest.mark.parametrize(
    ("path", "body", "field"),
    [
        ("/v1/rerank", {"query": QUERY, "documents": []}, "documents"),
        ("/v1/rerank", {"query": QUERY, "documents": ["d"] * 9}, "documents"),
        ("/v1/rerank", {"query": "", "documents": ["d"]}, "query"),
        ("/v1/rerank", {"query": QUERY, "documents": ["d", ""]}, "documents"),
        ("/v1/score", {"text_1": "", "text_2": ["d"]}, "text_1"),
        ("/v1/rerank", {"query": QUERY, "documents": ["d", 3]}, "documents"),
        ("/v1/rerank", {"documents": ["d"]}, "query"),
        ("/v1/score", {"text_1": ["a", "b"], "text_2": ["c", "d", "e"]}, "text_1"),
        ("/v1/score", {"text_1": "a", "text_2": []}, "text_2"),
        # Past the model's 512 positions: the error names the field the long text came in.
        ("/v1/score", {"text_1": LONG, "text_2": ["d", "e"]}, "text_1"),
        ("/v1/score", {"text_1": "a", "text_2": ["d", LONG]}, "text_2"),
        ("/v1/rerank", {"query": LONG, "documents": ["d"]}, "query"),
        ("/v1/rerank", {"query": QUERY, "documents": ["d", LONG]}, "documents"),
    ],
)
def test_bad_input_is_a_400(server, path: str, body: dict, field: str) -> None:
    response = _post(server, path, body)
    assert response.status_code == 400, response.text
    param = assert_openai_error(response.json())["param"]
    assert param == field or param.startswith(field + "."), param
    assert httpx.get(server.url + "/health", timeout=10).status_code == 200
