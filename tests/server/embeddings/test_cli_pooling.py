"""`pagedserve serve --runner pooling` with no model: the bundled all-MiniLM-L6-v2, served as
the real command serves it (a process of its own, on a port)."""

from __future__ import annotations

from pathlib import Path

import httpx
import torch

from tests.support.embedding import cosines, hf_embed
from tests.support.readme import run_example, section_examples
from tests.support.server_harness import assert_openai_error, start_daemon, stop


def test_serve_runner_pooling_serves_the_bundled_embedding_model(tmp_path: Path) -> None:
    daemon = start_daemon(tmp_path, ["--runner", "pooling", "--dtype", "float32"])
    try:
        cards = httpx.get(daemon.url + "/v1/models", timeout=10).json()["data"]
        assert [(c["id"], c["task"]) for c in cards] == [("all-MiniLM-L6-v2", "embed")]
        texts = ["served by the command", "another input"]
        response = httpx.post(
            daemon.url + "/v1/embeddings",
            json={"model": "all-MiniLM-L6-v2", "input": texts},
            timeout=60,
        )
        assert response.status_code == 200, response.text
        got = torch.tensor([d["embedding"] for d in response.json()["data"]])
        assert cosines(got, hf_embed(texts)).min() >= 0.99999
        refused = httpx.post(daemon.url + "/v1/completions", json={"prompt": "hi"}, timeout=10)
        assert refused.status_code == 400
        assert "embeds" in assert_openai_error(refused.json())["message"]
        curl, snippet = section_examples("Embeddings, score and rerank", page="embeddings.md")
        assert run_example(daemon.url, "bash", curl).split() == [
            "1",
            "Photosynthesis",
            "turns",
            "light",
            "into",
            "sugar.",
        ]
        assert run_example(daemon.url, "python", snippet).strip() == "384 Penguins cannot fly."
        metrics = httpx.get(daemon.url + "/metrics", timeout=10).text
        assert 'pagedserve:prompt_tokens_total{model_name="all-MiniLM-L6-v2"}' in metrics
    finally:
        stop(daemon)
