"""Image input: a prompt's images turned into placeholder spans and encoder inputs
(`processing`), the encoder cache and its per-step budget (`encoder_cache`), and each step's
image rows (`step_input`). The vision towers themselves live with their models in
engine/models/."""

from engine.multimodal.inputs import ImageItem, MultiModalInputs

__all__ = ["ImageItem", "MultiModalInputs"]
