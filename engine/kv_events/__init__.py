"""KV cache events: what the block pool stored, evicted and cleared, published over ZMQ in
vLLM's wire format for prefix-aware routers (llm-d's precise prefix-cache scorer, SGLang's
model gateway). Recorded on the engine thread into a list; encoded and sent by a publisher
thread, so that no subscriber, slow or absent, can hold up a step."""
