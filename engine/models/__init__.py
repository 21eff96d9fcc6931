"""Model definitions and the architecture registry."""

from engine.models.registry import SUPPORTED_ARCHITECTURES, resolve_architecture

__all__ = ["SUPPORTED_ARCHITECTURES", "resolve_architecture"]
