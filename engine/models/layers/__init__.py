"""The building blocks every architecture file assembles: norms, rotary embeddings, parallel
linear layers and embeddings that load their own checkpoint slices, attention, gated MLPs and
mixtures of experts."""
