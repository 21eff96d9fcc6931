"""vLLM's render routes: a request's prompt tokens and sampling parameters, without generating."""
