"""The pooling APIs on an embedding model: `POST /v1/embeddings` (OpenAI's shape) and
`/v1/score`, `/v1/rerank` (vLLM's shapes; `/rerank`, `/v2/rerank` as aliases) computed from the
embeddings' cosine similarity."""
