"""`pagedserve bench serve` and `pagedserve bench throughput`: load any OpenAI-compatible server
and measure it from the client's side, or run the same workload through the offline engine.
The scripts under bench/ build on these modules."""
