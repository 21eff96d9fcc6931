"""The OpenAI-compatible APIs, one package each (`completions`, `chat`, `responses`), and what
they share: the common request and response models, sampling inputs, logprobs, usage, and the
models' tool-call and reasoning parsers."""
