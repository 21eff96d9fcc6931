"""LoRA adapters as the server names them: which adapter a `model` name selects, the
adapters listed at /v1/models, and loading and unloading them at run time."""
