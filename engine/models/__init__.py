"""Model definitions, the layers they are built from, and the architecture registry."""

from engine.models.registry import SUPPORTED_ARCHITECTURES, model_class, resolve_architecture

__all__ = ["SUPPORTED_ARCHITECTURES", "model_class", "resolve_architecture"]
